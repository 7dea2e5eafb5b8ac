"""File objects that hash the bytes of a checkpoint file as they pass: ``HashingFile`` (what torch.save
writes into, so a file's digest record costs no second pass) and ``HashingReader`` (what a checked
resume hands torch.load, hashing what it reads as it reads it). The records they make and check:
records.py."""

from __future__ import annotations

import io
import os
from pathlib import Path

from smp_adapter.runtime.checkpoint.integrity.records import (PIECE, chunk_bytes, default_algorithm, digest_file,
                                                              digest_record, hasher, hashes_unit)

_BESIDE_BYTES = 1 << 20  # a write at least this large is hashed beside the write when a helper thread is given


class HashingFile(io.RawIOBase):
    """The file object ``torch.save`` writes into: every write is hashed on its way to the file,
    chunk by chunk, so a file's record costs no second pass over its bytes. torch's zip writer only
    appends; a seek (not expected) makes ``record`` None and the file is hashed after it is written.
    ``helper`` (an executor of one thread, on a spare core: runtime/checkpoint/integrity/spare_cores.py): a large
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
                piece = view[start:start + PIECE]
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
        return digest_record(self._algorithm, self._size, self._chunk, self._chunks + tail)


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
        self._algorithm, self.digest_record, self._shared_by = algorithm, record, shared_by
        self._step = record.get("chunk_bytes") or max(record["size"], 1)
        self._hash, self._cursor, self.checked = hasher(algorithm), 0, {}

    def __str__(self) -> str:  # DeepSpeed's checkpoint engine logs what it loads from: the path, as before
        return str(self._raw.name)

    def _mine(self, index: int) -> bool:
        return hashes_unit(index, self._shared_by)

    def _chunk_end(self, index: int) -> int:
        return min((index + 1) * self._step, self.digest_record["size"])

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
            got = self._raw.readinto(view[total:total + PIECE])
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
                self._feed(os.pread(self._raw.fileno(), min(end - self._cursor, PIECE), self._cursor) or b"\0")

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
                    want = self.digest_record["chunks"][index] if "chunks" in self.digest_record else self.digest_record["digest"]
                    self.checked[index if "chunks" in self.digest_record else None] = self._hash.hexdigest() == want
                self._hash = hasher(self._algorithm)

    def close(self) -> None:
        if not self.closed:
            size = self.digest_record["size"]
            if self._cursor < size and size - self._cursor <= 2 * _GAP:
                self._fill(size)  # the zip's directory, read first and served unhashed
            self._raw.close()
        super().close()
