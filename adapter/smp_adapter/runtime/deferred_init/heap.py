"""Returning the host heap's free memory to the kernel (glibc)."""

from __future__ import annotations


def release_freed_heap() -> None:
    """Return the memory freed on the host heap to the kernel. glibc keeps freed blocks below its
    (self-raising) mmap threshold in the heap: creating a model of N tensors of 4 MB under recording
    left N x 4 MB of resident, free heap (measured: 60 MB after a 64 MB MLP; 0 after trimming).
    Nothing to do where the C library has no malloc_trim."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util

        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None  # glibc's malloc_trim, looked up once (False where there is none)
