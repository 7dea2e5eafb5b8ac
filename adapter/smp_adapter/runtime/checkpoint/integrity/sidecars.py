"""One file's digest beside it, ``<file>.smp_digest``: what ``smp.save`` and full checkpoints
(``save_checkpoint(partial=False)``) record, and what ``smp.load``, a full checkpoint's resume and
``smp-adapter checkpoint verify`` check before reading (runtime/checkpoint/integrity/records.py has the record,
runtime/checkpoint/integrity/manifest.py the checks and the refusal)."""

from __future__ import annotations

import json
from pathlib import Path

from smp_adapter.errors import SMPCheckpointError
from smp_adapter.runtime.checkpoint.storage import atomic_write
from smp_adapter.runtime.checkpoint.integrity.manifest import (ALGORITHM, FILES, Problem, agree, check_contents, check_files,
                                                    check_sizes, default_algorithm, digest_file, hasher, refusal,
                                                    shares, skipped)

SIDECAR = ".smp_digest"  # <file>.smp_digest: {"digest_algorithm", "size", "digest"[, "chunk_bytes", "chunks"]}


def write_sidecar(path: str, written: dict | None = None) -> None:
    """The digest of a file smp.save has just written (``written``: hashed while it was written), beside
    it (replaced atomically)."""
    algorithm = default_algorithm()
    record = {ALGORITHM: algorithm, **(written or digest_file(path, algorithm))}
    atomic_write(f"{path}{SIDECAR}", lambda tmp: tmp.write_text(json.dumps(record)))


def read_sidecar(path) -> tuple[dict | None, list[Problem]]:
    """``path``'s record as a one-file manifest ({algorithm, files: {name: record}}; None when it has
    none: saved by torch.save, or before digests existed), and what is wrong with the record itself."""
    sidecar = Path(f"{path}{SIDECAR}")
    if not sidecar.is_file():
        return None, []
    try:
        record = json.loads(sidecar.read_text())
        algorithm = record.pop(ALGORITHM)
        if not isinstance(record["size"], int) or not isinstance(record["digest"], str):
            raise TypeError
        hasher(algorithm)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, [Problem(sidecar.name, "not a valid digest record: damaged or edited")]
    except SMPCheckpointError as exc:
        return None, [Problem(sidecar.name, str(exc))]
    return {ALGORITHM: algorithm, FILES: {Path(path).name: record}}, []


def sidecar_problems(path) -> list[Problem]:
    """What is wrong with ``path`` against its ``.smp_digest`` record (none when it has no record)."""
    manifest, problems = read_sidecar(path)
    if manifest is None:
        return problems
    return check_files(Path(path).parent, manifest, [Path(path).name])


def check_sidecar(path: str) -> None:
    """Before smp.load reads ``path``: refuse it when its recorded digest (if any) does not hold. Not
    collective, as smp.load is not: the rank that refuses raises, and the launcher ends the job."""
    problems = [] if skipped() else sidecar_problems(path)
    if problems:
        raise refusal(Path(path).parent, problems, "load it")


def require_sidecars_everywhere(paths, action: str, rank: int, world_size: int) -> None:
    """Collective, before a full checkpoint (``<path>/<tag>``, ``user_content_<tag>``, one folder) is
    read: every rank reads the records and checks the sizes (a stat each), the files' units (chunks
    of the large model file) are split among the ranks, each hashes its share, one all_gather, and
    every rank raises the same error or none does."""
    paths = [Path(p) for p in paths]
    folder, problems, algorithms, files = paths[0].parent, [], {}, {}
    if not skipped():
        for path in paths:
            manifest, bad = read_sidecar(path)
            problems += bad
            if manifest is not None:
                algorithms[path.name], files[path.name] = manifest[ALGORITHM], manifest[FILES][path.name]
        sized = check_sizes(folder, {FILES: files}, list(files))
        problems += sized
        share = [u for u in shares(files, world_size)[rank] if u[0] not in {p.file for p in sized}]
        for algorithm in sorted(set(algorithms.values())):
            problems += check_contents(folder, {ALGORITHM: algorithm, FILES: files},
                                       [u for u in share if algorithms[u[0]] == algorithm])
    problems = agree(problems, world_size)
    if problems:
        raise refusal(folder, problems, action)
