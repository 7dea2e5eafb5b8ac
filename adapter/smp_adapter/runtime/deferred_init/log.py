"""What a delayed-initialisation record keeps (runtime/deferred_init): a tensor as a view of a
recorded storage, a constant read from outside, a logged operation; and what torch's operator schema
says about an operator (does it write an argument, view one, draw random numbers)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

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


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _reads(largs, lkwargs) -> frozenset:
    return frozenset(a.key for a in tree_flatten((largs, lkwargs))[0] if isinstance(a, _Ref))


def _ref(t: torch.Tensor) -> _Ref:
    return _Ref(t.untyped_storage()._cdata, t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())


def meta_alias(t: torch.Tensor) -> torch.Tensor:
    """A plain meta tensor on the same (meta) storage as ``t``."""
    return torch.empty(0, dtype=t.dtype, device=META).set_(t.untyped_storage(), t.storage_offset(), t.size(),
                                                           t.stride())


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
