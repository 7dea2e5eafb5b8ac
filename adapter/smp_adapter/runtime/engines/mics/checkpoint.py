"""The MiCS engine's partial checkpoints: its own per-rank files (same-layout resume) and the
layout-independent pieces (runtime/checkpoint/universal.py) that let ZeRO-3, hpZ, ddp, tensor- and
pipeline-parallel jobs resume them, and MiCS jobs resume theirs.

A rank's shard of a parameter is the rows ``torch.chunk(tp_shard, sdp)[i]`` of the tensor the rank
would hold without sharding (its TP shard), so as a universal piece it is the range
[rows before it x row size, + its numel) of that tensor flattened. Each value is recorded once: by
the ranks of the first group of each RDP group (replicate coordinate 0, which hold one complete copy
between them), tensors every TP rank holds whole by TP rank 0 only, persistent buffers by the first
rank of the first group of TP rank 0.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from smp_adapter.errors import SMPCheckpointError
from smp_adapter.runtime.engines.mics import shards

FILE = "mics_rank{rank:05d}.pt"


def _row_offset(p) -> int:
    """Where this rank's shard of ``p`` starts in the flattened whole (TP shard) tensor."""
    mesh = p.device_mesh
    index, size = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
    rows = p.shape[0]
    per = math.ceil(rows / size) if rows else 0
    return min(rows, index * per) * (math.prod(p.shape[1:]) if p.dim() > 1 else 1)


def save(io, engine, optimizer) -> dict:
    """This rank's file (its shards, the torch optimizer's local state), then the universal index."""
    from smp_adapter.runtime.checkpoint import universal

    torch_optimizer, job = engine.torch_optimizer, engine.job
    path = Path(io.folder) / FILE.format(rank=job.rank)
    scaler = engine.loss_scaler  # fp16: the loss scaler's state, the same on every rank
    io.torch_save({"model": engine.local_tensors(), "optimizer": shards.to_local_tree(torch_optimizer.state_dict()),
                   "sdp": job.dims.sdp, "rdp": job.dims.rdp,
                   "loss_scaler": universal.scaler_fields(scaler) if scaler is not None else None}, path)
    if not universal.enabled():
        return {}
    views = [None] * job.world_size  # every rank's state keys and step (a rank may hold no state yet)
    dist.all_gather_object(views, (universal.state_keys(torch_optimizer), universal.step_count(torch_optimizer)))
    keys = sorted({k for rank_keys, _ in views for k in rank_keys})
    step = next((s for _, s in views if s is not None), None)
    first_group = job.groups.sdp_replicas is None or dist.get_rank(job.groups.sdp_replicas) == 0
    coord = job.coord
    module = engine.model.module
    pieces = []
    if first_group:
        for name, p in module.named_parameters():
            if universal.layout_of(p) is None and coord.tp != 0:
                continue  # whole on every TP rank: TP rank 0 records it
            local = p.to_local() if shards.is_shard(p) else p
            start = _row_offset(p) if shards.is_shard(p) else 0
            pieces.append((name, p, "param", start, local.detach().float().reshape(-1)))
            st = torch_optimizer.state.get(p, {})
            pieces += [(name, p, k, start, (st[k].to_local() if shards.is_shard(st[k]) else st[k]).detach().reshape(-1))
                       for k in keys if k in st]
    first_rank = first_group and coord.tp == 0 and dist.get_rank(job.groups.sdp) == 0
    buffers = universal.persistent_buffers(module, module.named_buffers()) if first_rank else []
    return {"universal": universal.write_index(io, pieces, buffers, module, torch_optimizer, keys, step, scaler=scaler)}


def load(io, engine, optimizer, strict: bool, load_optimizer: bool) -> None:
    job = engine.job
    path = Path(io.folder) / FILE.format(rank=job.rank)
    if not path.exists():
        raise SMPCheckpointError(
            f"{io.folder} has no {path.name} for rank {job.rank}: it was not saved by a MiCS run with this layout; "
            "resume with the saving run's options, or load a full checkpoint (partial=False)")
    blob = io.torch_load(path)
    if blob.get("sdp") != job.dims.sdp or blob.get("rdp") != job.dims.rdp:
        raise SMPCheckpointError(f"{path} was saved with sdp {blob.get('sdp')} of rdp {blob.get('rdp')}, this job runs "
                                 f"sdp {job.dims.sdp} of rdp {job.dims.rdp}: resume with the saving run's layout")
    engine.load_local_state_dict(blob["model"], strict)
    if load_optimizer and optimizer is not None:
        shards.load_optimizer_local(engine.torch_optimizer, blob["optimizer"])
    if engine.loss_scaler is not None:
        for key, value in (blob.get("loss_scaler") or {}).items():
            setattr(engine.loss_scaler, key, value)


def load_universal(engine, folder: Path, record: dict) -> None:
    """Another layout's checkpoint: each rank copies its rows of every parameter and of its optimizer
    state from the universal pieces (only the TP shard it needs is assembled), buffers whole."""
    from smp_adapter.runtime.checkpoint import universal

    pieces = universal.Pieces(Path(folder))
    module, torch_optimizer = engine.model.module, engine.torch_optimizer
    keys = list(record.get("state_keys", []))
    with torch.no_grad():
        for name, p in module.named_parameters():
            whole = pieces.full_or_shard(name, "param", p).reshape(p.shape)
            _put(p, whole)
            if torch_optimizer is None or not p.requires_grad or not keys:
                continue
            universal.create_missing_state(torch_optimizer, [p], keys, record.get("step"))
            for k in keys:
                _put(torch_optimizer.state[p][k], pieces.full_or_shard(name, k, p).reshape(p.shape))
        for name, b in module.named_buffers():
            if (name, "buffer") in pieces.by_name:
                b.copy_(pieces.tp_shard(name, "buffer", 0).to(b.dtype))
    if torch_optimizer is not None:
        universal.restore_step_and_groups(torch_optimizer, record)
    universal.restore_scaler(engine.loss_scaler, record.get("loss_scaler"))


def _put(target, whole: torch.Tensor) -> None:
    """``whole`` (the TP shard's value) into ``target``: its rows where ``target`` is a shard."""
    if shards.is_shard(target):
        local = target.to_local()
        local.copy_(shards.shard_rows(whole.to(local.dtype), target))
    else:
        target.copy_(whole.to(target.dtype))
