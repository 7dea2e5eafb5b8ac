"""Digests of every file of a partial checkpoint, recorded at save and checked before a checkpoint
is used (resume, ``smp-adapter checkpoint export / reshard / verify``). A leaf on the shared floor:
no engine is imported here; the engines' writers only tell ``note_written`` what they wrote.

Manifest fields (``smp_manifest.json``):
    digest_algorithm   "xxh3_128" (the ``xxhash`` package) or "blake2b" (hashlib, when xxhash is absent)
    files              {path relative to the folder: {"size": bytes, "digest": hex}} for every file but
                       the manifest: the engine's files (DeepSpeed's ``ds/`` included), the
                       layout-independent pieces, RNG states, user content
    manifest_digest    the digest of the manifest's own JSON without this field (sorted keys)

The hash: xxh3_128 runs at ~7.7 GB/s on one core of the development machine, blake2b at 0.26 GB/s
and blake3 at 1.3 GB/s (benchmarks/checkpoint.py --hash-speed); a checksum against damage, not a
signature against an adversary (docs/checkpoints.md says so).

Save: each rank digests the files it wrote (``WrittenFiles``: their bytes are still in the page
cache), the digests are gathered, and rank 0 digests anything no rank claimed (DeepSpeed's
``zero_to_fp32.py``) before writing the manifest, all inside the staging folder that is renamed into
place afterwards (the save stays atomic). Check: every file is split among the ranks by size,
each rank checks its share, and one collective gives every rank the verdict, so all ranks raise the
same error naming the file (none is left waiting in a later collective).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from smp_adapter.errors import SMPCheckpointError

MANIFEST = "smp_manifest.json"
FILES = "files"
ALGORITHM = "digest_algorithm"
SELF = "manifest_digest"
SKIP_ENV = "SMP_ADAPTER_SKIP_CHECKPOINT_VERIFY"


def _xxhash():
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash


def default_algorithm() -> str:
    return "xxh3_128" if _xxhash() is not None else "blake2b"


def hasher(algorithm: str):
    if algorithm == "blake2b":
        return hashlib.blake2b(digest_size=16)
    if algorithm == "xxh3_128":
        xxhash = _xxhash()
        if xxhash is None:
            raise SMPCheckpointError("this checkpoint's digests are xxh3_128, and the xxhash package is not "
                                     "installed: pip install xxhash (an smp-adapter dependency), or set "
                                     f"{SKIP_ENV}=1 to use it unchecked")
        return xxhash.xxh3_128()
    raise SMPCheckpointError(f"unknown checkpoint digest algorithm {algorithm!r}: it was written by a newer "
                             f"smp-adapter; upgrade, or set {SKIP_ENV}=1 to use it unchecked")


def digest_file(path, algorithm: str) -> dict:
    """{"size", "digest"} of one file, hashed through a memory map (no copy out of the page cache:
    12 ms for 200 MB here, against 17 ms read in chunks into a buffer)."""
    h = hasher(algorithm)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                h.update(mapped)
    return {"size": size, "digest": h.hexdigest()}


def skipped() -> bool:
    return os.environ.get(SKIP_ENV, "").strip().lower() in ("1", "true", "yes")


# -- save ------------------------------------------------------------------------------------------
_written: list | None = None  # the files this rank wrote inside a ``WrittenFiles`` block


def note_written(path) -> None:
    """Called by every checkpoint writer after a file is complete (atomic_torch_save, the index)."""
    if _written is not None:
        _written.append(Path(path))


@contextlib.contextmanager
def written_files():
    """``with written_files() as files:`` ... the paths this process wrote meanwhile."""
    global _written
    previous, _written = _written, []
    try:
        yield _written
    finally:
        _written = previous


@contextlib.contextmanager
def noting_saves(checkpoint_engine):
    """DeepSpeed's checkpoint engine writes its files itself: note each path it saves to."""
    had_own = "save" in vars(checkpoint_engine)
    original = checkpoint_engine.save

    def save(state_dict, path, *args, **kwargs):
        result = original(state_dict, path, *args, **kwargs)
        note_written(path)
        return result

    checkpoint_engine.save = save
    try:
        yield
    finally:
        if had_own:
            checkpoint_engine.save = original
        else:
            vars(checkpoint_engine).pop("save", None)


def digest_written(root: Path, paths, algorithm: str) -> dict:
    """{relative path: digest} of the files this rank wrote under ``root``."""
    root = Path(root).resolve()
    out = {}
    for path in paths:
        path = Path(path).resolve()
        if path.is_file() and path.is_relative_to(root):
            out[path.relative_to(root).as_posix()] = digest_file(path, algorithm)
    return out


def gather(own: dict, world_size: int) -> dict:
    """Every rank's digests, merged (collective: every rank calls it; it doubles as the barrier after
    which every rank's files are complete)."""
    if world_size == 1:
        return dict(own)
    import torch.distributed as dist

    views = [None] * world_size
    dist.all_gather_object(views, own)
    merged = {}
    for view in views:
        merged.update(view)
    return merged


def complete(root: Path, recorded: dict, algorithm: str) -> dict:
    """The manifest's digest fields for every file under ``root``: ``recorded`` plus the files no rank
    claimed (digested here)."""
    files = {}
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != MANIFEST:
            files[rel] = recorded.get(rel) or digest_file(path, algorithm)
    return {ALGORITHM: algorithm, FILES: files}


def _own_digest(manifest: dict, algorithm: str) -> str:
    h = hasher(algorithm)
    h.update(json.dumps({k: v for k, v in manifest.items() if k != SELF}, sort_keys=True).encode())
    return h.hexdigest()


def write_manifest(folder: Path, manifest: dict) -> None:
    """The manifest, carrying its own digest when it records file digests."""
    if ALGORITHM in manifest:
        manifest = {**manifest, SELF: _own_digest(manifest, manifest[ALGORITHM])}
    (Path(folder) / MANIFEST).write_text(json.dumps(manifest, indent=1))


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
            if manifest.get(SELF) != _own_digest(manifest, algorithm):
                return manifest, [Problem(MANIFEST, "its content does not match its own digest: edited or damaged "
                                                    "after the save")]
        except SMPCheckpointError as exc:
            return manifest, [Problem(MANIFEST, str(exc))]
    return manifest, []


def has_digests(manifest: dict) -> bool:
    return FILES in manifest


def check_files(folder: Path, manifest: dict, names) -> list[Problem]:
    """Size and digest of the recorded files ``names`` (a file cut short shows as a size first)."""
    problems = []
    algorithm, files = manifest[ALGORITHM], manifest[FILES]
    for name in names:
        path, want = Path(folder) / name, files[name]
        if not path.is_file():
            problems.append(Problem(name, "missing (recorded at the save, not in the folder now)"))
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(Problem(name, f"size {size} bytes, {want['size']} at the save: cut short or overwritten"))
        elif digest_file(path, algorithm)["digest"] != want["digest"]:
            problems.append(Problem(name, f"content differs from the save ({algorithm} digest): damaged bytes"))
    return problems


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


def shares(files: dict, world_size: int) -> list[list[str]]:
    """The recorded files split among the ranks, largest first to the least loaded (the same on every rank)."""
    load, out = [0] * world_size, [[] for _ in range(world_size)]
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        r = load.index(min(load))
        out[r].append(name)
        load[r] += files[name]["size"]
    return out


_warned: set = set()


def _warn_once(message: str, rank: int) -> None:
    if message not in _warned:
        _warned.add(message)
        if rank == 0:
            warnings.warn(message, stacklevel=3)


def refusal(folder: Path, problems, action: str) -> SMPCheckpointError:
    lines = "\n".join(f"  {folder / p.file}: {p.what}" for p in problems[:20])
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    return SMPCheckpointError(
        f"{folder} is damaged; refusing to {action} ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n"
        f"{lines}{more}\n"
        f"Use an older complete checkpoint (another <tag>_partial beside it; pass its tag, or write it into the "
        f"'newest' file), or copy this one again from its source and run `smp-adapter checkpoint verify "
        f"{folder}`; to use it anyway, accepting wrong values, set {SKIP_ENV}=1")


def _unchecked(folder: Path, manifest: dict, problems: list, rank: int) -> bool:
    """Whether the files are used without checking: the user's opt-out, or a checkpoint saved before
    digests existed (an intact manifest without them); one warning each."""
    if skipped():
        _warn_once(f"{SKIP_ENV}=1: checkpoint files are used without checking their digests", rank)
        return True
    if not problems and not has_digests(manifest):
        _warn_once(f"{folder} records no file digests (saved by an smp-adapter before they were added): it is "
                   "used unchecked; a new save records them", rank)
        return True
    return False


def require_intact(folder: Path, action: str) -> dict:
    """One process: the manifest, once every file checked out (else the error naming each problem)."""
    folder = Path(folder)
    manifest, problems = read_manifest(folder)
    if manifest is not None and _unchecked(folder, manifest, problems, 0):
        return manifest
    if not problems:
        manifest, problems = verify(folder)
    if problems:
        raise refusal(folder, problems, action)
    return manifest


def require_intact_everywhere(folder: Path, action: str, rank: int, world_size: int) -> dict:
    """Collective (every rank calls it): the files split among the ranks, each rank checks its share,
    and one all_gather gives every rank every problem, so all ranks return or all raise the same error."""
    folder = Path(folder)
    manifest, problems = read_manifest(folder)
    if manifest is not None and _unchecked(folder, manifest, problems, rank):
        problems = []
    elif not problems:
        try:
            problems = check_files(folder, manifest, shares(manifest[FILES], world_size)[rank])
            if rank == 0:
                problems += extra_files(folder, manifest)
        except SMPCheckpointError as exc:
            problems = [Problem(MANIFEST, str(exc))]
    if world_size > 1:
        import torch.distributed as dist

        views = [None] * world_size
        dist.all_gather_object(views, [(p.file, p.what) for p in problems])
        problems = sorted({Problem(*p) for view in views for p in view}, key=lambda p: p.file)
    if problems:
        raise refusal(folder, problems, action)
    return manifest


# -- smp.save / smp.load: one file, its digest beside it -------------------------------------------
SIDECAR = ".smp_digest"  # <file>.smp_digest: {"digest_algorithm", "size", "digest"}


def write_sidecar(path: str) -> None:
    """The digest of a file smp.save has just written, beside it (replaced atomically)."""
    algorithm = default_algorithm()
    record = {ALGORITHM: algorithm, **digest_file(path, algorithm)}
    tmp = f"{path}{SIDECAR}.tmp.{os.getpid()}"
    Path(tmp).write_text(json.dumps(record))
    os.replace(tmp, f"{path}{SIDECAR}")


def check_sidecar(path: str) -> None:
    """Before smp.load reads ``path``: refuse it when its recorded digest (if any) does not hold. A
    file without one (saved by torch.save, or before digests existed) is read as it is. Not
    collective: smp.load is not; the rank that refuses raises, and the launcher ends the job."""
    sidecar = Path(f"{path}{SIDECAR}")
    if skipped() or not sidecar.is_file():
        return
    folder, name = Path(path).parent, Path(path).name
    try:
        record = json.loads(sidecar.read_text())
        manifest = {ALGORITHM: record[ALGORITHM], FILES: {name: {"size": record["size"], "digest": record["digest"]}}}
    except (ValueError, KeyError, TypeError):
        raise refusal(folder, [Problem(sidecar.name, "not a valid digest record: damaged or edited")], "load it")
    try:
        problems = check_files(folder, manifest, [name])
    except SMPCheckpointError as exc:
        problems = [Problem(sidecar.name, str(exc))]
    if problems:
        raise refusal(folder, problems, "load it")
