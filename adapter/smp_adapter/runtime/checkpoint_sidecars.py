"""One file's digest beside it, ``<file>.smp_digest``: what ``smp.save`` and full checkpoints
(``save_checkpoint(partial=False)``) record, and what ``smp.load`` and a full checkpoint's resume
check before reading (runtime/checkpoint_digests.py has the hash, the checks and the refusal)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from smp_adapter.errors import SMPCheckpointError
from smp_adapter.runtime.checkpoint_digests import (ALGORITHM, FILES, Problem, agree, check_files, default_algorithm,
                                                    digest_file, refusal, skipped)

SIDECAR = ".smp_digest"  # <file>.smp_digest: {"digest_algorithm", "size", "digest"}


def write_sidecar(path: str, written: dict | None = None) -> None:
    """The digest of a file smp.save has just written (``written``: hashed while it was written), beside
    it (replaced atomically)."""
    algorithm = default_algorithm()
    record = {ALGORITHM: algorithm, **(written or digest_file(path, algorithm))}
    tmp = f"{path}{SIDECAR}.tmp.{os.getpid()}"
    Path(tmp).write_text(json.dumps(record))
    os.replace(tmp, f"{path}{SIDECAR}")


def sidecar_problems(path) -> list[Problem]:
    """What is wrong with ``path`` against its ``.smp_digest`` record (none when it has no record:
    saved by torch.save, or before digests existed)."""
    sidecar = Path(f"{path}{SIDECAR}")
    if not sidecar.is_file():
        return []
    folder, name = Path(path).parent, Path(path).name
    try:
        record = json.loads(sidecar.read_text())
        manifest = {ALGORITHM: record[ALGORITHM], FILES: {name: {"size": record["size"], "digest": record["digest"]}}}
    except (ValueError, KeyError, TypeError):
        return [Problem(sidecar.name, "not a valid digest record: damaged or edited")]
    try:
        return check_files(folder, manifest, [name])
    except SMPCheckpointError as exc:
        return [Problem(sidecar.name, str(exc))]


def check_sidecar(path: str) -> None:
    """Before smp.load reads ``path``: refuse it when its recorded digest (if any) does not hold. Not
    collective, as smp.load is not: the rank that refuses raises, and the launcher ends the job."""
    problems = [] if skipped() else sidecar_problems(path)
    if problems:
        raise refusal(Path(path).parent, problems, "load it")


def require_sidecars_everywhere(paths, action: str, rank: int, world_size: int) -> None:
    """Collective, before a full checkpoint (``<path>/<tag>``, ``user_content_<tag>``) is read: the
    files split among the ranks, each checks its share against the records, one all_gather, and
    every rank raises the same error or none does."""
    paths = [str(p) for p in paths]
    problems = [] if skipped() else [p for path in paths[rank::world_size] for p in sidecar_problems(path)]
    problems = agree(problems, world_size)
    if problems:
        raise refusal(Path(paths[0]).parent, problems, action)
