"""int8 layers keep a dequantized copy for products of many rows: the same values as the reference. int4 layers
keep none (their kernel runs every number of rows)."""

from __future__ import annotations

import torch
from conftest import tiny_model

from inferlab.kernels.layer import DenseCopyLayer
from inferlab.kernels.select import keep_dense_copies
from inferlab.quant import quantize_model
from inferlab.quant.int4 import Int4GroupLinear
from inferlab.quant.int8 import Int8Linear


def test_many_rows_through_the_dense_copy_equal_the_dequantize_reference():
    model = tiny_model(0).to(torch.bfloat16)
    quantize_model(model, "int8")
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    x = [torch.randn(3, 12, m.in_features, dtype=torch.bfloat16) for m in layers]  # 36 rows: beyond the gemv
    reference = []
    for layer, rows in zip(layers, x):
        reference.append(torch.nn.functional.linear(rows, layer.dequantize().to(rows.dtype), layer.bias))
    kept = keep_dense_copies(model, torch.bfloat16, budget_mb=64)
    assert kept == sum(m.out_features * m.in_features * 2 for m in layers)
    for layer, rows, want in zip(layers, x, reference):
        assert layer.dense is not None and "dense" not in layer.state_dict()  # memory only, never saved
        torch.testing.assert_close(layer(rows), want, rtol=0, atol=0)


def test_int4_layers_keep_no_copy():
    model = tiny_model(0).to(torch.bfloat16)
    quantize_model(model, "int4", 32)
    int4 = [m for m in model.modules() if isinstance(m, Int4GroupLinear)]
    assert int4 and not any(isinstance(m, DenseCopyLayer) for m in int4)
    keep_dense_copies(model, torch.bfloat16, budget_mb=64)  # the int8 LM head alone holds one
    assert all(m.dense is not None for m in model.modules() if isinstance(m, Int8Linear))


def test_no_copy_when_the_copies_do_not_fit_the_budget():
    model = tiny_model(0).to(torch.bfloat16)
    quantize_model(model, "int8")
    assert keep_dense_copies(model, torch.bfloat16, budget_mb=1e-3) == 0
    assert all(m.dense is None for m in model.modules() if isinstance(m, Int8Linear))
