"""GGUF's block formats that the kernels multiply as the file stores them (kernels/csrc/ggml_blocks.h), and their
dequantization in torch: the portable reference path of those layers, and the loader's fast way to read them.

Every one is w = scale * q + offset per sub-block, q a small integer: the K-quants (Q4_K, Q5_K, Q6_K) in super-blocks
of 256 weights whose sub-block scales (and mins) are 6- or 8-bit integers times the super-block's fp16 factors, and the
32-weight blocks (Q4_0, Q5_0, Q5_1, Q8_0) a K-quant file falls back to for rows that are not a multiple of 256. Each
function rounds as gguf's own dequantize does (the scale a product of two floats, exact in fp32; then w = scale * q,
plus or minus the offset), so the values are gguf's, in torch's vectorized ops rather than its numpy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# name -> (weights, bytes) per block; a block's size in bytes tells the kernels which format it is
BLOCK_LAYOUTS = {
    "Q4_0": (32, 18),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# every format dequantized here: the kernels' and Q4_1, which they take as int4 instead (quant/gguf_q4.py) and a token
# embedding keeps as the file's blocks (quant/gguf_embedding.py)
ROW_LAYOUTS = {**BLOCK_LAYOUTS, "Q4_1": (32, 20)}


def _half(b: Tensor, at: int) -> Tensor:
    """The fp16 at byte `at` of each block (n, bytes), as fp32 (n, 1)."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def nibbles(qs: Tensor) -> Tensor:
    """(n, 16) bytes of a 32-weight block -> codes (n, 32): low nibbles first, then high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def fifth_bits(qh: Tensor) -> Tensor:
    """(n, 4) bytes, a little-endian 32-bit word -> bit i of it at column i (n, 32), times 16 (byte i / 8's bit i % 8:
    in bytes, not int32, as the tiles made at load take it too: a quarter of the memory traffic)."""
    places = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return (((qh.unsqueeze(-1) >> places) & 1) << 4).reshape(qh.shape[0], 32)


def _k_scales(b: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K's and Q5_K's 6-bit sub-block scales and mins (n, 8), from bytes 4-15."""
    s = b[:, 4:16].to(torch.int32)
    low, high, top = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat((low & 63, (top & 0x0F) | ((low >> 6) << 4)), dim=1)
    mins = torch.cat((high & 63, (top >> 4) | ((high >> 6) << 4)), dim=1)
    return scales.float(), mins.float()


def _q4_0(b: Tensor) -> Tensor:
    return _half(b, 0) * (nibbles(b[:, 2:18]).float() - 8)


def _q4_1(b: Tensor) -> Tensor:
    return _half(b, 0) * nibbles(b[:, 4:20]).float() + _half(b, 2)


def _q5_0(b: Tensor) -> Tensor:
    return _half(b, 0) * ((nibbles(b[:, 6:22]) | fifth_bits(b[:, 2:6])).float() - 16)


def _q5_1(b: Tensor) -> Tensor:
    return _half(b, 0) * (nibbles(b[:, 8:24]) | fifth_bits(b[:, 4:8])).float() + _half(b, 2)


def _q8_0(b: Tensor) -> Tensor:
    return _half(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _k_quant(b: Tensor, codes: Tensor) -> Tensor:
    """Q4_K / Q5_K: codes (n, 8, 32) -> d * scale * q - dmin * min."""
    scales, mins = _k_scales(b)
    step = (_half(b, 0) * scales)[..., None]
    offset = (_half(b, 2) * mins)[..., None]
    return (step * codes.float() - offset).reshape(b.shape[0], -1)


def _low_high(qs: Tensor) -> Tensor:
    """(n, 128) bytes -> (n, 8, 32): sub-blocks 2c and 2c + 1 the low and high nibbles of bytes 32c.. 32c + 31."""
    q = qs.reshape(-1, 4, 1, 32)
    return torch.cat((q & 0x0F, q >> 4), dim=2).reshape(-1, 8, 32)


def _q4_k(b: Tensor) -> Tensor:
    return _k_quant(b, _low_high(b[:, 16:144]))


def _q5_k(b: Tensor) -> Tensor:
    qh = b[:, 16:48].reshape(-1, 1, 32)
    fifth = (
        qh >> torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    ) & 1  # (n, 8, 32): bit j for sub-block j
    return _k_quant(b, _low_high(b[:, 48:176]) | (fifth << 4))


def q6_k_codes(b: Tensor) -> tuple[Tensor, Tensor]:
    """Q6_K blocks (n, 210) -> each weight's low 4 bits and high 2 bits, uint8 (n, 256) each, in column order: weight
    128h + 32k + l (h < 2, k < 4, l < 32) has its low bits in nibble k / 2 of ql byte 64h + 32 (k % 2) + l and its high
    bits in pair k of qh byte 32h + l."""
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(n, 256)  # half, nibble, 64 bytes -> 32-weight runs
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    pairs = torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    return low, ((qh >> pairs) & 3).reshape(n, 256)


def _q6_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    low, high = q6_k_codes(b)
    q = ((low | (high << 4)).to(torch.int16) - 32).reshape(n, 16, 16).float()
    step = _half(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()  # (n, 16)
    return (step[..., None] * q).reshape(n, -1)


DEQUANTIZERS: dict[str, Callable[[Tensor], Tensor]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def dequantize_blocks(blocks: Tensor, kind: str) -> Tensor:
    """uint8 blocks (rows, bytes per row) or (rows, blocks, bytes per block) of format `kind` -> fp32 (rows, K)."""
    rows = blocks.shape[0]
    flat = blocks.reshape(-1, ROW_LAYOUTS[kind][1])
    return DEQUANTIZERS[kind](flat).reshape(rows, -1)
