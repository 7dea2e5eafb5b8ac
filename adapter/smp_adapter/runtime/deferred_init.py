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

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from smp_adapter.errors import SMPUsageError

META = torch.device("meta")


class RecordingError(SMPUsageError):
    """Module creation did something delayed initialisation cannot record or replay."""


@dataclass(frozen=True)
class _Ref:
    """A tensor of the log: a view of a recorded storage."""
    key: int
    dtype: torch.dtype
    size: tuple
    stride: tuple
    offset: int


@dataclass(frozen=True)
class _Const:
    """A real tensor the recorded code read (made outside the recording), and its version then."""
    value: torch.Tensor
    version: int


@dataclass
class _Storage:
    meta: object  # the meta UntypedStorage (kept, so that its address is never reused)
    device: torch.device  # where the script would have created it
    nbytes: int


@dataclass
class _Entry:
    func: object
    args: tuple
    kwargs: dict
    writes: frozenset  # storage keys written in place or created
    reads: frozenset  # storage keys of the tensor arguments
    outputs: list = field(default_factory=list)  # _Ref of each new storage (out-of-place results)
    rng: list | None = None  # [device, generator state before the op] (a list: synced over ranks)
    device: torch.device | None = None  # where it runs (factories: the device the script asked for)


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
                meta_flat.append(_meta_alias(a))
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


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _reads(largs, lkwargs) -> frozenset:
    return frozenset(a.key for a in tree_flatten((largs, lkwargs))[0] if isinstance(a, _Ref))


def _ref(t: torch.Tensor) -> _Ref:
    return _Ref(t.untyped_storage()._cdata, t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())


def _meta_alias(t: torch.Tensor) -> torch.Tensor:
    """A plain meta tensor on the same (meta) storage as ``t``."""
    return torch.empty(0, dtype=t.dtype, device=META).set_(t.untyped_storage(), t.storage_offset(), t.size(),
                                                           t.stride())


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


@contextlib.contextmanager
def _random_state(e: _Entry, kwargs: dict):
    if e.rng is None:
        yield
        return
    device, state = e.rng
    if any(a.name == "generator" for a in e.func._schema.arguments):
        g = torch.Generator(device=device)
        g.set_state(state)
        kwargs["generator"] = g
        yield
        return
    gen = _default_generator(torch.device(device))
    saved = gen.get_state()
    gen.set_state(state)
    try:
        yield
    finally:
        gen.set_state(saved)


def _default_generator(device: torch.device):
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    raise RecordingError(f"delayed initialisation cannot reproduce random values drawn on {device}")


def _view(storage, ref: _Ref) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device=storage.device).set_(storage, ref.offset, ref.size, ref.stride)


def _laid_out(result: torch.Tensor, ref: _Ref, nbytes: int):
    """The storage of an out-of-place result, laid out as the meta result was (the log's views of it
    use the meta strides)."""
    storage = result.untyped_storage()
    if (tuple(result.stride()) == ref.stride and result.storage_offset() == ref.offset
            and storage.nbytes() == nbytes and result.dtype == ref.dtype):
        return storage
    out = torch.empty(nbytes, dtype=torch.uint8, device=result.device).untyped_storage()
    _view(out, ref).copy_(result)
    return out


def _moved(storage, device):
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).to(device).untyped_storage()


# -- modules ---------------------------------------------------------------------------------------
def module_tensors(module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``module`` once (a tied weight once)."""
    seen, out = set(), []
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def holds_deferred(module) -> bool:
    return any(isinstance(t, DeferredTensor) for t in module_tensors(module))


def record_of(module) -> DeferredInit | None:
    """The record ``module``'s delayed tensors belong to (None: it has none). A record lives as long
    as a tensor of it does: once every tensor of a model was materialised or replaced, the log, and
    the tensors it refers to (a checkpoint loaded before the first step), are freed."""
    records = {id(t._deferred_record): t._deferred_record for t in module_tensors(module)
               if isinstance(t, DeferredTensor)}
    if len(records) > 1:
        raise RecordingError("the model mixes tensors of two separate delayed creations; create it inside one "
                             "smp.delay_param_initialization() / smp.model_creation() block")
    return next(iter(records.values()), None)


def open_record(holder) -> DeferredInit:
    """The record a new delayed creation adds to: the one still alive (``holder``: a weak reference
    to it, or None), else a new one."""
    record = holder() if holder is not None else None
    return record if record is not None else DeferredInit()


def replace_in_place(tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Give the Python object ``tensor`` (a parameter or buffer, which the optimizer, hooks and
    stage modules may hold) the data of ``value``, keeping its identity, class and requires_grad.
    Returns an object holding what ``tensor`` held before."""
    if isinstance(tensor, torch.nn.Parameter) or getattr(tensor, "_is_param", False):
        value = torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
    elif tensor.requires_grad != value.requires_grad:
        value = value.requires_grad_(tensor.requires_grad)
    # swap_tensors swaps the attribute dicts too: the marks others set on the tensor (the tensor-
    # parallel layout, Hugging Face's _is_hf_initialized) stay with the object
    value.__dict__.update({k: v for k, v in tensor.__dict__.items() if k not in ("_deferred_record", "_is_param")})
    # gradient hooks live with the tensor's autograd data, which swap_tensors swaps: put them back on the
    # object (tensor parallelism's 1/tp gradient scale is one; without it split weights got 2x gradients)
    hooks = {name: getattr(tensor, name) for name in _HOOK_TABLES if getattr(tensor, name, None)}
    torch.utils.swap_tensors(tensor, value)
    for name, table in hooks.items():
        setattr(tensor, name, table)
        setattr(value, name, None)
    return value


_HOOK_TABLES = ("_backward_hooks", "_post_accumulate_grad_hooks")


def meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``tensor``'s layout; on a deferred tensor's own storage (it stays replayable)."""
    if isinstance(tensor, DeferredTensor) or tensor.is_meta:
        return _meta_alias(tensor)
    return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=META)


def materialize_in_place(record: DeferredInit, tensors: list[torch.Tensor], device) -> None:
    """The deferred (or meta alias) ``tensors`` become real on ``device``, each keeping its identity;
    storages they shared are shared again."""
    tensors = [t for t in tensors if record.key_of(t) is not None]
    if not tensors:
        return
    with torch.no_grad():
        for tensor, value in zip(tensors, record.materialize(tensors, device)):
            replace_in_place(tensor, value)
    release_freed_heap()  # what the replay computed on the way


def release_freed_heap() -> None:
    """Return the memory freed on the host heap to the kernel. glibc keeps freed blocks below its
    (self-raising) mmap threshold in the heap: creating a model of N tensors of 4 MB under recording
    left N x 4 MB of resident, free heap (measured: 60 MB after a 64 MB MLP; 0 after trimming).
    Nothing to do where the C library has no malloc_trim."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util

        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None  # glibc's malloc_trim, looked up once (False where there is none)
