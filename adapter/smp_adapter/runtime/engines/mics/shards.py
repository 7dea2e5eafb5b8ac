"""FSDP2's shards (DTensors placed (Replicate, Shard(0)) on the MiCS mesh) as the rest of smp sees them.

A rank's shard of a parameter is ``dtensor.to_local()``: rows ``torch.chunk(full, sdp)[i]`` of the
whole tensor for shard coordinate ``i`` (FSDP2 pads the last chunks only in its communication
buffers). Whole values are made by ``full_tensor()`` (an all-gather inside the group).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from smp_adapter.errors import SMPCheckpointError
from smp_adapter.parallel.layers import LAYOUT_ATTR


def is_shard(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def row_range(shape: tuple, dtensor=None, mesh=None) -> tuple[int, int]:
    """(first row, number of rows) of this rank's shard of a tensor of ``shape`` as FSDP2 cuts it on the
    mesh of ``dtensor`` (or ``mesh``): ``torch.chunk`` along dimension 0 over the mesh's last dimension
    (later chunks may be short or empty)."""
    if not shape:
        return 0, 0
    mesh = dtensor.device_mesh if dtensor is not None else mesh
    index, size = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
    chunk = -(-shape[0] // size)
    start = min(index * chunk, shape[0])
    return start, min(chunk, shape[0] - start)


def shard_rows(full: torch.Tensor, dtensor) -> torch.Tensor:
    """This rank's rows of ``full`` as FSDP2 cuts them (Shard(0) on the mesh's last dimension)."""
    start, rows = row_range(tuple(full.shape), dtensor)
    return full.narrow(0, start, rows)


def _owners(params, module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(module, attribute name, parameter) for each DTensor parameter in ``params`` (as registered in
    ``module``, the wrapped model's module; None before the engine holds the model: nothing is sharded)."""
    wanted = {id(p) for p in params if is_shard(p)}
    found = []
    if module is None or not wanted:
        return found
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and id(p) in wanted:
                found.append((m, name, p))
    return found


@contextlib.contextmanager
def gathered(params, module, modifier_rank=None):
    """Inside: every sharded parameter among ``params`` is registered as its whole value (an
    all-gather inside the group; every rank passes the same parameters). On exit the shards come
    back; with ``modifier_rank`` not None, what was written into the whole values is kept (each
    rank keeps its own rows). Loading a state dict goes through ``load_whole`` instead: FSDP2's
    load hooks expect its own parameters registered."""
    owners = _owners(params, module)
    swapped = []
    with torch.no_grad():
        for m, name, p in owners:
            whole = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
            for key, value in vars(p).items():  # tensor parallelism's marks (split flag, layout), not DTensor's
                if (key == LAYOUT_ATTR or not key.startswith("_")) and not hasattr(whole, key):
                    setattr(whole, key, value)
            m._parameters[name] = whole
            swapped.append((m, name, p, whole))
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, p, whole in swapped:
                if modifier_rank is not None:
                    p.to_local().copy_(shard_rows(whole.data, p))
                m._parameters[name] = p


def load_local(module: nn.Module, sd: dict, strict: bool):
    """A partial state dict (this rank's shards, whole buffers) into the module."""
    own = module.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    if strict and (missing or unexpected):
        raise SMPCheckpointError(f"the partial state dict does not match the model: missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]}; load it into the model it was saved from, or pass "
                                 "strict=False")
    with torch.no_grad():
        for name, target in own.items():
            if name not in sd:
                continue
            local = target.to_local() if is_shard(target) else target
            value = sd[name]
            if tuple(value.shape) != tuple(local.shape):
                raise SMPCheckpointError(
                    f"{name}: the saved shard has shape {tuple(value.shape)}, this rank's has {tuple(local.shape)}: "
                    "the checkpoint was saved with another sharded_data_parallel_degree or model; resume with the "
                    "saving run's layout, or load a full checkpoint (partial=False)")
            local.copy_(value)
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def load_whole(module: nn.Module, sd: dict, strict: bool):
    """A state dict of whole tensors into the module: each rank takes its rows of every sharded
    parameter (no communication: every rank loads the same state dict). Rows of a tensor that still
    maps its checkpoint file (a full resume loads with mmap) are read from the file (file_backed.py):
    the rank never maps the other ranks' rows, nor its own."""
    from torch.distributed.tensor import DTensor

    from smp_adapter.runtime.file_backed import file_spans, read_rows

    sd = dict(sd)
    # a tensor of another shape stays whole: load_state_dict names the size mismatch
    targets = {name: t for name, t in module.state_dict().items()
               if is_shard(t) and isinstance(sd.get(name), torch.Tensor) and not is_shard(sd[name])
               and tuple(sd[name].shape) == tuple(t.shape)}
    spans = dict(zip(targets, file_spans([sd[name] for name in targets])))
    for name, target in targets.items():
        local, value = target.to_local(), sd[name]
        start, rows = row_range(tuple(value.shape), target)
        if spans[name] is not None:
            mine = torch.empty(local.shape, dtype=local.dtype, device=local.device)
            read_rows(spans[name], tuple(value.shape), value.dtype, start, mine)
        else:  # the rows first, then the shard's dtype and device: never a converted copy of the whole tensor
            mine = value.narrow(0, start, rows).to(device=local.device, dtype=local.dtype)
        sd[name] = DTensor.from_local(mine, target.device_mesh, target.placements, shape=target.shape,
                                      stride=target.stride(), run_check=False)
    return module.load_state_dict(sd, strict=strict)


def to_local_tree(obj):
    """``obj`` with every DTensor replaced by its local shard (a copy on the CPU)."""
    if is_shard(obj):
        return obj.to_local().detach().clone().cpu()
    if isinstance(obj, dict):
        return {k: to_local_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_local_tree(v) for v in obj)
    return obj


def load_optimizer_local(optimizer, sd: dict) -> None:
    """An optimizer state dict of local shards (``to_local_tree``) into ``optimizer``: each state
    tensor shaped like its parameter's shard becomes a DTensor placed as the parameter."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.load_state_dict(sd)
    for p in params:
        if not is_shard(p):
            continue
        for key, value in list(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor) and not is_shard(value) and value.shape == p.to_local().shape:
                optimizer.state[p][key] = DTensor.from_local(value.to(p.to_local().device), p.device_mesh,
                                                             p.placements, shape=p.shape, stride=p.stride(),
                                                             run_check=False)


def local_grads(model) -> list[tuple[torch.Tensor, bool]]:
    """(this rank's gradient shard, is split by tensor parallelism) of every parameter with a gradient."""
    out = []
    for p in model.module.parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if is_shard(p.grad) else p.grad
        out.append((g, model.is_distributed_parameter(p)))
    return out


def average_replicated_over_tp(model, group, size: int) -> None:
    """Without prescaled_batch: the shards of parameters not split by tensor parallelism are
    averaged over the TP group (``group``, of ``size`` ranks; each TP rank trained on its own samples)."""
    for g, split in local_grads(model):
        if not split and g.numel():
            dist.all_reduce(g, group=group)
            g.div_(size)


def clip(model, max_norm: float, tp_group, shard_group) -> float:
    """Scale every gradient shard by max_norm / global norm when that is < 1 (runtime/clipping.py: the
    squares of the shards summed inside the sharding group ``shard_group``, split parameters also over
    ``tp_group``, None without tensor parallelism)."""
    from smp_adapter.runtime.clipping import clip_by_global_norm

    grads = [(g, split, True) for g, split in local_grads(model)]
    return clip_by_global_norm(grads, max_norm, tp_group=tp_group, shard_group=shard_group)
