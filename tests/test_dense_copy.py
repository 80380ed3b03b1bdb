"""int8 layers keep a dequantized copy for products of many rows: the same values as the reference; in bf16 only
where oneDNN's bf16 GEMM runs on AMX tiles, as int4 layers do (elsewhere their kernel runs every number of rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_engine, tiny_model

from inferlab.kernels.gemv import BF16_TILES_MAX_ROWS, int4_kernel_max_rows, int8_kernel_max_rows
from inferlab.kernels.layer import holds_dense_copy
from inferlab.kernels.select import keep_dense_copies
from inferlab.quant import quantize_model
from inferlab.quant.int4 import Int4GroupLinear
from inferlab.quant.int8 import Int8Linear


@pytest.fixture
def native_bf16(monkeypatch):
    """oneDNN's bf16 GEMM runs on AMX tiles (pretended where it does not)."""
    monkeypatch.setattr("inferlab.quant.int8.amx_bf16_usable", lambda: True)


def test_many_rows_through_the_dense_copy_equal_the_dequantize_reference(native_bf16):
    model = tiny_model(0).to(torch.bfloat16)
    quantize_model(model, "int8")
    layers = [m for m in model.modules() if isinstance(m, Int8Linear) and m is not model.output]
    rows_beyond = int8_kernel_max_rows() + 4  # beyond the kernel: the copy's
    x = [torch.randn(1, rows_beyond, m.in_features, dtype=torch.bfloat16) for m in layers]
    reference = []
    for layer, rows in zip(layers, x):
        reference.append(torch.nn.functional.linear(rows, layer.dequantize().to(rows.dtype), layer.bias))
    kept = keep_dense_copies(model, torch.bfloat16, budget_mb=64)
    assert kept == sum(m.out_features * m.in_features * 2 for m in layers)
    for layer, rows, want in zip(layers, x, reference):
        assert layer.dense is not None and "dense" not in layer.state_dict()  # memory only, never saved
        torch.testing.assert_close(layer(rows), want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_lm_head_keeps_no_copy(native_bf16, dtype):
    """The LM head runs only on a step's logit rows (one a sequence), and the fused step never reads its copy: the
    copy would only hold memory (a vocabulary-sized matrix in bf16: 1,002 MiB at Llama-3.1-8B). Its many rows (a
    perplexity run's) take the int8 kernel, to the dequantized weights' products."""
    model = tiny_model(0).to(dtype)
    quantize_model(model, "int8")
    head = model.output
    assert isinstance(head, Int8Linear) and head.logit_head
    kept = keep_dense_copies(model, dtype, budget_mb=64)
    assert head.dense is None
    assert kept == sum(
        m.out_features * m.in_features * head.scales.element_size()
        for m in model.modules()
        if isinstance(m, Int8Linear) and m is not head
    )
    rows = torch.randn(int8_kernel_max_rows() + 4, head.in_features, dtype=dtype)
    want = F.linear(rows.float(), head.dequantize())
    assert F.cosine_similarity(head(rows).float(), want, dim=-1).min() >= 0.999


def test_int8_layers_keep_a_bf16_copy_only_on_amx(monkeypatch):
    monkeypatch.setattr("inferlab.quant.int8.amx_bf16_usable", lambda: False)
    for dtype, kept in ((torch.bfloat16, False), (torch.float32, True)):
        model = tiny_model(0).to(dtype)
        quantize_model(model, "int8")
        keep_dense_copies(model, dtype, budget_mb=64)
        layers = [m for m in model.modules() if isinstance(m, Int8Linear) and m is not model.output]
        assert layers and all((m.dense is not None) == kept for m in layers), dtype
        rows = torch.randn(int8_kernel_max_rows() + 4, layers[0].in_features, dtype=dtype)
        want = F.linear(rows, layers[0].dequantize().to(dtype), layers[0].bias)
        got = layers[0](rows)  # the kernel without a copy, the copy with one
        assert F.cosine_similarity(got.float(), want.float(), dim=-1).min() >= 0.999


def test_int4_layers_keep_no_copy_without_amx(monkeypatch, native_bf16):
    monkeypatch.setattr("inferlab.quant.int4.amx_bf16_usable", lambda: False)
    model = tiny_model(0).to(torch.bfloat16)
    quantize_model(model, "int4", 32)
    int4 = [m for m in model.modules() if isinstance(m, Int4GroupLinear)]
    assert keep_dense_copies(model, torch.bfloat16, budget_mb=64) == 0  # nor the int8 LM head (logit rows only)
    assert int4 and all(m.dense is None for m in int4)


@pytest.mark.parametrize("beyond", [0, 1])
def test_int4_copies_on_amx_serve_only_many_rows_in_bf16(monkeypatch, beyond):
    """With AMX (here pretended), a bf16 model's int4 layers keep bf16 copies: beyond int4_kernel_max_rows() rows
    (this build's) F.linear over the copy (the dequantized weights, to the bit), up to it the int4 kernel as before; an
    fp32 model keeps none (oneDNN's fp32 GEMM does not beat the kernel)."""
    monkeypatch.setattr("inferlab.quant.int4.amx_bf16_usable", lambda: True)
    rows = int4_kernel_max_rows() + beyond
    fp32 = tiny_model(0)
    quantize_model(fp32, "int4", 32)
    keep_dense_copies(fp32, torch.float32, budget_mb=64)
    assert all(m.dense is None for m in fp32.modules() if isinstance(m, Int4GroupLinear))
    model = tiny_model(0).to(torch.bfloat16)
    quantize_model(model, "int4", 32)
    layers = [m for m in model.modules() if isinstance(m, Int4GroupLinear)]
    x = [torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in layers]
    before = [layer(rows_) for layer, rows_ in zip(layers, x)]  # the kernel, no copy yet
    assert keep_dense_copies(model, torch.bfloat16, budget_mb=64) >= sum(
        m.out_features * m.in_features * 2 for m in layers
    )
    for layer, rows_, kernel in zip(layers, x, before):
        assert layer.dense is not None and "dense" not in layer.state_dict()
        got = layer(rows_)
        if beyond:
            want = torch.nn.functional.linear(rows_, layer.dequantize().to(torch.bfloat16), layer.bias)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            torch.testing.assert_close(got, kernel, rtol=0, atol=0)


def test_no_copy_when_the_copies_do_not_fit_the_budget():
    model = tiny_model(0).to(torch.bfloat16)
    quantize_model(model, "int8")
    assert keep_dense_copies(model, torch.bfloat16, budget_mb=1e-3) == 0
    assert all(m.dense is None for m in model.modules() if isinstance(m, Int8Linear))


def test_an_int4_engine_with_copies_runs_long_prompts_through_them(monkeypatch, tiny_tokenizer):
    """On an AMX CPU (pretended) a bf16 int4 engine's prompts of more than int4_kernel_max_rows() rows are multiplied in
    bf16, the copies' numbers: on the amx build inside the fused step (up to 55 rows its int4 tiles dequantized in
    cache, from 56 the copies on its bf16 tiles, up to BF16_TILES_MAX_ROWS rows), elsewhere the copies in the Python
    model. The prompt's logits stay those of the int4 kernel's fused step within bf16 activations' rounding, and the
    decodes after it run fused."""
    monkeypatch.setattr("inferlab.quant.int4.amx_bf16_usable", lambda: True)
    kwargs = dict(kernels="fast", quant="int4", dtype=torch.bfloat16, dim=128, hidden_dim=256)
    fused = tiny_engine(tiny_tokenizer, **kwargs)
    copies = tiny_engine(tiny_tokenizer, **kwargs, dense_copy_mb=64)
    on_tiles = copies.fused.isa == "amx"
    kernel_max_rows = int4_kernel_max_rows()
    assert fused.fused.max_rows > kernel_max_rows
    assert copies.fused.max_rows == (BF16_TILES_MAX_ROWS if on_tiles else kernel_max_rows)
    prompt = list(range(40, 40 + kernel_max_rows + 36))
    (want, want_seq), (got, got_seq) = fused.prefill(prompt), copies.prefill(prompt)
    assert F.cosine_similarity(want.float(), got.float(), dim=-1).min() >= 0.999
    assert int(want.argmax()) == int(got.argmax())
    token = int(want.argmax())
    want_step, got_step = fused.decode_step(token, want_seq), copies.decode_step(token, got_seq)
    assert F.cosine_similarity(want_step.float(), got_step.float(), dim=-1).min() >= 0.999
    want_seq.release()
    got_seq.release()
    # a long prompt multiplies the copies, and only it: with every copy zeroed (the plan holds the same storage) a new
    # long prompt's logits go astray, a short one's stay the int4 kernel's, and on the amx build one of 16-55 rows too
    # (its tiles dequantized, the copies not read)
    for layer in copies.model.modules():
        if isinstance(layer, Int4GroupLinear) and layer.dense is not None:
            layer.dense.zero_()
    cases = [(150, 10, True), (141, kernel_max_rows + (64 if on_tiles else 36), False)]
    if on_tiles:
        cases.append((120, kernel_max_rows + 25, True))
    for start, length, close in cases:
        prompt = list(range(start, start + length))
        (want, want_seq), (got, got_seq) = fused.prefill(prompt), copies.prefill(prompt)
        assert (F.cosine_similarity(want.float(), got.float(), dim=-1).min() >= 0.999) == close
        want_seq.release()
        got_seq.release()


def test_the_quantized_layers_are_seen_as_holding_copies():
    """holds_dense_copy, not isinstance on the protocol: on Python 3.12 that missed every layer (their `dense` is a
    buffer), and no copy was kept."""
    model = tiny_model(0)
    quantize_model(model, "int8")
    int4 = tiny_model(0)
    quantize_model(int4, "int4", 32)
    quantized = [m for m in [*model.modules(), *int4.modules()] if isinstance(m, (Int8Linear, Int4GroupLinear))]
    assert quantized and all(holds_dense_copy(m) for m in quantized)
    assert not holds_dense_copy(torch.nn.Linear(4, 4))
