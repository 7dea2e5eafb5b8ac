"""The tensor-parallel context every TP module reads at construction, and their base class.

A leaf of ``smp_adapter.parallel`` (it imports only ``layers`` for the parameter tags): ``nn.py``,
``transformer.py``, ``hf.py``, ``marking.py`` and ``tensor.py``'s replacement walk all build on it,
so none of them needs another's module at import time.

* ``TPContext(group, rank, size, prescaled_batch)``: the caller's TP group. ``smp.init`` makes one
  current (``set_current_tp_context``); ``using_tp_context`` swaps it temporarily;
  ``smp.shutdown`` clears it.
* ``DistributedModule``: base class of every TP module (``smp.nn`` and ``smp.tp_register`` ones).
* ``is_distributed_parameter`` / ``mark_distributed_parameter``: which parameters are TP shards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from smp_adapter import on_shutdown
from smp_adapter.errors import NotInitializedError
from smp_adapter.parallel.layers import DISTRIBUTED_ATTR, ShardMixin, mark_distributed


@dataclass(frozen=True)
class TPContext:
    group: "torch.distributed.ProcessGroup | None"  # the caller's TP group (None when size == 1)
    rank: int  # tp_rank
    size: int  # tp_size
    prescaled_batch: bool = False


_current: Optional[TPContext] = None


def set_current_tp_context(ctx: Optional[TPContext]) -> None:
    """Set (or clear, with None) the process-wide TP context; the runtime calls it after smp.init."""
    global _current
    if ctx is not None and not isinstance(ctx, TPContext):
        raise TypeError(f"expected a TPContext, got {type(ctx).__name__}")
    _current = ctx


@on_shutdown
def reset() -> None:
    """smp.shutdown: no TP context until the next smp.init."""
    set_current_tp_context(None)


def current_tp_context() -> Optional[TPContext]:
    """The TP context set by the runtime, or None before ``smp.init``."""
    return _current


def require_tp_context(what: str) -> TPContext:
    if _current is None:
        raise NotInitializedError(
            f"{what} needs the tensor-parallel group: call smp.init() before creating it"
        )
    return _current


@contextlib.contextmanager
def using_tp_context(ctx: TPContext):
    """Temporarily make ``ctx`` current (apply_tensor_parallelism builds registered modules in it)."""
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev


def is_distributed_parameter(p) -> bool:
    """True for parameters split across the TP ranks (reduce them over the RDP group)."""
    return bool(getattr(p, DISTRIBUTED_ATTR, False))


def mark_distributed_parameter(p: nn.Parameter, layout=None, ctx: Optional[TPContext] = None) -> None:
    """For custom ``DistributedModule``s: declare ``p`` split across TP ranks (optionally with a
    ``layers.ShardLayout`` so ``gather_full_state_dict`` can reassemble it). Without
    ``prescaled_batch`` the parameter is assumed to compute on the TP group's gathered batch, and
    its gradient is divided by tp (see ``layers.mark_distributed``). ``ctx`` defaults to the current one."""
    mark_distributed(p, layout, ctx or require_tp_context("mark_distributed_parameter"))


class DistributedModule(nn.Module):
    """Base class of every TP module (custom ones registered with ``smp.tp_register`` too).

    ``self.tp_context`` (a ``TPContext``), ``tp_rank``, ``tp_size``, ``tp_group`` are available after
    ``super().__init__()``. Parameters are treated as replicated unless tagged with
    ``smp_adapter.parallel.tensor.mark_distributed_parameter`` (which also applies the gradient
    scale of split parameters, see ``layers.mark_distributed``).
    """

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "_smp_tp_ctx", require_tp_context(f"smp.nn.{type(self).__name__}"))

    @property
    def tp_context(self) -> TPContext:
        return self._smp_tp_ctx

    @property
    def tp_rank(self) -> int:
        return self._smp_tp_ctx.rank

    @property
    def tp_size(self) -> int:
        return self._smp_tp_ctx.size

    @property
    def tp_group(self):
        return self._smp_tp_ctx.group


def is_split_module(module: nn.Module) -> bool:
    """Already tensor-parallel: an smp.nn module (DistributedModule) or a Megatron-core layer built
    by layers.py (both carry their TPContext)."""
    return isinstance(module, (DistributedModule, ShardMixin))

