"""The peak of live CPU tensor bytes of one process, measured independently of smp-adapter's plan.

How: every tensor storage alive when tracking starts (found through the garbage collector: the
model's parameters, DeepSpeed's flat buffers and partitions, the optimizer state) and every storage
an operator creates or resizes afterwards (a TorchDispatchMode sees each operator's outputs) is
counted at its current size until Python's weak reference to it dies; the running sum's maximum is
the peak. This is the approach of torch's own MemTracker (storage weak references), without its
FSDP and CUDA parts. Storages are counted once, however many tensors view them.

Not seen: memory outside tensors (gloo's buffers, Python objects) and storages only C++ holds when
tracking starts (none between training steps: the autograd graph is gone).
"""

from __future__ import annotations

import gc
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage identity -> bytes counted
        self.refs: dict[int, weakref.ref] = {}
        self.now = self.peak = 0

    def _gone(self, key):
        self.now -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def see(self, value) -> None:
        if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.device.type != "cpu":
            return
        storage = value.untyped_storage()
        key = storage._cdata
        nbytes = storage.nbytes()
        if key not in self.refs:
            self.refs[key] = weakref.ref(storage, lambda _, k=key: self._gone(k))
        self.now += nbytes - self.sizes.get(key, 0)
        self.sizes[key] = nbytes
        self.peak = max(self.peak, self.now)

    def start(self) -> "LiveTensorBytes":
        """Count what is alive now, then watch every operator."""
        with warnings.catch_warnings():  # isinstance() on every object touches deprecated module attributes
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    self.see(obj)
        self.peak = self.now
        return self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # outputs are new storages; in-place and out= operators (resize_, set_) change their inputs' sizes
        for value in tree_flatten(out)[0]:
            self.see(value)
        if func._schema.is_mutable:
            for value in tree_flatten((args, kwargs))[0]:
                self.see(value)
        return out
