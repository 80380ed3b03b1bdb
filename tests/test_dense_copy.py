"""Quantized layers keep a dequantized copy for products of many rows: the same values as the reference."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from inferlab.kernels.select import keep_dense_copies
from inferlab.quant import quantize_model
from inferlab.quant.int4 import Int4GroupLinear
from inferlab.quant.int8 import Int8Linear


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_many_rows_through_the_dense_copy_equal_the_dequantize_reference(mode):
    model = tiny_model(0).to(torch.bfloat16)
    quantize_model(model, mode, 32 if mode == "int4" else None)
    layers = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4GroupLinear))]
    x = [torch.randn(3, 12, m.in_features, dtype=torch.bfloat16) for m in layers]  # 36 rows: beyond the gemv
    reference = []
    for layer, rows in zip(layers, x):
        reference.append(torch.nn.functional.linear(rows, layer.dequantize().to(rows.dtype), layer.bias))
    kept = keep_dense_copies(model, torch.bfloat16, budget_mb=64)
    assert kept == sum(m.out_features * m.in_features * 2 for m in layers)
    for layer, rows, want in zip(layers, x, reference):
        assert layer.dense is not None and "dense" not in layer.state_dict()  # memory only, never saved
        torch.testing.assert_close(layer(rows), want, rtol=0, atol=0)


def test_no_copy_when_the_copies_do_not_fit_the_budget():
    model = tiny_model(0).to(torch.bfloat16)
    quantize_model(model, "int8")
    assert keep_dense_copies(model, torch.bfloat16, budget_mb=1e-3) == 0
    assert all(m.dense is None for m in model.modules() if isinstance(m, Int8Linear))
