"""One file's digest record: the hash, the record's format, and computing or checking it (a leaf on
the shared floor; runtime/checkpoint/integrity/manifest.py keeps a checkpoint's records in its manifest,
runtime/checkpoint/integrity/sidecars.py one record beside a file).

A record is ``{"size": bytes, "digest": hex}``. A file larger than one chunk (``chunk_bytes``,
8 MiB unless ``SMP_ADAPTER_DIGEST_CHUNK_BYTES`` says otherwise at the save) also records
``"chunk_bytes"`` and ``"chunks"``, the digest of each chunk in order, and its ``"digest"`` is the
digest of those chunk digests (bytes, concatenated): the chunks of one large file (ZeRO 0's model
file, which every rank reads) can then be checked by several ranks at once, and a damaged one is
named by its byte range. A record without ``"chunks"`` (a small file, or any file of a checkpoint
saved before chunks existed) is checked whole. The file objects that hash a file as it is written or
read: hashing_io.py.

The hash: xxh3_128 (the ``xxhash`` package), 22 GB/s on one core of the development machine against
0.94 GB/s for blake2b and 4.7 GB/s for blake3 (benchmarks/checkpoint.py --hash-speed); a checksum
against damage, not a signature against an adversary (docs/checkpoints.md says so).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
from pathlib import Path

from smp_adapter.errors import SMPCheckpointError, SMPUsageError

SKIP_ENV = "SMP_ADAPTER_SKIP_CHECKPOINT_VERIFY"
CHUNK_ENV = "SMP_ADAPTER_DIGEST_CHUNK_BYTES"
DEFAULT_CHUNK_BYTES = 8 << 20  # a 200 MB file is 24 chunks: two ranks' shares differ by one at most (4 %)
PIECE = 1 << 20  # the writer hashes, then writes, 1 MiB at a time: the write copies bytes the hash just
#                   pulled into the CPU's cache; the reader reads, then hashes, as much (a core's L2 here)


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


def chunk_bytes() -> int:
    """The chunk size new records use. A multiple of the memory-map granularity: a chunk is checked
    through a map that starts at its offset."""
    raw = os.environ.get(CHUNK_ENV, "").strip()
    if not raw:
        return DEFAULT_CHUNK_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0 or value % mmap.ALLOCATIONGRANULARITY:
        raise SMPUsageError(f"{CHUNK_ENV}={raw!r} is not a positive multiple of {mmap.ALLOCATIONGRANULARITY} bytes: "
                             f"set it to one (e.g. {DEFAULT_CHUNK_BYTES}, the default), or unset it")
    return value


def digest_record(algorithm: str, size: int, chunk: int, chunks: list) -> dict:
    if len(chunks) <= 1:
        return {"size": size, "digest": chunks[0]}
    top = hasher(algorithm)
    top.update(b"".join(bytes.fromhex(c) for c in chunks))
    return {"size": size, "digest": top.hexdigest(), "chunk_bytes": chunk, "chunks": chunks}


def units(name: str, record: dict) -> list:
    """The pieces ``record`` is checked in: ``(name, i)`` per chunk, or ``(name, None)`` for the whole file."""
    return [(name, i) for i in range(len(record["chunks"]))] if "chunks" in record else [(name, None)]


def hashes_unit(index: int | None, shared_by: tuple[int, int]) -> bool:
    """Whether the rank at ``position`` of the ``count`` ranks that read one file whole (``shared_by``)
    hashes its unit ``index``: every count-th chunk from its position; a file recorded whole, the first."""
    position, count = shared_by
    return (index or 0) % count == position


def due_units(record: dict, shared_by: tuple[int, int]) -> list:
    """The unit indices (chunk numbers, or None) of ``record`` that this rank of ``shared_by`` hashes."""
    return [i for _, i in units("", record) if hashes_unit(i, shared_by)]


def unit_bytes(record: dict, index: int | None) -> int:
    if index is None:
        return record["size"]
    step = record["chunk_bytes"]
    return max(0, min(step, record["size"] - index * step))


def unit_range(record: dict, index: int) -> str:
    start = index * record["chunk_bytes"]
    return f"bytes {start}-{start + unit_bytes(record, index) - 1} (chunk {index + 1} of {len(record['chunks'])})"


def digest_file(path, algorithm: str, chunk: int | None = None) -> dict:
    """The record of one file, hashed through a memory map (no copy out of the page cache: 12 ms for
    200 MB here, against 17 ms read in chunks into a buffer)."""
    chunk = chunk or chunk_bytes()
    chunks = []
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return digest_record(algorithm, 0, chunk, [hasher(algorithm).hexdigest()])
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            for start in range(0, size, chunk):
                h = hasher(algorithm)
                h.update(view[start:start + chunk])
                chunks.append(h.hexdigest())
    return digest_record(algorithm, size, chunk, chunks)


def damaged_units(path, algorithm: str, record: dict, indices) -> list:
    """Which of the units ``indices`` of the file (chunk numbers, or None for the whole file) no longer
    have their recorded digest. The caller has checked the size. The file is read or mapped once for
    all of them: each unmap of a thread's mapping interrupts the process's other running threads (the TLB)."""
    indices = list(indices)
    if None in indices:
        indices = [None]
    elif indices:
        step = record["chunk_bytes"]
        if step <= 0 or step % mmap.ALLOCATIONGRANULARITY or len(record["chunks"]) != -(-record["size"] // step):
            return indices  # a record edited out of shape (the manifest's own digest catches that first)
    if not indices or not record["size"]:
        return [i for i in indices if i is None and hasher(algorithm).hexdigest() != record["digest"]]
    bad = []
    with open(path, "rb", buffering=0) as f, _contents(f, record["size"]) as view:
        for index in indices:
            h = hasher(algorithm)
            if index is None:
                h.update(view)
            else:
                start = index * record["chunk_bytes"]
                h.update(view[start:start + unit_bytes(record, index)])
            if h.hexdigest() != (record["digest"] if index is None else record["chunks"][index]):
                bad.append(index)
    return bad


SMALL_BYTES = 1 << 20  # a file this small is read into memory to be hashed, not mapped (below)


def small(record: dict) -> bool:
    """A file recorded whole and at most ``SMALL_BYTES``: a resume checks it before the engine reads
    anything, by a plain read (tens of microseconds), rather than hashing it as it is read."""
    return "chunks" not in record and record["size"] <= SMALL_BYTES


@contextlib.contextmanager
def _contents(f, size: int):
    """A view of the first ``size`` bytes of the open file ``f``: a small file read in one call (a map
    and its unmap cost more than reading a few KiB: the RNG states, user content, the layout-independent
    index); a larger one mapped (no copy out of the page cache)."""
    if size <= SMALL_BYTES:
        with memoryview(f.read(size)) as view:
            yield view
        return
    with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
        yield view
