"""One file's digest record: the hash, the record's format, and computing or checking it (a leaf on
the shared floor; runtime/checkpoint_digests.py keeps a checkpoint's records in its manifest,
runtime/checkpoint_sidecars.py one record beside a file).

A record is ``{"size": bytes, "digest": hex}``. A file larger than one chunk (``chunk_bytes``,
8 MiB unless ``SMP_ADAPTER_DIGEST_CHUNK_BYTES`` says otherwise at the save) also records
``"chunk_bytes"`` and ``"chunks"``, the digest of each chunk in order, and its ``"digest"`` is the
digest of those chunk digests (bytes, concatenated): the chunks of one large file (ZeRO 0's model
file, which every rank reads) can then be checked by several ranks at once, and a damaged one is
named by its byte range. A record without ``"chunks"`` (a small file, or any file of a checkpoint
saved before chunks existed) is checked whole. ``HashingReader``: the file object a checked resume hands torch.load, hashing what it
reads as it reads it.

The hash: xxh3_128 (the ``xxhash`` package), 22 GB/s on one core of the development machine against
0.94 GB/s for blake2b and 4.7 GB/s for blake3 (benchmarks/checkpoint.py --hash-speed); a checksum
against damage, not a signature against an adversary (docs/checkpoints.md says so).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import mmap
import os
from pathlib import Path

from smp_adapter.errors import SMPCheckpointError, SMPUsageError

SKIP_ENV = "SMP_ADAPTER_SKIP_CHECKPOINT_VERIFY"
CHUNK_ENV = "SMP_ADAPTER_DIGEST_CHUNK_BYTES"
DEFAULT_CHUNK_BYTES = 8 << 20  # a 200 MB file is 24 chunks: two ranks' shares differ by one at most (4 %)
_PIECE = 1 << 20  # the writer hashes, then writes, 1 MiB at a time: the write copies bytes the hash just
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


def _record(algorithm: str, size: int, chunk: int, chunks: list) -> dict:
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
            return _record(algorithm, 0, chunk, [hasher(algorithm).hexdigest()])
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            for start in range(0, size, chunk):
                h = hasher(algorithm)
                h.update(view[start:start + chunk])
                chunks.append(h.hexdigest())
    return _record(algorithm, size, chunk, chunks)


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


_BESIDE_BYTES = 1 << 20  # a write at least this large is hashed beside the write when a helper thread is given


class HashingFile(io.RawIOBase):
    """The file object ``torch.save`` writes into: every write is hashed on its way to the file,
    chunk by chunk, so a file's record costs no second pass over its bytes. torch's zip writer only
    appends; a seek (not expected) makes ``record`` None and the file is hashed after it is written.
    ``helper`` (an executor of one thread, on a spare core: runtime/spare_core_hashing.py): a large
    write (a tensor's bytes) is hashed by it while this thread writes the same bytes (both only
    read them; the write returns once both are done), so the hash costs the save no time; without
    it, each 1 MiB is hashed and then written on this thread."""

    def __init__(self, raw, algorithm: str, helper=None):
        super().__init__()
        self._raw, self._algorithm, self._chunk, self._helper = raw, algorithm, chunk_bytes(), helper
        self._hash, self._chunks, self._in_chunk, self._size, self._appended = hasher(algorithm), [], 0, 0, True

    def writable(self) -> bool:
        return True

    @property
    def name(self) -> str:  # the path being written, as a file object's name is (tools and scripts read it)
        return self._raw.name

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self._helper is not None and self._appended and len(view) >= _BESIDE_BYTES:
            hashing = self._helper.submit(self._absorb, view)
            try:
                self._write_all(view)
            finally:
                hashing.result()
        else:
            start = 0
            while start < len(view):  # hash 1 MiB, write it while it is in the CPU's cache
                piece = view[start:start + _PIECE]
                self._absorb(piece)
                self._write_all(piece)
                start += len(piece)
        self._size += len(view)
        return len(view)

    def _write_all(self, view) -> None:
        while view:  # a raw write may take fewer bytes than asked
            view = view[self._raw.write(view):]

    def _absorb(self, view) -> None:
        """Add ``view`` to the running chunk digests (a chunk's digest closed at each chunk's end)."""
        start = 0
        while start < len(view):
            piece = view[start:start + self._chunk - self._in_chunk]  # never across a chunk's end
            if self._appended:
                self._hash.update(piece)
            start += len(piece)
            self._in_chunk += len(piece)
            if self._in_chunk == self._chunk:
                self._chunks.append(self._hash.hexdigest())
                self._hash, self._in_chunk = hasher(self._algorithm), 0

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        position = self._raw.seek(offset, whence)
        self._appended = self._appended and position == self._size
        return position

    def flush(self) -> None:
        self._raw.flush()

    def record(self) -> dict | None:
        if not self._appended:
            return None
        tail = [self._hash.hexdigest()] if self._in_chunk or not self._chunks else []
        return _record(self._algorithm, self._size, self._chunk, self._chunks + tail)


def write_hashed(path, write, algorithm: str | None = None, helper=None) -> dict:
    """Create ``path`` with ``write(file_object)`` (``torch.save(obj, f)``) and return its record,
    hashed while it was written (``helper``: see ``HashingFile``)."""
    algorithm = algorithm or default_algorithm()
    with open(path, "wb", buffering=0) as raw:
        f = HashingFile(raw, algorithm, helper)
        write(f)
    return f.record() or digest_file(Path(path), algorithm)


_GAP = 64 << 10  # a reader's skip shorter than this (a zip header's padding) is read and hashed to keep the hash going


class HashingReader(io.RawIOBase):
    """The file object ``torch.load`` reads from during a checked resume: the bytes it reads are
    hashed right after they land in their destination (in pieces of 1 MiB, still in the CPU's
    cache; against 256 KiB: 4x fewer calls through this Python code, ~0.5 ms less per 150 MB into
    reused buffers, up to as much more into freshly mapped ones: about even in whole resumes), chunk by chunk,
    against ``record``. torch reads a checkpoint nearly in order (the zip's directory at the end
    first, then each record); a short skip is read and hashed here, a far one served unhashed, and
    the file's end is hashed at ``close`` when little of it is left. ``checked``: {chunk index (None
    for a record without chunks): whether it matched}; the chunks not in it are checked another way."""

    def __init__(self, path, algorithm: str, record: dict, shared_by: tuple[int, int] = (0, 1)):
        """``shared_by`` = (position, count): the file is read whole by ``count`` ranks (ZeRO 0's model
        file, by a dp group); this one hashes chunks ``position``, ``position + count``, ..."""
        super().__init__()
        self._raw = open(path, "rb", buffering=0)
        self._algorithm, self._record, self._shared_by = algorithm, record, shared_by
        self._step = record.get("chunk_bytes") or max(record["size"], 1)
        self._hash, self._cursor, self.checked = hasher(algorithm), 0, {}

    def __str__(self) -> str:  # DeepSpeed's checkpoint engine logs what it loads from: the path, as before
        return str(self._raw.name)

    def _mine(self, index: int) -> bool:
        return hashes_unit(index, self._shared_by)

    def _chunk_end(self, index: int) -> int:
        return min((index + 1) * self._step, self._record["size"])

    def _skip_others(self, end: int) -> None:
        """Move the cursor past the chunks another rank hashes, up to ``end``."""
        while self._cursor < end and not self._mine(self._cursor // self._step):
            self._cursor = min(end, self._chunk_end(self._cursor // self._step))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return self._raw.name

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def readinto(self, buffer) -> int:
        view, total = memoryview(buffer).cast("B"), 0
        position = self._raw.tell()
        while total < len(view):
            got = self._raw.readinto(view[total:total + _PIECE])
            if not got:
                break
            self._absorb(position + total, view[total:total + got])
            total += got
        return total

    def _absorb(self, offset: int, data) -> None:
        self._skip_others(offset)
        if offset > self._cursor:
            if offset - self._cursor > _GAP:
                return  # read far ahead (the zip's directory): served unhashed
            self._fill(offset)
        skip = self._cursor - offset
        if skip < len(data):
            self._feed(data[skip:])

    def _fill(self, end: int) -> None:
        """Hash the bytes from the cursor to ``end`` (read here; the reader skipped them)."""
        while self._cursor < end:
            self._skip_others(end)
            if self._cursor < end:
                self._feed(os.pread(self._raw.fileno(), min(end - self._cursor, _PIECE), self._cursor) or b"\0")

    def _feed(self, data) -> None:
        while data:
            index = self._cursor // self._step
            end = self._chunk_end(index)
            room = min(len(data), end - self._cursor)
            mine = self._mine(index)
            if mine:
                self._hash.update(data[:room])
            self._cursor += room
            data = data[room:]
            if self._cursor == end:
                if mine:
                    want = self._record["chunks"][index] if "chunks" in self._record else self._record["digest"]
                    self.checked[index if "chunks" in self._record else None] = self._hash.hexdigest() == want
                self._hash = hasher(self._algorithm)

    def close(self) -> None:
        if not self.closed:
            size = self._record["size"]
            if self._cursor < size and size - self._cursor <= 2 * _GAP:
                self._fill(size)  # the zip's directory, read first and served unhashed
            self._raw.close()
        super().close()
