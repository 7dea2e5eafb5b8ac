"""Tensors whose bytes are still a file's: where in the file they lie, and reading some of their rows
with ``pread`` instead of through the mapping.

transformers' ``from_pretrained`` (safetensors, and ``.bin`` through ``torch.load(mmap=True)``) leaves
every parameter on a private mapping of the checkpoint file: nothing is read until a page is touched.
A sharding engine that copies its rows out of such a tensor touches half of the file's pages at sdp 2,
and the kernel counts mapped file pages in a rank's resident set (VmRSS, VmHWM) for as long as the
mapping lives: the wrap peaked at the rank's shards plus its rows' file pages (1.0 x the model at sdp 2,
where the shards are 0.5 x). Reading the rows with ``pread`` into the shard copies them from the page
cache into the shard's own memory and maps nothing.

That is only right while the tensor still holds the file's bytes: a private mapping gives a page its own
copy on the first write (copy-on-write), after which the file no longer says what the tensor holds. So a
tensor is read from its file only when /proc/self/pagemap shows none of its pages written since mapping
(a page that was never touched, or one still backed by the file); anything else, and any system without
/proc/self/maps and /proc/self/pagemap, goes the ordinary way (the caller copies from the tensor).
"""

from __future__ import annotations

import bisect
import ctypes
import os
from dataclasses import dataclass

import torch

# /proc/self/pagemap's entry bits (Documentation/admin-guide/mm/pagemap.rst): 63 present, 62 swapped,
# 61 a file page or shared anonymous memory

@dataclass(frozen=True)
class FileSpan:
    """Where a tensor's bytes lie: ``nbytes`` from ``offset`` in the file at ``path``; ``size`` and
    ``mtime_ns`` name the file's version (ranks compare spans to know they read the same bytes)."""

    path: str
    offset: int
    nbytes: int
    size: int
    mtime_ns: int


class _Mappings:
    """This process's file mappings (/proc/self/maps), read once, looked up by address."""

    def __init__(self, maps_text: str):
        self.starts: list[int] = []
        self.rows: list[tuple[int, int, int, str]] = []
        for line in maps_text.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue  # anonymous memory, the heap, the stack
            start, end = (int(x, 16) for x in parts[0].split("-"))
            self.starts.append(start)
            self.rows.append((start, end, int(parts[2], 16), parts[5].strip()))

    def span_of(self, address: int, nbytes: int) -> tuple[str, int] | None:
        """(file path, file offset) of ``[address, address + nbytes)`` when one mapping holds it all."""
        i = bisect.bisect_right(self.starts, address) - 1
        if i < 0:
            return None
        start, end, offset, path = self.rows[i]
        if address + nbytes > end or path.endswith(" (deleted)"):
            return None
        return path, offset + address - start


def _unchanged_since_mapped(pagemap, address: int, nbytes: int, page: int) -> bool:
    """Whether no page of ``[address, address + nbytes)`` got a private copy (was written)."""
    first, last = address // page, (address + nbytes - 1) // page
    pagemap.seek(first * 8)
    data = pagemap.read((last - first + 1) * 8)
    if len(data) != (last - first + 1) * 8:
        return False
    # one int64 per page, little-endian as the kernel writes them (8 bytes per page: a 1 GB tensor reads 2 MB)
    entries = torch.frombuffer(bytearray(data), dtype=torch.int64)
    present, swapped, file_page = entries < 0, (entries >> 62) & 1 == 1, (entries >> 61) & 1 == 1
    # an anonymous page (present but not the file's, or swapped out, which only anonymous pages are): written since mapping
    return not bool((swapped | (present & ~file_page)).any())


def file_spans(tensors: list[torch.Tensor]) -> list[FileSpan | None]:
    """For each tensor, where its bytes lie in a file when they are still that file's, else None
    (not on the CPU, not contiguous, not mapped from a file, written since mapped, or no /proc)."""
    out: list[FileSpan | None] = [None] * len(tensors)
    try:
        with open("/proc/self/maps") as f:
            mappings = _Mappings(f.read())
        pagemap = open("/proc/self/pagemap", "rb", buffering=0)
    except OSError:
        return out
    page = os.sysconf("SC_PAGE_SIZE")
    stats: dict[str, os.stat_result] = {}
    with pagemap:
        for i, t in enumerate(tensors):
            if type(t) not in (torch.Tensor, torch.nn.Parameter):
                continue  # a tensor subclass (DTensor, a delayed tensor): its data pointer is not its values
            if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0 or t.is_meta:
                continue
            nbytes = t.numel() * t.element_size()
            where = mappings.span_of(t.data_ptr(), nbytes)
            if where is None:
                continue
            try:
                if not _unchanged_since_mapped(pagemap, t.data_ptr(), nbytes, page):
                    continue
                st = stats.get(where[0]) or stats.setdefault(where[0], os.stat(where[0]))
            except OSError:
                continue
            out[i] = FileSpan(where[0], where[1], nbytes, st.st_size, st.st_mtime_ns)
    return out


def read_rows(span: FileSpan, shape: tuple, dtype: torch.dtype, start: int, out: torch.Tensor) -> None:
    """Rows ``[start, start + out.shape[0])`` (dimension 0) of the tensor of ``shape`` and ``dtype`` at
    ``span`` into ``out``, which may have another dtype or device (then through a host buffer)."""
    rows = out.shape[0] if out.dim() else 1
    row_bytes = span.nbytes // shape[0] if len(shape) else span.nbytes
    direct = out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
    target = out if direct else torch.empty((rows, *shape[1:]), dtype=dtype)
    _pread_into(span.path, span.offset + start * row_bytes, target, rows * row_bytes)
    if not direct:
        out.copy_(target.view(out.shape))


def _pread_into(path: str, offset: int, tensor: torch.Tensor, nbytes: int) -> None:
    if nbytes == 0:
        return
    buffer = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [buffer[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{path}: the file ended at byte {offset + done}, {nbytes - done} bytes short of a tensor "
                              "it holds (was it truncated while the job ran?)")
            done += n
    finally:
        os.close(fd)
