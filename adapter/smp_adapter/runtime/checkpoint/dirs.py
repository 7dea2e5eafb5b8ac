"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``: checkpoint directories, written
atomically (see the layout in checkpoint.py). What goes into a partial checkpoint's directory is
the engine's (runtime/engines: DeepSpeed's own format, or one file per pipeline stage)."""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from pathlib import Path

import torch

from smp_adapter.errors import SMPCheckpointError, SMPUsageError
from smp_adapter.runtime import agreement
from smp_adapter.runtime.checkpoint.integrity import manifest as digests
from smp_adapter.runtime.checkpoint.integrity import resume_check
from smp_adapter.runtime.checkpoint.integrity import saving
from smp_adapter.runtime.checkpoint import files as ckpt
from smp_adapter.runtime.checkpoint.io import CheckpointIO
from smp_adapter.runtime.checkpoint.integrity import sidecars
from smp_adapter.runtime.checkpoint import storage
from smp_adapter.ledger import record as comm_ledger
from smp_adapter.runtime.finiteness import refuse_non_finite_checkpoint
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
    storage.atomic_write(path / "newest", lambda tmp: tmp.write_text(tag + "\n"))
    storage.fsync_dir(path)


def _agree(error: str | None, world_size: int) -> None:
    """Every rank raises together when any rank's part of this phase failed (runtime/agreement.py): the
    failing rank its own error, the others one naming it; also a barrier."""
    agreement.raise_agreed(agreement.agree_on_failure(error, world_size, SMPCheckpointError), SMPCheckpointError)


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
    # a checkpoint of NaN weights would be named newest and, with retention, replace the good ones
    refuse_non_finite_checkpoint(model.module, model.runtime_engine.local_data, path / tag)
    error = None
    if s.rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = str(storage.storage_failure(exc, path))
    _agree(error, s.world_size)  # also the barrier after which the directory exists
    if partial:
        _save_partial(path, tag, model, optimizer, user_content, num_kept_partial_checkpoints)
        return
    sd = model.state_dict()  # collective under ZeRO-3 / TP
    error = None
    if s.rank == 0:  # each file with its digest beside it (<file>.smp_digest), checked on resume
        try:
            for obj, file in ((sd, path / tag), (user_content, path / f"user_content_{tag}")):
                if obj is not None:
                    sidecars.write_sidecar(str(file), ckpt.atomic_torch_save(obj, str(file)))
            _write_newest(path, tag)
        except Exception as exc:
            if not storage.is_storage_failure(exc):
                raise
            error = str(storage.storage_failure(exc, path))
    _agree(error, s.world_size)


def _save_partial(path: Path, tag: str, model, optimizer, user_content, keep) -> None:
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
    error, own = None, {}
    io = CheckpointIO(staging)  # notes each file this rank writes, with its digest
    try:
        engine_record = model.runtime_engine.save_partial(io, optimizer) or {}
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        io.torch_save(rng, staging / f"rng_rank{s.rank}.pt")
        if s.rank == 0 and user_content is not None:
            io.torch_save(user_content, staging / "user_content.pt")
        storage.fsync_files(p for p, _ in io.written)  # each rank its own files: on disk before the rename
        own = saving.digest_written(staging, io.written, algorithm) if not io.failures else {}
    except Exception as exc:
        if not storage.is_storage_failure(exc):  # a bug: the other ranks may be in a collective this one left
            agreement.report_cause(f"{type(exc).__name__}: {exc}")  # so the launcher names it if gloo aborts
            raise
        io.failures.append(exc)
    if io.failures:  # the first write that failed (they did not raise: the engine's collectives ran on)
        error = str(storage.storage_failure(io.failures[0], path, staging))
    failures = agreement.agree_on_failure(error, s.world_size, SMPCheckpointError)
    if failures:
        if s.rank == 0:
            storage.remove_quietly(staging)
        _barrier()  # the staging folder is gone on every rank's return
        agreement.raise_agreed(failures, SMPCheckpointError)
    # each rank digests what it wrote (still in the page cache); the gather is also the barrier after
    # which every rank's files are in staging
    recorded = saving.gather(own, s.world_size)
    error = None
    if s.rank == 0:
        try:
            _publish(path, tag, staging, final, recorded, algorithm, engine_record)
            if keep is not None:
                _prune(path, int(keep))
        except Exception as exc:
            if not storage.is_storage_failure(exc):
                raise
            storage.remove_quietly(staging)
            error = str(storage.storage_failure(exc, path, staging))
    _agree(error, s.world_size)  # also the barrier after which the checkpoint is published


def _publish(path: Path, tag: str, staging: Path, final: Path, recorded: dict, algorithm: str,
             engine_record: dict) -> None:
    """Rank 0: the manifest, then the rename that makes the checkpoint visible, then ``newest``."""
    manifest = {"tag": tag, "layout": ckpt.current_layout(), "format": "smp-adapter/1", **engine_record,
                **saving.complete(staging, recorded, algorithm)}
    saving.write_manifest(staging, manifest)
    storage.fsync_file(staging / ckpt.MANIFEST)
    storage.fsync_tree(staging)
    if final.exists():
        old = path / f".{tag}_partial.old"
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)
    storage.fsync_dir(path)
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
    """Load a checkpoint written by save_checkpoint; returns its user_content (or None). ``tag=None``:
    the one ``newest`` names, else (damaged, incomplete) the newest older one that verifies, with a
    warning on every rank naming the damaged one; an explicit tag is loaded or refused, never replaced."""
    s = require_initialized("resume_from_checkpoint")
    path = Path(path)
    model = s.model
    if model is None:
        raise SMPUsageError("smp.resume_from_checkpoint needs smp.DistributedModel (and, for partial checkpoints, "
                            "smp.DistributedOptimizer) to exist: call it after wrapping model and optimizer")
    load = functools.partial(_resume_partial if partial else _resume_full, path, model, strict=strict,
                             load_optimizer=load_optimizer and load_sharded_optimizer_state,
                             translate_function=translate_function)
    if tag is not None:
        return load(_check_tag(tag))
    newest = _newest_tag(path)
    older = [t for t in _tags_newest_first(path, partial) if t != newest]
    for candidate, fallback in zip([newest, *older], [*older, None]):
        try:
            return load(candidate)
        except SMPCheckpointError as exc:
            if fallback is None:
                raise
            reason = "; ".join([str(exc).splitlines()[0], *getattr(exc, "damaged", ())])
            warnings.warn(f"rank {s.rank}: checkpoint {candidate!r} in {path} cannot be resumed from ({reason}); "
                          f"resuming from the next newest one, {fallback!r}, instead. Delete or repair {candidate!r} "
                          "(smp-adapter checkpoint verify names its damaged files)", stacklevel=3)
    raise SMPCheckpointError(f"no checkpoint in {path} to resume from")  # not reached: the loop returns or raises


def _tags_newest_first(path: Path, partial: bool) -> list[str]:
    """The tags of the complete checkpoints in ``path``, newest first (by when each was published)."""
    if partial:
        found = [(d / ckpt.MANIFEST, d.name[:-len("_partial")]) for d in path.glob("*_partial")
                 if not d.name.startswith(".") and (d / ckpt.MANIFEST).exists()]
    else:
        found = [(f, f.name[:-len(sidecars.SIDECAR)]) for f in path.glob(f"*{sidecars.SIDECAR}")
                 if not f.name.startswith((".", "user_content_"))]
    return [tag for stamp, tag in sorted(found, key=lambda item: -item[0].stat().st_mtime_ns)]


def _resume_full(path: Path, model, tag: str, strict: bool, load_optimizer: bool, translate_function):
    s = state
    uc = path / f"user_content_{tag}"
    # both files checked before either is read; one collective, so all ranks refuse together
    recorded = uc.exists() or Path(f"{uc}{sidecars.SIDECAR}").exists()
    sidecars.require_sidecars_everywhere([path / tag, *([uc] if recorded else [])], "resume from it", s.rank,
                                        s.world_size)
    # mapped, not read: a sharding engine takes only its rows from the file (MiCS: runtime/file_backed.py)
    sd = ckpt.safe_torch_load(str(path / tag), map_location="cpu", mmap=True)
    if translate_function is not None:
        sd = translate_function(sd)
    model.load_state_dict(sd, strict=strict)
    return ckpt.safe_torch_load(str(uc)) if uc.exists() else None


def _resume_partial(path: Path, model, tag: str, strict: bool, load_optimizer: bool, translate_function):
    s = state
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
    io = CheckpointIO(folder, check)  # the engine's torch.load reads go through the check, hashed as read
    try:
        with check.loading():
            if difference is None and manifest.get(ckpt.ENGINE_FILES, True):
                model.runtime_engine.load_partial(io, s.optimizer, strict, load_optimizer)
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
