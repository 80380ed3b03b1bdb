"""load_engine's contract: Hydra group names and dotted overrides, chat, streaming events, random presets."""

import asyncio

import pytest
import torch

from inferlab import GenerationRequest, compute_kv_cache_bytes, load_engine
from inferlab.api import compose
from inferlab.errors import InvalidRequestError


@pytest.fixture(scope="module")
def engine():
    return load_engine(
        model="tiny-random",
        precision="fp32",
        cache="contiguous",
        device="cpu",
        **{"cache.max_seq_len": 128, "cache.slots": 2, "max_new_tokens": 6},
    )


def test_groups_and_dotted_overrides_reach_the_engine(engine):
    assert engine.config.max_seq_len == 128 and engine.config.slots == 2
    assert engine.config.defaults.max_new_tokens == 6
    assert engine.kv_cache.nbytes == compute_kv_cache_bytes(engine.loaded.config, 2, 128, torch.float32)
    bf16 = load_engine(model="tiny-random", precision="bf16", cache="none", **{"cache.max_seq_len": 64})
    assert bf16.config.cache_mode == "none" and next(bf16.model.parameters()).dtype == torch.bfloat16


def test_unknown_group_value_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match="model/no-such-model"):
        load_engine(model="no-such-model")


def test_shape_presets_compose_with_their_real_architectures():
    qwen = compose("engine", ["model=qwen2.5-0.5b"]).model.architecture
    llama = compose("engine", ["model=llama-3.2-1b"]).model.architecture
    assert (qwen.dim, qwen.n_layers, qwen.n_heads, qwen.n_kv_heads, qwen.qkv_bias) == (896, 24, 14, 2, True)
    assert (llama.dim, llama.n_layers, llama.n_kv_heads, llama.rope_scaling.rope_type) == (2048, 16, 8, "llama3")


def test_generate_with_text_and_ids_and_chat(engine):
    ids = engine.tokenizer.encode("Once upon a time")
    by_text = engine.generate("Once upon a time", temperature=0)
    by_ids = engine.generate(ids, temperature=0)
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) <= 6
    assert by_text.timings.prompt_tokens == len(ids)
    chat = engine.chat([{"role": "user", "content": "Hi"}], max_new_tokens=3)
    rendered = engine.tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert chat.timings.prompt_tokens == len(engine.tokenizer.encode(rendered)) and "<|im_start|>" in rendered


def test_stream_generate_events_carry_timings(engine):
    async def collect():
        request = GenerationRequest("The sea", engine.sampling_params(max_new_tokens=5, temperature=0))
        return [event async for event in engine.stream_generate(request)]

    events = asyncio.run(collect())
    tokens, last = events[:-1], events[-1]
    assert tokens[0].ttft_ms is not None and tokens[0].ttft_ms > 0
    assert all(e.ttft_ms is None for e in tokens[1:]) and all(e.token_id is not None for e in tokens)
    assert last.token_id is None and last.finish_reason in ("stop", "length")
    t = last.timings
    assert t.completion_tokens == len(tokens) and t.prompt_tokens == len(engine.tokenizer.encode("The sea"))
    if t.completion_tokens > 1:
        assert t.tpot_ms == pytest.approx((t.total_ms - t.ttft_ms) / (t.completion_tokens - 1))
        assert t.tokens_per_sec == pytest.approx(1e3 / t.tpot_ms)
    assert [e.token_id for e in tokens] == engine.generate("The sea", max_new_tokens=5, temperature=0).token_ids
