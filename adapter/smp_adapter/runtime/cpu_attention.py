"""CPU attention whose chosen kernel raises: torch's math kernel for exactly those dtypes, found by probing.

torch 2.13's CPU flash-attention kernel packs its reduced-precision operands with AVX-512 instructions
when the CPU could pack them (``cpublas::could_pack``: what the hardware has, AMX, AVX512-BF16/FP16),
even when torch dispatches below AVX512 (``ATEN_CPU_CAPABILITY=avx2``/``default``, or a build choice);
it then raises "pack_vnni2 is only supported when avx512 is supported". Which dtype does so depends on
the CPU's other features: float16 on one Intel machine, bfloat16 on an Intel Xeon with AMX, none on an
AMD EPYC (Zen 4). A rule written from a capability name is therefore wrong somewhere, so none is
written: each process asks the kernel.

The rule, for every process that imports smp (CUDA on CPU or not): at install, each floating dtype's
attention is run once on the CPU, forward and backward, with torch's own kernel choice (``probe``). A
dtype whose call raises is routed to the math kernel (which computes the same attention); every other
dtype, every CUDA tensor, and every CPU where nothing raises keeps the kernel torch chooses, bit for
bit. A call that still raises the packing error later (a shape the probe did not cover) routes its
dtype from then on and is retried on the math kernel, with one warning.

Two ways in: eager calls reach ``torch.nn.functional.scaled_dot_product_attention``, wrapped by
``install()`` at the first smp import (names bound to torch's function before that keep it); a traced
pipeline stage calls the aten op itself, so the pipeline engine runs a step inside
``math_kernel_for(<the job's compute dtype>)``.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

PROBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The flash kernel packs only when q and kv are >= 64 long and the GEMM work per thread is >= 4 x the
# packing work (qs_per_thread * qSplitSize / (batch * heads) >= 4, qSplitSize 32 at this length). One
# batch row and one head of 128 tokens makes that ratio >= 32 at any thread count, so a CPU that packs
# packs here; a head size of 64 is even (no padding path) and a multiple of the pack block.
PROBE_SHAPE = (1, 1, 128, 64)
PACKING_ERROR = "only supported when avx512"

_verdicts: dict[torch.dtype, bool] = {}  # dtype -> torch's chosen CPU kernel raised for it
_installed = False


def _math_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _torch_choice():
    """Every backend enabled, as in a fresh process: the probe asks what torch chooses by itself,
    whatever block the first caller sits in."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _torch_attention():
    return _torch_sdpa if _installed else torch.nn.functional.scaled_dot_product_attention


def probe(dtype: torch.dtype) -> bool:
    """True when torch's own CPU attention kernel raises for ``dtype`` in this process (forward or
    backward, causal or not); the answer is cached for the process."""
    if dtype not in _verdicts:
        g = torch.Generator().manual_seed(0)
        attention = _torch_attention()
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
                  RuntimeWarning, stacklevel=3)


def _torch_sdpa(query, key, value, *args, **kwargs):
    """torch's own functional, as it was when install() wrapped it (set there)."""
    raise AssertionError("cpu_attention.install() has not run")


def scaled_dot_product_attention(query, key, value, *args, **kwargs):
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


def install() -> bool:
    """Probe every floating dtype and wrap torch's functional (once, at the first smp import)."""
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
