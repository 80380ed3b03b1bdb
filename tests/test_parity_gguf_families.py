"""Each family as a GGUF file (written with gguf's GGUFWriter from the same random weights, laid out as
llama.cpp's converter does) against transformers on the original model: logits and greedy tokens."""

import pytest
from conftest import byte_level_backend
from gguf_writer import byte_level_vocab, write_gguf
from test_parity_transformers import MAX_SEQ_LEN, assert_engine_matches, local_engine, reference_model

from inferlab.model.config import ModelConfig

CASES = [
    "llama",
    "llama-tied-llama3-rope",
    "mistral-head-dim",
    "qwen2",  # q/k/v biases (reference_model makes them nonzero)
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3-partial-rotary-longrope-short",
    "phi3-longrope-long",
]


@pytest.fixture(scope="module", params=CASES)
def gguf_file(request, tmp_path_factory):
    reference = reference_model(request.param)
    path = write_gguf(
        reference, tmp_path_factory.mktemp(request.param) / "model.gguf", byte_level_vocab(byte_level_backend())
    )
    return request.param, reference, path


@pytest.mark.parametrize("kernels,cache", [("fast", "contiguous"), ("portable", "paged")])
def test_gguf_logits_and_greedy_tokens_match_transformers(gguf_file, kernels, cache, one_thread):
    case, reference, path = gguf_file
    engine = local_engine(path, kernels, cache)
    assert engine.loaded.gguf_path == path
    ours, hf = engine.loaded.config, ModelConfig.from_hf(reference.config.to_dict())
    hf.max_seq_len = MAX_SEQ_LEN
    for field in (
        "qk_norm",
        "sandwich_norms",
        "activation",
        "embed_scale",
        "attn_softcap",
        "final_softcap",
        "rope_local_theta",
        "rotary_dim",
        "tie_embeddings",
        "head_dim",
    ):  # the file declares the family
        assert getattr(ours, field) == getattr(hf, field), field
    assert [ours.window(i) for i in range(ours.n_layers)] == [hf.window(i) for i in range(hf.n_layers)]
    assert ours.query_scale == pytest.approx(hf.query_scale)
    assert (ours.rope_scaling is None) == (hf.rope_scaling is None)
    assert_engine_matches(engine, reference, case, kernels)
