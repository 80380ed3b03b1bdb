"""INT8 / INT4 weight quantization on random layers and tiny models: storage, error bounds, kernel vs reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from gguf import GGMLQuantizationType, quants
from torch import nn

from inferlab.errors import QuantizationError
from inferlab.kernels.aten import int4_layout, int4_mm, int4pack_scales_and_zeros, to_int4pack
from inferlab.quant import Int4GroupLinear, Int8Embedding, Int8Linear, quantize_model, weight_bytes
from inferlab.quant.apply import module_bytes
from inferlab.quant.gguf_q4 import q4_1_codes
from inferlab.quant.int4 import dequantize_groups_int4, pack_nibbles, quantize_groups_int4, unpack_nibbles


def random_linear(n: int, k: int, bias: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
    return linear.to(dtype)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


# ---- INT8 --------------------------------------------------------------------------------------------


def test_int8_storage_is_a_quarter_of_fp32_and_output_close():
    linear = random_linear(512, 256, bias=True)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8
    assert q.weight.nbytes == linear.weight.nbytes // 4  # = 0.5x fp16
    assert q.weight.nbytes + q.scales.nbytes <= 0.26 * linear.weight.nbytes
    x = torch.randn(4, 7, 256)
    assert cosine(q(x), linear(x)) > 0.998


def test_int8_error_within_half_a_step_per_row():
    linear = random_linear(64, 128)
    q = Int8Linear(linear, use_kernel=False)
    step = linear.weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - linear.weight).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernel_matches_reference_in_bf16(bias):
    linear = random_linear(96, 160, bias=bias, dtype=torch.bfloat16)
    fast, ref = Int8Linear(linear), Int8Linear(linear, use_kernel=False)
    assert torch.equal(fast.weight, ref.weight)
    for shape in ((3, 5, 160), (1, 1, 160)):  # a prompt (int8pack) and a decode step (the CPU decode kernel)
        x = torch.randn(shape, dtype=torch.bfloat16)
        torch.testing.assert_close(fast(x).float(), ref(x).float(), atol=2e-2, rtol=2e-2)


# ---- INT4 --------------------------------------------------------------------------------------------


def test_pack_unpack_round_trip_exact():
    codes = torch.randint(0, 16, (24, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (24, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_within_half_a_step_per_group(group_size):
    linear = random_linear(48, 256)
    q = Int4GroupLinear(linear, group_size, use_kernel=False)
    assert q.weight.nbytes == 48 * 256 // 2  # exactly 0.5 byte per weight
    assert q.scales.shape == q.mins.shape == (48, 256 // group_size)
    groups = linear.weight.view(48, -1, group_size)
    error = (q.dequantize() - linear.weight).view(48, -1, group_size).abs().amax(dim=-1)
    step = (groups.amax(dim=-1) - groups.amin(dim=-1)) / 15
    # scales and mins are fp16 values (as GGUF's Q4_1 stores them): half an fp16 step of the min and of 16 steps more
    rounding = (groups.amin(dim=-1).abs() + 16 * step) * 2**-11
    assert (error <= step / 2 + rounding + 1e-6).all()


def test_int4_zero_point_conversion_exact_in_fp32():
    """The kernels' (q - 8) * scale + zero, fed our (scale, min), reproduces q * scale + min."""
    codes, scales, mins = quantize_groups_int4(random_linear(32, 128).weight.detach(), 32)
    x = torch.randn(3, 128)
    out = int4_mm(x, to_int4pack(codes, "cpu"), 32, int4pack_scales_and_zeros(scales, mins), "cpu")
    torch.testing.assert_close(out, x @ dequantize_groups_int4(codes, scales, mins).T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_kernel_matches_reference_in_bf16(group_size, bias):
    linear = random_linear(96, 256, bias=bias, dtype=torch.bfloat16)
    fast, ref = Int4GroupLinear(linear, group_size), Int4GroupLinear(linear, group_size, use_kernel=False)
    assert fast.layout == int4_layout(torch.device("cpu"), torch.bfloat16, 96, 256) and ref.layout == "rows"
    halved = (ref.scales.nbytes + ref.mins.nbytes) // 2 if fast.layout == "tiles" else 0  # tiles: fp16 scales, mins
    assert module_bytes(fast) == module_bytes(ref) - halved and ref.weight.nbytes == 96 * 256 // 2
    for shape in ((2, 3, 256), (1, 1, 256), (1, 4, 256)):  # a prompt, and decode steps of 1 and 4 rows
        x = torch.randn(shape, dtype=torch.bfloat16)
        torch.testing.assert_close(fast(x).float(), ref(x).float(), atol=3e-2, rtol=3e-2)
        assert cosine(ref(x), linear(x)) > 0.98


def test_int4_fp32_decodes_through_the_row_layout():
    """aten's CPU int4 kernel is slower than dense fp32 with fp32 activations; inferlab's own reads the rows."""
    linear = random_linear(32, 64)
    fast, ref = Int4GroupLinear(linear, 32), Int4GroupLinear(linear, 32, use_kernel=False)
    assert fast.layout == int4_layout(torch.device("cpu"), torch.float32, 32, 64) and ref.layout == "rows"
    x = torch.randn(1, 1, 64)
    torch.testing.assert_close(fast(x), ref(x), atol=1e-4, rtol=1e-4)


def test_gguf_q4_1_blocks_decode_exactly():
    weights = np.random.default_rng(0).normal(0, 0.05, (16, 96)).astype(np.float32)
    blocks = quants.quantize(weights, GGMLQuantizationType.Q4_1)
    codes, scales, mins = q4_1_codes(blocks)
    expected = quants.dequantize(blocks, GGMLQuantizationType.Q4_1)
    assert np.array_equal(dequantize_groups_int4(codes, scales, mins).numpy(), expected)
    linear = nn.Linear(96, 16, bias=False)
    imported = Int4GroupLinear(linear, 32, use_kernel=False, codes=(codes, scales, mins))
    assert np.array_equal(imported.dequantize().numpy(), expected)


@pytest.mark.parametrize("group_size", [16, 48, 256])
def test_int4_unsupported_group_size(group_size):
    with pytest.raises(QuantizationError, match="group_size"):
        Int4GroupLinear(random_linear(16, 256), group_size)


def test_int4_in_features_not_divisible():
    with pytest.raises(QuantizationError, match="not divisible"):
        Int4GroupLinear(random_linear(16, 96), 64)


# ---- whole models ------------------------------------------------------------------------------------


def logits(model: nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(1))
    return model(tokens, torch.arange(12).expand(2, 12)).float()


@pytest.mark.parametrize("mode, min_cosine", [("int8", 0.999), ("int4", 0.95)])
@pytest.mark.parametrize("tied", [False, True])
def test_quantize_model_swaps_every_linear(mode, min_cosine, tied):
    model = tiny_model(tie_embeddings=tied)
    expected = logits(model)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    report = quantize_model(model, mode, group_size=32)
    assert [layer.name for layer in report.layers] == ["output", *(name for name in linears if name != "output")]
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.output, Int8Linear)  # the head stays at 8 bits in both modes
    assert {layer.format for layer in report.layers if layer.name != "output"} == {mode}
    assert report.bytes_after == weight_bytes(model) < report.bytes_before
    assert isinstance(model.tok_embeddings, Int8Embedding) == tied
    assert cosine(logits(model), expected) > min_cosine


def test_tied_embedding_reads_the_heads_int8_rows():
    model = tiny_model(tie_embeddings=True)
    tokens = torch.tensor([[0, 5, 256]])
    expected = model.tok_embeddings(tokens)
    quantize_model(model, "int8")
    assert model.tok_embeddings.head is model.output
    torch.testing.assert_close(model.tok_embeddings(tokens), model.output.dequantize()[tokens])
    assert (model.tok_embeddings(tokens) - expected).abs().max() <= model.output.scales.max() / 2 + 1e-7


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_kernel_matches_reference(mode):
    fast, ref = tiny_model().to(torch.bfloat16), tiny_model().to(torch.bfloat16)
    quantize_model(fast, mode, group_size=32)
    quantize_model(ref, mode, group_size=32, use_kernel=False)
    torch.testing.assert_close(logits(fast), logits(ref), atol=5e-2, rtol=5e-2)


def test_quantize_model_errors_leave_model_untouched():
    model = tiny_model()  # dim 64, hidden 128
    with pytest.raises(QuantizationError, match="layers.0.attention.wqkv: in_features=64 is not divisible"):
        quantize_model(model, "int4", group_size=128)
    with pytest.raises(QuantizationError, match="not supported"):
        quantize_model(model, "int4", group_size=48)
    with pytest.raises(QuantizationError, match="unknown quantization"):
        quantize_model(model, "int3")
    assert isinstance(model.layers[0].attention.wqkv, nn.Linear)
    quantize_model(model, "int8")
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_model(model, "int4")
    with pytest.raises(QuantizationError, match="no nn.Linear"):
        quantize_model(nn.Sequential(nn.ReLU()), "int8")
