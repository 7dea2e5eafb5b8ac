"""Checkpoints (docs/checkpoints.md): smp.save / smp.load and the model state-dict helpers behind
DistributedModel. save_checkpoint / resume_from_checkpoint are in checkpoint/dirs.py, the file
primitives in checkpoint/files.py (a leaf both import).

Layout written by ``save_checkpoint(path, tag)`` (our encoding of smp's rankinfo, docs/runtime.md):
    <path>/<tag>_partial/          one directory per partial checkpoint
        ds/...                     DeepSpeed engine checkpoint: model + (sharded) optimizer per rank
        stage_pp<P>_tp<T>.pt       instead of ds/ when pp > 1: a stage's model + optimizer state
                                   (smp_adapter/runtime/engines/pipeline/checkpoint.py)
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

from smp_adapter.errors import SMPCheckpointError, SMPUsageError
from smp_adapter.runtime.checkpoint.integrity.sidecars import check_sidecar, write_sidecar
from smp_adapter.runtime.checkpoint.files import (LAYOUT_MARK, PARTIAL_MARK, atomic_torch_save, check_layout,
                                                  current_layout, safe_torch_load)
from smp_adapter.runtime.state import require_initialized, state


# -- model state dicts ---------------------------------------------------------------------------
def full_model_state_dict(model, gather_to_rank0: bool = False) -> dict:
    """The whole model in the original module's layout. Collective under ZeRO-3 and TP: every rank
    must call it."""
    module, engine = model.module, model.runtime_engine
    if engine.holds_shards(module):  # ZeRO-3: whole values only inside the engine's gathered block
        with engine.gathered(list(module.parameters()), modifier_rank=None):
            # copies: the gathered tensors are freed again when the context ends
            sd = {k: v.detach().clone().cpu() for k, v in _unsplit_state_dict(module).items()}
    elif state.dims.tp > 1:
        sd = _unsplit_state_dict(module)
    else:  # (another pipeline stage's tensors are meta here: that stage contributes them below)
        sd = {k: v if v.is_meta else v.detach().clone().cpu() for k, v in module.state_dict().items()}
    sd = engine.merge_full_state_dict(sd)  # pp > 1: each stage contributes its entries
    if gather_to_rank0 and state.rank != 0:
        return {}
    return sd


def _unsplit_state_dict(module) -> dict:
    """The module's state dict with tensor-parallel shards gathered (collective over TP)."""
    if state.dims.tp == 1:
        return module.state_dict()
    from smp_adapter.parallel.tensor import current_tp_context, gather_full_state_dict

    return gather_full_state_dict(module, current_tp_context())


def local_model_state_dict(model) -> dict:
    engine = model.runtime_engine
    sd = engine.local_state_dict(engine.local_tensors())  # this rank's tensors (ZeRO-3: its shards)
    sd[PARTIAL_MARK] = True
    sd[LAYOUT_MARK] = current_layout()
    return sd


def load_model_state_dict(model, state_dict, strict: bool = True):
    if not isinstance(state_dict, dict):
        raise SMPCheckpointError(f"load_state_dict expects a dict of tensors, got {type(state_dict).__name__}")
    sd = dict(state_dict)
    module, engine = model.module, model.runtime_engine
    if sd.pop(PARTIAL_MARK, False):
        check_layout(sd.pop(LAYOUT_MARK, current_layout()), "this partial state dict")
        return engine.load_local_state_dict(sd, strict)
    sd.pop(LAYOUT_MARK, None)
    if state.dims.tp > 1:  # this rank's slices of the unsplit tensors
        from smp_adapter.parallel.tensor import current_tp_context, shard_state_dict

        sd = shard_state_dict(module, sd, current_tp_context())
    return engine.load_whole_state_dict(sd, strict)


# -- smp.save / smp.load -------------------------------------------------------------------------
def _partial_name(f: str, v3: bool | None) -> str:
    """``f_<pp>_<tp>`` (smp 1.6+), plus ``_<rdp>`` when each replica holds its own optimizer-state
    shard. smp 1.10's ``v3`` says so explicitly (True: per rdp rank; False: one file per mp rank, the
    caller saving on rdp_rank() == 0 only); None decides from the layout, so a ZeRO shard is never
    overwritten by another replica's."""
    c = state.coord
    per_replica = state.dims.zero_stage > 0 if v3 is None else bool(v3)
    return f"{f}_{c.pp}_{c.tp}_{c.rdp}" if per_replica else f"{f}_{c.pp}_{c.tp}"


def save(obj, f, partial: bool = True, pickle_module=None, pickle_protocol: int = 2, v3: bool | None = None):
    """torch.save to a string path; partial=True adds this rank's position to the name."""
    require_initialized("save")
    if not isinstance(f, (str, os.PathLike)):
        raise SMPUsageError("smp.save needs a file path (str), not a file object, as in smp v1")
    path = _partial_name(str(f), v3) if partial else str(f)
    write_sidecar(path, atomic_torch_save(obj, path, pickle_protocol))  # <path>.smp_digest: smp.load checks it


def load(f, map_location=None, pickle_module=None, pickle_load_args=None, partial: bool = True,
         back_compat: bool = False, weights_only: bool = True):
    """torch.load; partial=True picks this rank's file (all historic names). Loading is weights-only
    plus plain data (transformers configs, argparse.Namespace); other objects need weights_only=False
    or SMP_ADAPTER_TRUST_CHECKPOINTS=1 (checkpoint/files.py, safe_torch_load).

    ``back_compat=True`` (smp >= 1.10; transformers' SageMaker-MP resume passes it for checkpoints an
    smp < 1.10 job wrote): that file name, ``f_<mp_rank>``, is looked for first; the others still follow."""
    require_initialized("load")
    f = str(f)
    if partial:
        c = state.coord
        candidates = [f"{f}_{c.pp}_{c.tp}_{c.rdp}", f"{f}_{c.pp}_{c.tp}", f"{f}_{c.mp_rank}"]
        if back_compat:
            candidates.insert(0, candidates.pop())
        found = [p for p in candidates if os.path.exists(p)]
        if not found:
            raise SMPCheckpointError(f"no partial checkpoint file for this rank: looked for {', '.join(candidates)}. "
                                     "Was it saved with smp.save(..., partial=True) by this layout? For a full "
                                     "checkpoint pass partial=False")
        f = found[0]
    check_sidecar(f)  # a file smp.save wrote: refused when damaged, naming it
    return safe_torch_load(f, map_location, weights_only)


__all__ = ["save", "load", "full_model_state_dict", "local_model_state_dict", "load_model_state_dict",
           "atomic_torch_save", "safe_torch_load"]
