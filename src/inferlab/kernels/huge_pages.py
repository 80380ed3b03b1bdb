"""A CPU model's weights in one 2 MiB-aligned arena on huge pages (Linux), the way the decode kernels read them; its KV
pools on huge pages too.

A decode step streams every weight once. On 4 KiB pages that costs a TLB entry per 4 KiB, and the
hardware prefetcher stops at every page boundary; on 2 MiB pages neither happens. Anonymous memory gets
huge pages here only when it is advised before it is first written (transparent huge pages in "madvise"
mode), so the weights are copied into a fresh arena advised that way, and every module points at its
views of it: the weights then stream faster, and decoding with them. Where the advice is refused (other systems,
THP off), the weights stay where they are.

The KV pools go there too (zeros_on_huge_pages): attention reads each sequence's blocks wherever they lie in a
pool of hundreds of MiB, a 2 KiB run of keys here and one there, so on 4 KiB pages nearly every run costs a TLB
miss, the more so the more sequences a step attends for.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import sys

import torch
from torch import Tensor, nn

from inferlab.native_memory import libc, return_freed_memory

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MIN_BYTES = 1 << 16  # norms and biases stay put: a few KiB each, read from cache
TRIM_BYTES = 32 << 20  # the move hands freed originals back to the system every this many bytes
RELEASE_BYTES = 32 << 20  # a weight is copied this many bytes at a time, the original's pages released after each
MADV_DONTNEED = 4

log = logging.getLogger(__name__)


def _advise_huge_pages(address: int, length: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    return libc().madvise(address, length, MADV_HUGEPAGE) == 0


def _advised_arena(nbytes: int) -> Tensor | None:
    """`nbytes` of fresh memory (uint8) from a 2 MiB boundary on, advised as huge pages before anything touches it;
    None where the advice is refused."""
    pages = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = _fresh_pages(pages + HUGE_PAGE)
    start = -raw.data_ptr() % HUGE_PAGE
    if not _advise_huge_pages(raw.data_ptr() + start, pages):
        return None
    return raw[start : start + nbytes]


def _fresh_pages(nbytes: int) -> Tensor:
    """An anonymous mapping as uint8: the kernel hands its pages over zero-filled, each when first touched, so a
    buffer of zeros costs memory only as far as it is written (a KV pool sized from the memory available holds
    the blocks its sequences have used, not the whole budget)."""
    # private: a shared anonymous mapping is shmem, which transparent huge pages' "madvise" mode leaves on 4 KiB pages
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """torch.zeros(shape, dtype, device), on huge pages where it is CPU memory of at least one huge page and the
    advice is granted (a KV pool); CPU memory comes from fresh pages either way, resident as it is written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    arena = _advised_arena(nbytes) if nbytes >= HUGE_PAGE else None
    if arena is None:
        arena = _fresh_pages(max(nbytes, 1))[:nbytes]
    return arena.view(dtype).view(shape)


def _large_tensors(model: nn.Module, min_bytes: int) -> dict[int, Tensor]:
    """Parameters and persistent buffers worth moving, by data pointer (tied weights once): contiguous CPU tensors
    that own their whole storage. Not the non-persistent buffers, the rotary tables: a step reads a few of their
    rows, and they are cut to the served context after this (Transformer.limit_context), which left their
    whole-context originals in the arena (64 MiB at Llama-3.1-8B's 131,072 positions). Not views either: a view keeps
    its base, so the memory it was moved from would stay (seen: 328 MiB, an embedding's blocks shaped by a view)."""
    found: dict[int, Tensor] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):  # a step looks up a few rows: no stream to speed up, a transient to spare
            continue
        buffers = [b for name, b in module._buffers.items() if name not in module._non_persistent_buffers_set]
        for tensor in [*module._parameters.values(), *buffers]:
            if (
                tensor is not None
                and tensor._base is None
                and tensor.device.type == "cpu"
                and tensor.nbytes >= min_bytes
                and tensor.is_contiguous()
                and tensor.nbytes == tensor.untyped_storage().nbytes()
            ):
                found.setdefault(tensor.data_ptr(), tensor)
    return found


def _copy_releasing(copy: Tensor, tensor: Tensor) -> None:
    """copy.copy_(tensor), RELEASE_BYTES at a time, each copied part's whole pages of `tensor` handed back to the system
    at once (MADV_DONTNEED) where no other tensor shares its storage: the largest weight (Llama-3.1-8B's int8 LM head,
    501 MiB) no longer exists twice at the move's peak. Those pages then read as zeros: the caller points `tensor` at
    the copy next. A storage with views elsewhere is copied whole and left as it is."""
    # two references to the storage: the tensor's, and the one untyped_storage() hands out for the question
    release = sys.platform.startswith("linux") and torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) == 2
    source, target = tensor.reshape(-1).view(torch.uint8), copy.reshape(-1).view(torch.uint8)
    for start in range(0, source.numel(), RELEASE_BYTES):
        part = slice(start, start + RELEASE_BYTES)
        target[part].copy_(source[part])
        if release:
            first = -(-(source.data_ptr() + start) // mmap.PAGESIZE) * mmap.PAGESIZE
            end = (source.data_ptr() + min(start + RELEASE_BYTES, source.numel())) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > first:
                libc().madvise(first, end - first, MADV_DONTNEED)


def move_weights_to_huge_pages(model: nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Copy the model's large weights into one arena advised as huge pages; return the bytes moved (0 when
    the advice is refused and nothing moved)."""
    tensors = _large_tensors(model, min_bytes)
    offsets, total = {}, 0
    for ptr, nbytes in [(ptr, t.nbytes) for ptr, t in tensors.items()]:
        offsets[ptr] = total
        total += -(-nbytes // 64) * 64  # each tensor 64-byte aligned
    if total == 0:
        return 0
    arena = _advised_arena(total)
    if arena is None:
        log.info("huge pages refused (madvise errno %d); weights stay on normal pages", ctypes.get_errno())
        return 0
    # one tensor at a time, each pointed at its copy in place (`.data`): whatever holds the tensor (modules, tied
    # weights, kernel wrappers) sees the copy, and the original storage is released at once, so the model never
    # exists twice (a whole second copy was the load's peak: twice the weights)
    freed = 0
    for ptr in list(tensors):
        tensor = tensors.pop(ptr)
        view = arena[offsets[ptr] : offsets[ptr] + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        _copy_releasing(view, tensor)
        tensor.data = view
        freed += tensor.nbytes
        if freed >= TRIM_BYTES:  # originals under malloc's mmap threshold stay resident in its heap until trimmed
            return_freed_memory()
            freed = 0
    return_freed_memory()
    return total
