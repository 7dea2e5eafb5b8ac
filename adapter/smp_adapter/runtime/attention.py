"""Every wrap of ``torch.nn.functional.scaled_dot_product_attention`` (SDPA): one wrapper, installed once
per process at the first smp import (``install``), doing two things, in this order.

* Recording the backend that ran (from smp.init on, ``record_backends``): the first call of each kind
  (device, dtype, mask/causal, dropout) runs under a dispatch mode that sees which aten kernel SDPA
  chose: the backend that *ran*, not the one asked for. Rank 0 says it once per kind (stderr);
  ``attention_backends()`` returns the record. Later calls pay one dictionary lookup. Compiled and
  exported code (dynamo tracing, pipeline stages) is not recorded: the kernel is chosen inside the
  graph there. The recording sits outside the CPU rule, so a routed call is recorded as math.
* The CPU rule: CPU attention whose chosen kernel raises runs torch's math kernel, for exactly those
  dtypes, found by probing (below).

Why a probe. torch 2.13's CPU flash-attention kernel packs its reduced-precision operands with AVX-512
instructions when the CPU could pack them (``cpublas::could_pack``: what the hardware has, AMX,
AVX512-BF16/FP16), even when torch dispatches below AVX512 (``ATEN_CPU_CAPABILITY=avx2``/``default``, or
a build choice); it then raises "pack_vnni2 is only supported when avx512 is supported". Which dtype does
so depends on the CPU's other features: float16 on one Intel machine, bfloat16 on an Intel Xeon with
AMX, none on an AMD EPYC (Zen 4). A rule written from a capability name is therefore wrong somewhere,
so none is written: each process asks the kernel.

The rule, for every process that imports smp (CUDA on CPU or not): at install, each floating dtype's
attention is run once on the CPU, forward and backward, with torch's own kernel choice (``probe``). A
dtype whose call raises is routed to the math kernel (which computes the same attention); every other
dtype, every CUDA tensor, and every CPU where nothing raises keeps the kernel torch chooses, bit for
bit. A call that still raises the packing error later (a shape the probe did not cover) routes its
dtype from then on and is retried on the math kernel, with one warning.

Two ways in: eager calls reach the functional, wrapped by ``install()`` (names bound to torch's function
before that keep it); a traced pipeline stage calls the aten op itself, so the pipeline engine runs a
step inside ``math_kernel_for(<the job's compute dtype>)``.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch
from torch import nn

from smp_adapter import on_shutdown

# -- the backend that ran ----------------------------------------------------------------------------
# aten kernel SDPA dispatches to -> the backend's name; none of these seen: the math composite ran
SDPA_KERNELS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "fused (overrideable)",
}
MATH = "math"

_seen: dict[tuple, str] = {}  # (device type, dtype, mask kind, dropout) -> backend that ran
_speaker: int | None = None  # the rank whose job records (it says each kind once if 0); None: no job asked yet


@on_shutdown
def reset() -> None:
    """Run by smp.shutdown: the record belongs to one job."""
    _seen.clear()


def record_backends(rank: int) -> None:
    """smp.init: record the backend of each kind of call from now on (``rank`` 0 says each); the wrapper is
    installed if the smp import has not done it."""
    global _speaker
    _speaker = rank
    install()


def attention_backends() -> dict[tuple, str]:
    """{(device type, dtype, "mask" | "causal" | "none", dropout > 0): backend} for every kind of
    attention call this process ran since smp.init."""
    return dict(_seen)


def backend_of(op_names) -> str:
    for name in op_names:  # "aten._scaled_dot_product_flash_attention.default" or "aten::..."
        backend = SDPA_KERNELS.get(name.removeprefix("aten::").removeprefix("aten.").split(".")[0])
        if backend:
            return backend
    return MATH


def op_names_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpNames(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__ if hasattr(func, "__name__") else str(func))
            return func(*args, **(kwargs or {}))

    return OpNames()


def _unrecorded_kind(query, attn_mask, dropout_p, is_causal) -> tuple | None:
    """The call's kind when it is to be recorded (a job asked, a plain tensor, a kind not seen yet)."""
    # plain tensors only: fake/meta tensors (tracing) and tensor subclasses keep their own dispatch
    if (_speaker is None or type(query) not in (torch.Tensor, nn.Parameter) or query.is_meta
            or torch.compiler.is_compiling()):
        return None
    kind = (query.device.type, str(query.dtype).removeprefix("torch."),
            "mask" if attn_mask is not None else "causal" if is_causal else "none", dropout_p > 0)
    return None if kind in _seen else kind


def _record(kind: tuple, op_names) -> None:
    _seen[kind] = backend_of(op_names)
    if _speaker == 0:
        print(f"smp-adapter: attention ({kind[0]} {kind[1]}, {kind[2]}{', dropout' if kind[3] else ''}) "
              f"ran on SDPA's {_seen[kind]} kernel", file=sys.stderr, flush=True)


# -- the CPU rule -------------------------------------------------------------------------------------
PROBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The flash kernel packs only when q and kv are >= 64 long and the GEMM work per thread is >= 4 x the
# packing work (qs_per_thread * qSplitSize / (batch * heads) >= 4, qSplitSize 32 at this length). One
# batch row and one head of 128 tokens makes that ratio >= 32 at any thread count, so a CPU that packs
# packs here; a head size of 64 is even (no padding path) and a multiple of the pack block.
PROBE_SHAPE = (1, 1, 128, 64)
PACKING_ERROR = "only supported when avx512"

_verdicts: dict[torch.dtype, bool] = {}  # dtype -> torch's chosen CPU kernel raised for it (kept for the process)


def _math_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _torch_choice():
    """Every backend enabled, as in a fresh process: the probe asks what torch chooses by itself,
    whatever block the first caller sits in."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def probe(dtype: torch.dtype) -> bool:
    """True when torch's own CPU attention kernel raises for ``dtype`` in this process (forward or
    backward, causal or not); the answer is cached for the process."""
    if dtype not in _verdicts:
        g = torch.Generator().manual_seed(0)
        attention = _torch_sdpa if _installed else torch.nn.functional.scaled_dot_product_attention
        raised = False
        try:
            with torch.enable_grad(), _torch_choice():
                for causal in (True, False):
                    q, k, v = (torch.randn(PROBE_SHAPE, generator=g).to(dtype).requires_grad_() for _ in range(3))
                    attention(q, k, v, is_causal=causal).float().sum().backward()
        except RuntimeError:
            raised = True
        _verdicts[dtype] = raised
    return _verdicts[dtype]


def routed_dtypes() -> list[torch.dtype]:
    """The dtypes whose CPU attention runs the math kernel in this process (probed so far)."""
    return [dtype for dtype, raised in _verdicts.items() if raised]


def _routes(dtype: torch.dtype | None, device: torch.device) -> bool:
    if device.type != "cpu" or dtype is None or not dtype.is_floating_point:
        return False
    if dtype not in _verdicts and torch.compiler.is_compiling():
        return False  # no probe inside a graph being traced; install() probed the dtypes models use
    return probe(dtype)


def math_kernel_for(dtype: torch.dtype | None, device: torch.device | str | None = "cpu"):
    """A context in which attention of ``dtype`` on ``device`` cannot reach a kernel that raises: the
    math kernel where this process's probe found torch's choice raising for that dtype on the CPU,
    nothing otherwise."""
    if _routes(dtype, torch.device(device or "cpu")):
        return _math_kernel()
    return contextlib.nullcontext()


def _route_after_error(dtype: torch.dtype, error: RuntimeError) -> None:
    _verdicts[dtype] = True
    warnings.warn(f"CPU attention: torch's kernel for {dtype} raised ({error}) on a shape the start-up probe "
                  "did not cover; this process's CPU attention of that dtype runs the math kernel from now on",
                  RuntimeWarning, stacklevel=4)


def _on_a_kernel_that_runs(query, key, value, *args, **kwargs):
    """torch's functional, with CPU attention of a routed dtype on the math kernel."""
    if query.device.type != "cpu":
        return _torch_sdpa(query, key, value, *args, **kwargs)
    if _routes(query.dtype, query.device):
        with _math_kernel():
            return _torch_sdpa(query, key, value, *args, **kwargs)
    try:
        return _torch_sdpa(query, key, value, *args, **kwargs)
    except RuntimeError as error:
        if PACKING_ERROR not in str(error):
            raise
        _route_after_error(query.dtype, error)
        with _math_kernel():
            return _torch_sdpa(query, key, value, *args, **kwargs)


# -- the one wrapper ----------------------------------------------------------------------------------
_installed = False


def _torch_sdpa(query, key, value, *args, **kwargs):
    """torch's own functional, as it was when install() wrapped it (set there)."""
    raise AssertionError("attention.install() has not run")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    """torch's functional: the first call of a kind recorded once a job asked (smp.init), CPU attention
    of a routed dtype on the math kernel."""
    kind = _unrecorded_kind(query, attn_mask, dropout_p, is_causal)
    if kind is None:
        return _on_a_kernel_that_runs(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)
    mode = op_names_mode()
    with mode:
        out = _on_a_kernel_that_runs(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)
    _record(kind, mode.names)
    return out


def install() -> bool:
    """Probe every floating dtype and wrap torch's functional (once per process: the first smp import)."""
    global _installed, _torch_sdpa
    if _installed:
        return True
    for dtype in PROBED_DTYPES:
        probe(dtype)
    _torch_sdpa = torch.nn.functional.scaled_dot_product_attention
    scaled_dot_product_attention.__doc__ = _torch_sdpa.__doc__
    scaled_dot_product_attention.__wrapped__ = _torch_sdpa
    torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention
    _installed = True
    return True


def uninstall() -> None:
    """torch's functional put back where the wrapper is still the one installed (the probe's verdicts stay:
    they are the process's)."""
    global _installed
    if _installed and torch.nn.functional.scaled_dot_product_attention is scaled_dot_product_attention:
        torch.nn.functional.scaled_dot_product_attention = _torch_sdpa
        _installed = False
