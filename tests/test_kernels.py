"""The CPU decode kernels (kernels/csrc/), each build this CPU runs (the `isa` fixture), against the portable
reference they replace."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_engine
from torch import nn

from inferlab.kernels.attention import decode_attention, decode_attention_applies
from inferlab.kernels.build import cpu_gemv_available, int4_tile_rows, load_isa, use_isa
from inferlab.kernels.gemv import GemvLinear, gemv, pack_bf16, packs_bf16, unpack_bf16
from inferlab.kernels.isa import supported_isas
from inferlab.kernels.select import select_kernels
from inferlab.model.transformer import RMSNorm, linear_after_glu, linear_after_norm
from inferlab.quant.int4 import (
    Int4GroupLinear,
    dequantize_groups_int4,
    pack_nibbles,
    quantize_groups_int4,
    tile_parts,
    tile_rows,
    untile_rows,
)
from inferlab.quant.int8 import Int8Linear

needs_gemv = pytest.mark.skipif(not cpu_gemv_available(), reason="no AVX2 CPU or no C++ toolchain here")

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def prepare(x, norm, gated=False):
    """The kernel's input rows, in fp64: rmsnorm(x), or silu(gate) * up."""
    x = x.double()
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if norm is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    return x


def random_weights(weight_kind, n, k, group_size, dtype):
    """(weight, scales, mins) as the kernel takes them, and the dense weights they stand for."""
    mins = None
    if weight_kind == "int8":
        weight, scales = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) / 100
        dense = weight.double() * scales.double()[:, None]
    elif weight_kind == "int4":
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        # fp16 values, as the quantizer makes them (the kernels' tiles hold them in fp16)
        scales, mins = (
            (torch.rand(n, k // group_size) / 50).half().float(),
            (-torch.rand(n, k // group_size) / 7).half().float(),
        )
        weight, dense = pack_nibbles(codes), dequantize_groups_int4(codes, scales, mins)
    else:
        weight, scales = torch.randn(n, k).to(dtype) / k**0.5, None
        dense = weight
    return weight, scales, mins, dense


def int16_code_error(x, weight):
    """Bound on what int16 activation codes (x / max|x| * 16383, rounded) change in x @ weight.T."""
    return (x.abs().amax(-1, keepdim=True) / 2 / 16383 * weight.abs().sum(1)).max().item()


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_kind", ["dense", "int8", "int4"])
@pytest.mark.parametrize("rows", [*range(1, 9), 13, 70])
@pytest.mark.parametrize("extras", ["none", "bias", "norm", "bias+norm", "gated"])
def test_gemv_equals_reference(isa, dtype, weight_kind, rows, extras):
    torch.manual_seed(rows)
    # 203 rows: the 4-row tiles leave a tail; K = 80 ends in half a 32-weight step, K = 96 in half a 64-column
    # int4 step (AVX-512's widths); int4 groups of 32 to 128; 13 and 70 rows: chunks of activation rows
    n, k, group_size = 203, 96 if rows % 2 else 80, 32
    if weight_kind == "int4" and rows % 2 == 0:
        k, group_size = {2: (128, 32), 4: (128, 64), 6: (128, 32), 8: (256, 128)}.get(rows, (256, 64))
    gated = extras == "gated"
    x = torch.randn(1, rows, 2 * k if gated else k).to(dtype)
    weight, scales, mins, dense = random_weights(weight_kind, n, k, group_size, dtype)
    bias = torch.randn(n).to(dtype) if "bias" in extras else None
    norm = None
    if "norm" in extras:
        norm = RMSNorm(k, 1e-5)
        norm.weight.data = (torch.rand(k) + 0.5).to(dtype)
    y = gemv(x, weight, scales, bias, norm, gated, mins)
    assert y.shape == (1, rows, n) and y.dtype == dtype
    prepared = prepare(x, norm, gated)
    expected = F.linear(prepared, dense.double(), None if bias is None else bias.double())
    tolerance = TOLERANCE[dtype] * max(expected.abs().max().item(), 1.0)
    if weight_kind != "dense":  # integer formats take int16 activation codes
        tolerance += int16_code_error(prepared, dense.double())
    assert (y.double() - expected).abs().max().item() <= tolerance


def int4_int16_code_product(x, codes, scales, mins, bias, group_size):
    """What the int4 kernel computes, exactly: x's int16 codes per row (x / (max|x| / 16383), fp32, rounded to
    nearest even), their integer dots with the nibble codes per group (int64, exact), then in fp64
    (sum over groups of dot * scale + min * the group's sum of codes) * the row's scale + bias. Returns that
    and the sum of the terms' magnitudes (what the kernel's fp32 summation rounds relative to)."""
    x_scale = x.abs().amax(-1, keepdim=True) / 16383
    x_codes = torch.round(x / x_scale).long().unflatten(-1, (-1, group_size))  # (M, G, group)
    dots = torch.einsum("mgk,ngk->mng", x_codes, codes.long().unflatten(-1, (-1, group_size))).double()
    dot_terms = dots * scales.double()
    min_terms = x_codes.sum(-1).double()[:, None, :] * mins.double()
    x_scale = x_scale.double()
    exact = (dot_terms + min_terms).sum(-1) * x_scale + (0 if bias is None else bias.double())
    return exact, (dot_terms.abs() + min_terms.abs()).sum(-1) * x_scale


@needs_gemv
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 16, 33, 64, 128])
@pytest.mark.parametrize(("n", "k", "group_size"), [(203, 1056, 32), (37, 96, 32), (45, 1536, 64)])
def test_int4_gemv_is_the_int16_code_product_to_float_rounding(isa, rows, n, k, group_size):
    """The int4 kernel multiplies the same int16 activation codes as the int8 one, exactly in integers: every
    path (streamed rows at 1-2 activation rows, tiles beyond) equals that integer product within the rounding
    of its fp32 sum (one update per 32-column block and one per group, then the scale and the bias: at most that
    many ulp of the terms' magnitudes; measured: about 1), on odd N and odd numbers of 32-column blocks."""
    torch.manual_seed(rows + k)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales, mins = torch.rand(n, k // group_size) / 50, -torch.rand(n, k // group_size) / 7
    x, bias = torch.randn(rows, k) * torch.rand(rows, 1) * 4, torch.randn(n)
    y = gemv(x, pack_nibbles(codes), scales, bias, None, False, mins)
    exact, magnitude = int4_int16_code_product(x, codes, scales, mins, bias, group_size)
    bound = (k // 32 + k // group_size + 2) * 2.0**-23 * (magnitude + bias.abs().double())
    assert ((y.double() - exact).abs() <= bound).all()


@needs_gemv
@pytest.mark.parametrize(("n", "k"), [(208, 1024), (96, 64), (48, 8192), (203, 1040), (32, 14336)])
def test_int8_gemv_is_the_int16_code_product_rounded_once(isa, n, k):
    """The int8 kernel's result is, to the bit: x's int16 codes per row (x / (max|x| / 16383) in fp32, rounded to
    nearest even; beyond 8192 columns the largest code is floor(16383 * 8192 / K), so that a lane's int32 sum cannot
    overflow: 8191 at Llama-3.1-8B's 14336) dotted with the codes exactly, that integer rounded to fp32 once, times
    the row's scale, times the weight row's scale, plus the bias. So every path gives the same floats: one
    activation row on the vector kernel, and on the amx build 6 or more on AMX tiles (csrc/amx.h: Int8Tiles; N a
    multiple of 16 and K of 64, here 208 x 1024, 96 x 64, 48 x 8192 and 32 x 14336; 203 x 1040 stays on the vector
    kernel), alone or among 1 to 40 and 70 rows (tiles of 16 activation rows, whole and partial)."""
    torch.manual_seed(k)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales, bias = torch.rand(n) / 100, torch.randn(n)
    x = torch.randn(70, k) * torch.rand(70, 1) * 4
    x_scale = x.abs().amax(-1, keepdim=True) / (16383 if k <= 8192 else math.floor(16383 * 8192 / k))
    dots = torch.round(x / x_scale).long() @ weight.long().T  # exact
    expected = dots.float() * x_scale * scales + bias
    alone = torch.cat([gemv(x[m : m + 1], weight, scales, bias, None, False) for m in range(70)])
    assert torch.equal(alone, expected)
    for rows in [*range(1, 41), 70]:
        assert torch.equal(gemv(x[:rows], weight, scales, bias, None, False), expected[:rows]), rows


def int4_int8_block_code_product(x, codes, scales, mins, bias, group_size):
    """What the int4 kernel computes with int8 activation codes, exactly: x's int8 codes per block of 32 columns
    (x * (127 / max|x| of the block), fp32, rounded to nearest even; a code is worth max|x| / 127), their integer
    dots with the nibble codes per block (int64, exact), then in fp64 the sum over blocks of dot * scale * what a
    code is worth, plus per group min * the group's sum of x, plus the bias. Returns that and the sum of the
    terms' magnitudes (the min terms' with the sum of |x|: the kernel sums x in fp32)."""
    blocks = x.unflatten(-1, (-1, 32))  # (M, B, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    x_codes = torch.round(blocks * torch.where(top > 0, 127 / top, 0.0)).long()
    dots = torch.einsum("mbk,nbk->mnb", x_codes, codes.long().unflatten(-1, (-1, 32))).double()
    block_scales = scales.double().repeat_interleave(group_size // 32, dim=1)  # (N, B)
    dot_terms = dots * block_scales * (top / 127).double().squeeze(-1)[:, None, :]
    group_x = x.double().unflatten(-1, (-1, group_size))  # (M, G, group)
    min_terms = group_x.sum(-1)[:, None, :] * mins.double()
    exact = dot_terms.sum(-1) + min_terms.sum(-1) + (0 if bias is None else bias.double())
    magnitude = dot_terms.abs().sum(-1) + (group_x.abs().sum(-1)[:, None, :] * mins.double().abs()).sum(-1)
    return exact, magnitude


@needs_gemv
@pytest.mark.parametrize("layout", ["rows", "tiles"])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
@pytest.mark.parametrize(("n", "k", "group_size"), [(203, 1056, 32), (37, 96, 32), (45, 1536, 64)])
def test_int4_gemv_with_int8_activations_is_the_int8_block_code_product(isa, layout, rows, n, k, group_size):
    """int8_activations (a draft's): the int4 kernel's integer dots are those of x's int8 codes per 32-column
    block, exactly; its fp32 sums equal that product within their rounding (a multiply and an update per block, one
    per group, the group's fp32 sum of x, the bias); a row's result does not depend on the other rows of the call."""
    torch.manual_seed(rows + k)
    if layout == "tiles":  # whole blocks of rows
        n = n // 16 * 16
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales, mins = (
        (torch.rand(n, k // group_size) / 50).half().float(),
        (-torch.rand(n, k // group_size) / 7).half().float(),
    )
    x, bias = torch.randn(rows, k) * torch.rand(rows, 1) * 4, torch.randn(n)
    x[0, :32] = 0  # a block of zeros: codes 0, whatever its scale
    weight = pack_nibbles(codes)
    if layout == "tiles":
        weight = tile_rows(weight, scales, mins, int4_tile_rows())
        _, scales_in, mins_in = tile_parts(weight, k // group_size)
    else:
        scales_in, mins_in = scales, mins
    y = gemv(x, weight, scales_in, bias, None, False, mins_in, int8_activations=True)
    exact, magnitude = int4_int8_block_code_product(x, codes, scales, mins, bias, group_size)
    bound = (2 * (k // 32) + k // group_size + group_size + 2) * 2.0**-23 * (magnitude + bias.abs().double())
    assert ((y.double() - exact).abs() <= bound).all()
    alone = gemv(x[-1:], weight, scales_in, bias, None, False, mins_in, int8_activations=True)
    assert torch.equal(alone[0], y[-1])


@needs_gemv
@pytest.mark.parametrize("layout", ["rows", "tiles"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int4_gemv_with_int8_activations_sums_the_largest_block_dots_exactly(isa, layout, sign):
    """On AVX2 a block's products of nibbles and int8 codes are summed in int16 lanes until the block's end: every
    code 15 against activation codes of +-127 (16 products a lane, +-30,480, the most there can be) comes out exact."""
    n, k = 2 * int4_tile_rows(), 256
    codes = torch.full((n, k), 15, dtype=torch.uint8)
    scales, mins = torch.ones(n, k // 32), torch.zeros(n, k // 32)
    weight = pack_nibbles(codes)
    scales_in, mins_in = scales, mins
    if layout == "tiles":
        weight = tile_rows(weight, scales, mins, int4_tile_rows())
        _, scales_in, mins_in = tile_parts(weight, k // 32)
    x = torch.full((3, k), sign)
    y = gemv(x, weight, scales_in, None, None, False, mins_in, int8_activations=True)
    exact, _ = int4_int8_block_code_product(x, codes, scales, mins, None, 32)
    assert torch.allclose(exact, torch.full_like(exact, sign * 15 * k)) and torch.allclose(y.double(), exact, rtol=1e-6)


@needs_gemv
@pytest.mark.parametrize(("k", "group_size"), [(1056, 32), (1536, 64)])
def test_int4_tiles_give_the_row_layouts_products_to_the_bit(isa, k, group_size):
    """Weights laid out as the kernel's tiles (a layer's own, read in place by the fused step) multiply exactly as
    the nibble rows they hold, at every number of rows (streamed rows at 1-2, tiles made per call beyond); the
    layout holds the same bytes, rearranged."""
    torch.manual_seed(k)
    n, tile_rows_ = 96, int4_tile_rows()
    weight, scales, mins, _ = random_weights("int4", n, k, group_size, torch.float32)
    tiles = tile_rows(weight, scales, mins, tile_rows_)
    assert tiles.nbytes == weight.nbytes + (scales.nbytes + mins.nbytes) // 2  # fp16 scales and mins
    assert all(torch.equal(a, b) for a, b in zip(untile_rows(tiles, k // group_size), (weight, scales, mins)))
    _, tile_scales, tile_mins = tile_parts(tiles, k // group_size)
    bias, norm = torch.randn(n), RMSNorm(k, 1e-5)
    for rows in (1, 2, 3, 8, 9, 33):
        x = torch.randn(rows, k)
        want = gemv(x, weight, scales, bias, norm, False, mins)
        assert torch.equal(gemv(x, tiles, tile_scales, bias, norm, False, tile_mins), want), rows


@needs_gemv
def test_an_int4_layer_made_on_one_build_runs_on_another(isa):
    """A layer's tiles follow the kernel build that runs (tests switch builds): laid out again for its rows per
    block, the same products as the reference path's weights."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 96)
    other = next((name for name in supported_isas() if name != isa and load_isa(name)), None)
    if other is None:
        pytest.skip("one kernel build on this CPU")
    use_isa(other)
    layer = Int4GroupLinear(linear, 32)  # tiled for the other build
    use_isa(isa)
    x = torch.randn(3, 256)
    want = gemv(x, *(t for t in layer.nibble_rows()[:2]), linear.bias.detach(), None, False, layer.nibble_rows()[2])
    assert torch.equal(layer(x), want) and layer.weight.shape[2] == int4_tile_rows()


@needs_gemv
@pytest.mark.parametrize(
    ("weight_kind", "dtype"),
    [("dense", torch.float32), ("dense", torch.bfloat16), ("int8", torch.float32), ("int4", torch.float32)],
)
def test_a_rows_product_does_not_depend_on_the_other_rows_of_the_call(isa, weight_kind, dtype):
    """Batch invariance: each row computed alone and inside calls of 1 to 70 rows is the same to the bit (a
    decode step and a speculative verification, or a mixed step and per-sequence forwards, agree exactly).
    K = 1040 ends in half a 32-weight step, 1056 in half a 64-column int4 step; rows span several L2 tiles."""
    torch.manual_seed(3)
    n, k = 203, 1056 if weight_kind == "int4" else 1040
    weight, scales, mins, _ = random_weights(weight_kind, n, k, 32, dtype)
    bias, norm = torch.randn(n), RMSNorm(k, 1e-5)
    x = torch.randn(70, k) * torch.rand(70, 1) * 4
    alone = torch.cat([gemv(x[m : m + 1], weight, scales, bias, norm, False, mins) for m in range(70)])
    for rows in range(1, 71):
        assert torch.equal(gemv(x[:rows], weight, scales, bias, norm, False, mins), alone[:rows]), rows


@needs_gemv
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(("n", "k"), [(208, 1056), (96, 32), (48, 8192), (64, 1040), (32, 16)])
def test_bf16_weights_are_the_bf16_activations_product_and_batch_invariant(isa, packed, n, k):
    """The avx512 build multiplies bf16 weights by AVX-512 BF16's dots, as rows (csrc/gemv.h: Bf16DotStep) or in
    blocks of 16 rows (Bf16Blocks: gemv.pack_bf16), and the amx build on AMX tiles (csrc/amx.h), all with the
    activations rounded to bf16: each row is that product summed in fp32 (within fp32 rounding of the exact sum: the
    blocks' one chain of K / 2 dots per output rounds up to K times), alone or among 1 to 40, 70 and 128 rows (the
    tiles' activation rows in tiles of 16: 1, 2, 3, 5 and 8 tiles, whole and partial; the blocks' in chunks of up to
    6), with bias and scales; N a multiple of 16 (odd and even counts of 16-row blocks), K of 32 or only of 16."""
    if isa == "avx2":
        pytest.skip("the avx2 build widens bf16 weights to multiply the fp32 activations")
    if packed and not packs_bf16(torch.zeros(n, k, dtype=torch.bfloat16)):
        pytest.skip(f"the {isa} build reads bf16 weights as rows")
    torch.manual_seed(n)
    rows_weight = (torch.randn(n, k) / k**0.5).bfloat16()
    weight = pack_bf16(rows_weight) if packed else rows_weight
    if packed:
        assert torch.equal(unpack_bf16(weight), rows_weight)
    bias = torch.randn(n)
    x = torch.randn(128, k) * torch.rand(128, 1) * 4
    alone = torch.cat([gemv(x[m : m + 1], weight, None, bias, None, False) for m in range(128)])
    exact = x.bfloat16().double() @ rows_weight.double().T
    magnitude = x.bfloat16().double().abs() @ rows_weight.double().abs().T
    rounding = k * 2**-24 if packed else 1e-6
    assert ((alone.double() - bias.double() - exact).abs() <= rounding * magnitude + 1e-6).all()
    for rows in [*range(1, 41), 70, 128]:
        assert torch.equal(gemv(x[:rows], weight, None, bias, None, False), alone[:rows]), rows
    # bf16 activations (the Python model's bf16 layers) are the same products, rounded to bf16 on the way out
    plain = gemv(x[:5], weight, None, None, None, False)
    assert torch.equal(gemv(x[:5].bfloat16(), weight, None, None, None, False), plain.bfloat16())


@pytest.mark.parametrize(("n", "k", "group_size"), [(208, 576, 32), (96, 1536, 64), (48, 64, 32)])
def test_int4_tiles_in_bf16_are_the_bf16_copy_product(isa, n, k, group_size):
    """From bf16_from_rows rows on, the amx build multiplies int4 tiles in bf16 (csrc/amx.h: Int4DequantTiles):
    the same floats, to the bit, as its bf16 tiles over the layer's dequantized copy (q * scale + min rounded to
    bf16, quant/int4.py), alone or among 1 to 40 and 70 rows (A tiles whole and partial, one and two of them a pass;
    odd and even counts of 16-row blocks), with a bias; fewer rows keep the int4 kernel's product."""
    if isa != "amx":
        pytest.skip("the tiles run on the amx build only")
    torch.manual_seed(n + k)
    codes, scales, mins = quantize_groups_int4(torch.randn(n, k), group_size)
    tiles = tile_rows(pack_nibbles(codes), scales, mins, int4_tile_rows())
    _, tile_scales, tile_mins = tile_parts(tiles, k // group_size)
    copy = dequantize_groups_int4(codes, scales, mins).bfloat16()
    x, bias = torch.randn(70, k) * torch.rand(70, 1) * 4, torch.randn(n)
    for rows in [*range(1, 41), 70]:
        want = gemv(x[:rows], copy, None, bias, None, False)
        got = gemv(x[:rows], tiles, tile_scales, bias, None, False, tile_mins, bf16_from_rows=1)
        assert torch.equal(got, want), rows
    int4 = gemv(x[:8], tiles, tile_scales, bias, None, False, tile_mins)
    assert not torch.equal(int4, gemv(x[:8], copy, None, bias, None, False))
    assert torch.equal(gemv(x[:8], tiles, tile_scales, bias, None, False, tile_mins, bf16_from_rows=9), int4)


@needs_gemv
def test_gemv_leaves_its_input_alone_and_refuses_what_it_does_not_cover(isa):
    x = torch.randn(1, 64)
    before = x.clone()
    gemv(x, torch.randn(10, 64), None, None, RMSNorm(64, 1e-6), False)
    gemv(x, torch.randn(10, 32), None, None, None, True)
    assert torch.equal(x, before)  # the norm and the gating are applied to a copy
    with pytest.raises(RuntimeError, match="multiple of 16"):
        gemv(torch.randn(1, 12), torch.randn(4, 12), None, None, None, False)
    with pytest.raises(RuntimeError, match="activation rows"):
        gemv(torch.randn(0, 64), torch.randn(4, 64), None, None, None, False)


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [640, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1), (16, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_decode_attention_writes_the_step_and_equals_sdpa(isa, dtype, block_size, heads, head_dim):
    """One query per sequence, each at its own length, over blocks of a shared pool found through its block
    table (one 640-token block per slot is the contiguous cache), GQA groups (up to 8 query heads a task, in tiles
    of 4, 2 or 1 per pass over their keys by head dim and build: groups of 8 and 16 take several); head dims of 4 and 8 widest vectors
    (unrolled) and of 5 narrow ones."""
    torch.manual_seed(block_size)
    (n_heads, n_kv_heads), lengths = heads, [1, 8, 77, 600]
    per_sequence = -(-640 // block_size)
    k_pool, v_pool = (
        torch.randn(1 + 4 * per_sequence, n_kv_heads, block_size, head_dim).to(dtype) * 3 for _ in range(2)
    )
    tables = torch.randperm(4 * per_sequence).add(1).view(4, per_sequence)  # block 0 belongs to nobody
    q = torch.randn(4, n_heads, 1, head_dim).to(dtype)
    k, v = (torch.randn(4, n_kv_heads, 1, head_dim).to(dtype) for _ in range(2))
    untouched = k_pool[0].clone()
    assert decode_attention_applies(torch.device("cpu"), dtype, head_dim, "fast")
    out = decode_attention(q, k, v, k_pool, v_pool, tables, torch.tensor(lengths) - 1)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.equal(k_pool[0], untouched)
    for b, length in enumerate(lengths):
        keys, values = (
            pool[tables[b]].transpose(0, 1).reshape(n_kv_heads, -1, head_dim)[:, :length] for pool in (k_pool, v_pool)
        )  # (H_kv, length, D), in position order
        assert torch.equal(keys[:, -1], k[b, :, 0]) and torch.equal(values[:, -1], v[b, :, 0])
        expected = F.scaled_dot_product_attention(
            q[b : b + 1].double(), keys[None].double(), values[None].double(), enable_gqa=True
        )
        assert (out[b : b + 1].double() - expected).abs().max() <= TOLERANCE[dtype] * 3


@needs_gemv
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_prompt_chunks_attend_causally_beside_single_rows(isa, heads, head_dim):
    """One step's rows as the fused step hands them over: a chunk of 37 rows after 20 cached positions, a decode of
    another sequence, a chunk of 16 rows from position 0 and a run of 15 (bf16 pools, fp32 queries). On the AVX-512
    builds runs of 16 rows or more of one sequence attend a tile of rows at a time in bf16 pair dots (AMX tiles or
    the vectors; csrc/chunk_attention.h: bf16 queries and weights, partial tiles of rows and keys, causal within the
    chunk); the others, and head dims not a multiple of 64, attend a row at a time in fp32. Every row equals attention over its own keys up to its position."""
    torch.manual_seed(head_dim)
    (n_heads, n_kv_heads), block_size, per_sequence = heads, 16, 8
    runs = [(0, range(20, 57)), (1, range(90, 91)), (2, range(0, 16)), (3, range(5, 20))]  # (sequence, positions)
    k_pool, v_pool = (
        torch.randn(1 + 4 * per_sequence, n_kv_heads, block_size, head_dim).bfloat16() * 3 for _ in range(2)
    )
    sequence_tables = torch.randperm(4 * per_sequence).add(1).view(4, per_sequence)
    rows = [(s, p) for s, positions in runs for p in positions]
    tables = torch.stack([sequence_tables[s] for s, _ in rows])
    positions = torch.tensor([p for _, p in rows])
    q = torch.randn(len(rows), n_heads, 1, head_dim)
    k, v = (torch.randn(len(rows), n_kv_heads, 1, head_dim) for _ in range(2))
    out = decode_attention(q, k, v, k_pool, v_pool, tables, positions)
    chunk_rows = head_dim % 64 == 0 and isa in ("avx512", "amx")
    for i, (s, p) in enumerate(rows):
        keys, values = (
            pool[sequence_tables[s]].transpose(0, 1).reshape(n_kv_heads, -1, head_dim)[:, : p + 1]
            for pool in (k_pool, v_pool)
        )
        assert torch.equal(keys[:, -1], k[i, :, 0].bfloat16()) and torch.equal(values[:, -1], v[i, :, 0].bfloat16())
        expected = F.scaled_dot_product_attention(
            q[i : i + 1].double(), keys[None].double(), values[None].double(), enable_gqa=True
        )
        if not (chunk_rows and s in (0, 2)):
            assert (out[i : i + 1].double() - expected).abs().max() <= 1e-4, (s, p)
            continue
        # the tiles' roundings: the scaled query and the unnormalized weights to bf16, their sum from fp32 values
        group = n_heads // n_kv_heads
        keys, values = (x.double().repeat_interleave(group, 0) for x in (keys, values))  # (H, p + 1, D)
        scores = (q[i, :, 0] * head_dim**-0.5).bfloat16().double()[:, None] @ keys.transpose(1, 2)  # (H, 1, p + 1)
        weights = (scores - scores.amax(-1, keepdim=True)).exp().float()
        tiles = weights.bfloat16().double() @ values / weights.double().sum(-1, keepdim=True)
        assert (out[i, :, 0].double() - tiles[:, 0]).abs().max() <= 2e-3, (s, p)
        assert (out[i : i + 1].double() - expected).abs().max() <= TOLERANCE[torch.bfloat16] * 3, (s, p)


@needs_gemv
@pytest.mark.parametrize("n", [64, 72])
def test_a_packed_bf16_layer_holds_blocks_in_place_of_its_rows(isa, n):
    """GemvLinear(pack=True) holds bf16 weights in blocks where the build reads them so (N a multiple of 16 on the
    avx512 build; 72 rows stay rows), serves any rows from them on the kernel, the same sums for a row alone or
    among others, and gives the rows back for the portable path (plain_weight)."""
    torch.manual_seed(n)
    linear = nn.Linear(64, n, bias=True).to(torch.bfloat16)
    layer = GemvLinear(linear, pack=True)
    assert layer.packed() == (isa == "avx512" and n % 16 == 0)
    assert torch.equal(layer.plain_weight(), linear.weight)
    assert layer.weight.numel() == linear.weight.numel()  # the blocks replace the rows: no padding, no second copy
    x = torch.randn(40, 64).bfloat16()
    with torch.no_grad():
        y = layer(x)
        assert torch.equal(torch.cat([layer(x[m : m + 1]) for m in range(40)]), y)
        assert (y.float() - linear(x).float()).abs().max() <= TOLERANCE[torch.bfloat16]
        layer.use_kernel = False
        assert torch.equal(layer(x), linear(x))


@needs_gemv
@pytest.mark.parametrize("shape", [(1, 64), (1, 3, 64), (2, 7, 64), (40, 64)])
def test_gemv_linear_matches_the_unfused_ops_for_any_batch(isa, shape):
    """Few rows take the kernel, more rows `F.linear`: either way linear(norm(x)), linear(silu(g) * u)."""
    torch.manual_seed(0)
    linear, norm = nn.Linear(64, 72, bias=True), RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64) + 0.5
    x = torch.randn(shape)
    with torch.no_grad():
        expected = linear(norm(x))
        assert torch.allclose(linear_after_norm(GemvLinear(linear), norm, x), expected, atol=1e-5)
        assert torch.allclose(GemvLinear(linear)(x), linear(x), atol=1e-5)
        gate_up = torch.cat((x, x.flip(-1)), dim=-1)
        expected = linear(F.silu(x) * x.flip(-1))
        assert torch.allclose(linear_after_glu(GemvLinear(linear), gate_up, "silu"), expected, atol=1e-5)


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_with_fast_kernels_matches_portable_engine(isa, tiny_tokenizer, dtype):
    """Prefill (F.linear) then 20 decode steps (the kernel): the same logits and greedy tokens as F.linear."""
    reference, fast = tiny_engine(tiny_tokenizer, dtype=dtype), tiny_engine(tiny_tokenizer, dtype=dtype)
    assert select_kernels(reference.model, torch.device("cpu"), dtype, "portable") == []
    swapped = select_kernels(fast.model, torch.device("cpu"), dtype, "fast")
    assert "output" in swapped and "layers.0.attention.wqkv" in swapped and len(swapped) == 1 + 4 * 2
    prompt = list(range(20, 52))
    ref_logits, ref_seq = reference.prefill(prompt)
    fast_logits, fast_seq = fast.prefill(prompt)
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    for _ in range(20):
        assert (ref_logits.float() - fast_logits.float()).abs().max() <= tolerance
        assert int(ref_logits.argmax()) == int(fast_logits.argmax())
        token = int(ref_logits.argmax())
        ref_logits, fast_logits = reference.decode_step(token, ref_seq), fast.decode_step(token, fast_seq)
    ref_seq.release()
    fast_seq.release()


@needs_gemv
def test_int8_layer_kernel_matches_its_dequantized_reference(isa):
    torch.manual_seed(0)
    layer = Int8Linear(nn.Linear(96, 130, bias=True))
    x = torch.randn(1, 1, 96)
    with torch.no_grad():
        expected = F.linear(x, layer.dequantize(), layer.bias)
        assert torch.allclose(layer(x), expected, atol=1e-4)
        layer.use_kernel = False
        assert torch.allclose(layer(x), expected, atol=1e-5)


def test_portable_and_other_devices_keep_f_linear(tiny_tokenizer):
    model = tiny_engine(tiny_tokenizer).model
    model.layers[0].attention.wo = Int8Linear(model.layers[0].attention.wo)
    assert select_kernels(model, torch.device("cpu"), torch.float32, "portable") == []
    assert model.layers[0].attention.wo.use_kernel is False  # quantized layers take their reference path too
    assert select_kernels(model, torch.device("cuda"), torch.float32, "fast") == []
    assert select_kernels(model, torch.device("cpu"), torch.float16, "fast") == []
    assert all(type(m) is not GemvLinear for m in model.modules())
    cpu = torch.device("cpu")
    assert not decode_attention_applies(cpu, torch.float32, 64, "portable")
    assert not decode_attention_applies(torch.device("cuda"), torch.float32, 64, "fast")
    assert not decode_attention_applies(cpu, torch.float32, 12, "fast")  # head_dim not a multiple of 8
    with pytest.raises(Exception, match="device.kernels"):
        select_kernels(model, torch.device("cpu"), torch.float32, "fastest")


@needs_gemv
def test_int8_sums_over_more_than_8192_columns_do_not_overflow(isa):
    """The largest int8 row product there can be: every weight 127 against activations all at the largest code, over
    Llama-3.1-8B's 14336 columns (an int32 lane then sums 127 * 8191 * 14336 / 8 = 1.86e9 < 2^31), comes out right."""
    k = 14336
    weight = torch.full((16, k), 127, dtype=torch.int8)
    for sign in (1.0, -1.0):
        y = gemv(torch.full((3, k), sign), weight, torch.ones(16), None, None, False)
        assert torch.allclose(y, torch.full_like(y, sign * 127 * k), rtol=1e-6)
