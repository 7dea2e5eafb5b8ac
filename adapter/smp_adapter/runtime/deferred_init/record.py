"""The record of a delayed creation: ``DeferredInit`` (recording, and the replay that materialises
chosen tensors), the ``DeferredTensor`` its tensors are, and the dispatch mode that makes factories
create them (runtime/deferred_init/__init__.py says how it works)."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from smp_adapter.runtime.deferred_init.heap import release_freed_heap
from smp_adapter.runtime.deferred_init.log import (
    META, RecordingError, _Const, _default_generator, _Entry, _is_random, _is_view, _laid_out, meta_alias, _moved,
    _random_state, _reads, _Ref, _ref, _Storage, _view)


class DeferredInit:
    """The record of the tensors created under delayed initialisation in one process."""

    def __init__(self):
        self.storages: dict[int, _Storage] = {}
        self.log: list[_Entry] = []

    @contextlib.contextmanager
    def creating(self):
        """Tensors made by factories inside are DeferredTensors of this record."""
        try:
            with _Creating(self):
                yield
        finally:
            release_freed_heap()  # the random draws' scratch tensors

    def key_of(self, tensor: torch.Tensor) -> int | None:
        """The record's storage behind ``tensor`` (a DeferredTensor, or a meta alias of one)."""
        if not (isinstance(tensor, DeferredTensor) or tensor.is_meta):
            return None
        key = tensor.untyped_storage()._cdata
        return key if key in self.storages else None

    def random_states(self) -> list:
        """The recorded generator states, in log order (every rank of a data-parallel group replays
        its first rank's: runtime/engines/base.py)."""
        return [e.rng for e in self.log if e.rng is not None]

    def adopt_random_states(self, states: list) -> None:
        mine = [e for e in self.log if e.rng is not None]
        if len(mine) != len(states):
            raise RecordingError(
                f"delayed initialisation: this rank drew {len(mine)} random tensors while creating the model and the "
                f"first rank of its data-parallel group drew {len(states)}: every data-parallel rank must create the "
                "same model the same way")
        for entry, rng in zip(mine, states):
            entry.rng = list(rng)

    # -- replay ------------------------------------------------------------------------------------
    def materialize(self, tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
        """Plain tensors with the recorded values of ``tensors`` on ``device``; tensors that shared
        a storage share one again (tied weights, views)."""
        refs = []
        for t in tensors:
            if self.key_of(t) is None:
                raise RecordingError(
                    f"a tensor of shape {tuple(t.shape)} has no storage and was not created under smp's delayed "
                    "initialisation, so its values cannot be produced: create the model inside "
                    "smp.delay_param_initialization() / smp.model_creation(), not on the meta device yourself")
            refs.append(_ref(t))
        targets = {r.key for r in refs}
        storages = self._replay(self._needed(targets), targets, torch.device(device))
        return [_view(storages[r.key], r) for r in refs]

    def _needed(self, targets: set) -> list[_Entry]:
        needed, wanted = [], set(targets)
        for entry in reversed(self.log):
            if entry.writes & wanted:
                needed.append(entry)
                wanted |= entry.reads
        needed.reverse()
        return needed

    def _replay(self, entries: list[_Entry], targets: set, device: torch.device) -> dict:
        last_use: dict[int, int] = {}
        for i, e in enumerate(entries):
            for k in e.reads | e.writes:
                last_use[k] = i
        real: dict = {}
        done: dict = {}
        for i, e in enumerate(entries):
            self._run(e, real)
            for k in e.reads | e.writes:
                if last_use[k] == i and k in real:
                    storage = real.pop(k)
                    if k in targets:  # moved now: the host holds only what later entries still read
                        done[k] = storage if storage.device == device else _moved(storage, device)
        if targets - set(done):
            raise RecordingError("delayed initialisation: a tensor's creation was not recorded (internal error)")
        return done

    def _run(self, e: _Entry, real: dict) -> None:
        def arg(a):
            if isinstance(a, _Ref):
                return _view(real[a.key], a)
            if isinstance(a, _Const):
                if a.value._version != a.version:
                    raise RecordingError(
                        "delayed initialisation: a tensor made outside the model's creation was copied into it and "
                        "changed afterwards, so the copy cannot be replayed: copy a tensor you no longer change")
                return a.value
            if isinstance(a, torch.device) and a.type == "meta":
                return e.device
            return a

        args, kwargs = tree_map(arg, e.args), tree_map(arg, e.kwargs)
        if "device" in kwargs and e.device is not None:
            kwargs["device"] = e.device
        with _random_state(e, kwargs):
            out = e.func(*args, **kwargs)
        if e.outputs:
            results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            for ref, result in zip(e.outputs, results):
                real[ref.key] = _laid_out(result, ref, self.storages[ref.key].nbytes)

    # -- recording (called from DeferredTensor and _Creating) --------------------------------------
    def _new(self, meta: torch.Tensor, device) -> _Ref:
        storage = meta.untyped_storage()
        self.storages[storage._cdata] = _Storage(storage, torch.device(device), storage.nbytes())
        return _ref(meta)

    def _wrap(self, meta: torch.Tensor) -> "DeferredTensor":
        return DeferredTensor(meta, self)

    def device_of(self, tensor) -> torch.device:
        return self.storages[tensor.untyped_storage()._cdata].device

    def record_factory(self, func, args, kwargs):
        names = {a.name for a in func._schema.arguments}
        device = torch.device(kwargs.get("device") or "cpu")
        rng = _advance(self, func, args, dict(kwargs), device) if _is_random(func) else None
        meta_kwargs = {**kwargs, "device": META}
        if "pin_memory" in kwargs:
            meta_kwargs["pin_memory"] = False
        out = func(*args, **meta_kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if "dtype" in names and kwargs.get("dtype") is None and outs:
            kwargs = {**kwargs, "dtype": outs[0].dtype}  # replayed later, maybe under another default dtype
        refs = [self._new(t, device) for t in outs]
        self.log.append(_Entry(func, args, dict(kwargs), frozenset(r.key for r in refs), frozenset(), refs, rng,
                               device))
        return tree_map(lambda t: self._wrap(t) if isinstance(t, torch.Tensor) else t, out)

    def record_operation(self, func, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        deferred = [t for t in flat if isinstance(t, DeferredTensor)]
        device = self.device_of(deferred[0])
        logged, meta_flat = [], []
        for a in flat:
            if isinstance(a, DeferredTensor):
                logged.append(_ref(a))
                meta_flat.append(meta_alias(a))
            elif isinstance(a, torch.Tensor):
                if a.is_meta:
                    raise RecordingError(f"delayed initialisation: {func} mixes a model tensor with a meta tensor "
                                         "made outside the model's creation")
                logged.append(_Const(a, a._version))
                meta_flat.append(torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=META))
            else:
                logged.append(a)
                meta_flat.append(a)
        margs, mkwargs = tree_unflatten(meta_flat, spec)
        largs, lkwargs = tree_unflatten(logged, spec)
        if func is torch.ops.prim.device.default:
            return device
        if _is_view(func):  # a meta view of the same storage: views are described by their storage
            return tree_map(lambda t: self._wrap(t) if isinstance(t, torch.Tensor) else t, func(*margs, **mkwargs))
        new_device = mkwargs.get("device")
        if new_device is not None and torch.device(new_device).type != "meta":
            device = torch.device(new_device)  # .to(device): the new storage lives there
            mkwargs = {**mkwargs, "device": META}
        rng = _advance(self, func, largs, lkwargs, device) if _is_random(func) else None
        written = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        if written:
            targets = [args[i] if i < len(args) else kwargs.get(name) for i, name in written]
            targets = [t for t in targets if isinstance(t, torch.Tensor)]
            if any(not isinstance(t, DeferredTensor) for t in targets):
                raise RecordingError(f"delayed initialisation: {func} writes a model tensor's values into a tensor "
                                     "made outside the model's creation; make that tensor inside the creation")
            try:
                func(*margs, **mkwargs)  # checks shapes; a data-dependent write (t[mask] = v) has no meta kernel
            except (NotImplementedError, RuntimeError):
                pass
            self.log.append(_Entry(func, largs, lkwargs, frozenset(t.untyped_storage()._cdata for t in targets),
                                   _reads(largs, lkwargs), [], rng, device))
            return targets[0] if len(targets) == 1 else tuple(targets)
        try:
            out = func(*margs, **mkwargs)
        except (NotImplementedError, RuntimeError):  # no meta kernel, or a data-dependent shape
            out = self._computed(func, largs, lkwargs)
            out = tree_map(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=META)
                           if isinstance(t, torch.Tensor) else t, out)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs:  # a value (item(), equal, is_nonzero): computed for real from the replayed inputs
            return self._computed(func, largs, lkwargs)
        refs = [self._new(t, device) for t in outs]
        self.log.append(_Entry(func, largs, lkwargs, frozenset(r.key for r in refs), _reads(largs, lkwargs), refs,
                               rng, device))
        return tree_map(lambda t: self._wrap(t) if isinstance(t, torch.Tensor) else t, out)

    def _computed(self, func, largs, lkwargs):
        return func(*tree_map(lambda a: _real(self, a), largs), **tree_map(lambda a: _real(self, a), lkwargs))


class DeferredTensor(torch.Tensor):
    """A tensor of a delayed-initialisation record: a meta tensor that reports the device the
    script created it on (as torch's FakeTensor does) and records what is done to it."""

    @staticmethod
    def __new__(cls, meta: torch.Tensor, record: DeferredInit):
        device = record.device_of(meta)
        self = torch.Tensor._make_subclass(cls, meta, meta.requires_grad, dispatch_device=True,
                                           device_for_backend_keys=device)
        self._deferred_record = record
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        record = next(t._deferred_record for t in tree_flatten((args, kwargs or {}))[0]
                      if isinstance(t, DeferredTensor))
        return record.record_operation(func, args, kwargs or {})

    def __repr__(self):
        return f"DeferredTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


class _Creating(TorchDispatchMode):
    """Factories make DeferredTensors; operations on real tensors alone run as usual (a literal
    ``torch.tensor([...])`` stays real: Hugging Face probes the device context with one)."""

    def __init__(self, record: DeferredInit):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if tensors or not any(a.name == "device" for a in func._schema.arguments):
            return func(*args, **kwargs)  # DeferredTensor arguments re-dispatch to their class
        return self.record.record_factory(func, args, kwargs)


def _real(record: DeferredInit, a):
    """A logged argument's value now: a recorded tensor replayed, a constant as it is."""
    if isinstance(a, _Ref):
        meta = torch.empty(0, dtype=a.dtype, device=META).set_(record.storages[a.key].meta, a.offset, a.size,
                                                               a.stride)
        return record.materialize([meta], record.storages[a.key].device)[0]
    if isinstance(a, _Const):
        return a.value
    return a


def _advance(record: DeferredInit, func, largs, lkwargs, device):
    """Run a random operation once for real (its inputs replayed) so the generator advances as it
    would have; return [generator device, its state from before]."""
    generator = lkwargs.get("generator")
    gen = generator if generator is not None else _default_generator(device)
    state = gen.get_state()
    args = tree_map(lambda a: device if isinstance(a, torch.device) and a.type == "meta" else _real(record, a), largs)
    kwargs = tree_map(lambda a: _real(record, a), lkwargs)
    if "device" in kwargs:
        kwargs["device"] = device
    func(*args, **kwargs)  # the result is dropped: only the generator's advance matters
    if generator is not None:
        lkwargs["generator"] = None  # replayed on a private generator of the same state
    return [gen.device, state]
