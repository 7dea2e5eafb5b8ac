"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``: checkpoint directories, written
atomically (see the layout in checkpoint.py). What goes into a partial checkpoint's directory is
the engine's (runtime/engines: DeepSpeed's own format, or one file per pipeline stage)."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch

from smp_adapter.errors import SMPCheckpointError, SMPUsageError
from smp_adapter.runtime.checkpoint.integrity import manifest as digests
from smp_adapter.runtime.checkpoint.integrity import resume_check
from smp_adapter.runtime.checkpoint import files as ckpt
from smp_adapter.runtime.checkpoint.integrity import sidecars
from smp_adapter.runtime import comm_ledger
from smp_adapter.runtime.state import require_initialized, state


def _barrier() -> None:
    import torch.distributed as dist

    if state.world_size > 1:
        dist.barrier()


def _check_tag(tag) -> str:
    if not isinstance(tag, str) or not tag or "/" in tag or tag.startswith(".") or tag == "newest":
        raise SMPUsageError(f"checkpoint tag {tag!r} must be a non-empty file name (no '/', not starting with '.', "
                            "not 'newest'), identical on all ranks")
    return tag


def _checkpoint_phase(func):
    """The communication ledger files a save's or resume's traffic under phase "checkpoint"."""
    @functools.wraps(func)
    def run(*args, **kwargs):
        with comm_ledger.phase("checkpoint"):
            return func(*args, **kwargs)
    return run


def _write_newest(path: Path, tag: str) -> None:
    tmp = path / f".newest.tmp.{os.getpid()}"
    tmp.write_text(tag + "\n")
    os.replace(tmp, path / "newest")


@_checkpoint_phase
def save_checkpoint(path, tag, partial: bool = True, model=None, optimizer=None, user_content=None,
                    translate_if_full: bool = True, num_kept_partial_checkpoints=None):
    s = require_initialized("save_checkpoint")
    tag = _check_tag(tag)
    model = model or s.model
    optimizer = optimizer or s.optimizer
    if model is None:
        raise SMPUsageError("smp.save_checkpoint needs a model: create smp.DistributedModel first or pass model=")
    path = Path(path)
    if s.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    _barrier()
    if partial:
        _save_partial(path, tag, model, optimizer, user_content)
        if s.rank == 0 and num_kept_partial_checkpoints is not None:
            _prune(path, int(num_kept_partial_checkpoints))
    else:
        sd = model.state_dict()  # collective under ZeRO-3 / TP
        if s.rank == 0:  # each file with its digest beside it (<file>.smp_digest), checked on resume
            for obj, file in ((sd, path / tag), (user_content, path / f"user_content_{tag}")):
                if obj is not None:
                    sidecars.write_sidecar(str(file), ckpt.atomic_torch_save(obj, str(file)))
            _write_newest(path, tag)
    _barrier()


def _save_partial(path: Path, tag: str, model, optimizer, user_content) -> None:
    s = state
    final = path / f"{tag}_partial"
    staging = path / f".{tag}_partial.tmp"
    if s.rank == 0 and staging.exists():
        shutil.rmtree(staging)  # left by a crash during an earlier save
    _barrier()
    if optimizer is None or not model.runtime_engine.ready_for_checkpoint:
        raise SMPUsageError("partial checkpoints need the optimizer: create smp.DistributedOptimizer before "
                            "smp.save_checkpoint(..., partial=True), or save a full checkpoint with partial=False")
    algorithm = digests.default_algorithm()
    with digests.written_files() as written:
        engine_record = model.runtime_engine.save_partial(staging, optimizer) or {}
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        ckpt.atomic_torch_save(rng, str(staging / f"rng_rank{s.rank}.pt"))
        if s.rank == 0 and user_content is not None:
            ckpt.atomic_torch_save(user_content, str(staging / "user_content.pt"))
    # each rank digests what it wrote (still in the page cache); the gather is also the barrier after
    # which every rank's files are in staging
    recorded = digests.gather(digests.digest_written(staging, written, algorithm), s.world_size)
    if s.rank == 0:
        manifest = {"tag": tag, "layout": ckpt.current_layout(), "format": "smp-adapter/1", **engine_record,
                    **digests.complete(staging, recorded, algorithm)}
        digests.write_manifest(staging, manifest)
        if final.exists():
            old = path / f".{tag}_partial.old"
            os.replace(final, old)
            os.replace(staging, final)
            shutil.rmtree(old)
        else:
            os.replace(staging, final)
        _write_newest(path, tag)


def _prune(path: Path, keep: int) -> None:
    """Delete the oldest *complete* partial checkpoints beyond ``keep`` (never a .tmp one)."""
    complete = [d for d in path.glob("*_partial") if (d / ckpt.MANIFEST).exists()]
    complete.sort(key=lambda d: (d / ckpt.MANIFEST).stat().st_mtime)
    for old in complete[:max(0, len(complete) - keep)]:
        shutil.rmtree(old)


def _newest_tag(path: Path) -> str:
    newest = path / "newest"
    if not newest.exists():
        raise SMPCheckpointError(f"no checkpoint found in {path} (no 'newest' file): check the path, or pass tag=")
    return newest.read_text().strip()


@_checkpoint_phase
def resume_from_checkpoint(path, tag=None, partial: bool = True, strict: bool = True, load_optimizer: bool = True,
                           load_sharded_optimizer_state: bool = True, translate_function=None):
    """Load a checkpoint written by save_checkpoint; returns its user_content (or None)."""
    s = require_initialized("resume_from_checkpoint")
    path = Path(path)
    tag = _newest_tag(path) if tag is None else _check_tag(tag)
    model = s.model
    if model is None:
        raise SMPUsageError("smp.resume_from_checkpoint needs smp.DistributedModel (and, for partial checkpoints, "
                            "smp.DistributedOptimizer) to exist: call it after wrapping model and optimizer")
    if not partial:
        uc = path / f"user_content_{tag}"
        # both files checked before either is read; one collective, so all ranks refuse together
        recorded = uc.exists() or Path(f"{uc}{sidecars.SIDECAR}").exists()
        sidecars.require_sidecars_everywhere([path / tag, *([uc] if recorded else [])], "resume from it", s.rank,
                                            s.world_size)
        sd = ckpt.safe_torch_load(str(path / tag), map_location="cpu")
        if translate_function is not None:
            sd = translate_function(sd)
        model.load_state_dict(sd, strict=strict)
        return ckpt.safe_torch_load(str(uc)) if uc.exists() else None
    folder = path / f"{tag}_partial"
    manifest_file = folder / ckpt.MANIFEST
    if not manifest_file.exists():
        raise SMPCheckpointError(f"{folder} is not a complete smp-adapter partial checkpoint (no {ckpt.MANIFEST}); "
                                 "it may be from an interrupted save: resume from an earlier tag")
    if s.optimizer is None or not model.runtime_engine.ready_for_checkpoint:
        raise SMPUsageError("resume a partial checkpoint after creating smp.DistributedOptimizer (the optimizer "
                            "state is restored into it)")
    # every file checked before a step uses any value, and all ranks refuse together: the manifest, file
    # list and sizes now; the digests as the engine reads the files (read once), the rest and the verdict after
    check = resume_check.start_check(folder, "resume from it", s.rank, s.world_size, s.local_size)
    manifest = check.manifest
    difference = ckpt.layout_difference(manifest.get("layout", {}))
    try:
        with check.reading():  # torch.load's files hashed as it reads them (resume_check.Check)
            if difference is None and manifest.get(ckpt.ENGINE_FILES, True):
                model.runtime_engine.load_partial(folder, s.optimizer, strict,
                                                  load_optimizer and load_sharded_optimizer_state)
            else:  # another layout, or rewritten by `checkpoint reshard`: the universal pieces, or a clear refusal
                difference = difference or f"rewritten by smp-adapter checkpoint reshard from {manifest.get('resharded_from')}"
                model.runtime_engine.load_partial_from_other_layout(folder, s.optimizer, manifest, difference)
    except SMPCheckpointError:  # the engine could not read a file: name the damage when the digests show it
        problems = check.every_problem()
        if problems:
            raise digests.refusal(folder, problems, "resume from it") from None
        raise
    check.finish()
    rng_file = folder / f"rng_rank{s.rank}.pt"
    if difference is None and rng_file.exists():  # a rank's RNG means something only in the same layout
        rng = ckpt.safe_torch_load(str(rng_file))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    uc = folder / "user_content.pt"
    return ckpt.safe_torch_load(str(uc)) if uc.exists() else None
