"""spec=ngram|draft|self through the engine, load_engine and a trained-format draft checkpoint."""

from __future__ import annotations

import asyncio

import pytest
from conftest import tiny_engine, tiny_model

from inferlab.api import load_engine
from inferlab.engine.drafters import ModelDrafter, NgramDrafter
from inferlab.engine.engine import GenerationRequest
from inferlab.engine.speculative import Speculation
from inferlab.errors import ModelLoadError
from inferlab.kernels.build import cpu_gemv_available
from inferlab.train.checkpoint import save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["abcabcabcab", "the cat sat on the mat; the cat", "xyz"]


@pytest.mark.parametrize("kernels", [None, "fast"])  # fast: the target verifies through the fused C++ step
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_engine_greedy_equals_spec_off(tiny_tokenizer, kind, kernels):
    plain = tiny_engine(tiny_tokenizer, max_new_tokens=20)
    spec = tiny_engine(tiny_tokenizer, max_new_tokens=20, kernels=kernels)
    if kernels == "fast" and not cpu_gemv_available():
        pytest.skip("no AVX2 CPU or no C++ toolchain here")
    assert (spec.fused is not None) == (kernels == "fast")
    spec.speculation = Speculation(NgramDrafter() if kind == "ngram" else ModelDrafter(tiny_model(0, n_layers=1)), 3)
    for prompt in PROMPTS:
        want, got = plain.generate(prompt), spec.generate(prompt)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reason == want.finish_reason and got.timings.completion_tokens == len(got.token_ids)
    stats = spec.stats()
    assert stats["requests_running"] == 0 and 0 < stats["spec_target_calls"] <= stats["spec_generated"]
    assert stats["spec_generated"] >= sum(len(plain.generate(p).token_ids) for p in PROMPTS)


def test_engine_stream_and_submit_use_speculation(tiny_tokenizer):
    plain = tiny_engine(tiny_tokenizer, max_new_tokens=12)
    spec = tiny_engine(tiny_tokenizer, max_new_tokens=12)
    spec.speculation = Speculation(NgramDrafter(), 4)
    request = GenerationRequest(PROMPTS[0], spec.sampling_params())

    async def collect() -> list:
        return [e async for e in spec.submit(request)]

    events = asyncio.run(collect())
    assert [e.token_id for e in events[:-1]] == plain.generate(PROMPTS[0]).token_ids
    assert events[0].ttft_ms is not None and events[-1].finish_reason == "length"


def test_engine_stop_string_cuts_inside_a_round(tiny_tokenizer):
    plain = tiny_engine(tiny_tokenizer, max_new_tokens=20)
    spec = tiny_engine(tiny_tokenizer, max_new_tokens=20)
    spec.speculation = Speculation(ModelDrafter(plain.model), 4)  # accepts everything: rounds of 5 tokens
    full = plain.generate(PROMPTS[1]).text
    stop = full[6:8]
    want, got = plain.generate(PROMPTS[1], stop=stop), spec.generate(PROMPTS[1], stop=stop)
    assert got.text == want.text and got.finish_reason == "stop"


@pytest.mark.slow
def test_load_engine_spec_ngram_matches_greedy():
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    plain = load_engine(cache="contiguous").generate(prompt, max_new_tokens=24)
    spec = load_engine(spec="ngram", **{"spec.k": 2}).generate(prompt, max_new_tokens=24)
    assert spec.token_ids == plain.token_ids


@pytest.mark.slow
def test_load_engine_spec_draft(tmp_path, monkeypatch):
    """A draft made of smollm2's first layer, saved the way inferlab-train saves it, loads and is lossless."""
    monkeypatch.setenv("INFERLAB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="make draft"):
        load_engine(spec="draft")
    engine = load_engine(precision="fp32")  # the draft is cut from its float weights
    draft = tiny_model(0, **{**engine.model.config.__dict__, "n_layers": 1})
    state = {
        k: v for k, v in engine.model.state_dict().items() if not k.startswith("layers.") or k.startswith("layers.0.")
    }
    draft.load_state_dict(state)
    save_checkpoint(draft, engine.tokenizer, tmp_path / "drafts" / "smollm2-135m")
    spec = load_engine(precision="fp32", spec="draft", **{"spec.k": 2})
    assert spec.speculation.drafter.fused is not None or not cpu_gemv_available()  # the draft's own fused step
    prompt = "What is the capital of France?"
    assert (
        spec.generate(prompt, max_new_tokens=16, chat=True).token_ids
        == engine.generate(prompt, max_new_tokens=16, chat=True).token_ids
    )


@pytest.mark.slow
def test_load_engine_spec_self_matches_greedy():
    """SmolLM2's own Q4_1 blocks draft for its fp32 weights, through both fused steps: spec off's tokens."""
    prompt = "Write a short story about a lighthouse keeper."
    plain = load_engine(precision="fp32").generate(prompt, max_new_tokens=32, chat=True)
    spec = load_engine(precision="fp32", spec="self")
    assert spec.speculation.drafter.fused is not None or not cpu_gemv_available()
    assert spec.generate(prompt, max_new_tokens=32, chat=True).token_ids == plain.token_ids
    stats = spec.stats()
    assert stats["spec_accepted"] > stats["spec_proposed"] / 2
