"""Checkpoints (spec §2.13): smp.save / smp.load, save_checkpoint / resume_from_checkpoint,
and the model state-dict helpers behind DistributedModel.

Layout written by ``save_checkpoint(path, tag)`` (our encoding of smp's rankinfo, docs/runtime.md):
    <path>/<tag>_partial/          one directory per partial checkpoint
        ds/...                     DeepSpeed engine checkpoint: model + (sharded) optimizer per rank
        stage_pp<P>_tp<T>.pt       instead of ds/ when pp > 1: a stage's model + optimizer state
                                   (smp_adapter/pipeline/checkpoint.py)
        rng_rank<R>.pt             each rank's RNG states (exact resume with dropout)
        user_content.pt
        smp_manifest.json          written last: layout, tag; its presence = the checkpoint is complete
    <path>/<tag>                   full checkpoint: the plain model state dict (torch.load-able)
    <path>/user_content_<tag>
    <path>/newest                  the newest tag, one line
Atomicity: a partial checkpoint is written under ``.<tag>_partial.tmp`` and renamed into place by
rank 0 only after every rank finished (barrier); ``newest`` is replaced atomically. A crash mid-save
leaves only a ``.tmp`` directory, which resume never reads and the next save removes.
"""

from __future__ import annotations

import os

import torch

from smp_adapter.errors import SMPCheckpointError, SMPUsageError
from smp_adapter.runtime.state import require_initialized, state

PARTIAL_MARK = "_smp_is_partial"
LAYOUT_MARK = "_smp_layout"
MANIFEST = "smp_manifest.json"


# -- layout --------------------------------------------------------------------------------------
def current_layout() -> dict:
    d = state.dims
    return {"pp": d.pp, "tp": d.tp, "rdp": d.rdp, "sdp": d.sdp, "zero_stage": d.zero_stage,
            "placement": d.grid.order, "world_size": d.world_size}


def check_layout(saved: dict, what: str) -> None:
    now = current_layout()
    keys = ("pp", "tp", "rdp", "sdp", "zero_stage", "placement")
    diff = {k: (saved.get(k), now[k]) for k in keys if saved.get(k) != now[k]}
    if diff:
        detail = ", ".join(f"{k}: saved {a} vs now {b}" for k, (a, b) in diff.items())
        raise SMPCheckpointError(
            f"{what} was saved with another parallel layout ({detail}). Partial checkpoints load only into the same "
            "layout: relaunch with the saved degrees, or save a full checkpoint (partial=False) and load that instead")


# -- model state dicts ---------------------------------------------------------------------------
def _zero3(model) -> bool:
    """Parameters are ZeRO-3 shards (after the engine is built, or created under zero.Init)."""
    return any(hasattr(p, "ds_id") for p in model.module.parameters())


def full_model_state_dict(model, gather_to_rank0: bool = False) -> dict:
    """The whole model in the original module's layout. Collective under ZeRO-3 and TP: every rank
    must call it."""
    module = model.module
    if _zero3(model):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            sd = {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}
    elif state.dims.tp > 1:
        from smp_adapter.parallel.tensor import current_tp_context, gather_full_state_dict

        sd = gather_full_state_dict(module, current_tp_context())
    else:
        sd = {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}
    if getattr(model, "_pipeline", None) is not None:  # pp > 1: each stage contributes its entries
        sd = model._pipeline.full_state_dict(sd)
    if gather_to_rank0 and state.rank != 0:
        return {}
    return sd


def local_model_state_dict(model) -> dict:
    module = model.module
    if _zero3(model):
        sd = {n: p.ds_tensor.detach().clone().cpu() for n, p in module.named_parameters()}
        sd.update({n: b.detach().clone().cpu() for n, b in module.named_buffers()})
    else:
        sd = {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}
    if getattr(model, "_pipeline", None) is not None:
        from smp_adapter.pipeline.checkpoint import mark_stage

        sd = mark_stage(model, model._pipeline.local_state_dict(sd))
    sd[PARTIAL_MARK] = True
    sd[LAYOUT_MARK] = current_layout()
    return sd


def load_model_state_dict(model, state_dict, strict: bool = True):
    if not isinstance(state_dict, dict):
        raise SMPCheckpointError(f"load_state_dict expects a dict of tensors, got {type(state_dict).__name__}")
    sd = dict(state_dict)
    module = model.module
    if sd.pop(PARTIAL_MARK, False):
        check_layout(sd.pop(LAYOUT_MARK, current_layout()), "this partial state dict")
        if getattr(model, "_pipeline", None) is not None:  # this stage's entries only
            from smp_adapter.pipeline.checkpoint import load_stage_state_dict

            return load_stage_state_dict(model, sd, strict=strict)
        if _zero3(model):
            with torch.no_grad():
                for n, p in module.named_parameters():
                    p.ds_tensor.copy_(sd[n])
            return None
        return module.load_state_dict(sd, strict=strict)
    sd.pop(LAYOUT_MARK, None)
    if _zero3(model):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            return module.load_state_dict(sd, strict=strict)
    if state.dims.tp > 1:
        from smp_adapter.parallel.tensor import current_tp_context, shard_state_dict

        return module.load_state_dict(shard_state_dict(module, sd, current_tp_context()), strict=strict)
    return module.load_state_dict(sd, strict=strict)


# -- smp.save / smp.load -------------------------------------------------------------------------
def _partial_name(f: str) -> str:
    c = state.coord
    if state.dims.zero_stage > 0:  # each rdp rank holds its own optimizer-state shard
        return f"{f}_{c.pp}_{c.tp}_{c.rdp}"
    return f"{f}_{c.pp}_{c.tp}"


def save(obj, f, partial: bool = True, pickle_module=None, pickle_protocol: int = 2):
    """torch.save to a string path; partial=True adds this rank's position to the name."""
    require_initialized("save")
    if not isinstance(f, (str, os.PathLike)):
        raise SMPUsageError("smp.save needs a file path (str), not a file object, as in smp v1")
    path = _partial_name(str(f)) if partial else str(f)
    atomic_torch_save(obj, path, pickle_protocol)


def atomic_torch_save(obj, path: str, pickle_protocol: int = 2) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp, pickle_protocol=pickle_protocol)
    os.replace(tmp, path)


def load(f, map_location=None, pickle_module=None, pickle_load_args=None, partial: bool = True,
         weights_only: bool = True):
    """torch.load(weights_only=True); partial=True picks this rank's file (all historic names)."""
    require_initialized("load")
    f = str(f)
    if partial:
        c = state.coord
        candidates = [f"{f}_{c.pp}_{c.tp}_{c.rdp}", f"{f}_{c.pp}_{c.tp}", f"{f}_{c.mp_rank}"]
        found = [p for p in candidates if os.path.exists(p)]
        if not found:
            raise SMPCheckpointError(f"no partial checkpoint file for this rank: looked for {', '.join(candidates)}. "
                                     "Was it saved with smp.save(..., partial=True) by this layout? For a full "
                                     "checkpoint pass partial=False")
        f = found[0]
    return safe_torch_load(f, map_location, weights_only)


def safe_torch_load(path: str, map_location=None, weights_only: bool = True):
    if not os.path.exists(path):
        raise SMPCheckpointError(f"checkpoint file {path} does not exist: check the path and tag")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as exc:  # pickle / zip errors: the file is not a (safe) torch checkpoint
        raise SMPCheckpointError(
            f"{path} is not a loadable checkpoint ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). Loading "
            "uses torch.load(weights_only=True); if you trust a file holding other Python objects, pass "
            "weights_only=False to smp.load") from None


# -- save_checkpoint / resume_from_checkpoint ----------------------------------------------------
from smp_adapter.runtime.checkpoint_dirs import resume_from_checkpoint, save_checkpoint  # noqa: E402,F401

__all__ = ["save", "load", "save_checkpoint", "resume_from_checkpoint", "full_model_state_dict",
           "local_model_state_dict", "load_model_state_dict"]
