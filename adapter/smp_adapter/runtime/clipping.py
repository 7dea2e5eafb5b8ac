"""Global-norm gradient clipping (``optimizer.clip_master_grads``) where smp-adapter clips itself:
pp > 1 (no DeepSpeed engine), ZeRO-0 fp32 at pp = 1 (DeepSpeed's plain optimizer has no clip) and the
MiCS engine (gradient shards: squares summed over the sharding group).

With tensor parallelism a rank holds 1/tp of each split weight and a full copy of every replicated
parameter, so

    norm^2 = sum over split parameters (all-reduced over the TP group)
           + sum over replicated parameters (local: the same on every TP rank)

and with pp > 1 each stage's norm^2 is summed over the PP group (a parameter tied across stages is
counted on one stage only). Every rank then multiplies its gradients by the same factor
max_norm / (norm + 1e-6) when that is < 1, as torch.nn.utils.clip_grad_norm_ does. A per-rank norm
would give TP ranks different factors and let their replicated parameters drift apart.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def clip_by_global_norm(grads: list[tuple[torch.Tensor, bool, bool]], max_norm: float, tp_group=None,
                        pp_group=None, shard_group=None) -> float:
    """grads: (gradient, is_split, counted) for every local gradient; ``counted`` False leaves a
    gradient out of the norm (a tied copy counted elsewhere) but still scales it. ``shard_group``: the
    gradients are shards, each group of ranks holding one copy of the whole (MiCS): their squares are
    summed over it first. Returns the norm."""
    split = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for g, is_split, counted in grads:
        if counted:
            sq = g.detach().double().pow(2).sum()
            if is_split:
                split += sq
            else:
                replicated += sq
    if shard_group is not None:
        both = torch.stack([split, replicated])
        dist.all_reduce(both, group=shard_group)
        split, replicated = both[0], both[1]
    if tp_group is not None:
        dist.all_reduce(split, group=tp_group)
    total = split + replicated
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for g, _, _ in grads:
            g.detach().mul_(coef)
    return norm
