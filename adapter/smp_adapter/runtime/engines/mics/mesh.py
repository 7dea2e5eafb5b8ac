"""MiCS's groups as an FSDP2 2-D DeviceMesh, and the units FSDP2 shards.

smp v1 (1.15) cuts each RDP group (the ranks holding the same tensor-parallel shard) into
consecutive chunks of ``sdp`` ranks (``RankGrid.sdp_groups``): a chunk shards parameters,
gradients and optimizer state among itself, and the chunks are replicas of each other. As a
DeviceMesh of this rank's RDP group, shape (rdp / sdp, sdp):

    row i    = chunk i (the "shard" dimension: all-gathers and reduce-scatters stay inside it)
    column j = the j-th rank of every chunk (the "replicate" dimension: the one all-reduce of each
               rank's gradient shard per optimizer step)

Every rank creates every group in the same order (torch requires it, ``groups_for``); the mesh is
built from them (``DeviceMesh.from_group``), so each TP rank has its own mesh over its own RDP group.
"""

from __future__ import annotations

import torch
from torch import nn

from smp_adapter.translate.mics import UNIT_MIN_ELEMENTS, splits_block  # the units rule's home, beside its text

SHARD, REPLICATE = "shard", "replicate"


def build_groups(dims, rank: int):
    """(this rank's shard group, its replicate group): every rank creates all of them, in one order."""
    import torch.distributed as dist

    shard = replicate = None
    for ranks in dims.grid.sdp_groups(dims.sdp):
        group = dist.new_group(list(ranks))
        if rank in ranks:
            shard = group
    for ranks in dims.grid.sdp_replica_groups(dims.sdp):
        group = dist.new_group(list(ranks))
        if rank in ranks:
            replicate = group
    return shard, replicate


def mics_mesh(dims, rank: int, shard_group, replicate_group, device_type: str):
    """This rank's (replicate, shard) DeviceMesh over its RDP group."""
    from torch.distributed.device_mesh import DeviceMesh

    rdp_group = next(g for g in dims.grid.groups("rdp") if rank in g)
    ranks = torch.tensor(rdp_group, dtype=torch.int).view(dims.rdp // dims.sdp, dims.sdp)
    return DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=ranks,
                                 mesh_dim_names=(REPLICATE, SHARD))


def sharding_units(module: nn.Module, sdp: int = 1) -> list[nn.Module]:
    """The submodules FSDP2 gathers one at a time, innermost first; the root module is the last unit and
    holds what is left (embeddings, heads, norms). The size rule: a submodule becomes a unit once its
    parameters outside smaller units reach ``UNIT_MIN_ELEMENTS``. A model with repeated blocks
    (runtime/kernel_switches.py ``repeated_blocks``: every parameter-holding element of an ``nn.ModuleList``,
    the same blocks SMP_ADAPTER_COMPILE=blocks compiles): each block is a unit, whatever its size, and
    nothing outside the blocks but the root; a block holding more than 1/BLOCK_SPLIT of the rank's
    shard (the model's parameters / sdp) comes after the units the size rule finds inside it (a GPT-2
    block of width 1024 at sdp 2: its four projections, the block keeping its norms). Any other model
    (an ``nn.Sequential`` of layers, a module of named children): the size rule over the whole tree. A
    parameter shared by two modules (a tied weight) stays with the root: FSDP2 shards each parameter in
    one unit."""
    from smp_adapter.runtime.kernel_switches import repeated_blocks

    owners: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    units: list[nn.Module] = []
    claimed: set[int] = set()

    def claim(m: nn.Module, top: nn.Module) -> None:
        """The size rule over m's subtree, innermost first; ``top`` itself is left to the caller."""
        for child in m.children():
            claim(child, top)
        free = [p for p in m.parameters() if id(p) not in claimed]
        if m is top or any(owners.get(id(p), 0) > 1 for p in free):
            return
        if sum(p.numel() for p in free) >= UNIT_MIN_ELEMENTS:
            units.append(m)
            claimed.update(id(p) for p in free)

    blocks = repeated_blocks(module)
    if not blocks:
        claim(module, module)
        return units
    model_numel = sum(p.numel() for p in module.parameters())
    for block in blocks:
        if splits_block(sum(p.numel() for p in block.parameters()), model_numel, sdp):
            claim(block, block)
        units.append(block)
        claimed.update(id(p) for p in block.parameters())
    return units
