"""Quantize float weights into GGUF's block formats, bytes as llama.cpp lays them out (model/gguf_blocks.py reads them).

gguf's own package quantizes the 32-weight formats but not the K-quants; these make K-quant blocks from any weights
(tests' data, a model requantized to a K-quant mix) with the plain rule: each sub-block's range sets its scale (and
min), the super-block's fp16 factors the largest of them over the 6-bit (8-bit for Q6_K) range, and the codes are the
ones those rounded factors give. llama.cpp searches each scale for the least error; the layout is the same.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from inferlab.errors import QuantizationError
from inferlab.model.gguf_blocks import ROW_LAYOUTS


def _fp16_bytes(values: Tensor) -> Tensor:
    """(n,) fp32 -> (n, 2) bytes of their fp16."""
    return values.half().reshape(-1, 1).view(torch.uint8)


def _factor(largest: Tensor, levels: int) -> Tensor:
    """The fp16 super-block factor that spreads `largest` over `levels` integer steps (never 0), as fp32."""
    return (largest / levels).half().float().clamp(min=2**-24)


def _min_scale_blocks(w: Tensor, top: int) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K: w (n, 8, 32) -> (header bytes (n, 16): d, dmin, 12 bytes of 6-bit scales and mins; codes (n, 8, 32)
    in [0, top])."""
    low = w.amin(dim=-1).clamp(max=0)  # the offset subtracts, so a min above 0 is taken as 0
    spans = (w.amax(dim=-1) - low) / top
    d, dmin = _factor(spans.amax(dim=-1), 63), _factor((-low).amax(dim=-1), 63)
    sc = torch.round(spans / d[:, None]).clamp(0, 63).to(torch.int32)
    m = torch.round(-low / dmin[:, None]).clamp(0, 63).to(torch.int32)
    step, offset = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    codes = torch.where(step > 0, torch.round((w + offset) / step.clamp(min=2**-40)), 0).clamp(0, top)
    return torch.cat((_fp16_bytes(d), _fp16_bytes(dmin), pack_k_scales(sc, m)), dim=1), codes.to(torch.uint8)


def pack_k_scales(sc: Tensor, m: Tensor) -> Tensor:
    """Q4_K / Q5_K: 6-bit scales and mins (..., 8) -> their 12 bytes (..., 12): sub-blocks 0-3 in the low 6 bits of
    bytes 0-3 (scales) and 4-7 (mins), 4-7 in the nibbles of bytes 8-11 with their top 2 bits in the top bits of bytes
    0-7. Every bit is used, so unpack_k_scales undoes it exactly."""
    sc, m = sc.to(torch.int32), m.to(torch.int32)
    return torch.cat(
        (
            (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
            (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ),
        dim=-1,
    ).to(torch.uint8)


def unpack_k_scales(packed: Tensor) -> tuple[Tensor, Tensor]:
    """pack_k_scales' 12 bytes (..., 12) -> the 6-bit scales and mins uint8 (..., 8)."""
    b = packed.to(torch.int32)
    low, high, top = b[..., :4], b[..., 4:8], b[..., 8:]
    sc = torch.cat((low & 63, (top & 0x0F) | ((low >> 6) << 4)), dim=-1)
    m = torch.cat((high & 63, (top >> 4) | ((high >> 6) << 4)), dim=-1)
    return sc.to(torch.uint8), m.to(torch.uint8)


def _nibble_pairs(codes: Tensor) -> Tensor:
    """(n, 8, 32) codes' low 4 bits -> (n, 128): sub-block 2c in the low nibbles of bytes 32c.., 2c + 1 in the high."""
    low = codes & 0x0F
    return (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(codes.shape[0], -1)


def _q4_k(w: Tensor) -> Tensor:
    header, codes = _min_scale_blocks(w.reshape(-1, 8, 32), 15)
    return torch.cat((header, _nibble_pairs(codes)), dim=1)


def _q5_k(w: Tensor) -> Tensor:
    header, codes = _min_scale_blocks(w.reshape(-1, 8, 32), 31)
    fifth = (codes >> 4).to(torch.int32) << torch.arange(8, dtype=torch.int32).reshape(1, 8, 1)
    return torch.cat((header, fifth.sum(dim=1).to(torch.uint8), _nibble_pairs(codes)), dim=1)


def _q6_k(w: Tensor) -> Tensor:
    w = w.reshape(-1, 16, 16)
    n = w.shape[0]
    spans = w.abs().amax(dim=-1) / 31
    d = _factor(spans.amax(dim=-1), 127)
    sc = torch.round(spans / d[:, None]).clamp(0, 127)
    step = (d[:, None] * sc)[..., None]
    q = (torch.where(step > 0, torch.round(w / step.clamp(min=2**-40)), 0).clamp(-32, 31) + 32).to(torch.uint8)
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat((q6_k_code_bytes(q.reshape(n, -1)), scales, _fp16_bytes(d)), dim=1)


def q6_k_code_bytes(q: Tensor) -> Tensor:
    """6-bit codes uint8 (n, 256) in column order -> Q6_K's ql and qh bytes (n, 192) (model/gguf_blocks.py's
    q6_k_codes undone)."""
    n = q.shape[0]
    q = q.reshape(n, 2, 4, 32)  # half h, quarter k, l: weight 128h + 32k + l
    low = q & 0x0F
    ql = torch.cat((low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)), dim=2)  # (n, 2, 64)
    high = (q >> 4).to(torch.int32) << torch.arange(0, 8, 2, dtype=torch.int32).reshape(1, 1, 4, 1)
    qh = high.sum(dim=2).to(torch.uint8)  # (n, 2, 32)
    return torch.cat((ql.reshape(n, -1), qh.reshape(n, -1)), dim=1)


K_QUANTIZERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize_blocks(weight: Tensor, kind: str) -> Tensor:
    """weight (N, K) -> uint8 blocks (N, K / weights per block, bytes per block) of format `kind`."""
    if kind not in ROW_LAYOUTS:
        raise QuantizationError(f"no block format {kind!r}; use one of {list(ROW_LAYOUTS)}")
    per_block, size = ROW_LAYOUTS[kind]
    n, k = weight.shape
    if k % per_block:
        raise QuantizationError(f"{kind} needs rows of a multiple of {per_block} weights, not {k}")
    w = weight.detach().float()
    if kind in K_QUANTIZERS:
        blocks = K_QUANTIZERS[kind](w.reshape(-1, per_block))
    else:
        from gguf import GGMLQuantizationType, quants

        blocks = torch.from_numpy(np.ascontiguousarray(quants.quantize(w.numpy(), GGMLQuantizationType[kind])))
    return blocks.reshape(n, k // per_block, size)
