"""``shard_optimizer_state`` with pipeline_parallel_degree > 1: ZeRO stage 1 over each stage's
reduced-data-parallel (rdp) group, carried out here because pp > 1 has no DeepSpeed engine.

smp v1 keeps each piece of optimizer state on one rank of the rdp group (the ranks holding identical
copies of this stage). We keep the user's torch optimizer object, so its ``param_groups``, LR
schedulers and hyperparameter changes keep working:
  1. on the first ``optimizer.step()`` (the model is partitioned by then) each of this stage's
     parameters gets one owner among the rdp ranks: largest first, to the least-loaded rank, so the
     ranks' state sizes differ by at most one parameter (the same greedy rule as torch's
     ZeroRedundancyOptimizer; DeepSpeed splits a flat buffer exactly instead);
  2. gradients are averaged over the data-parallel ranks as without sharding (the pipeline step);
  3. ``step()``: the gradients of parameters this rank does not own are hidden (``.grad = None``)
     while the torch optimizer steps, so it neither updates those parameters nor creates state for
     them; then the gradients are put back;
  4. each owner broadcasts its updated parameters over the rdp group, flattened into one tensor per
     owner (rdp broadcasts per step).
Per rank: parameters and gradients whole (ZeRO-1, as smp v1), optimizer state ~1/rdp of the stage's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class PipelineStateSharding:
    def __init__(self, params: list, group, rdp_size: int):
        self.group = group
        self.params = params
        self.owner = assign_owners([p.numel() for p in params], rdp_size)
        self.rank = dist.get_rank(group)
        self.size = rdp_size
        self.global_rank = [dist.get_global_rank(group, r) for r in range(rdp_size)]

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        hidden = [(p, p.grad) for p, o in zip(self.params, self.owner) if o != self.rank and p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        try:
            optimizer.step()
        finally:
            for p, g in hidden:
                p.grad = g
        self.broadcast_parameters()

    def broadcast_parameters(self) -> None:
        with torch.no_grad():
            for owner in range(self.size):
                mine = [p for p, o in zip(self.params, self.owner) if o == owner]
                if not mine:
                    continue
                flat = _flatten_dense_tensors([p.data for p in mine])
                dist.broadcast(flat, src=self.global_rank[owner], group=self.group)
                if owner != self.rank:
                    for p, value in zip(mine, _unflatten_dense_tensors(flat, [p.data for p in mine])):
                        p.data.copy_(value)


def assign_owners(sizes: list[int], ranks: int) -> list[int]:
    """Owner rank of each parameter: largest first to the least-loaded rank (ties: the lower rank)."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner
