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


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"precision": "fp32", "+precision.activations": "int8"},
            "precision.activations=int8 is for int4 weights and GGUF K-quants",
        ),
        ({"model": "tiny-random", "precision.activations": "int8"}, r"K-quants \(this model runs fp32\)"),  # auto
        ({"precision": "int4", "precision.activations": "int4"}, "precision.activations must be int16 or int8"),
    ],
)
def test_int8_activation_codes_are_refused_where_they_do_not_apply(overrides, message):
    with pytest.raises(InvalidRequestError, match=message):
        load_engine(device="cpu", **overrides)


def test_int8_activation_codes_reach_the_fused_step():
    """precision.activations=int8: the fused step's int4 products take int8 codes (the Python model, the reference,
    keeps int16 ones), and the engine says so."""
    engines = {
        codes: load_engine(
            model="tiny-random", precision="int4", cache="paged", device="cpu", **{"precision.activations": codes}
        )
        for codes in ("int16", "int8")
    }
    if engines["int8"].fused is None:
        pytest.skip("no fused step here (no AVX2 CPU or no C++ toolchain)")
    assert "int8 activation codes" in engines["int8"].describe()
    assert "activation codes" not in engines["int16"].describe()
    ids = engines["int8"].tokenizer.encode("Once upon a time")
    first = {}
    for codes, engine in engines.items():
        first[codes], seq = engine.prefill(ids)
        seq.release()
    assert not torch.equal(first["int8"], first["int16"])
    assert torch.nn.functional.cosine_similarity(first["int8"], first["int16"], dim=0) >= 0.99


def test_int8_activation_codes_without_a_fused_step_say_they_do_nothing(caplog):
    overrides = {"precision.activations": "int8", "device.kernels": "portable"}
    engine = load_engine(model="tiny-random", precision="int4", cache="paged", device="cpu", **overrides)
    assert engine.fused is None and "activation codes" not in engine.describe()
    assert "precision.activations=int8 has no effect here" in caplog.text


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
