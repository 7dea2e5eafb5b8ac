"""MiCS's groups as an FSDP2 2-D DeviceMesh (the units FSDP2 shards: units.py).

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
