"""CUDA on CPU ranks: run an unchanged GPU training script on a machine without GPUs.

smp v1 scripts were written for one GPU per rank: ``torch.cuda.set_device(smp.local_rank())``,
``torch.device("cuda")``, ``.cuda()``, ``torch.cuda.synchronize()``, memory queries, and often their
own ``assert torch.cuda.is_available()``. ``smp-adapter launch`` on a machine without CUDA (or with
``--cpu``) sets ``SMP_ADAPTER_CUDA_ON_CPU=1``; importing ``smdistributed.modelparallel`` then calls
``install()``, which makes those calls behave as on one GPU per rank while every tensor stays on
the CPU. Never installed when a real CUDA device exists.

How:
* device arguments: a ``TorchFunctionMode`` rewrites ``"cuda"`` / ``"cuda:1"`` / ``torch.device("cuda", i)``
  given to any torch function or tensor method (``.to``, factories such as ``torch.zeros(..., device=)``)
  to ``"cpu"``, and makes ``Tensor.cuda()`` return the tensor. It applies to every caller, because
  libraries act on the script's devices too (transformers' Trainer moves the model to
  ``torch.device("cuda", smp.local_rank())`` on its SageMaker-MP path).
* capability queries (``is_available``, ``device_count``, ``is_bf16_supported``) answer "one GPU per
  rank" only to the script's own code: calls from torch, DeepSpeed, Megatron-core, transformers,
  accelerate and smp-adapter get the real answer, so they keep choosing their CPU paths.
* ``set_device``, ``synchronize``, ``empty_cache`` and the ``reset_*`` statistics calls do nothing;
  ``current_device`` returns the index last set. Memory queries report this process's resident memory
  (``memory_allocated`` / ``memory_reserved``: now; ``max_*``: peak since start), ``mem_get_info`` the
  machine's free and total RAM, device properties name the CPU with the machine's RAM.
* float16 ``scaled_dot_product_attention`` runs torch's math kernel on CPUs without AVX512, where
  torch's CPU flash kernel for float16 raises (see ``_FP16_FLASH_NEEDS_MATH``).
* ``torch.cuda.amp.autocast`` / ``torch.autocast("cuda")`` become CPU autocast (bfloat16 unless a
  dtype is given); ``torch.cuda.amp.GradScaler`` is torch's CPU GradScaler; ``torch.cuda.Event``
  measures wall-clock time; streams are placeholders; ``torch.cuda.FloatTensor`` & co. are the CPU types.

Limits: tensors report ``is_cuda == False`` and ``device.type == "cpu"``; code that branches on
those takes its CPU path. The mode lives in the thread that imported smp (CPU autograd runs there
too). Each torch call pays a Python-level check. Measured on the 2-core CI machine (AdamW step of a
4-layer MLP, batch 32, one thread, 3 alternated runs): width 64 0.47 -> 0.85 ms (+0.38 ms, about 6 us
per torch call), width 1024 within run-to-run noise (25-39 ms). A smoke-test tool, not for timing.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

ENV = "SMP_ADAPTER_CUDA_ON_CPU"
# callers that must keep seeing the real machine
_LIBRARIES = ("torch", "deepspeed", "megatron", "transformers", "accelerate", "smp_adapter", "smdistributed",
              "apex", "triton", "safetensors", "huggingface_hub", "datasets", "numpy")
_installed = False
_current = 0


def _from_library(depth: int = 2) -> bool:
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name.split(".", 1)[0] in _LIBRARIES


def _is_device(device) -> bool:
    return isinstance(device, torch.device) or (isinstance(device, str) and (device == "cpu" or _is_cuda(device)))


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return False


# torch 2.13's CPU flash-attention kernel for float16 packs with AVX512 instructions and raises
# "pack_vnni2 is only supported when avx512 is supported" elsewhere (ATEN_CPU_CAPABILITY=avx2/default,
# or CPUs without AVX512 such as AMD EPYC before Zen 4) for sequences of 32 tokens and more. A GPU
# script's fp16 attention then fails on such CPU ranks; its math kernel computes the same attention.
# (the functional, and the aten op a traced pipeline stage calls; both choose a kernel by sdpa_kernel)
_SDPA = (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
_FP16_FLASH_NEEDS_MATH = torch.backends.cpu.get_cpu_capability() != "AVX512"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return _as_transferred(args[0])
        # a move to a device: here every device is the CPU (torch.device("cuda", i) already says "cpu:i")
        transfer = func is torch.Tensor.to and any(_is_device(a) for a in (*args[1:], kwargs.get("device")))
        if transfer:  # "cpu:i" is not the tensor's "cpu" to torch, which would copy every time: one CPU
            args = tuple(torch.device("cpu") if _is_device(a) else a for a in args)
            if kwargs.get("device") is not None:
                kwargs = {**kwargs, "device": torch.device("cpu")}
        if any(_is_cuda(a) for a in args):
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs = {**kwargs, "device": "cpu"}
        if _FP16_FLASH_NEEDS_MATH and func in _SDPA:
            query = args[0] if args else kwargs.get("query")
            if getattr(query, "dtype", None) == torch.float16:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.MATH):
                    return func(*args, **kwargs)
        out = func(*args, **kwargs)
        return _as_transferred(out) if transfer and out is args[0] else out


def _as_transferred(t: torch.Tensor) -> torch.Tensor:
    """What a copy to a GPU gives: strides kept where the tensor is dense, contiguous otherwise. A
    strided slice (``rows[0::2]``) moved with ``.to("cuda")`` comes out contiguous, and scripts rely
    on it without knowing (Hugging Face's T5 loss calls ``labels.view(-1)``); a contiguous tensor is
    returned as it is (same values and layout, no copy)."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.preserve_format)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _ram() -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


class _Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1000.0  # milliseconds, as CUDA events


class _Stream:
    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cpu")

    def synchronize(self):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or _Event()
        event.record()
        return event

    def query(self):
        return True


def _autocast_class(base):
    class CpuAutocast(base):
        def __init__(self, device_type="cuda", dtype=None, enabled=True, cache_enabled=None):
            if isinstance(device_type, bool):  # torch.cuda.amp.autocast(enabled) positional
                device_type, enabled = "cuda", device_type
            if device_type == "cuda":
                device_type, dtype = "cpu", dtype or torch.bfloat16
            super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    CpuAutocast.__name__ = CpuAutocast.__qualname__ = "autocast"
    return CpuAutocast


class _CpuGradScaler(torch.amp.GradScaler):
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, enabled=True):
        super().__init__("cpu", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)


def _query(real, fake):
    """A capability query answering ``fake()`` to the script and ``real()`` to libraries."""
    def query(*args, **kwargs):
        return real(*args, **kwargs) if _from_library() else fake(*args, **kwargs)

    query.__name__ = getattr(real, "__name__", "query")
    return query


def _set_device(device):
    global _current
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        _current = device.index or 0
    else:
        _current = int(device) if device is not None else 0


def requested() -> bool:
    return os.environ.get(ENV) == "1"


def install() -> bool:
    """Install the shim in this process; False (and nothing changed) when a real GPU exists."""
    global _installed
    if _installed:
        return True
    cuda = torch.cuda
    if cuda.is_available():
        return False
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1"))))
    properties = SimpleNamespace(name="CPU (smp-adapter CUDA on CPU ranks)", total_memory=_ram()[1], major=8, minor=0,
                                 multi_processor_count=os.cpu_count() or 1, is_integrated=False)
    replacements = {
        "is_available": _query(cuda.is_available, lambda: True),
        "device_count": _query(cuda.device_count, lambda: local),
        "is_bf16_supported": _query(cuda.is_bf16_supported, lambda *a, **k: True),
        "set_device": _set_device,
        "current_device": lambda: _current,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "ipc_collect": lambda: None,
        "memory_allocated": lambda device=None: _rss(),
        "memory_reserved": lambda device=None: _rss(),
        "max_memory_allocated": lambda device=None: _peak_rss(),
        "max_memory_reserved": lambda device=None: _peak_rss(),
        "memory_cached": lambda device=None: _rss(),
        "max_memory_cached": lambda device=None: _peak_rss(),
        "memory_stats": lambda device=None: {"allocated_bytes.all.current": _rss(), "allocated_bytes.all.peak": _peak_rss(),
                                             "reserved_bytes.all.current": _rss(), "reserved_bytes.all.peak": _peak_rss()},
        "mem_get_info": lambda device=None: _ram(),
        "get_device_name": lambda device=None: properties.name,
        "get_device_properties": lambda device=None: properties,
        "get_device_capability": lambda device=None: (properties.major, properties.minor),
        "Event": _Event, "Stream": _Stream,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "current_stream": lambda device=None: _Stream(), "default_stream": lambda device=None: _Stream(),
    }
    for name in ("reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
                 "reset_accumulated_memory_stats"):
        replacements[name] = lambda device=None: None
    for name, cpu_type in (("FloatTensor", torch.FloatTensor), ("HalfTensor", torch.HalfTensor),
                           ("BFloat16Tensor", torch.BFloat16Tensor), ("DoubleTensor", torch.DoubleTensor),
                           ("IntTensor", torch.IntTensor), ("LongTensor", torch.LongTensor),
                           ("ByteTensor", torch.ByteTensor), ("BoolTensor", torch.BoolTensor)):
        replacements[name] = cpu_type
    for name, value in replacements.items():
        setattr(cuda, name, value)
    cuda.amp.autocast = _autocast_class(torch.amp.autocast_mode.autocast)
    cuda.amp.GradScaler = _CpuGradScaler
    torch.autocast = torch.amp.autocast = _autocast_class(torch.amp.autocast_mode.autocast)
    _CudaToCpu().__enter__()  # stays on the mode stack for the life of the process
    _installed = True
    return True


def install_if_requested() -> bool:
    return install() if requested() else False
