"""Partial (per-stage) checkpoints with pipeline_parallel_degree > 1.

With pp > 1 there is no DeepSpeed engine to write a checkpoint, and each rank holds one stage:
  * ``model.local_state_dict()`` is this stage's entries (TP shards under TP), marked with the
    layout and the stage assignment (``stage_units``) it was taken under;
  * ``save_checkpoint(..., partial=True)`` writes one file per (pp_rank, tp_rank), from the rdp rank
    0 replica (the others hold the same values):
    ``stage_pp<P>_tp<T>.pt`` = {"model": local state dict, "optimizer": local optimizer state,
    "mixed_precision": fp16/bf16 fp32 masters and loss-scaler state, or None};
    with ``shard_optimizer_state`` each rank's optimizer state is its own shard
    (runtime/engines/pipeline/sharded_optimizer.py), so it goes to ``optimizer_pp<P>_tp<T>_rdp<R>.pt`` from every rank
    and the stage file's "optimizer" is None;
  * loading works before the first step too (the usual place for ``resume_from_checkpoint``): the
    model is then still whole on every rank, so this stage's entries are loaded by name into it and
    the partition, made at the first step, is checked against the saved one in a post-partition
    hook. Optimizer state is keyed by parameter index, the same before and after partitioning.

The stage assignment depends only on the model, the options and the first batch's shapes, and is
computed identically on every rank, so a mismatch is detected by every rank at the same point (no
rank is left waiting in a collective).
"""

from __future__ import annotations

from pathlib import Path

from smp_adapter.errors import SMPCheckpointError, SMPUsageError

STAGE_MARK = "_smp_stage_units"


def stage_file(folder: Path, pp_rank: int, tp_rank: int) -> Path:
    return Path(folder) / f"stage_pp{pp_rank}_tp{tp_rank}.pt"


def optimizer_shard_file(folder: Path, pp_rank: int, tp_rank: int, rdp_rank: int) -> Path:
    return Path(folder) / f"optimizer_pp{pp_rank}_tp{tp_rank}_rdp{rdp_rank}.pt"


def mark_stage(runner, sd: dict) -> dict:
    """Add the stage assignment to a local state dict (once the model is partitioned)."""
    if runner.built:
        sd[STAGE_MARK] = [list(units) for units in runner.stage_units]
    return sd


def save_stage(io, runner, optimizer, saved=None) -> dict | None:
    """This rank's part of a partial checkpoint, into ``io.folder`` through ``io`` (a
    ``checkpoint.io.CheckpointIO``; rdp rank 0 of each (pp, tp) position writes the stage file);
    return the stage file's object (None on other rdp ranks). ``saved``: a
    ``checkpoint.refs.SavedTensors`` told what each file holds."""
    model = runner.model
    if not runner.built:
        raise SMPUsageError("with pipeline_parallel_degree > 1 a partial checkpoint can be saved only after the first "
                            "@smp.step call, which cuts the model into stages; save after a training step, or save a "
                            "full checkpoint with partial=False")
    c = runner.job.coord
    sharded = runner.job.dims.zero_stage > 0
    mixed = getattr(optimizer, "mixed_precision", None)
    staging = Path(io.folder)
    staging.mkdir(parents=True, exist_ok=True)

    def save(obj, path: Path) -> None:
        io.torch_save(obj, path)
        if saved is not None:
            saved.record(path, obj)

    if sharded and optimizer is not None:  # every rank's own shard of the optimizer state
        save(optimizer.local_state_dict(), optimizer_shard_file(staging, c.pp, c.tp, c.rdp))
    if c.rdp != 0:
        return None
    # the rest is the same on every rdp rank; fp16/bf16: the fp32 masters and the loss scaler
    optimizer_sd = optimizer.local_state_dict() if optimizer is not None and not sharded else None
    blob = {"model": model.local_state_dict(), "optimizer": optimizer_sd,
            "mixed_precision": mixed.state_dict() if mixed is not None else None}
    save(blob, stage_file(staging, c.pp, c.tp))
    return blob


def save_universal(io, runner, optimizer, mixed, saved, blob) -> dict:
    """The layout-independent index (runtime/checkpoint/universal.py) of this stage, so that a job
    with another layout can resume the checkpoint. Each value is recorded once: parameters (fp32
    masters under fp16/bf16) by rdp rank 0 of their (pp, tp) position, a tied parameter by the
    first of the stages holding it, optimizer state by the rank holding it (its owner under
    shard_optimizer_state, else rdp rank 0), persistent buffers by tp rank 0 / rdp rank 0 of their
    stage. The index points into the stage and optimizer files ``save_stage`` has just written
    (``saved``; ``blob``: this rank's stage file object, whose parameter and master copies are the
    tensors recorded), so no value is written twice. Collective: the ranks agree on the
    optimizer's state keys and step count."""
    import torch.distributed as dist

    from smp_adapter.runtime.checkpoint import universal

    job = runner.job
    c, sharded = job.coord, job.dims.zero_stage > 0
    torch_optimizer = optimizer.optimizer
    views = [None] * job.world_size  # the state keys and step of every rank: some own no state
    dist.all_gather_object(views, (universal.state_keys(torch_optimizer), universal.step_count(torch_optimizer)))
    keys = sorted({k for rank_keys, _ in views for k in rank_keys})
    step = next((s for _, s in views if s is not None), None)
    master = mixed.masters_by_param() if mixed is not None else {}
    stored = {}  # rdp rank 0: the copies in the stage file (the same values), whose bytes are on disk already
    if blob is not None:
        model_sd = blob["model"]
        stored = (dict(zip(map(id, mixed.params), blob["mixed_precision"]["masters"])) if master
                  else {id(p): model_sd[name] for name, p in runner.local_named_parameters() if name in model_sd})
    recorded_elsewhere = {id(p) for p, group in runner.tied if min(dist.get_process_group_ranks(group)) != job.rank}
    pieces = []
    for name, p in runner.local_named_parameters():
        if id(p) in recorded_elsewhere or (universal.layout_of(p) is None and c.tp != 0):
            continue  # a tied copy another stage records, or whole on every TP rank: TP rank 0 records
        values = master.get(id(p), p)
        if c.rdp == 0:
            pieces.append((name, p, "param", 0, stored.get(id(p), values).detach().reshape(-1)))
        if sharded or c.rdp == 0:
            st = torch_optimizer.state.get(values, {})
            pieces += [(name, p, k, 0, st[k].detach().reshape(-1)) for k in keys if k in st]
    module = runner.model.module
    buffers = (universal.persistent_buffers(module, runner.local_named_buffers()) if c.tp == 0 and c.rdp == 0
               else [])
    return universal.write_index(io, pieces, buffers, module, torch_optimizer, keys, step, saved,
                                 scaler=mixed.scaler if mixed is not None else None)


def load_universal(runner, folder: Path, universal: dict, mixed):
    """Resume a checkpoint of another layout (any pp = 1 layout, another pp x tp x dp, another
    partition) from its universal pieces, in two parts:
      * now: the model's values (the whole model on every rank before the first step, which is when
        the stages are cut; this stage's after), persistent buffers and the fp16 loss scaler, so the
        first step computes with the saved state;
      * returned, for the engine to call at the first optimizer step, once the stage's parameters,
        their fp32 masters (fp16/bf16) and the shard_optimizer_state owners exist: the masters at
        full precision, the optimizer state of the parameters this rank steps (its owner's only
        under shard_optimizer_state), step count and hyperparameters.
    Every rank reads only the tensors of its own parameters (the TP shard it holds, cut from the
    saved shards)."""
    import torch

    from smp_adapter.runtime.checkpoint import universal as universal_fmt

    pieces = universal_fmt.Pieces(folder)
    with torch.no_grad():
        for name, p in runner.local_named_parameters():
            p.copy_(pieces.full_or_shard(name, "param", p).reshape(p.shape).to(p.dtype))
        for name, b in runner.local_named_buffers():
            if (name, "buffer") in pieces.by_name:
                b.copy_(pieces.tp_shard(name, "buffer", 0).to(b.dtype))
    if mixed is not None:
        universal_fmt.restore_scaler(mixed.scaler, universal.get("loss_scaler"))
    keys = list(universal.get("state_keys", []))

    def load_optimizer_state(optimizer, owned) -> None:
        """``owned(hp)``: whether this rank steps (and keeps state for) the fp32 tensor ``hp``."""
        master = mixed.masters_by_param() if mixed is not None else {}
        with torch.no_grad():
            for name, p in runner.local_named_parameters():
                hp = master.get(id(p), p)  # what the optimizer steps: the fp32 master, or the parameter
                if hp is not p:
                    hp.copy_(pieces.full_or_shard(name, "param", p).reshape(hp.shape))
                if not p.requires_grad or not owned(hp):
                    continue
                universal_fmt.create_missing_state(optimizer, [hp], keys, universal.get("step"))
                for k in keys:
                    optimizer.state[hp][k].copy_(pieces.full_or_shard(name, k, p).reshape(hp.shape))
        universal_fmt.restore_step_and_groups(optimizer, universal)

    return load_optimizer_state


def load_stage(io, model, optimizer, strict: bool, load_optimizer: bool, job) -> None:
    """This rank's stage file (and optimizer shard) from ``io.folder``, read through ``io``; ``job``: the
    smp job (this rank's coordinates, the ZeRO stage)."""
    c, folder = job.coord, Path(io.folder)
    path = stage_file(folder, c.pp, c.tp)
    if not path.exists():
        raise SMPCheckpointError(f"{folder} has no {path.name} for this rank (pp_rank {c.pp}, tp_rank {c.tp}): it was "
                                 "not written by a pipeline-parallel run with this layout; resume from a checkpoint "
                                 "saved with the same pipeline_parallel_degree and tensor_parallel_degree")
    blob = io.torch_load(path)
    if not isinstance(blob, dict) or "model" not in blob:
        raise SMPCheckpointError(f"{path} is not an smp-adapter stage checkpoint (no 'model' entry)")
    model.load_state_dict(blob["model"], strict=strict)
    mixed = getattr(optimizer, "mixed_precision", None)
    if (mixed is None) != (blob.get("mixed_precision") is None):
        raise SMPCheckpointError(f"{path} was saved {'without' if mixed is not None else 'with'} fp16/bf16 and this run "
                                 f"uses {'fp16/bf16' if mixed is not None else 'fp32'}: resume with the saving run's "
                                 "precision options, or load a full checkpoint (partial=False)")
    if mixed is not None:
        mixed.load_state_dict(blob["mixed_precision"])
    if not load_optimizer or optimizer is None:
        return
    if job.dims.zero_stage > 0:  # this rank's shard of the stage's optimizer state
        shard = optimizer_shard_file(folder, c.pp, c.tp, c.rdp)
        if not shard.exists():
            raise SMPCheckpointError(f"{folder} has no {shard.name}: it was saved without shard_optimizer_state or with "
                                     "another data-parallel degree; resume with the saving run's options, or pass "
                                     "load_optimizer=False to start the optimizer afresh")
        optimizer.load_state_dict(io.torch_load(shard))
    elif blob.get("optimizer") is not None:
        optimizer.load_state_dict(blob["optimizer"])


def load_stage_state_dict(runner, sd: dict, strict: bool = True):
    """Load this stage's entries (a dict from ``local_state_dict``, layout already checked)."""
    module = runner.module
    saved_units = sd.pop(STAGE_MARK, None)
    names = set(module.state_dict().keys())
    unexpected = sorted(set(sd) - names)
    if unexpected and strict:
        raise SMPCheckpointError(f"the partial state dict has entries this model does not have: {unexpected[:5]}"
                                 f"{' ...' if len(unexpected) > 5 else ''}; it was saved from another model "
                                 "(or pass strict=False to skip them)")
    module.load_state_dict({k: v for k, v in sd.items() if k in names}, strict=False)

    # the partition is made at the first step: checked then if it does not exist yet
    runner.on_partitioned(lambda: _check_stage(runner, saved_units, set(sd) & names, strict, persistent=names))
    return None


def _check_stage(runner, saved_units, loaded: set, strict: bool, persistent: set | None = None) -> None:
    """``persistent``: the model's state dict keys (default: every key of this stage)."""
    if saved_units is not None and [list(u) for u in runner.stage_units] != saved_units:
        raise SMPCheckpointError(
            "the partial checkpoint was saved under another stage assignment (saved "
            f"{_describe(saved_units)}, now {_describe(runner.stage_units)}): partial checkpoints load only into the "
            "same partition. Use the same model, options (auto_partition, memory_weight, partition marks) and batch "
            "shapes as the saving run; or rewrite it once with `smp-adapter checkpoint reshard DIR --to OPTIONS "
            "--world-size N OUT` and resume OUT (its layout-independent pieces load into any partition); or save and "
            "load a full checkpoint (partial=False)")
    # a stage's state dict also lists the model's non-persistent buffers (torch.export registers every
    # buffer of a stage as persistent; transformers 4.x's GPT-2 attn.bias is one): never saved, not missing
    missing = sorted((runner.local_keys if persistent is None else runner.local_keys & persistent) - loaded)
    if missing and strict:
        raise SMPCheckpointError(f"the partial state dict lacks entries of this stage: {missing[:5]}"
                                 f"{' ...' if len(missing) > 5 else ''}; it belongs to another stage or model "
                                 "(or pass strict=False to keep their current values)")


def _describe(units) -> str:
    return " | ".join(",".join(u[:2]) + (",..." if len(u) > 2 else "") for u in units)
