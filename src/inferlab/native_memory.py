"""Memory that native code freed but the C allocator still holds."""

from __future__ import annotations

import ctypes


def return_freed_memory() -> None:
    """Hand malloc's free pages back to the system (glibc malloc_trim; elsewhere nothing). glibc keeps what a
    freed allocation below its mmap threshold (up to 32 MiB) leaves in its heaps resident until trimmed: loading
    frees many such tensors and parser objects (the float weights left behind by the huge-page move, the GGUF's
    parsed metadata), which would otherwise stay in the process's resident memory."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):  # glibc
        libc.malloc_trim(0)
