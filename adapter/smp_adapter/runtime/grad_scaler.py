"""``smp.amp.GradScaler``: torch's GradScaler, made consistent across smp's ranks.

torch's scaler assumes one process that saw the whole loss. Under smp two things differ:

* With pipeline parallelism only the last stage runs the loss part of the step function, so only
  it calls ``scaler.scale(loss)``; the other stages still receive gradients multiplied by that scale
  (it flows back through the pipeline) and then call ``scaler.step(optimizer)`` / ``update()``. torch
  would stop there ("Attempted step but _scale is None"). Here a scaler that never scaled starts from
  the same ``init_scale``, so every stage holds the same scale as long as they agree on overflows.
* Overflow is a property of the whole model: a stage or tensor-parallel shard that overflowed must
  make every rank skip its step and back off, as smp v1 did. ``unscale_`` therefore takes the maximum
  of the local found-inf flags over all ranks (one scalar all-reduce per step; data-parallel replicas
  agree already, tensor- and pipeline-parallel ranks may not).

Growth and backoff then follow torch's rules on every rank with identical inputs, so the scales
stay equal without ever being broadcast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smp_adapter.runtime.state import state


def _default_device() -> str:
    if state.initialized and state.device is not None:
        return torch.device(state.device).type
    return "cuda" if torch.cuda.is_available() else "cpu"


class GradScaler(torch.amp.GradScaler):
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True, device=None):
        super().__init__(device or _default_device(), init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)

    def _ensure_scale(self) -> None:
        """A rank that never called scale() (an early pipeline stage) starts from init_scale."""
        if self._enabled and self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(self._device))

    def unscale_(self, optimizer) -> None:
        self._ensure_scale()
        super().unscale_(optimizer)
        if not self._enabled:
            return
        per_device = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        found = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for flag in per_device.values():  # a rank whose optimizer holds no gradient reports 0
            found = torch.maximum(found, flag.to(found.device))
        if state.initialized and state.world_size > 1:
            # every rank joins, so none can wait here for another that skipped the collective
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=state.groups.world)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {found.device: found}

    def step(self, optimizer, *args, **kwargs):
        self._ensure_scale()
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None) -> None:
        self._ensure_scale()
        super().update(new_scale)
