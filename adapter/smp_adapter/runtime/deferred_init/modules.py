"""Delayed initialisation over a module: its tensors, its record, and putting values into the
tensors a module, an optimizer and hooks already hold (``replace_in_place``)."""

from __future__ import annotations

import torch

from smp_adapter.runtime.deferred_init.heap import release_freed_heap
from smp_adapter.runtime.deferred_init.log import META, RecordingError, meta_alias
from smp_adapter.runtime.deferred_init.record import DeferredInit, DeferredTensor


def own_tensors(module) -> list[torch.Tensor]:
    """``module``'s own parameters and buffers (not its children's), and the delayed tensors it holds
    as plain attributes: transformers 4.x's GPT-J keeps its rotary table as ``self.embed_positions``,
    neither parameter nor buffer, made by factories inside the creation. Left without storage, it
    turned every forward into a recording and the gradients into record tensors."""
    tensors = [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]
    return tensors + [v for v in vars(module).values() if isinstance(v, DeferredTensor)]


def module_tensors(module) -> list[torch.Tensor]:
    """Every tensor of ``module`` and its submodules (``own_tensors``) once (a tied weight once)."""
    seen, out = set(), []
    for m in module.modules():
        for t in own_tensors(m):
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
        return meta_alias(tensor)
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
