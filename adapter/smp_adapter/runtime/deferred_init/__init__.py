"""Delayed parameter initialisation for any ``nn.Module``: create it without storage, materialise
only what a rank keeps, with the values the script would have got without delaying.

Inside ``record.creating()`` every tensor a factory makes (``torch.empty``, ``randn``, ``zeros``,
...) is a ``DeferredTensor``: it reports the device and dtype the script asked for, is not
``is_meta``, and has no storage of its own (it is backed by a meta tensor). Every operation that
writes one is logged, there or later (a cast, the tensor-parallel split): the factory, in-place
initialisers (``normal_``, ``zero_``, ``copy_`` from a slice of another), out-of-place results.
A random operation also runs once for real, on a scratch tensor of the same layout, so the random
generator advances exactly as it would have; the log keeps the generator's state from before it.
Reading a value (``.item()``, ``any()``: trunc_normal_'s rejection loop) computes it for real.
Nothing larger than one tensor and what it was computed from is ever allocated.

``record.materialize(tensors, device)`` replays, in order, only the logged operations that lead to
those tensors' storages (what they read, recursively), random ones on a private generator set to
the recorded state: the same operation, shapes and generator state give the same values to the
bit. Each storage moves to ``device`` as soon as nothing later reads it on the host.

A tensor in the log is (storage, dtype, size, stride, offset), so views cost nothing: a write
through ``weight.data[0].zero_()`` or a Parameter made from a view replays on the same bytes.
torchdistx's ``deferred_init`` records the same way in C++; this follows torch's operator schema
(which arguments an operator writes, which results only view an input) and FakeTensor's way of
reporting a device for a meta-backed tensor.
"""

from smp_adapter.runtime.deferred_init.heap import release_freed_heap
from smp_adapter.runtime.deferred_init.log import RecordingError
from smp_adapter.runtime.deferred_init.modules import (
    holds_deferred, materialize_in_place, meta_like, module_tensors, open_record, own_tensors, record_of, replace_in_place)
from smp_adapter.runtime.deferred_init.record import DeferredInit, DeferredTensor

__all__ = ["DeferredInit", "DeferredTensor", "RecordingError", "holds_deferred", "materialize_in_place", "meta_like",
           "module_tensors", "open_record", "own_tensors", "record_of", "release_freed_heap", "replace_in_place"]
