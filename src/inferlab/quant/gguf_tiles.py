"""GGUF Q4_K blocks as the CPU kernels' int4 tiles, and back.

A Q4_K sub-block of 32 weights is w = (d * sc) * q - (dmin * m), q in [0, 15]: an int4 group of 32 (quant/int4.py),
whose scale d * sc fp16 would round (d is fp16, sc 6 bits). So the tiles keep the file's own factors: the codes as
int4 tiles' chunks (weight rows in vector lanes, read as one stream at any number of activation rows), then per
super-block of 256 columns a line of the rows' fp16 d and -dmin and the int8 lines of the 8 sub-blocks' sc and m,
multiplied in the kernel once per block (kernels/csrc/gemv.h: Int4Format's super_blocks). 148 bytes per 256 weights
of a row where the blocks take 144 (sc and m a byte each), and the same numbers: q4_k_blocks gives back the file's
blocks bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inferlab.quant.kquants import pack_k_scales, unpack_k_scales

SUPER = 256  # weights per Q4_K block (a super-block)
SUBS = 8  # its sub-blocks of 32
LINES = 1 + SUBS // 2  # int32 lines (of `rows` values) a super-block's factors take: d and -dmin, sc, m


def q4_k_tiles(blocks: Tensor, rows: int) -> Tensor:
    """Q4_K blocks uint8 (N, S, 144) -> tiles int32 (N / rows, 32 S + 5 S, rows): per block of `rows` weight rows,
    int4 tiles' codes (quant/int4.py's tile_rows: each 4-byte chunk of 8 codes as `rows` values), then per super-block
    the rows' fp16 d, then their fp16 -dmin (one line), then int8 (8, rows) sc, then m. `rows`:
    kernels.build.int4_tile_rows."""
    n, supers, _ = blocks.shape
    tiles = n // rows
    d, dmin = (blocks[..., i : i + 2].contiguous().view(torch.float16)[..., 0] for i in (0, 2))  # (N, S)
    sc, m = unpack_k_scales(blocks[..., 4:16])  # (N, S, 8)
    chunks = _nibble_rows(blocks[..., 16:]).view(torch.int32).view(tiles, rows, -1).transpose(1, 2)

    def lanes(t: Tensor) -> Tensor:  # (N, S, ...) -> (N / rows, S, ..., rows)
        return t.reshape(tiles, rows, supers, -1).permute(0, 2, 3, 1)

    factors = lanes(torch.stack((d, -dmin), dim=-1)).contiguous().view(torch.int32)  # (N / rows, S, 1, rows)
    subs = lanes(torch.cat((sc, m), dim=-1)).contiguous().view(tiles, supers, 2 * SUBS * rows).view(torch.int32)
    lines = torch.cat((factors.reshape(tiles, supers, rows), subs), dim=2).view(tiles, supers * LINES, rows)
    return torch.cat((chunks, lines), dim=1)


def q4_k_blocks(tiles: Tensor) -> Tensor:
    """q4_k_tiles' tiles -> the Q4_K blocks uint8 (N, S, 144) they were made from."""
    count, values, rows = tiles.shape
    supers = values // (SUPER // 8 + LINES)
    chunks, lines = tiles.split([supers * SUPER // 8, supers * LINES], dim=1)
    rows_of_codes = chunks.transpose(1, 2).reshape(count * rows, -1).contiguous().view(torch.uint8)
    nibbles = _q4_k_nibbles(rows_of_codes.view(-1, supers, SUPER // 2))

    def rows_first(t: Tensor) -> Tensor:  # (N / rows, S, k, rows) -> (N, S, k)
        return t.permute(0, 3, 1, 2).reshape(count * rows, supers, -1)

    lines = lines.reshape(count, supers, LINES, rows)
    factors = rows_first(lines[:, :, :1].contiguous().view(torch.float16).view(count, supers, 2, rows))
    subs = rows_first(lines[:, :, 1:].contiguous().view(torch.uint8).view(count, supers, 2 * SUBS, rows))
    d, dmin = factors[..., 0], -factors[..., 1]
    header = torch.stack((d, dmin), dim=-1).contiguous().view(torch.uint8)  # (N, S, 4)
    return torch.cat((header, pack_k_scales(subs[..., :SUBS], subs[..., SUBS:]), nibbles), dim=-1)


# Nibbles from one layout to the other byte-wise, two codes a byte (unpacked to a byte a code and packed again, a
# 16384 x 2048 layer took 1.9x as long). Q4_K: quarter c's byte l holds column l of sub-block 2c (low nibble) and of 2c + 1 (high); nibble rows
# (quant/int4.py's pack_nibbles): each sub-block's columns 2i and 2i + 1 in the low and high nibble of a byte.


def _nibble_rows(quarters: Tensor) -> Tensor:
    """Q4_K's code bytes (N, S, 128) -> nibble rows (N, S * 128)."""
    pairs = quarters.reshape(*quarters.shape[:2], SUBS // 2, 16, 2)
    even, odd = pairs[..., 0], pairs[..., 1]  # columns 2i and 2i + 1 of the quarter's two sub-blocks
    low = (even & 0x0F) | (odd << 4)
    high = (even >> 4) | (odd & 0xF0)
    return torch.stack((low, high), dim=3).reshape(quarters.shape[0], -1)


def _q4_k_nibbles(rows: Tensor) -> Tensor:
    """_nibble_rows undone: (N, S, 128) nibble rows -> Q4_K's code bytes (N, S, 128)."""
    subs = rows.reshape(*rows.shape[:2], SUBS // 2, 2, 16)
    low, high = subs[..., 0, :], subs[..., 1, :]  # sub-blocks 2c and 2c + 1, two columns a byte
    even = (low & 0x0F) | (high << 4)
    odd = (low >> 4) | (high & 0xF0)
    return torch.stack((even, odd), dim=-1).reshape(rows.shape)
