"""The KernelLayer protocol (kernels/layer.py): what the plain and the quantized linears hand the kernels."""

import pytest
import torch
from torch import nn

from inferlab.kernels.build import int4_tile_rows
from inferlab.kernels.fused_decode import projection_parts
from inferlab.kernels.gemv import GemvLinear
from inferlab.kernels.layer import KernelLayer, KernelWeights
from inferlab.model import transformer
from inferlab.quant.int4 import Int4GroupLinear, tile_rows, unpack_nibbles, untile_rows
from inferlab.quant.int8 import Int8Linear


def layers(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).to(dtype)
    return linear, {"gemv": GemvLinear(linear), "int8": Int8Linear(linear), "int4": Int4GroupLinear(linear, 32)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_and_quantized_linears_expose_their_weights_and_the_switch(dtype):
    linear, swapped = layers(dtype)
    assert not isinstance(linear, KernelLayer)
    gemv, int8 = swapped["gemv"].kernel_weights(), swapped["int8"].kernel_weights()
    assert gemv.format == {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype] and gemv.weight is linear.weight
    assert gemv.scales is None and gemv.bias is linear.bias
    assert int8.format == "int8" and torch.equal(int8.weight, swapped["int8"].weight)
    assert torch.allclose(int8.weight.float() * int8.scales.float()[:, None], swapped["int8"].dequantize())
    if swapped["int4"].layout == "tiles":  # where the gemv kernel reads int4 (else aten's int4pack does)
        int4, rows = swapped["int4"].kernel_weights(), int4_tile_rows()
        assert int4.format == "int4_tiles" and int4.group_size == 32 and int4.mins.shape == (48 // rows, 2, rows)
        assert int4.weight.shape == (48 // rows, 64 // 8 + 2, rows)  # codes, fp16 scales and mins: one buffer
        packed, scales, mins = untile_rows(int4.weight, 2)
        assert unpack_nibbles(packed).shape == (48, 64) and scales.shape == mins.shape == (48, 2)
        assert torch.equal(tile_rows(packed, scales, mins, rows), int4.weight)
        assert sorted(swapped["int4"].state_dict()) == ["bias", "weight"]  # held once
    for layer in swapped.values():
        assert isinstance(layer, KernelLayer)
        weights = layer.kernel_weights()
        if weights is not None:  # the fused decode plan takes [weight, scales, mins, bias, dense copy]
            weight, _, _, bias, copy = projection_parts(layer)
            assert (weight.data_ptr(), bias.data_ptr()) == (weights.weight.data_ptr(), weights.bias.data_ptr())
            assert copy.numel() == 0  # none kept
        layer.use_kernel = False  # the portable reference path: nothing for the kernels
        assert layer.kernel_weights() is None and projection_parts(layer) is None


def test_kernel_weights_refuse_a_format_their_tensors_do_not_have():
    w = torch.zeros(4, 16)
    with pytest.raises(ValueError, match="int8 weights must be torch.int8"):
        KernelWeights("int8", w, torch.ones(4))
    with pytest.raises(ValueError, match="take no scales"):
        KernelWeights("fp32", w, torch.ones(4))
    with pytest.raises(ValueError, match="only they, have mins"):
        KernelWeights("int4", torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1))
    assert KernelWeights("fp32", w).parts()[1].numel() == 0


def test_fp32_rows_over_bf16_weights_beyond_the_kernel_are_the_widened_product(monkeypatch):
    """An LM head's many rows (prompt logprobs) in fp32 over a bf16 head: the weight widened a slice at a time, the
    product of widening it whole up to fp32's summation order (BLAS blocks a GEMM by its shape: on AVX-512 a
    20-column product and a 3-column one sum the 32 terms in different orders)."""
    monkeypatch.setattr(transformer, "LOGIT_SLICE_VALUES", 3 * 32)  # 3 weight rows a slice: 7 slices of 20 rows
    torch.manual_seed(0)
    head = GemvLinear(nn.Linear(32, 20, bias=True).to(torch.bfloat16))
    x = torch.randn(2, 40, 32)  # beyond the kernel's rows
    want = torch.nn.functional.linear(x, head.weight.float(), head.bias.float())
    got = head(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
