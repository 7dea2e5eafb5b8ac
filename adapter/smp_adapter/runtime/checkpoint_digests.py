"""Digests of every file of a partial checkpoint, recorded at save and checked before a checkpoint
is used (resume, ``smp-adapter checkpoint export / reshard / verify``). A leaf on the shared floor:
no engine is imported here; the engines' writers only tell ``note_written`` what they wrote.

Manifest fields (``smp_manifest.json``):
    digest_algorithm   "xxh3_128" (the ``xxhash`` package) or "blake2b" (hashlib, when xxhash is absent)
    files              {path relative to the folder: {"size": bytes, "digest": hex}} for every file but
                       the manifest: the engine's files (DeepSpeed's ``ds/`` included), the
                       layout-independent pieces, RNG states, user content
    manifest_digest    the digest of the manifest's own JSON without this field (sorted keys)

The hash: xxh3_128, 22 GB/s on one core of the development machine against 0.94 GB/s for blake2b
and 4.7 GB/s for blake3 (benchmarks/checkpoint.py --hash-speed); a checksum against damage, not a
signature against an adversary (docs/checkpoints.md says so).

Save: the files are hashed as they are written (``write_hashed``: torch.save into a file object that
hashes each 1 MiB before writing it, while those bytes are in the CPU's cache; DeepSpeed's default
checkpoint engine is handed that file object instead of its path, ``noting_saves``); a file some
writer did not hash (the safetensors index, another checkpoint engine's files) is hashed right after.
The digests are gathered, and rank 0 digests anything no rank claimed (DeepSpeed's
``zero_to_fp32.py``) before writing the manifest, all inside the staging folder that is renamed into
place afterwards (the save stays atomic). Check (``start_check`` / ``Check.finish``, resume): every
file is split among the ranks by size; sizes and the file list are checked before anything is read,
the digests while the engine reads the same files, and one collective gives every rank the verdict
before the resume returns, so all ranks raise the same error naming the file (none is left waiting
in a later collective). ``smp.save`` / full checkpoints: a ``<file>.smp_digest`` record beside each
file (runtime/checkpoint_sidecars.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
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
_CHUNK = 1 << 20  # hash, then write, 1 MiB at a time: the write copies the bytes the hash just pulled into the CPU's cache


class _HashingFile(io.RawIOBase):
    """The file object ``torch.save`` writes into: every write is hashed on its way to the file, so a
    file's digest costs no second pass over its bytes. torch's zip writer only appends; a seek
    (not expected) makes ``record`` None and the file is hashed after it is written."""

    def __init__(self, raw, algorithm: str):
        super().__init__()
        self._raw, self._hash, self._size, self._appended = raw, hasher(algorithm), 0, True

    def writable(self) -> bool:
        return True

    @property
    def name(self) -> str:  # the path being written, as a file object's name is (tools and scripts read it)
        return self._raw.name

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _CHUNK):
            chunk = view[start:start + _CHUNK]
            if self._appended:
                self._hash.update(chunk)
            while chunk:  # a raw write may take fewer bytes than asked
                chunk = chunk[self._raw.write(chunk):]
        self._size += len(view)
        return len(view)

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        position = self._raw.seek(offset, whence)
        self._appended = self._appended and position == self._size
        return position

    def flush(self) -> None:
        self._raw.flush()

    def record(self) -> dict | None:
        return {"size": self._size, "digest": self._hash.hexdigest()} if self._appended else None


def write_hashed(path, write, algorithm: str | None = None) -> dict:
    """Create ``path`` with ``write(file_object)`` (``torch.save(obj, f)``) and return its {"size",
    "digest"}, hashed while it was written."""
    algorithm = algorithm or default_algorithm()
    with open(path, "wb", buffering=0) as raw:
        f = _HashingFile(raw, algorithm)
        write(f)
    return f.record() or digest_file(path, algorithm)


_written: list | None = None  # (path, its default-algorithm digest or None) per file written in a ``written_files`` block


def note_written(path, record: dict | None = None) -> None:
    """Called by every checkpoint writer once a file is complete, with its digest (``write_hashed``,
    default algorithm) when it was hashed while written (atomic_torch_save, DeepSpeed's files); the
    others are hashed at the end of the save."""
    if _written is not None:
        _written.append((Path(path), record))


@contextlib.contextmanager
def written_files():
    """``with written_files() as files:`` ... the (path, record) of each file this process wrote meanwhile."""
    global _written
    previous, _written = _written, []
    try:
        yield _written
    finally:
        _written = previous


@contextlib.contextmanager
def noting_saves(checkpoint_engine, writes_with_torch_save: bool):
    """DeepSpeed's checkpoint engine writes its files itself: note each path it saves to. Its default
    engine (``writes_with_torch_save``: ``torch.save(state_dict, path)``) is handed a hashing file
    object instead of the path, so the file is hashed as it is written; any other engine's files are
    hashed after the save."""
    had_own = "save" in vars(checkpoint_engine)
    original = checkpoint_engine.save

    def save(state_dict, path, *args, **kwargs):
        if writes_with_torch_save and isinstance(path, (str, os.PathLike)):
            note_written(path, write_hashed(path, lambda f: original(state_dict, f, *args, **kwargs)))
            return None
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


def digest_written(root: Path, written, algorithm: str) -> dict:
    """{relative path: digest} of the files this rank wrote under ``root`` (hashed now when their
    writer did not hash them)."""
    root = Path(root).resolve()
    out = {}
    for path, record in written:
        path = Path(path).resolve()
        if path.is_file() and path.is_relative_to(root):
            hashed = record if algorithm == default_algorithm() else None
            out[path.relative_to(root).as_posix()] = hashed or digest_file(path, algorithm)
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


def check_sizes(folder: Path, manifest: dict, names) -> list[Problem]:
    """The recorded files ``names`` are there with their recorded sizes (a stat each: a file cut
    short or missing is refused before any byte is read)."""
    problems, files = [], manifest[FILES]
    for name in names:
        path, want = Path(folder) / name, files[name]
        if not path.is_file():
            problems.append(Problem(name, "missing (recorded at the save, not in the folder now)"))
        elif path.stat().st_size != want["size"]:
            problems.append(Problem(name, f"size {path.stat().st_size} bytes, {want['size']} at the save: cut short "
                                          "or overwritten"))
    return problems


def check_contents(folder: Path, manifest: dict, names) -> list[Problem]:
    """The digests of the recorded files ``names`` (those of the right size)."""
    algorithm, files = manifest[ALGORITHM], manifest[FILES]
    return [Problem(name, f"content differs from the save ({algorithm} digest): damaged bytes") for name in names
            if digest_file(Path(folder) / name, algorithm)["digest"] != files[name]["digest"]]


def check_files(folder: Path, manifest: dict, names) -> list[Problem]:
    """Size, then digest, of each recorded file of ``names``."""
    return [p for name in names for p in (check_sizes(folder, manifest, [name]) or
                                          check_contents(folder, manifest, [name]))]


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


def agree(problems: list, world_size: int) -> list:
    """Every rank's problems, on every rank (collective)."""
    if world_size == 1:
        return problems
    import torch.distributed as dist

    views = [None] * world_size
    dist.all_gather_object(views, [(p.file, p.what) for p in problems])
    return sorted({Problem(*p) for view in views for p in view}, key=lambda p: p.file)


class Check:
    """A resume's check, in two collective halves around the engine's load (``start_check``, then
    ``finish``): what costs no read (the manifest, every file there with its size, no file added)
    is settled before the engine reads anything; the digests of this rank's share are computed in a
    thread while the engine reads the same files (the hash releases the GIL), so the disk is read
    once, by whichever comes first, and the verdict comes before the resume returns, i.e. before a
    training step uses a value. On a node the ranks share the page cache."""

    def __init__(self, folder: Path, manifest: dict, names, action: str, rank: int, world_size: int):
        import threading

        self.folder, self.manifest, self._action, self._world = folder, manifest, action, world_size
        self._names, self._problems = list(names), []
        self._thread = threading.Thread(target=self._hash, args=(names,), name="smp-checkpoint-digests", daemon=True)
        if names:
            self._thread.start()

    def _hash(self, names) -> None:
        try:
            self._problems = check_contents(self.folder, self.manifest, names)
        except (OSError, SMPCheckpointError) as exc:  # a file replaced while it was read
            self._problems = [Problem(MANIFEST, f"could not be checked: {exc}")]

    def local_problems(self) -> list:
        """This rank's share's problems (not collective)."""
        if self._thread.ident is not None:  # started
            self._thread.join()
        return self._problems

    def every_problem(self) -> list:
        """Not collective: every file checked by this rank alone, for a rank whose engine could not read a
        file (the other ranks may be inside the engine's collectives): it ends with the digest error."""
        if self.manifest is None or not has_digests(self.manifest) or skipped():
            return []
        others = [n for n in sorted(self.manifest[FILES]) if n not in set(self._names)]
        return sorted(self.local_problems() + check_files(self.folder, self.manifest, others), key=lambda p: p.file)

    def finish(self) -> dict:
        """Collective: every rank returns the manifest, or every rank raises the same error."""
        problems = agree(self.local_problems(), self._world)
        if problems:
            raise refusal(self.folder, problems, self._action)
        return self.manifest


def start_check(folder: Path, action: str, rank: int, world_size: int) -> Check:
    """Collective: refuse, on every rank, a checkpoint whose manifest, file list or sizes are wrong;
    then start hashing this rank's share (``Check``)."""
    folder = Path(folder)
    manifest, problems = read_manifest(folder)
    names = []
    if manifest is not None and _unchecked(folder, manifest, problems, rank):
        problems = []
    elif not problems:
        try:
            hasher(manifest[ALGORITHM])  # an algorithm this process cannot compute: refused now
            names = shares(manifest[FILES], world_size)[rank]
            problems = check_sizes(folder, manifest, names) + (extra_files(folder, manifest) if rank == 0 else [])
        except SMPCheckpointError as exc:
            problems = [Problem(MANIFEST, str(exc))]
    problems = agree(problems, world_size)
    if problems:
        raise refusal(folder, problems, action)
    return Check(folder, manifest, names, action, rank, world_size)


def require_intact_everywhere(folder: Path, action: str, rank: int, world_size: int) -> dict:
    """Collective (every rank calls it): the files split among the ranks, each rank checks its share,
    and the problems are gathered, so all ranks return or all raise the same error."""
    return start_check(folder, action, rank, world_size).finish()
