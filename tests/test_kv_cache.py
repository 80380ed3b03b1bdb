"""KV-cached decoding against full recomputation, the cache's in-place writes, and the slot pool."""

import pytest
import torch
from conftest import tiny_config, tiny_engine

from inferlab.engine.kv.contiguous import CachedAttend, KVCache, SlotPool, compute_kv_cache_bytes
from inferlab.errors import CapacityError


def test_cached_decode_matches_full_recompute_at_every_step(tiny_tokenizer):
    cached = tiny_engine(tiny_tokenizer, "contiguous")
    recompute = tiny_engine(tiny_tokenizer, "none")  # same seed: same weights
    prompt = list(range(5, 37))
    logits_c, seq_c = cached.prefill(prompt)
    logits_r, seq_r = recompute.prefill(prompt)
    for _ in range(100):
        assert torch.allclose(logits_c, logits_r, atol=1e-5, rtol=0), (logits_c - logits_r).abs().max()
        token = int(torch.argmax(logits_r))
        logits_c = cached.decode_step(token, seq_c)
        logits_r = recompute.decode_step(token, seq_r)
    assert seq_c.length == seq_r.length == len(prompt) + 100
    seq_c.release()


def test_greedy_tokens_identical_with_and_without_cache(tiny_tokenizer):
    prompt = list(range(40, 72))
    outputs = [
        tiny_engine(tiny_tokenizer, mode).generate(prompt, max_new_tokens=32, temperature=0).token_ids
        for mode in ("contiguous", "none")
    ]
    assert len(outputs[0]) == 32 and outputs[0] == outputs[1]


def test_update_writes_in_place_and_returns_views():
    config = tiny_config()
    cache = KVCache(config, slots=2, max_seq_len=16, dtype=torch.float32, device=torch.device("cpu"))
    k_ptr = cache.k.data_ptr()
    k = torch.randn(1, config.n_kv_heads, 3, config.head_dim)
    v = torch.randn(1, config.n_kv_heads, 3, config.head_dim)
    keys, values = cache.update(1, k, v, start_pos=4, slots=slice(1, 2))
    assert cache.k.data_ptr() == k_ptr and keys.data_ptr() == cache.k[1, 1].data_ptr()
    assert keys.shape == (1, config.n_kv_heads, 7, config.head_dim)
    assert torch.equal(cache.k[1, 1, :, 4:7], k[0]) and torch.equal(cache.v[1, 1, :, 4:7], v[0])
    assert cache.k[1, 0].abs().sum() == 0 and cache.k[0].abs().sum() == 0  # other slots and layers untouched


def test_chunked_prefill_with_offset_mask_matches_one_shot(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer)
    prompt = list(range(3, 43))
    one_shot, seq = engine.prefill(prompt)
    seq.release()
    _, seq = engine.prefill(prompt[:17])
    chunked = seq.forward(prompt[17:])  # 23 new tokens attending to 17 cached ones: causal with offset
    seq.release()
    assert torch.allclose(one_shot, chunked, atol=1e-5)


def test_compute_kv_cache_bytes_equals_formula():
    config = tiny_config(n_layers=3, n_kv_heads=2, dim=64, n_heads=4)
    for dtype, row_bytes in ((torch.float32, 16 * 4), (torch.bfloat16, 16 * 2), (torch.int8, 16 + 4)):
        expected = 2 * 3 * 2 * row_bytes * 100 * 5  # an int8 row of 16 codes carries its fp32 scale
        assert compute_kv_cache_bytes(config, batch_size=5, seq_len=100, dtype=dtype) == expected
    cache = KVCache(config, slots=5, max_seq_len=100, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert cache.nbytes == compute_kv_cache_bytes(config, 5, 100, torch.bfloat16)


def test_pool_refuses_what_does_not_fit():
    config = tiny_config()
    pool = SlotPool(KVCache(config, slots=2, max_seq_len=32, dtype=torch.float32, device=torch.device("cpu")), config)
    with pytest.raises(CapacityError, match="33 tokens.*holds 32 tokens"):
        pool.allocate(33)
    a, b = pool.allocate(32), pool.allocate(10)
    assert {a, b} == {0, 1} and pool.used == 2
    with pytest.raises(CapacityError, match="all 2 KV slots are in use"):
        pool.allocate(1)
    pool.release(a)
    assert pool.allocate(5) == a


def test_engine_refuses_request_larger_than_a_slot_and_frees_slots(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, max_new_tokens=8)
    with pytest.raises(CapacityError):
        engine.prefill(list(range(100)), reserve_tokens=200)  # 300 tokens > 256 per slot
    assert engine.pool.used == 0
    engine.generate(list(range(10)), max_new_tokens=4)
    assert engine.pool.used == 0  # released after generation


def test_cached_attend_single_query_needs_no_mask():
    config = tiny_config()
    cache = KVCache(config, slots=1, max_seq_len=16, dtype=torch.float32, device=torch.device("cpu"))
    assert CachedAttend(cache, start_pos=5, n_new=1).mask is None
    assert CachedAttend(cache, start_pos=0, n_new=4).mask is None  # plain causal
    assert CachedAttend(cache, start_pos=5, n_new=4).mask.shape == (1, 1, 4, 9)
