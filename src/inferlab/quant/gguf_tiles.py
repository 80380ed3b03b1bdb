"""GGUF Q4_K blocks as the CPU kernels' int4 tiles, and back.

A Q4_K sub-block of 32 weights is w = (d * sc) * q - (dmin * m), q in [0, 15]: an int4 group of 32 (quant/int4.py),
whose scale d * sc fp16 would round (d is fp16, sc 6 bits). So the tiles keep the file's own factors: the codes as
int4 tiles' chunks (weight rows in vector lanes, read as one stream at any number of activation rows), then per
super-block of 256 columns a line of the rows' fp16 d and -dmin and the int8 lines of the 8 sub-blocks' sc and m,
multiplied in the kernel once per block (kernels/csrc/gemv.h: Int4Format's kQ4K). 148 bytes per 256 weights
of a row where the blocks take 144 (sc and m a byte each), and the same numbers: q4_k_blocks gives back the file's
blocks bit for bit.

A Q6_K sub-block of 16 weights is w = (d * sc) * (q - 32), q in [0, 63], sc int8: the same sums at group 16, the offset
a min -32 * d * sc. Its tiles hold, per super-block, the codes' low 4 bits as int4 chunks and their high 2 bits as
one more line per sub-block, after its two chunks, then a line of the rows' d as fp32 (exact) and 4 lines of the 16
sub-blocks' int8 sc (kernels/csrc/gemv.h: Int4Format's kQ6K), so a tile is read as one stream: 212 bytes per 256
weights of a row where the blocks take 210. q6_k_blocks gives back the file's blocks bit for bit.

The 32-weight blocks a K-quant file keeps where a row is not a multiple of 256, Q5_0 (w = d * (q - 16), q 5 bits) and
Q8_0 (w = d * q, q int8), are tiles in super-blocks of 2 blocks: per block its code lines, then one line of both
blocks' fp16 d (kernels/csrc/gemv.h: Int4Format's kQ5_0, kQ8_0), as many bytes as the blocks. Q5_0's code lines are its
4 int4 chunks of low nibbles and a line of its fifth bits (FIFTH_BITS), Q8_0's per chunk of 8 columns two lines of
its int8 codes (_q8_0_order). q5_0_blocks and q8_0_blocks give back the file's blocks bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from inferlab.model.gguf_blocks import fifth_bits, nibbles, q6_k_codes
from inferlab.quant.kquants import pack_k_scales, q6_k_code_bytes, unpack_k_scales

SUPER = 256  # weights per K-quant block (a super-block)
SUBS = 8  # Q4_K: its sub-blocks of 32
LINES = 1 + SUBS // 2  # int32 lines (of `rows` values) a super-block's factors take: d and -dmin, sc, m
Q6_SUBS = 16  # Q6_K: its sub-blocks of 16
Q6_LINES = 1 + Q6_SUBS // 4  # d (fp32), sc (int8)
Q6_CODE_LINES = Q6_SUBS * 3  # per sub-block: its 2 chunks of low nibbles, then its high bit pairs
# Bit of column i (of 8) of a chunk's high pair in its sub-block's line, before 8 * (the chunk's place in the sub-block):
# the kernel's six_bit_pairs brings those of columns s and s + 4 above their nibbles with one shift for s = 0, 1 and
# one for s = 2, 3
HIGH_BITS = (0, 4, 2, 6, 16, 20, 18, 22)
PAIR = 2  # Q5_0, Q8_0: blocks a super-block of their tiles (one line holds both blocks' fp16 d)
# Q5_0: the fifth bit of column i of chunk j at bit j + 4 i of its line (8 j + i at j + 4 i: a 4 x 8 transpose of the
# block's word), where the kernel's fifth_bit_pairs puts those of columns s and s + 4 above their nibbles with one
# shift for s = 0, 1 and one for s = 2, 3


# Rows made into tiles at a time (in_row_chunks): a whole layer at once takes temporaries of several times its codes
# as bytes (SmolLM2-1.7B's Q6_K gate|up: ~100 MiB beyond its 28 MiB of tiles), which set the load's peak
CHUNK_ROWS = 1024


def in_row_chunks(make: Callable[[Tensor, int], Tensor], blocks: Tensor, rows: int) -> Tensor:
    """make(blocks, rows) (one of the *_tiles below) CHUNK_ROWS rows at a time, into one tensor: the same tiles
    (a block of `rows` rows is made from those rows alone), with temporaries of one chunk's size."""
    if blocks.shape[0] <= CHUNK_ROWS:
        return make(blocks, rows)
    first = make(blocks[:CHUNK_ROWS], rows)
    tiles = first.new_empty((blocks.shape[0] // rows, *first.shape[1:]))
    tiles[: len(first)] = first
    for n in range(CHUNK_ROWS, blocks.shape[0], CHUNK_ROWS):
        tiles[n // rows : (n + CHUNK_ROWS) // rows] = make(blocks[n : n + CHUNK_ROWS], rows)
    return tiles


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


def q6_k_tiles(blocks: Tensor, rows: int) -> Tensor:
    """Q6_K blocks uint8 (N, S, 210) -> tiles int32 (N / rows, S, 48 + 5, rows): per block of `rows` weight rows and
    super-block, per sub-block of 16 columns its 2 int4 chunks (as q4_k_tiles') and a line of their high bit pairs
    (HIGH_BITS), then the rows' d as fp32, then their int8 (16, rows) sc. `rows`: kernels.build.int4_tile_rows."""
    n, supers, _ = blocks.shape
    tiles = n // rows
    low, high = (bits.view(n, supers, SUPER) for bits in q6_k_codes(blocks.reshape(-1, blocks.shape[-1])))
    nibbles = (low[..., 0::2] | (low[..., 1::2] << 4)).contiguous().view(torch.int32).view(n, supers * Q6_SUBS, 2)
    # the line's byte 2 half + chunk holds the pairs of columns 4 half.. 4 half + 3 of the chunk, at bits HIGH_BITS[:4]
    pairs = high.view(n, supers * Q6_SUBS, 2, 2, 4).transpose(2, 3)  # (half, chunk, column), a byte a pair
    line_bytes = pairs[..., 0] | (pairs[..., 1] << 4) | (pairs[..., 2] << 2) | (pairs[..., 3] << 6)
    high_line = line_bytes.reshape(n, supers * Q6_SUBS, 4).view(torch.int32)  # (N, 16 S, 1)
    codes = torch.cat((nibbles, high_line), dim=2).view(tiles, rows, supers, Q6_CODE_LINES).permute(0, 2, 3, 1)

    def lanes(t: Tensor) -> Tensor:  # (N, S, ...) -> (N / rows, S, ..., rows)
        return t.reshape(tiles, rows, supers, -1).permute(0, 2, 3, 1)

    d = blocks[..., 208:210].contiguous().view(torch.float16).float()  # (N, S, 1)
    d_line = lanes(d).contiguous().view(torch.int32)  # (N / rows, S, 1, rows)
    scales = lanes(blocks[..., 192:208]).contiguous().view(tiles, supers, Q6_SUBS * rows).view(torch.int32)
    lines = torch.cat((d_line.reshape(tiles, supers, rows), scales), dim=2).view(tiles, supers, Q6_LINES, rows)
    return torch.cat((codes, lines), dim=2)


def q6_k_blocks(tiles: Tensor) -> Tensor:
    """q6_k_tiles' tiles -> the Q6_K blocks uint8 (N, S, 210) they were made from."""
    count, supers, _, rows = tiles.shape
    codes, lines = tiles.split([Q6_CODE_LINES, Q6_LINES], dim=2)
    words = codes.permute(0, 3, 1, 2).reshape(count * rows, supers * Q6_SUBS, 3)
    nibbles = words[..., :2].contiguous().view(torch.uint8).view(-1, supers, SUPER // 2)
    low = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1).view(-1, supers, SUPER)
    high_line = words[..., 2:]  # (N, 16 S, 1)
    chunks = torch.stack((high_line, high_line >> 8), dim=2)  # (N, 16 S, 2, 1)
    high = ((chunks >> torch.tensor(HIGH_BITS, dtype=torch.int32)) & 3).to(torch.uint8).view(-1, supers, SUPER)

    def rows_first(t: Tensor) -> Tensor:  # (N / rows, S, k, rows) -> (N, S, k)
        return t.permute(0, 3, 1, 2).reshape(count * rows, supers, -1)

    d = rows_first(lines[:, :, :1].contiguous().view(torch.float32)).to(torch.float16)  # exact: it was fp16
    # its two bytes by arithmetic: a view as bytes would need a last stride of 1, which a (N, S, 1) tensor may lack
    halves = d.view(torch.int16)
    d_bytes = torch.stack((halves & 0xFF, (halves >> 8) & 0xFF), dim=-1).to(torch.uint8).reshape(-1, supers, 2)
    scales = rows_first(lines[:, :, 1:].contiguous().view(torch.uint8).view(count, supers, Q6_SUBS, rows))
    code_bytes = q6_k_code_bytes((low | (high << 4)).view(-1, SUPER)).view(count * rows, supers, -1)
    return torch.cat((code_bytes, scales, d_bytes), dim=-1)


def _lined(codes: Tensor, d: Tensor, rows: int) -> Tensor:
    """Q5_0 / Q8_0: each block's code lines int32 (N, B, k) and its fp16 d (N, B) -> tiles int32
    (N / rows, B / 2, 2 k + 1, rows): per super-block its 2 blocks' code lines, then their d (rows of block 0's, then
    of block 1's) as one line."""
    n, count, k = codes.shape
    tiles, supers = n // rows, count // PAIR
    code_lines = codes.reshape(tiles, rows, supers, PAIR * k).permute(0, 2, 3, 1)
    d_line = d.reshape(tiles, rows, supers, PAIR).permute(0, 2, 3, 1).reshape(tiles, supers, 1, PAIR * rows)
    return torch.cat((code_lines, d_line.contiguous().view(torch.int32)), dim=2)


def _unlined(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """_lined undone: tiles -> (code lines int32 (N, B, k), fp16 d bytes uint8 (N, B, 2))."""
    count, supers, lines, rows = tiles.shape
    codes = tiles[:, :, :-1].permute(0, 3, 1, 2).reshape(count * rows, supers * PAIR, (lines - 1) // PAIR)
    d = tiles[:, :, -1:].contiguous().view(torch.float16).reshape(count, supers, PAIR, rows).permute(0, 3, 1, 2)
    return codes, d.contiguous().view(torch.uint8).view(count * rows, supers * PAIR, 2)


def _d(blocks: Tensor) -> Tensor:
    """The fp16 d of 32-weight blocks uint8 (N, B, bytes) (their first 2 bytes) -> (N, B)."""
    return blocks[..., :2].contiguous().view(torch.float16)[..., 0]


def _packed_bits(bits: Tensor) -> Tensor:
    """Bits uint8 (..., 8 n), 0 or 1 -> n bytes (..., n), bit i of byte b from bits[8 b + i]."""
    places = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.unflatten(-1, (-1, 8)) << places).sum(dim=-1, dtype=torch.uint8)


def _transposed_bits(word: Tensor, shape: tuple[int, int]) -> Tensor:
    """32-bit words as bytes uint8 (n, 4) -> the words whose bit b is bit b' of these, where b' at index b of
    the bits (shape) transposed: (4, 8) makes Q5_0's word a line of FIFTH_BITS, (8, 4) undoes it."""
    bits = (fifth_bits(word) >> 4).view(-1, *shape).transpose(1, 2).reshape(-1, 32)
    return _packed_bits(bits)


def q5_0_tiles(blocks: Tensor, rows: int) -> Tensor:
    """Q5_0 blocks uint8 (N, B, 22) -> tiles int32 (N / rows, B / 2, 11, rows): per block its 4 int4 chunks (as
    q4_k_tiles') and its line of fifth bits, then per 2 blocks their fp16 d. `rows`: kernels.build.int4_tile_rows."""
    n, count, _ = blocks.shape
    flat = blocks.reshape(n * count, -1)
    low = nibbles(flat[:, 6:22])  # (N B, 32), column order
    chunks = (low[:, 0::2] | (low[:, 1::2] << 4)).view(torch.int32)  # (N B, 4)
    fifth = _transposed_bits(flat[:, 2:6], (4, 8)).view(torch.int32)  # (N B, 1)
    return _lined(torch.cat((chunks, fifth), dim=1).view(n, count, -1), _d(blocks), rows)


def q5_0_blocks(tiles: Tensor) -> Tensor:
    """q5_0_tiles' tiles -> the Q5_0 blocks uint8 (N, B, 22) they were made from."""
    codes, d = _unlined(tiles)
    n, count, _ = codes.shape
    lines = codes.reshape(n * count, -1)
    chunk_bytes = lines[:, :4].contiguous().view(torch.uint8)  # (N B, 16): columns 2t, 2t + 1 in byte t
    low = torch.stack((chunk_bytes & 0x0F, chunk_bytes >> 4), dim=-1).reshape(-1, 32)
    qs = low[:, :16] | (low[:, 16:] << 4)
    qh = _transposed_bits(lines[:, 4:].contiguous().view(torch.uint8), (8, 4))
    return torch.cat((d, qh.view(n, count, 4), qs.view(n, count, 16)), dim=-1)


def q8_0_tiles(blocks: Tensor, rows: int) -> Tensor:
    """Q8_0 blocks uint8 (N, B, 34) -> tiles int32 (N / rows, B / 2, 17, rows): per block its 8 lines of int8 codes
    (_q8_0_order), then per 2 blocks their fp16 d. `rows`: kernels.build.int4_tile_rows."""
    n, count, _ = blocks.shape
    return _lined(_q8_0_order(blocks[..., 2:]).view(torch.int32), _d(blocks), rows)  # codes (N, B, 8)


def q8_0_blocks(tiles: Tensor) -> Tensor:
    """q8_0_tiles' tiles -> the Q8_0 blocks uint8 (N, B, 34) they were made from."""
    codes, d = _unlined(tiles)
    return torch.cat((d, _q8_0_order(codes.contiguous().view(torch.uint8))), dim=-1)


def _q8_0_order(codes: Tensor) -> Tensor:
    """Q8_0's codes uint8 (..., 32) in column order <-> in the tiles' order: a chunk's two lines, each lane's 4 bytes
    its columns (s, s + 1, s + 4, s + 5) for s = 0, 2, whose int16 are the pairs (s, s + 4) and (s + 1, s + 5) the
    kernel's int8_pairs sign-extends. Per chunk, column 4 h + 2 p + c at 4 p + 2 h + c (h, p, c < 2): a swap of h and
    p that undoes itself (a strided copy: a gather by index took 10x as long)."""
    return codes.unflatten(-1, (4, 2, 2, 2)).transpose(-3, -2).reshape(codes.shape)
