"""CUDA on CPU ranks: run an unchanged GPU training script on a machine without GPUs.

smp v1 scripts were written for one GPU per rank: ``torch.cuda.set_device(smp.local_rank())``,
``torch.device("cuda")``, ``.cuda()``, ``torch.cuda.synchronize()``, memory queries, and often their
own ``assert torch.cuda.is_available()``. ``smp-adapter launch`` on a machine without CUDA (or with
``--cpu``) sets ``SMP_ADAPTER_CUDA_ON_CPU=1``; importing ``smdistributed.modelparallel`` then calls
``install()``, which makes those calls behave as on one GPU per rank while every tensor stays on
the CPU. Never installed when a real CUDA device exists.

How:
* device arguments: the torch calls that can take a device are wrapped one by one (factories such
  as ``torch.zeros(..., device=)``, ``Tensor.new_*``, ``Tensor.to``, ``Tensor.cuda`` and so
  ``Module.to`` / ``Module.cuda``, ``torch.load(map_location=)``): ``"cuda"`` / ``"cuda:1"`` /
  ``torch.device("cuda", i)`` there means the CPU. Every caller gets this, because libraries act on
  the script's devices too (transformers' Trainer moves the model to
  ``torch.device("cuda", smp.local_rank())`` on its SageMaker-MP path). Every other torch call runs
  untouched: the step's forward, backward and optimizer cost what they cost without the shim. (It
  was a ``TorchFunctionMode`` over every torch call until it measured ~6% of a GPT-2 step on CPU
  ranks; even an empty mode costs ~10% of a small model's step.)
* capability queries (``is_available``, ``device_count``, ``is_bf16_supported``) answer "one GPU per
  rank" only to the script's own code: calls from torch, DeepSpeed, Megatron-core, transformers,
  accelerate and smp-adapter get the real answer, so they keep choosing their CPU paths.
* ``set_device``, ``synchronize``, ``empty_cache`` and the ``reset_*`` statistics calls do nothing;
  ``current_device`` returns the index last set. Memory queries report this process's resident memory
  (``memory_allocated`` / ``memory_reserved``: now; ``max_*``: peak since start), ``mem_get_info`` the
  machine's free and total RAM, device properties name the CPU with the machine's RAM.
* CPU attention of a dtype whose torch kernel raises on this CPU (probed per process) is not this
  shim's: runtime/attention.py does it for every process that imports smp, and changes nothing
  else. Nothing this shim does picks another kernel for a computation the script runs on the CPU
  anyway, so a rank computes the same numbers with the mode on or off.
* ``torch.cuda.amp.autocast`` / ``torch.autocast("cuda")`` become CPU autocast (bfloat16 unless a
  dtype is given); ``torch.cuda.amp.GradScaler`` is torch's CPU GradScaler; ``torch.cuda.Event``
  measures wall-clock time; streams are placeholders; ``torch.cuda.FloatTensor`` & co. are the CPU types.

Limits: tensors report ``is_cuda == False`` and ``device.type == "cpu"``; code that branches on
those takes its CPU path. ``torch.device("cuda", i)`` itself stays a CUDA device (it is read as the
CPU where it is used), so ``torch.Generator(device=torch.device("cuda"))`` fails as on a CPU
machine. Names bound before smp was imported (``from torch import zeros``) keep torch's own. Cost:
a Python-level check in the wrapped calls only (~0.3 us each); nothing elsewhere
(benchmarks/launch_overhead.py: mode on against off within noise).
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
from types import SimpleNamespace

import torch

from smp_adapter.compat.libraries import is_library_module  # callers that must keep seeing the real machine

ENV = "SMP_ADAPTER_CUDA_ON_CPU"
_installed = False
_current = 0


def _from_library(depth: int = 2) -> bool:
    return is_library_module(sys._getframe(depth).f_globals.get("__name__", ""))


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return False


_CPU = torch.device("cpu")

# The calls that take a device, wrapped one by one (nothing else pays anything): every torch function
# and Tensor method whose aten schema has a ``device`` argument (torch 2.13; tests/unit/test_cuda_on_cpu.py
# lists the schemas again and fails on one that is neither here nor in _NOT_WRAPPED), plus asarray and
# new_tensor (Python-level factories) and torch.fft's frequency grids. ``device`` is keyword-only in each.
_FACTORIES = ("arange", "as_tensor", "asarray", "bartlett_window", "blackman_window", "empty", "empty_like",
              "empty_permuted", "empty_quantized", "empty_strided", "eye", "from_file", "full", "full_like",
              "hamming_window", "hann_window", "kaiser_window", "linspace", "logspace", "normal", "ones", "ones_like",
              "rand", "rand_like", "randint", "randint_like", "randn", "randn_like", "randperm", "range",
              "scalar_tensor", "sparse_bsc_tensor", "sparse_bsr_tensor", "sparse_compressed_tensor",
              "sparse_coo_tensor", "sparse_csc_tensor", "sparse_csr_tensor", "tensor", "tril_indices", "triu_indices",
              "zeros", "zeros_like")
_TENSOR_FACTORIES = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros")
_FFT_FACTORIES = ("fftfreq", "rfftfreq")
# a class (replacing it would break isinstance checks on torch's own generators); pinning is a host
# operation, torch's own CPU answer is kept
_NOT_WRAPPED = ("Generator", "pin_memory", "is_pinned")


def _device_to_cpu(factory):
    """``factory`` with a CUDA ``device=`` read as the CPU (TorchScript still compiles it as the aten op)."""
    def call(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    call.__name__ = call.__qualname__ = getattr(factory, "__name__", "factory")
    call.__doc__ = factory.__doc__
    call.__wrapped__ = factory
    op = torch.jit._builtins._find_builtin(factory)
    if op is not None:
        torch.jit._builtins._register_builtin(call, op)
    return call


_TO = torch.Tensor.to


def _to(self, *args, **kwargs):
    """``Tensor.to``: a CUDA destination (first argument or ``device=``) is the CPU, as a copy to a GPU."""
    if args and _is_cuda(args[0]):
        args = (_CPU, *args[1:])
    elif "device" in kwargs and _is_cuda(kwargs["device"]):
        kwargs["device"] = _CPU
    else:
        return _TO(self, *args, **kwargs)
    out = _TO(self, *args, **kwargs)
    return _as_transferred(out) if out is self else out


def _cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return _as_transferred(self)


def _load_to_cpu(load):
    """``torch.load(..., map_location="cuda:1" / torch.device("cuda", i))`` loads onto the CPU."""
    def call(f, map_location=None, *args, **kwargs):
        return load(f, _CPU if _is_cuda(map_location) else map_location, *args, **kwargs)

    call.__name__, call.__doc__, call.__wrapped__ = "load", load.__doc__, load
    return call


def _wrap_device_arguments() -> None:
    # ``with torch.device("meta"):`` (transformers 5 creates every model inside it for from_pretrained,
    # accelerate's init_empty_weights too) gives a device to the factories in torch's set
    # torch.utils._device._device_constructors(), built once, at its first call, from the names then in
    # torch. The mode dispatches the torch function our wrapper calls, i.e. torch's own: built after the
    # wrapping, the set would hold only our wrappers, no factory would go to meta, and transformers 5
    # would load BERT's non-persistent buffers as uninitialised memory (it marks them initialised while
    # still on the CPU, then replaces them with torch.empty_like). Built here, it holds torch's own.
    import torch.utils._device

    torch.utils._device._device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _device_to_cpu(getattr(torch, name)))
    for name in _TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _device_to_cpu(getattr(torch.Tensor, name)))
    for name in _FFT_FACTORIES:
        setattr(torch.fft, name, _device_to_cpu(getattr(torch.fft, name)))
    torch.Tensor.to, torch.Tensor.cuda = _to, _cuda
    torch.load = _load_to_cpu(torch.load)
    # zero.Init puts back the factories it saw when DeepSpeed was imported: where that came first, ours
    zero_init = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn"):
        if zero_init is not None and hasattr(zero_init, f"_orig_torch_{name}"):
            setattr(zero_init, f"_orig_torch_{name}", getattr(torch, name))


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
    _wrap_device_arguments()
    _installed = True
    return True


def install_if_requested() -> bool:
    return install() if requested() else False
