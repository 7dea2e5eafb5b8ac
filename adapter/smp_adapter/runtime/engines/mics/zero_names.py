"""The ZeRO-3 names smp v1 scripts read, answered from FSDP2's shards.

smp v1's sharded data parallelism was DeepSpeed's ZeRO-3, and the AWS templates read its names
directly: ``p.ds_shape`` / ``p.ds_numel`` (a parameter's whole size, to count the model),
``p.ds_tensor`` (the rank's shard, to sum squared norms over ``optimizer.ds_param_shard_group``),
``optimizer.fp32_partitioned_groups_flat`` (the fp32 shards the optimizer steps, to count them) and
``optimizer.fp16_groups`` (the parameters per group, to record their shapes), ``optimizer._global_grad_norm``
(the last step's gradient norm, before clipping, which they log). On the MiCS engine
each means the same thing about FSDP2's shards: set on the parameters when they are sharded, and
answered by ``ZeroNames`` through smp.DistributedOptimizer (its ``optimizer_internals``).
"""

from __future__ import annotations

import torch

from smp_adapter.runtime.engines.mics import shards


def name_shards(module) -> None:
    """ds_shape, ds_numel and ds_tensor on every sharded parameter of ``module``."""
    with torch.no_grad():
        for p in module.parameters():
            if not shards.is_shard(p):
                continue
            local = p.to_local()  # FSDP2's persistent local shard (no autograd view under no_grad)
            local.ds_numel = local.numel()  # DeepSpeed's ds_tensor.ds_numel: the shard's own size
            p.ds_shape, p.ds_numel, p.ds_tensor = p.shape, p.numel(), local


class ZeroNames:
    """DeepSpeed's ZeRO-3 optimizer's names over the torch optimizer smp wraps."""

    def __init__(self, optimizer, engine):
        self._optimizer, self._engine = optimizer, engine

    @property
    def _global_grad_norm(self) -> float:
        """The global norm of the gradients at the last optimizer step, before clipping."""
        return self._engine.last_grad_norm

    @property
    def fp16_groups(self) -> list[list]:
        """The parameters of each group (DeepSpeed: the low-precision parameters it partitions)."""
        return [list(group["params"]) for group in self._optimizer.param_groups]

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """Per group, this rank's fp32 shards of its parameters, flattened into one tensor (a copy:
        DeepSpeed's flat buffer is its storage; FSDP2 keeps one per parameter)."""
        out = []
        for group in self._optimizer.param_groups:
            pieces = [(p.to_local() if shards.is_shard(p) else p).detach().reshape(-1).float() for p in group["params"]]
            out.append(torch.cat(pieces) if pieces else torch.zeros(0))
        return out
