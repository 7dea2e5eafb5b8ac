"""A partial checkpoint's manifest (``smp_manifest.json``) and the checks against it, before a
checkpoint is used (resume, ``smp-adapter checkpoint export / reshard / verify``). A leaf on the
shared floor: no engine is imported here.

Manifest fields:
    digest_algorithm   "xxh3_128" (the ``xxhash`` package) or "blake2b" (hashlib, when xxhash is absent)
    files              {path relative to the folder: a record (integrity/records.py: size, digest,
                       and per-chunk digests for a file over one chunk)} for every file but the
                       manifest: the engine's files (DeepSpeed's ``ds/`` included), the
                       layout-independent pieces, RNG states, user content
    manifest_digest    the digest of the manifest's own JSON without this field (sorted keys)

Save: integrity/saving.py (the digests gathered, the manifest written), fed by the files the save's
``checkpoint/io.py`` ``CheckpointIO`` noted. Check: ``verify`` / ``require_intact`` in one process
(``checkpoint verify / export / reshard``); a resume's check around the engine's load, in every
rank, is integrity/resume_check.py, built on the pieces here (``read_manifest``, ``check_sizes``,
``check_contents``, ``shares``, ``agree``, ``refusal``).
``smp.save`` / full checkpoints: a ``<file>.smp_digest`` record beside each file
(integrity/sidecars.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from smp_adapter.errors import SMPCheckpointError
from smp_adapter.runtime.agreement import max_over_ranks
from smp_adapter.runtime.state import warn_once, warned as _warned  # noqa: F401  (_warned: tests clear it)
from smp_adapter.runtime.checkpoint.integrity.records import (CHUNK_ENV, SKIP_ENV, default_algorithm, digest_file, hasher, unit_bytes,  # noqa: F401
                                                damaged_units, unit_range, units)

MANIFEST = "smp_manifest.json"
FILES = "files"
ALGORITHM = "digest_algorithm"
SELF = "manifest_digest"


def skipped() -> bool:
    return os.environ.get(SKIP_ENV, "").strip().lower() in ("1", "true", "yes")


def own_digest(manifest: dict, algorithm: str) -> str:
    h = hasher(algorithm)
    h.update(json.dumps({k: v for k, v in manifest.items() if k != SELF}, sort_keys=True).encode())
    return h.hexdigest()


# -- check -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    file: str      # relative to the checkpoint folder
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def read_manifest(folder: Path) -> tuple[dict | None, list[Problem]]:
    """The manifest, and what is wrong with it (unreadable, or its content not its recorded digest)."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None, [Problem(MANIFEST, "missing: the checkpoint is incomplete (an interrupted save or copy)")]
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return None, [Problem(MANIFEST, f"not valid JSON ({str(exc)[:80]}): damaged or edited")]
    if not isinstance(manifest, dict):
        return None, [Problem(MANIFEST, "not a JSON object: damaged or edited")]
    if ALGORITHM in manifest or SELF in manifest:
        try:
            algorithm = manifest.get(ALGORITHM, "")
            if manifest.get(SELF) != own_digest(manifest, algorithm):
                return manifest, [Problem(MANIFEST, "its content does not match its own digest: edited or damaged "
                                                    "after the save")]
        except SMPCheckpointError as exc:
            return manifest, [Problem(MANIFEST, str(exc))]
    return manifest, []


def has_digests(manifest: dict) -> bool:
    return FILES in manifest


def units_of(files: dict, items) -> list:
    """``items``: file names (every unit of each) or ``(name, chunk index)`` units, as units."""
    return [u for item in items for u in (units(item, files[item]) if isinstance(item, str) else [tuple(item)])]


def check_sizes(folder: Path, manifest: dict, items) -> list[Problem]:
    """The recorded files of ``items`` (names or units) are there with their recorded sizes (a stat
    each: a file cut short or missing is refused before any byte is read)."""
    problems, files = [], manifest[FILES]
    for name in dict.fromkeys(u[0] for u in units_of(files, items)):
        path, want = Path(folder) / name, files[name]
        if not path.is_file():
            problems.append(Problem(name, "missing (recorded at the save, not in the folder now)"))
        elif path.stat().st_size != want["size"]:
            problems.append(Problem(name, f"size {path.stat().st_size} bytes, {want['size']} at the save: cut short "
                                          "or overwritten"))
    return problems


def check_contents(folder: Path, manifest: dict, items) -> list[Problem]:
    """The digests of ``items`` (names or units) of the recorded files (of the right size): one
    problem per file, naming its damaged chunks."""
    algorithm, files, by_file = manifest[ALGORITHM], manifest[FILES], {}
    for name, index in units_of(files, items):
        by_file.setdefault(name, []).append(index)
    problems = []
    for name, indices in by_file.items():
        bad = damaged_units(Path(folder) / name, algorithm, files[name], indices)
        if bad:
            problems.append(Problem(name, differs(algorithm, files[name], bad)))
    return problems


def differs(algorithm: str, record: dict, indices) -> str:
    ranges = ", ".join(unit_range(record, i) for i in indices if i is not None)
    return f"content differs from the save ({algorithm} digest{' of ' + ranges if ranges else ''}): damaged bytes"


def check_files(folder: Path, manifest: dict, items) -> list[Problem]:
    """Size, then digest, of the recorded files of ``items`` (names or units)."""
    by_file: dict = {}
    for unit in units_of(manifest[FILES], items):
        by_file.setdefault(unit[0], []).append(unit)
    return [p for name, own in by_file.items() for p in (check_sizes(folder, manifest, [name]) or
                                                         check_contents(folder, manifest, own))]


def extra_files(folder: Path, manifest: dict) -> list[Problem]:
    recorded = manifest[FILES]
    return [Problem(rel, "not recorded in the manifest (added after the save)")
            for rel in sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file())
            if rel != MANIFEST and rel not in recorded]


def verify(folder: Path) -> tuple[dict | None, list[Problem]]:
    """Every check, in one process (``checkpoint verify``, export, reshard)."""
    folder = Path(folder)
    manifest, problems = read_manifest(folder)
    if manifest is None or problems:
        return manifest, problems
    if not has_digests(manifest):
        return manifest, []
    try:
        return manifest, check_files(folder, manifest, sorted(manifest[FILES])) + extra_files(folder, manifest)
    except SMPCheckpointError as exc:
        return manifest, [Problem(MANIFEST, str(exc))]


def shares(files: dict, world_size: int) -> list[list[tuple]]:
    """The recorded files' units (whole small files, chunks of large ones) split among the ranks,
    largest first to the least loaded (the same on every rank): one large file read by every rank
    (ZeRO 0's model file) is checked by all of them, a chunk each in turn."""
    load, out = [0] * world_size, [[] for _ in range(world_size)]
    every = units_of(files, sorted(files))
    for name, index in sorted(every, key=lambda u: (-unit_bytes(files[u[0]], u[1]), u[0], u[1] or 0)):
        r = load.index(min(load))
        out[r].append((name, index))
        load[r] += unit_bytes(files[name], index)
    return out


def problem_lines(folder: Path, problems, most: int = 20) -> list[str]:
    """Each problem as ``<file>: <what>`` (at most ``most`` of them, then how many more)."""
    lines = [f"{folder / p.file}: {p.what}" for p in problems[:most]]
    return lines + ([f"... and {len(problems) - most} more"] if len(problems) > most else [])


def refusal(folder: Path, problems, action: str) -> SMPCheckpointError:
    lines = "\n".join(f"  {line}" for line in problem_lines(folder, problems))
    error = SMPCheckpointError(
        f"{folder} is damaged; refusing to {action} ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n"
        f"{lines}\n"
        f"Use an older complete checkpoint (another <tag>_partial beside it; pass its tag, or write it into the "
        f"'newest' file), or copy this one again from its source and run `smp-adapter checkpoint verify "
        f"{folder}`; to use it anyway, accepting wrong values, set {SKIP_ENV}=1")
    error.damaged = problem_lines(folder, problems, most=5)  # what a fallback to an older checkpoint names
    return error


def used_unchecked(folder: Path, manifest: dict, problems: list, rank: int) -> bool:
    """Whether the files are used without checking: the user's opt-out, or a checkpoint saved before
    digests existed (an intact manifest without them); one warning each."""
    if skipped():
        warn_once([f"{SKIP_ENV}=1: checkpoint files are used without checking their digests"], rank)
        return True
    if not problems and not has_digests(manifest):
        warn_once([f"{folder} records no file digests (saved by an smp-adapter before they were added): it is "
                   "used unchecked; a new save records them"], rank)
        return True
    return False


def require_intact(folder: Path, action: str) -> dict:
    """One process: the manifest, once every file checked out (else the error naming each problem)."""
    folder = Path(folder)
    manifest, problems = read_manifest(folder)
    if manifest is not None and used_unchecked(folder, manifest, problems, 0):
        return manifest
    if not problems:
        manifest, problems = verify(folder)
    if problems:
        raise refusal(folder, problems, action)
    return manifest


def agree(problems: list, world_size: int, same: int = 0) -> list:
    """Every rank's problems, on every rank (collective), one per file, sorted by file. When no rank
    has any (every intact checkpoint) that is one all-reduce of a count; the problems themselves are
    gathered only when some rank has one. ``same``: a number every rank must hold alike (how many
    units the check reduces later); a rank differing is a problem on every rank."""
    if world_size > 1:
        count, high, low = max_over_ranks([len(problems), same, -same], world_size)
        if high != -low:
            problems = [*problems, Problem(MANIFEST, "read differently by the ranks (changed while they read it, or "
                                                     f"{SKIP_ENV} set on some ranks only)")]
        elif not count:
            return []
    views = [[(p.file, p.what) for p in problems]]
    if world_size > 1:
        import torch.distributed as dist

        views = [None] * world_size
        dist.all_gather_object(views, [(p.file, p.what) for p in problems])
    by_file: dict = {}  # one problem per file: two ranks may each find a damaged chunk of one file
    for file, what in (p for view in views for p in view):
        by_file.setdefault(file, {})[what] = None
    return [Problem(file, "; ".join(whats)) for file, whats in sorted(by_file.items())]
