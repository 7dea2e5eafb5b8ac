"""Layout-independent partial checkpoints: written beside the engine's own files by every
``save_checkpoint(partial=True)`` (the DeepSpeed engine: ``save`` here; the pipeline engine:
pipeline/checkpoint.py ``save_universal``, both through ``universal.write_index``), read by the DeepSpeed
engine's ``resume_from_checkpoint(partial=True)`` when the job now has another layout (data-parallel
size, ZeRO stage 0/1/3, hpZ, tensor-parallel degree, world size, or pp > 1 -> pp = 1). Same-layout
resumes keep using the engine's own files (exact and fastest).

The on-disk format, the writer shared by both engines and the reader: runtime/checkpoint/universal.py.

Who records what (every element once, no communication): ZeRO-3: each rank its own partition
(DeepSpeed's local API); ZeRO-1/2 (and DeepSpeed's bf16 optimizer): each rank the fragment of each
parameter its flat partition owns (``p._hp_mapping``, the record DeepSpeed's own universal
checkpoints read); no ZeRO: data-parallel rank 0 of each TP shard, whole (it is the rank that
writes DeepSpeed's model file). Parameters every TP rank holds whole are recorded by TP rank 0's
group only.

Loading a parameter: read the pieces of the TP shards it needs (only the matching TP rank's when
the TP layout is unchanged), rebuild the target TP shard (through the full tensor when the tp
degree changed: memory of one full parameter at a time, never the whole model), then hand it to
DeepSpeed (``safe_set_full_*`` / ``safe_set_local_*``) or, without ZeRO, to the parameter and
the torch optimizer's state. The Adam step count and the param groups' hyperparameters come back
from the manifest.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from smp_adapter.runtime.checkpoint.universal import (Pieces, create_missing_state, layout_of, persistent_buffers,
                                                  restore_scaler, restore_step_and_groups, shard_shape, state_keys,
                                                  step_count, write_index)



def _stage(engine) -> int:
    return engine.zero_optimization_stage()


def _inner_optimizer(engine):
    """The torch optimizer holding the fp32 state (DeepSpeed's ZeRO wrappers keep it as .optimizer)."""
    opt = engine.optimizer
    return opt.optimizer if _stage(engine) > 0 else opt


def _unique_params(module):
    seen, out = set(), []
    for name, p in module.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


# -- save ------------------------------------------------------------------------------------------
def _pieces_to_write(engine, p, keys, rdp_rank: int) -> list[tuple[str, int, torch.Tensor]]:
    """(kind, start in the flattened TP shard, 1-D view of live values) this rank records for ``p``:
    views of the tensors DeepSpeed has just saved, so ``save`` can usually point at them."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    numel = math.prod(shard_shape(p))
    if hasattr(p, "ds_id"):  # ZeRO-3: this rank's own partition, trimmed of its padding
        if p.requires_grad:
            local = {"param": safe_get_local_fp32_param(p)}
            local.update({k: safe_get_local_optimizer_state(p, k) for k in keys})
        else:  # frozen (a fine-tune's fixed layers): no fp32 master, no optimizer state; the model's values
            local = {"param": p.ds_tensor}
        part = local["param"].numel()
        start = rdp_rank * part
        stop = min(numel, start + part)
        return [(kind, start, v.detach().reshape(-1)[:max(0, stop - start)])
                for kind, v in local.items() if v is not None and stop > start]
    flats = _hp_flat_partitions(engine) if p.requires_grad else []  # frozen: whole on every rank, as without ZeRO
    if flats:  # ZeRO-1/2 (or DeepSpeed's bf16 optimizer): the fragment of p this rank's flat partition owns
        mapping = getattr(p, "_hp_mapping", None)  # docs/architecture.md: the record DeepSpeed's own
        if mapping is None:                        # universal checkpoints read
            return []
        lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
        flat = flats[mapping.param_group_index]
        flat_state = _inner_optimizer(engine).state.get(flat, {})
        values = {"param": flat, **{k: flat_state[k] for k in keys if k in flat_state}}
        return [(kind, lp.start, v.detach().reshape(-1).narrow(0, hp.start, hp.numel)) for kind, v in values.items()]
    # no ZeRO: every data-parallel rank holds it whole; the one that writes DeepSpeed's model file records it
    if rdp_rank != 0:
        return []
    st = _inner_optimizer(engine).state.get(p, {})
    values = {"param": p, **{k: st[k] for k in keys if k in st}}
    return [(kind, 0, v.detach().reshape(-1)) for kind, v in values.items()]


def save(engine, module, io, job, saved=None) -> dict:
    """The DeepSpeed engine's index (pp = 1), written into ``io.folder`` through ``io`` (the save's
    ``checkpoint.io.CheckpointIO``); return what the manifest records (rank 0's view). ``job``: the
    smp job (this rank's coordinates). ``saved``: a ``checkpoint.refs.SavedTensors`` around DeepSpeed's save."""
    inner = _inner_optimizer(engine)
    keys = state_keys(inner)
    coord = job.coord
    pieces = [(name, p, kind, start, values) for name, p in _unique_params(module)
              if layout_of(p) is not None or coord.tp == 0  # held whole by every TP rank: TP rank 0 records
              for kind, start, values in _pieces_to_write(engine, p, keys, coord.rdp)]
    buffers = persistent_buffers(module, module.named_buffers()) if job.rank == 0 else []  # the same everywhere
    return write_index(io, pieces, buffers, module, inner, keys, step_count(inner), saved,
                       scaler=loss_scaler(engine.optimizer))


def loss_scaler(ds_optimizer):
    """DeepSpeed's loss scaler: its ZeRO optimizers keep one as ``loss_scaler``, its fp16 optimizer
    without ZeRO keeps the same fields in ``loss_scale_config``; None under fp32."""
    return getattr(ds_optimizer, "loss_scaler", None) or getattr(ds_optimizer, "loss_scale_config", None)


# -- load ------------------------------------------------------------------------------------------
def load(engine, module, folder: Path, universal: dict, job) -> None:
    """Put every parameter and its optimizer state back from the universal pieces (any layout);
    ``job``: the smp job (this rank's coordinates)."""
    from deepspeed.utils import safe_set_full_fp32_param

    pieces = Pieces(folder)
    keys = list(universal.get("state_keys", []))
    inner = _inner_optimizer(engine)
    flats = _hp_flat_partitions(engine)
    create_missing_state(inner, flats or [p for g in inner.param_groups for p in g["params"]], keys,
                          universal.get("step"))
    for name, p in _unique_params(module):
        shape = shard_shape(p)
        kinds = ["param", *keys] if p.requires_grad else ["param"]  # frozen: no optimizer state
        values = {kind: pieces.full_or_shard(name, kind, p).reshape(shape) for kind in kinds}
        if not p.requires_grad:
            _set_model_value(p, values["param"])
        elif hasattr(p, "ds_id"):
            _set_zero3(p, values, keys, job.coord.rdp)
        elif flats:  # ZeRO-1/2 (or DeepSpeed's bf16 optimizer): whole lp parameter, fp32 fragments
            with torch.no_grad():
                p.data.copy_(values["param"].to(p.dtype))
            safe_set_full_fp32_param(p, values["param"])
            _set_fragment_state(inner, flats, p, values, keys)
        else:
            with torch.no_grad():
                p.data.copy_(values["param"].to(p.dtype))
            st = inner.state[p]
            for k in keys:
                st[k].copy_(values[k])
    restore_step_and_groups(inner, universal)
    restore_scaler(loss_scaler(engine.optimizer), universal.get("loss_scaler"))
    with torch.no_grad():
        for name, b in module.named_buffers():
            if (name, "buffer") in pieces.by_name:
                b.copy_(pieces.tp_shard(name, "buffer", 0).to(b.dtype))



def _hp_flat_partitions(engine) -> list:
    """DeepSpeed's fp32 flat partitions, one per param group: the tensors its torch optimizer steps
    (ZeRO-3, ZeRO-1/2, the bf16 optimizer); empty without ZeRO (the optimizer steps the parameters)."""
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        flats = getattr(engine.optimizer, attr, None)
        if flats:
            return list(flats)
    return []


def _set_fragment_state(inner, flats, p, values: dict, keys) -> None:
    """ZeRO-1/2: the optimizer-state fragment of ``p`` this rank owns, written into the flat state.

    DeepSpeed's public ``safe_set_full_optimizer_state`` works only once its optimizer has stepped
    (it links the state fragments after the first step), and a resume comes before that. So this
    writes where that link will point: the fragment address DeepSpeed keeps on the parameter
    (``_hp_mapping``: the same record DeepSpeed's own universal checkpoints read; docs/architecture.md
    lists it among the private names used)."""
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:  # this rank owns no fragment of p
        return
    lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
    flat_state = inner.state[flats[mapping.param_group_index]]
    for k in keys:
        flat_state[k].narrow(0, hp.start, hp.numel).copy_(values[k].flatten().narrow(0, lp.start, lp.numel))


def _set_model_value(p, value: torch.Tensor) -> None:
    """The parameter's model copy only (ZeRO-3: through DeepSpeed's gather / re-partition)."""
    if hasattr(p, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):  # rank 0 of p's group; all hold the value
            with torch.no_grad():
                p.data.copy_(value.to(p.dtype))
        return
    with torch.no_grad():
        p.data.copy_(value.to(p.dtype))


def _set_zero3(p, values: dict, keys, rdp_rank: int) -> None:
    """A ZeRO-3 parameter: the model's partition (through DeepSpeed's gather/re-partition, which also
    refreshes hpZ's secondary copy) and the fp32 master and optimizer-state partitions."""
    from deepspeed.utils import (safe_get_local_fp32_param, safe_set_local_fp32_param,
                                 safe_set_local_optimizer_state)

    _set_model_value(p, values["param"])
    part = safe_get_local_fp32_param(p).numel()
    start = rdp_rank * part

    def local(v):
        flat = v.flatten().float()
        piece = flat[start:start + part]
        return torch.cat([piece, piece.new_zeros(part - piece.numel())]) if piece.numel() < part else piece

    safe_set_local_fp32_param(p, local(values["param"]))
    for k in keys:
        safe_set_local_optimizer_state(p, local(values[k]), k)
