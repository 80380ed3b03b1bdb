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
import sys

import torch
from torch import Tensor, nn

from inferlab.native_memory import return_freed_memory

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MIN_BYTES = 1 << 16  # norms and biases stay put: a few KiB each, read from cache

log = logging.getLogger(__name__)


def _advise_huge_pages(address: int, length: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, length, MADV_HUGEPAGE) == 0


def _advised_arena(nbytes: int) -> Tensor | None:
    """`nbytes` of fresh memory (uint8) from a 2 MiB boundary on, advised as huge pages before anything touches it;
    None where the advice is refused."""
    pages = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(pages + HUGE_PAGE, dtype=torch.uint8)  # untouched yet: its pages fault in after the advice
    start = -raw.data_ptr() % HUGE_PAGE
    if not _advise_huge_pages(raw.data_ptr() + start, pages):
        return None
    return raw[start : start + nbytes]


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """torch.zeros(shape, dtype, device), on huge pages where it is CPU memory of at least one huge page and the
    advice is granted (a KV pool)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    arena = _advised_arena(nbytes) if device.type == "cpu" and nbytes >= HUGE_PAGE else None
    if arena is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return arena.view(dtype).view(shape).zero_()


def _large_tensors(model: nn.Module, min_bytes: int) -> dict[int, Tensor]:
    """Parameters and buffers worth moving, by data pointer (tied weights once): contiguous CPU tensors
    that own their whole storage."""
    found: dict[int, Tensor] = {}
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if (
                tensor is not None
                and tensor.device.type == "cpu"
                and tensor.nbytes >= min_bytes
                and tensor.is_contiguous()
                and tensor.nbytes == tensor.untyped_storage().nbytes()
            ):
                found.setdefault(tensor.data_ptr(), tensor)
    return found


def move_weights_to_huge_pages(model: nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Copy the model's large weights into one arena advised as huge pages; return the bytes moved (0 when
    the advice is refused and nothing moved)."""
    tensors = _large_tensors(model, min_bytes)
    offsets, total = {}, 0
    for ptr, tensor in tensors.items():
        offsets[ptr] = total
        total += -(-tensor.nbytes // 64) * 64  # each tensor 64-byte aligned
    if total == 0:
        return 0
    arena = _advised_arena(total)
    if arena is None:
        log.info("huge pages refused (madvise errno %d); weights stay on normal pages", ctypes.get_errno())
        return 0
    moved: dict[int, Tensor] = {}
    for ptr, tensor in tensors.items():
        view = arena[offsets[ptr] : offsets[ptr] + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        moved[ptr] = nn.Parameter(view, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else view
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.data_ptr() in moved:
                    table[name] = moved[tensor.data_ptr()]
    tensors.clear()
    return_freed_memory()  # the old copies were a few MiB each, inside malloc's heap
    return total
