"""Memory that native code freed but the C allocator still holds."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter: allocations of at least this many bytes get a mapping of their own
LOADING_MMAP_THRESHOLD = 1 << 20
SERVING_MMAP_THRESHOLD = 32 << 20  # the most glibc's own sliding threshold rises to (64-bit)


@cache
def libc() -> ctypes.CDLL:
    """The process's C library, errno kept for ctypes.get_errno, madvise's arguments typed (pointers are 64-bit)."""
    library = ctypes.CDLL(None, use_errno=True)
    library.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return library


def return_freed_memory() -> None:
    """Hand malloc's free pages back to the system (glibc malloc_trim; elsewhere nothing). glibc keeps what a
    freed allocation below its mmap threshold (up to 32 MiB) leaves in its heaps resident until trimmed: loading
    frees many such tensors and parser objects (the float weights left behind by the huge-page move, the GGUF's
    parsed metadata), which would otherwise stay in the process's resident memory."""
    if hasattr(libc(), "malloc_trim"):  # glibc
        libc().malloc_trim(0)


@contextmanager
def large_frees_returned() -> Iterator[None]:
    """While in the block: every allocation of 1 MiB or more is a mapping of its own (glibc), which free() unmaps at
    once. Loading reads and rearranges one layer after another, each through temporaries of tens of MiB; glibc's
    sliding threshold rises to the largest freed one and keeps later ones of that size in its heaps, whose freed
    pages stay resident until trimmed, so the temporaries of several layers would add up in the load's peak. After
    the block, a fixed threshold at that sliding one's ceiling (elsewhere than glibc: nothing)."""
    glibc = hasattr(libc(), "mallopt")
    if glibc:
        libc().mallopt(M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if glibc:
            libc().mallopt(M_MMAP_THRESHOLD, SERVING_MMAP_THRESHOLD)
