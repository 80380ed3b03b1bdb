"""GGUF's block formats as the file stores them (K-quants Q4_K, Q5_K, Q6_K; Q4_0, Q5_0, Q5_1, Q8_0): our torch
dequantizers give gguf's own `dequantize` values to the bit; the CPU kernels' products on random blocks equal the
dequantized reference within the rounding of their int16 activation codes (half a code step per activation) and float
rounding, on every kernel build this CPU runs, whatever rows come with a row; our
K-quant quantizer writes blocks gguf reads back; a fused projection whose parts keep different formats, and a model
whose file mixes them (precision=auto -> gguf), decode through the fused C++ step to the portable path's greedy
tokens."""

import gguf
import numpy as np
import pytest
import torch
from conftest import byte_level_backend
from gguf_writer import byte_level_vocab, write_gguf
from transformers import LlamaConfig, LlamaForCausalLM

from inferlab.api import load_engine
from inferlab.errors import QuantizationError
from inferlab.kernels.build import cpu_gemv_available, int4_tile_rows, kernel_ops, use_isa
from inferlab.kernels.isa import supported_isas
from inferlab.model.gguf_blocks import BLOCK_LAYOUTS, dequantize_blocks
from inferlab.model.transformer import RMSNorm
from inferlab.quant import gguf_tiles
from inferlab.quant.gguf_linear import TILED, GGUFBlockLinear
from inferlab.quant.gguf_tiles import in_row_chunks, q4_k_blocks, q4_k_tiles
from inferlab.quant.kquants import quantize_blocks
from inferlab.quant.requantize_gguf import LINEAR, requantize_gguf

FORMATS = list(BLOCK_LAYOUTS)
FACTOR_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q4_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,)}
needs_kernels = pytest.mark.skipif(not cpu_gemv_available(), reason="no AVX2 CPU or no C++ toolchain here")


def random_blocks(kind: str, rows: int, blocks: int, seed: int = 0) -> torch.Tensor:
    """uint8 (rows, blocks, bytes): every byte random (codes, sub-block scales and mins, fifth bits), the fp16
    factors random finite values."""
    rng = np.random.default_rng(seed)
    size = BLOCK_LAYOUTS[kind][1]
    b = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in FACTOR_AT[kind]:
        factors = rng.uniform(-0.02, 0.02, (rows, blocks)).astype(np.float16)
        b[..., at : at + 2] = factors.view(np.uint8).reshape(rows, blocks, 2)
    return torch.from_numpy(b)


def gguf_values(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    rows = blocks.reshape(blocks.shape[0], -1).numpy()
    return torch.from_numpy(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[kind]))


@pytest.mark.parametrize("kind", FORMATS)
def test_torch_dequantize_equals_gguf(kind):
    blocks = random_blocks(kind, 6, 3)
    assert torch.equal(dequantize_blocks(blocks, kind), gguf_values(blocks, kind))


# mean |error| / mean |w| of our quantizer on Gaussian weights, per format: about what its bits allow
QUANTIZER_ERROR = {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025, "Q4_0": 0.1, "Q5_0": 0.05, "Q5_1": 0.05, "Q8_0": 0.01}


@pytest.mark.parametrize("kind", FORMATS)
def test_quantizer_writes_blocks_gguf_reads(kind):
    w = torch.randn(24, 512, generator=torch.Generator().manual_seed(1)) * 0.05
    blocks = quantize_blocks(w, kind)
    assert blocks.shape == (24, 512 // BLOCK_LAYOUTS[kind][0], BLOCK_LAYOUTS[kind][1])
    values = gguf_values(blocks, kind)
    assert torch.equal(dequantize_blocks(blocks, kind), values)
    assert (values - w).abs().mean() / w.abs().mean() < QUANTIZER_ERROR[kind]


def gemv(x: torch.Tensor, weight: torch.Tensor, int8_activations: bool = False) -> torch.Tensor:
    return kernel_ops().gemv(x, weight, None, None, None, 0.0, None, False, int8_activations, 0)


def assert_products_equal_the_reference(weight: torch.Tensor, w: torch.Tensor, label: str) -> None:
    """The kernel's products of `weight` (blocks or tiles) at 1 to 40 activation rows equal x @ w.T (w: gguf's
    dequantized values) within the rounding of the int16 activation codes and of fp32 sums; a row's result does not
    depend on the rows beside it."""
    x = torch.randn(40, w.shape[1], generator=torch.Generator().manual_seed(3))
    single = gemv(x[:1], weight)
    for m in (1, 3, 8, 40):  # a decode step, a batch, a prompt chunk (the tiled path)
        y = gemv(x[:m], weight)
        xm = x[:m].double()
        exact = xm @ w.T
        # each activation is an int16 code of its row's max|x| / 16383 (within half a step), times fp32 sums whose
        # rounding is relative to the sum of |products|
        codes = 0.5 * xm.abs().amax(dim=1, keepdim=True) / 16383 * w.abs().sum(dim=1)
        floats = 2e-6 * (xm.abs() @ w.abs().T)
        assert ((y.double() - exact).abs() <= codes + floats).all(), (label, m)
        assert torch.equal(y[:1], single)  # a row's sum does not depend on the rows beside it


def assert_int8_code_products_equal_the_reference(
    weight: torch.Tensor, w: torch.Tensor, label: str, code_cols: int = 32
) -> None:
    """The kernel's products of tiles with int8 activation codes per `code_cols` columns (precision.activations=int8)
    at 1 to 40 activation rows equal x @ w.T within half a code step per activation (the block's max|x| / 127) and
    fp32 sums; a row's result does not depend on the rows beside it."""
    x = torch.randn(40, w.shape[1], generator=torch.Generator().manual_seed(8))
    single = gemv(x[:1], weight, int8_activations=True)
    for m in (1, 3, 8, 40):
        y, xm = gemv(x[:m], weight, int8_activations=True).double(), x[:m].double()
        steps = xm.view(m, -1, code_cols).abs().amax(dim=2).repeat_interleave(code_cols, dim=1) / 127
        assert ((y - xm @ w.T).abs() <= 0.5 * steps @ w.abs().T + 2e-6 * (xm.abs() @ w.abs().T)).all(), (label, m)
        assert torch.equal(y[:1].float(), single)


@needs_kernels
@pytest.mark.parametrize("kind", FORMATS)
def test_kernel_products_equal_the_dequantized_reference(isa, kind, one_thread):
    rows, weights = 37, 1024  # rows: not a multiple of any build's lanes or of a dot call's rows
    blocks = random_blocks(kind, rows, weights // BLOCK_LAYOUTS[kind][0], seed=2)
    assert_products_equal_the_reference(blocks, gguf_values(blocks, kind).double(), kind)


@needs_kernels
def test_q4_k_tiles_hold_the_blocks_and_multiply_as_they_do(isa, one_thread):
    """Q4_K blocks laid out as the build's int4 tiles (quant/gguf_tiles.py) give back the very blocks, and the kernel's
    products of the tiles (with int16 activation codes, and with int8 ones per block) equal gguf's dequantized
    values' products."""
    blocks = random_blocks("Q4_K", 48, 4, seed=7)  # 48 rows: whole blocks of either build's tile rows
    tiles = q4_k_tiles(blocks, int4_tile_rows())
    assert tiles.dtype == torch.int32 and torch.equal(q4_k_blocks(tiles), blocks)
    w = gguf_values(blocks, "Q4_K").double()
    assert_products_equal_the_reference(tiles, w, "Q4_K tiles")
    assert_int8_code_products_equal_the_reference(tiles, w, "Q4_K tiles, int8 codes")


LINED = ["Q6_K", "Q5_0", "Q8_0"]  # tiles whose code lines and factor lines are one stream (gemv.h: Int4Format::Lined)


@needs_kernels
@pytest.mark.parametrize("kind", LINED)
def test_lined_tiles_hold_the_blocks_and_multiply_as_they_do(isa, kind, one_thread):
    """Q6_K, Q5_0 and Q8_0 blocks laid out as the build's int4 tiles with their high bits (Q6_K's pairs, Q5_0's fifth
    bits) or int8 codes in lines (quant/gguf_tiles.py) give back the very blocks, and the kernel's products of the
    tiles equal gguf's dequantized values' products at 1, 3, 8 and 40 activation rows; every code and every Q6_K int8
    scale taken (random bytes)."""
    blocks = random_blocks(kind, 48, 1024 // BLOCK_LAYOUTS[kind][0], seed=11)  # 48 rows: whole blocks of tile rows
    tiles, blocks_again = TILED[kind][:2]
    tiled = tiles(blocks, int4_tile_rows())
    assert tiled.dtype == torch.int32 and torch.equal(blocks_again(tiled), blocks)
    w = gguf_values(blocks, kind).double()
    assert_products_equal_the_reference(tiled, w, f"{kind} tiles")
    if (
        kind == "Q6_K"
    ):  # int8 activation codes take its 6-bit codes, per super-block (gemv.h: Int4Format::int8_code_cols)
        assert_int8_code_products_equal_the_reference(tiled, w, "Q6_K tiles, int8 codes", code_cols=256)


@pytest.mark.parametrize("kind", list(TILED))
def test_tiles_made_in_row_chunks_are_a_whole_layers(kind, monkeypatch):
    """A layer made into tiles a chunk of rows at a time (as loading does, for its peak) gets the tiles the whole
    layer at once gets, the last chunk a short one."""
    monkeypatch.setattr(gguf_tiles, "CHUNK_ROWS", 32)
    blocks = random_blocks(kind, 80, 512 // BLOCK_LAYOUTS[kind][0], seed=5)  # chunks of 32, 32 and 16 rows
    make = TILED[kind][0]
    for rows in (8, 16):  # either build's tile rows
        assert torch.equal(in_row_chunks(make, blocks, rows), make(blocks, rows))


# Per lined format: its code bytes in a block, the bytes of its largest and of its smallest (most negative) codes
EXTREME_CODES = {
    "Q6_K": (slice(0, 192), 0xFF, 0x00),
    "Q5_0": (slice(2, 22), 0xFF, 0x00),
    "Q8_0": (slice(2, 34), 0x7F, 0x80),
}


@needs_kernels
@pytest.mark.parametrize("kind", LINED)
def test_lined_tiles_at_the_bounds_of_their_integer_sums(isa, kind, one_thread):
    """Every code at its largest (or smallest: Q6_K's and Q5_0's 0 is their most negative weight, under Q6_K's scale
    -128) against activations at their int16 bound (Q6_K's also at int8 codes' -127), at the kernels' largest K: the
    dots (of 16-fold odd columns, for nibbles) stay within int32 (AVX2's int16 quad sums too) and the products equal the
    reference within one fp32 rounding per float update."""
    k = 32768  # gemv.h's kMaxK
    blocks = random_blocks(kind, 32, k // BLOCK_LAYOUTS[kind][0], seed=12)
    codes, largest, smallest = EXTREME_CODES[kind]
    blocks[:16, :, codes] = largest
    blocks[16:, :, codes] = smallest
    if kind == "Q6_K":
        blocks[..., 192:208] = 0x80  # sc = -128
    x = torch.full((1, k), -1.0)
    w = gguf_values(blocks, kind).double()
    tiled = TILED[kind][0](blocks, int4_tile_rows())
    updates = k // 16  # a float update per block (of 16 or 32 columns), each rounding once
    bound = updates * 2**-24 * (x.double().abs() @ w.abs().T)
    for int8_codes in (False, True) if kind == "Q6_K" else (False,):  # int8: each block's sums in int32 on AVX2 too
        for rows in (1, 5):  # a decode's 8 integer sums per block, many rows' 2
            y = gemv(x.expand(rows, k), tiled, int8_activations=int8_codes).double()
            assert ((y - x.double() @ w.T).abs() <= bound).all(), (int8_codes, rows)  # codes exact: x = -max


@needs_kernels
def test_stacked_parts_each_in_its_format(isa, one_thread):
    """q/k in Q4_K and v in Q6_K (a K-quant file's fused projection), parts in Q5_0 and Q8_0 (its 32-weight
    fallbacks), then a part the tiles' blocks of rows do not divide (kept as blocks), with a bias: the kernel path (decode rows and a prompt chunk, with the RMSNorm fused in)
    equals the portable path's dequantize-then-linear within the rounding of the int16 activation codes (half a step
    per activation) and of fp32 sums."""
    torch.manual_seed(6)
    linear = torch.nn.Linear(512, 165, bias=True)
    parts = [
        ("Q4_K", random_blocks("Q4_K", 64, 2, seed=4)),
        ("Q6_K", random_blocks("Q6_K", 32, 2, seed=5)),
        ("Q5_0", random_blocks("Q5_0", 32, 16, seed=14)),
        ("Q8_0", random_blocks("Q8_0", 32, 16, seed=15)),
        ("Q6_K", random_blocks("Q6_K", 5, 2, seed=13)),
    ]
    layer = GGUFBlockLinear(linear, parts)
    reference = GGUFBlockLinear(linear, parts, use_kernel=False)
    weights = layer.kernel_weights()
    assert weights.stacked and reference.kernel_weights() is None
    # as the int4 kernel's tiles where whole blocks of its rows
    assert [p.format for p in weights.every_part()] == ["q4_k_tiles", "q6_k_tiles", "q5_0_tiles", "q8_0_tiles", "gguf"]
    assert all(torch.equal(held, given) for (_, held), (_, given) in zip(layer.parts(), parts))
    norm = RMSNorm(512, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(512) + 0.5)
    w = reference.dequantize().double()
    for m in (1, 5, 33):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        with torch.no_grad():
            got, expected, normed = layer(x, norm), reference(x, norm), norm(x).double()
        codes = 0.5 * normed.abs().amax(dim=1, keepdim=True) / 16383 * w.abs().sum(dim=1)
        floats = 2e-6 * (normed.abs() @ w.abs().T)
        assert ((got - expected).double().abs() <= codes + floats).all()


@needs_kernels
@pytest.mark.parametrize("kind", list(TILED))
def test_tiles_are_laid_out_again_for_another_build(isa, kind, one_thread):
    """A layer's tiles (Q4_K, Q6_K, Q5_0, Q8_0) made under one kernel build serve another whose blocks of tile rows differ (tests
    switch builds; avx2's are 8 rows, avx512's 16): laid out again from the same blocks, to the same products."""
    linear = torch.nn.Linear(512, 64, bias=False)
    blocks = random_blocks(kind, 64, 512 // BLOCK_LAYOUTS[kind][0], seed=9)
    layer = GGUFBlockLinear(linear, [(kind, blocks)])
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        expected = layer(x)
    for other in supported_isas():
        use_isa(other)
        try:
            weights = layer.kernel_weights()
            assert weights.format == f"{kind.lower()}_tiles" and weights.weight.shape[-1] == int4_tile_rows()
            assert torch.equal(layer.parts()[0][1], blocks)
            with torch.no_grad():
                got = layer(x)
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), other
        finally:
            use_isa(isa)


def tiny_llama(hidden: int, tied: bool = True) -> LlamaForCausalLM:
    vocab = byte_level_backend().get_vocab_size(with_added_tokens=True)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(
    scope="module", params=[("Q4_K_M", 256), ("Q4_K_M", 288), ("Q4_K_M", 320), ("Q5_K_M", 256), ("Q6_K", 256)]
)
def kquant_file(request, tmp_path_factory):
    """A tiny Llama written as fp32 GGUF, then requantized to the mix: at width 256 K-quants throughout (layer 2's
    attn_v and ffn_down in Q6_K under the *_K_M mixes, so its q/k/v is stacked Q4_K + Q6_K), at 288 and 320 the 32-weight
    fallbacks (Q5_0, Q8_0) beside ffn_down's K-quants: at 288 (9 blocks a row) kept as blocks, at 320 as tiles."""
    mix, hidden = request.param
    folder = tmp_path_factory.mktemp(f"{mix}_{hidden}")
    src = write_gguf(tiny_llama(hidden), folder / "f32.gguf", byte_level_vocab(byte_level_backend()))
    return requantize_gguf(src, folder / f"{mix}.gguf", mix)


def engine_on(path, kernels: str, isa: str = "auto", precision: str = "gguf", activations: str = "int16"):
    overrides = {"model.path": str(path), "device.kernels": kernels, "device.isa": isa, "cache.max_seq_len": 128}
    if activations != "int16":
        overrides["precision.activations"] = activations
    if precision == "gguf":
        overrides["precision.dtype"] = "float32"  # the fused step's fp32 activations on both sides
    return load_engine(model="local", precision=precision, cache="contiguous", device="cpu", **overrides)


def test_auto_serves_a_kquant_file_in_its_own_formats(kquant_file):
    engine = engine_on(kquant_file, "portable", precision="auto")
    assert engine.config.precision.startswith("gguf (auto: the GGUF's")
    kinds = {
        kind
        for layer in engine.model.layers
        for m in layer.modules()
        if isinstance(m, GGUFBlockLinear)
        for kind in m.kinds
    }
    tensor_types = {t.tensor_type.name for t in gguf.GGUFReader(str(kquant_file)).tensors if LINEAR.fullmatch(t.name)}
    assert kinds == tensor_types
    engine.close()


@needs_kernels
def test_fused_step_matches_the_portable_path(kquant_file, isa, one_thread):
    portable = engine_on(kquant_file, "portable")
    fast = engine_on(kquant_file, "fast", isa)
    assert portable.fused is None and fast.fused is not None and fast.fused.isa == isa
    tokens = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = portable.model(torch.tensor([tokens]), torch.arange(len(tokens)).unsqueeze(0))[0]
    logits, seq = fast.prefill(tokens[:8], reserve_tokens=16)
    got = [logits.float()]
    for token in tokens[8:-1]:  # teacher-forced decode steps through the fused step
        got.append(fast.decode_step(token, seq).float())
    seq.release()
    expected = expected[7:]
    for e, g in zip(expected, got):
        # every product meets int16 activation codes (and the int8 head), where the portable path multiplies fp32
        assert (e - g).abs().max() <= 1e-3 * e.abs().max()
        assert int(e.argmax()) == int(g.argmax())
    prompt = tokens[:8]
    assert (
        fast.generate(prompt, max_new_tokens=8, temperature=0).token_ids
        == portable.generate(prompt, max_new_tokens=8, temperature=0).token_ids
    )
    fast.close()
    portable.close()


@needs_kernels
def test_int8_activation_codes_on_a_kquant_file(kquant_file, isa, one_thread):
    """precision.activations=int8 on a K-quant file: the fused step's Q4_K and Q6_K products take int8 codes per block
    (a prompt's rows and a decode's alike), the engine says so, and its logits stay near the portable path's."""
    portable = engine_on(kquant_file, "portable")
    fast = engine_on(kquant_file, "fast", isa, activations="int8")
    assert "int8 activation codes" in fast.describe()
    tokens = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = portable.model(torch.tensor([tokens]), torch.arange(len(tokens)).unsqueeze(0))[0][7:]
    logits, seq = fast.prefill(tokens[:8], reserve_tokens=8)
    got = [logits.float()]
    for token in tokens[8:-1]:
        got.append(fast.decode_step(token, seq).float())
    seq.release()
    for e, g in zip(expected, got):
        # int8 codes: half a step of 1/127 of a block's max|x| per activation (int16's: of 1/16383 of the row's), so
        # far more than int16's error (the fused step's test above); the kernels' own tests bound each product
        assert torch.nn.functional.cosine_similarity(e, g, dim=0) >= 0.995
    fast.close()
    portable.close()


# a tiny random model's logits against the file's own: int4 rounds 4- to 6-bit values to 4 bits again (measured down to
# 0.976), int8 keeps them nearly as they are
REQUANTIZED_MIN_COSINE = {"int8": 0.99, "int4": 0.95}


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_int_precisions_requantize_a_kquant_file(kquant_file, precision, one_thread):
    """precision=int8|int4 on a K-quant file dequantizes its blocks and quantizes them again: the model it serves is
    the file's up to that second rounding."""
    engine = engine_on(kquant_file, "fast", precision=precision)
    reference = engine_on(kquant_file, "portable")
    assert engine.config.precision == precision
    assert not any(isinstance(m, GGUFBlockLinear) for m in engine.model.modules())
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        got = engine.model(tokens, positions)[0].float()
        expected = reference.model(tokens, positions)[0].float()
    assert torch.nn.functional.cosine_similarity(got, expected, dim=-1).min() >= REQUANTIZED_MIN_COSINE[precision]
    engine.close()
    reference.close()


def test_self_speculation_refuses_a_kquant_target(kquant_file):
    """An int4 draft of a K-quant model would read about as many bytes a step as the model itself."""
    with pytest.raises(QuantizationError, match="no fewer bytes than this gguf target"):
        load_engine(model="local", precision="auto", spec="self", device="cpu", **{"model.path": str(kquant_file)})
