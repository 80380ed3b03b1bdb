"""Memory that native code freed but the C allocator still holds."""

from __future__ import annotations

import ctypes


def return_freed_memory() -> None:
    """Hand malloc's free pages back to the system (glibc malloc_trim; elsewhere nothing). glibc keeps what a
    freed allocation below its mmap threshold (up to 32 MiB) leaves in its heaps resident until trimmed: loading
    frees many such tensors and parser objects (measured: +240 MiB of RSS for fp32 SmolLM2 after the huge-page
    move, ~12 MiB for int4 after the GGUF's metadata is released)."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):  # glibc
        libc.malloc_trim(0)
