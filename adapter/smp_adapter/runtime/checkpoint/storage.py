"""Checkpoint storage: durability before a checkpoint is published, and what a save does when the
disk fails it.

* ``atomic_write``: every file the project publishes (a checkpoint file, a digest sidecar, ``newest``)
  is written beside its name, fsynced, then renamed over it: a reader sees the old file or the new
  one, never a part, also after a node crash.
* ``fsync_tree`` / ``fsync_dir``: a checkpoint's files and directories reach the disk before the
  rename that publishes it (and the parent directory after it), so a node crash never leaves a
  renamed checkpoint whose files are incomplete.
* ``storage_failure``: a save that fails for lack of space (or any other OSError; torch reports its
  own writer's as ``RuntimeError: ... unexpected pos``, the OSError only in ``__context__``) becomes
  one ``SMPCheckpointError`` naming the file, the cause and the free space.
* ``writable_problem``: the launcher's check, before a job starts, that a directory can be written
  and is not full.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from smp_adapter.errors import SMPCheckpointError

MIN_FREE_BYTES = 1 << 20  # below this a directory counts as full (a checkpoint's smallest file is larger)


def fsync_file(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path) -> None:
    """The directory's entries (names created or renamed in it) reach the disk."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a file system without directory handles: nothing to flush there
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems (and /proc-like mounts) refuse fsync on directories
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def atomic_write(path, write):
    """``write(tmp)`` fills a temporary file beside ``path`` (hidden: ``.<name>.tmp.<pid>``), which
    reaches the disk and then replaces ``path`` in one rename; a failed write leaves nothing behind.
    Returns what ``write`` returns."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        result = write(tmp)
        fsync_file(tmp)  # on disk before the rename publishes it
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
    return result


def fsync_files(paths) -> None:
    for path in paths:
        if Path(path).is_file():
            fsync_file(path)


def fsync_tree(root: Path) -> None:
    """Every directory under ``root`` (files are fsynced by the rank that wrote them)."""
    for folder, _, _ in os.walk(root):
        fsync_dir(folder)


def free_bytes(path) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing ancestor)."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _human(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, or in its cause/context chain (torch's file writer)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


# how writers that are not Python's report a failed write: torch's zip writer, safetensors (Rust)
_WRITER_FAILURE = re.compile(r"unexpected pos|file write failed|PytorchStreamWriter failed|I/O error|os error \d+")


def is_storage_failure(exc: BaseException) -> bool:
    return os_error_in(exc) is not None or bool(_WRITER_FAILURE.search(str(exc)))


def _errno_of(exc: BaseException) -> int | None:
    cause = os_error_in(exc)
    if cause is not None:
        return cause.errno
    m = re.search(r"os error (\d+)", str(exc))
    return int(m.group(1)) if m else None


def _last_written(folder: Path | None) -> Path | None:
    """The newest file under ``folder``: the one being written when torch's writer failed. Never raises:
    another rank's failed write may remove its temporary file meanwhile (seen: a FileNotFoundError here
    took the rank out before the ranks agreed on the failure)."""
    if folder is None or not folder.exists():
        return None
    newest, when = None, -1
    try:
        for path in folder.rglob("*"):
            try:
                stamp = path.stat().st_mtime_ns if path.is_file() else -1
            except OSError:  # removed since it was listed
                continue
            if stamp > when:
                newest, when = path, stamp
    except OSError:
        pass
    return newest


def storage_failure(exc: BaseException, where: Path, staging: Path | None = None) -> SMPCheckpointError:
    """The error a save that ``exc`` failed raises: the file, the cause, the free space."""
    cause, code = os_error_in(exc), _errno_of(exc)
    # a copy's or rename's error carries both paths, the source first (shutil.copyfile's sendfile on a full
    # disk: DeepSpeed's zero_to_fp32.py in site-packages); the file written is the second
    name = getattr(cause, "filename2", None) or getattr(cause, "filename", None) or _last_written(staging) or where
    reason = (f"{os.strerror(code)} (errno {errno.errorcode.get(code, code)})" if code is not None
              else str(exc).splitlines()[0])
    free = free_bytes(where)
    full = code in (errno.ENOSPC, errno.EDQUOT)
    fix = ("free space there or save elsewhere" if full or (free is not None and free < MIN_FREE_BYTES)
           else "check the directory's permissions and file system")
    return SMPCheckpointError(
        f"checkpoint save to {where} failed writing {name}: {reason}; free space on that file system: "
        f"{_human(free)}. Nothing of this save was kept (no temporary folder), 'newest' and the earlier checkpoints "
        f"are as they were: {fix}, then save again")


def remove_quietly(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def writable_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot take a job's output (not writable, or full), else None. Creates it."""
    probe = Path(folder) / f".smp-adapter-write-check.{os.getpid()}"
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return f"cannot be written ({exc.strerror}); free space: {_human(free_bytes(folder))}"
    finally:
        remove_quietly(probe)
    free = free_bytes(folder)
    if free is not None and free < MIN_FREE_BYTES:
        return f"is on a full file system ({_human(free)} free)"
    return None
