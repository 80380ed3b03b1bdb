"""Quantization on the real default model (SmolLM2-135M Q4_1 GGUF): lossless Q4_1 import, int8 on real layers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from inferlab.api import compose, load_engine
from inferlab.kernels.aten import int4_layout
from inferlab.model.loader import LoadedModel, load_model
from inferlab.quant import Int4GroupLinear, Int8Linear, quantize_model
from inferlab.quant.gguf_q4 import read_q4_1_linears

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def fp32() -> LoadedModel:
    spec = compose("engine", ["model=smollm2-135m"]).model
    return load_model(dict(spec), torch.float32, torch.device("cpu"), max_seq_len=256)


def next_token_logits(loaded: LoadedModel, model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([loaded.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None], last_only=True)[0, -1].float()


def test_q4_1_import_reproduces_the_dequantized_gguf_weights(fp32):
    imported = read_q4_1_linears(fp32.gguf_path, fp32.config)
    assert len(imported) == 4 * fp32.config.n_layers  # wqkv, wo, w13, w2 of every layer
    for name, codes in imported.items():
        linear = fp32.model.get_submodule(name)
        q = Int4GroupLinear(linear, 32, use_kernel=False, codes=codes())
        assert q.weight.nbytes * 2 == linear.weight.numel()
        assert torch.equal(q.dequantize(), linear.weight), name


@pytest.mark.parametrize(
    "name",
    [
        "layers.0.attention.wqkv",
        "layers.0.attention.wo",
        "layers.15.feed_forward.w13",
        "layers.29.feed_forward.w2",
        "output",
    ],
)
def test_int8_on_real_layers(fp32, name):
    linear = fp32.model.get_submodule(name)
    q = Int8Linear(linear)
    assert q.weight.nbytes * 4 == linear.weight.nbytes
    x = torch.randn(8, linear.in_features, generator=torch.Generator().manual_seed(0))
    assert F.cosine_similarity(q(x).flatten(), linear(x).flatten(), dim=0) > 0.998


def test_quantize_model_int4_imports_every_decoder_linear(fp32):
    model = copy.deepcopy(fp32.model)
    report = quantize_model(model, "int4", group_size=32, gguf_path=fp32.gguf_path)
    sources = {layer.name: layer.source for layer in report.layers}
    assert sources.pop("output") == "quantized"
    assert set(sources.values()) == {"gguf_q4_1"} and len(sources) == 4 * fp32.config.n_layers
    assert report.bytes_after < 0.4 * report.bytes_before
    expected, got = next_token_logits(fp32, fp32.model), next_token_logits(fp32, model)
    assert F.cosine_similarity(expected, got, dim=0) > 0.99  # only the int8 head differs from the fp32 model
    assert expected.argmax() == got.argmax()


def test_precision_int4_config_runs_the_kernels(fp32):
    engine = load_engine(precision="int4", device="cpu", **{"cache.max_seq_len": 256})
    quantized = [m for m in engine.model.modules() if isinstance(m, (Int8Linear, Int4GroupLinear))]
    assert len(quantized) == 4 * fp32.config.n_layers + 1
    layout = int4_layout(torch.device("cpu"), torch.bfloat16, 576, 576)
    assert all(m.layout == layout for m in quantized if isinstance(m, Int4GroupLinear))
    assert all(m.use_kernel for m in quantized)
    assert next_token_logits(fp32, engine.model).argmax() == next_token_logits(fp32, fp32.model).argmax()
