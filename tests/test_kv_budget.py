"""The KV memory and the context follow the model and the machine (engine/kv/budget.py, api.kv_pool): the pool is
the tokens or MiB a user names, else a share of the memory available after the weights, capped by what the running
sequences can use; a sequence may hold the model's whole context where the pool holds it; the server's
limits=context lifts the seed's prompt and max_tokens caps to that context, and a prompt beyond it is refused
with the limit named."""

import pytest
import torch
from fastapi.testclient import TestClient
from test_server import make_settings

from inferlab import load_engine
from inferlab.engine.kv import budget
from inferlab.engine.kv.budget import size_kv_pool
from inferlab.errors import InvalidRequestError
from inferlab.server import create_app

LONG_CONTEXT = {"device": "cpu", "model.architecture.max_seq_len": 8192}


def test_the_pool_is_what_is_asked_or_a_share_of_free_memory(monkeypatch):
    row = 1024  # bytes of KV a token
    assert size_kv_pool(row, 16, 100, None, 0.25, 10**9).tokens == 112  # whole blocks, at least the tokens asked
    assert size_kv_pool(row, 16, None, 1.0, 0.25, 10**9).tokens == 1024
    monkeypatch.setattr(budget, "memory_available_mib", lambda: 64.0)
    shared = size_kv_pool(row, 16, None, None, 0.25, 10**9)
    assert shared.tokens == 16 * 1024 and "25% of the 64 MiB" in shared.why
    capped = size_kv_pool(row, 16, None, None, 0.25, 4096)
    assert capped.tokens == 4096 and "full context" in capped.why
    for tokens, mib, share in ((10, 1.0, 0.25), (0, None, 0.25), (None, -1.0, 0.25), (None, None, 1.5)):
        with pytest.raises(InvalidRequestError, match="cache.kv"):
            size_kv_pool(row, 16, tokens, mib, share, 10**9)


def test_int8_kv_holds_about_twice_the_tokens_of_bf16_in_the_same_mib():
    sized = {**LONG_CONTEXT, "cache.kv_budget_mb": 4, "model.architecture.dim": 256}  # heads of 64 (one fp32 scale)
    bf16 = load_engine("tiny-random", "bf16", **sized)
    int8 = load_engine("tiny-random", "bf16", cache="paged_int8", **sized)
    assert int8.config.kv_pool.tokens >= 1.85 * bf16.config.kv_pool.tokens
    for engine in (bf16, int8):
        engine.close()


def test_defaults_serve_a_6000_token_prompt_within_the_models_context():
    engine = load_engine("tiny-random", "fp32", **LONG_CONTEXT)
    reference = load_engine("tiny-random", "fp32", cache="none", **LONG_CONTEXT)
    try:
        assert engine.config.max_seq_len == 8192  # the model's context, not a fixed 2048
        assert "context 8,192 tokens" in engine.describe() and "KV pool of" in engine.describe()
        ids = torch.randint(10, 40000, (6000,), generator=torch.Generator().manual_seed(0)).tolist()
        out = engine.generate(ids, max_new_tokens=4)
        assert out.token_ids == reference.generate(ids, max_new_tokens=4).token_ids  # full recomputation
    finally:
        engine.close()
        reference.close()


def test_a_small_pool_bounds_the_context_and_says_so():
    engine = load_engine("tiny-random", "fp32", **{**LONG_CONTEXT, "cache.kv_tokens": 1024})
    try:
        assert engine.config.max_seq_len == 1024 and engine.model.rope_cos.shape[0] == 1024
        with pytest.raises(InvalidRequestError, match="the context allows at most"):
            engine.check_prompt(list(range(10, 1100)))
    finally:
        engine.close()


def test_limits_context_lifts_the_caps_to_the_context():
    engine = load_engine("tiny-random", "fp32", **LONG_CONTEXT)
    try:
        prompt = " hello" * 6000  # 6,000 tokens, 36,000 characters
        assert len(engine.tokenizer.encode(prompt)) == 6000
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
        guarded = TestClient(create_app(engine, make_settings(), "tiny"))
        refused = guarded.post("/v1/completions", json=body)
        assert refused.status_code in (413, 422) and "4096" in refused.text + str(refused.status_code)
        lifted = TestClient(create_app(engine, make_settings(limits="context", timeout_s=600), "tiny"))
        served = lifted.post("/v1/completions", json=body)
        assert served.status_code == 200, served.text
        assert served.json()["usage"] == {"prompt_tokens": 6000, "completion_tokens": 2, "total_tokens": 6002}
        beyond = lifted.post("/v1/completions", json={**body, "prompt": " hello" * 9000})
        assert beyond.status_code == 422 and "the context allows at most 8176" in beyond.json()["error"]["message"]
        with lifted.stream(
            "POST", "/v1/completions", json={**body, "prompt": "hi", "max_tokens": 5000, "stream": True}
        ) as r:
            assert r.status_code == 200  # the guard's cap of 1024 new tokens is lifted to the context
    finally:
        engine.close()
