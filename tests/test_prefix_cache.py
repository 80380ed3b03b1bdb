"""Block-level prefix cache: a shared 200-token prefix is not recomputed, gives the same logits, and evicts LRU."""

from dataclasses import replace

import torch
from conftest import tiny_engine

from inferlab.engine.engine import InferenceEngine
from inferlab.engine.kv import block_manager
from inferlab.engine.kv.block_manager import BlockManager, BlockTable
from inferlab.engine.kv.prefix_cache import PrefixCache

SYSTEM = [(7 * i) % 250 + 1 for i in range(200)]  # a 200-token "system prompt"


def prefix_engine(tokenizer, **config) -> InferenceEngine:
    engine = tiny_engine(tokenizer, "paged", slots=4)
    return InferenceEngine(engine.loaded, replace(engine.config, prefix_cache=True, **config))


def test_shared_prefix_skips_its_blocks_and_gives_identical_first_token_logits(tiny_tokenizer):
    engine = prefix_engine(tiny_tokenizer)
    first = engine.generate(SYSTEM + [11, 12, 13, 14, 15], max_new_tokens=4)
    assert engine.stats()["kv_tokens_computed"] == 205 + 3
    prompt = SYSTEM + list(range(30, 42))  # 212 tokens, the first 192 in 12 full blocks shared
    computed = engine.stats()["kv_tokens_computed"]
    logits, seq = engine.prefill(prompt)
    assert engine.stats()["kv_tokens_computed"] - computed == len(prompt) - 192 == 20  # only the new tokens
    assert seq.kv.num_cached == 192 and engine.stats()["prefix_cache_hits"] == 12
    reference, ref_seq = tiny_engine(tiny_tokenizer, "contiguous").prefill(prompt)
    assert torch.allclose(logits, reference, atol=1e-5), (logits - reference).abs().max()
    seq.release()
    ref_seq.release()
    assert engine.generate(SYSTEM + [11, 12, 13, 14, 15], max_new_tokens=4).token_ids == first.token_ids


def test_prefix_hits_through_the_engine_loop(tiny_tokenizer):
    engine = prefix_engine(tiny_tokenizer)
    prompts = [SYSTEM + [40 + i, 41 + i, 42 + i] for i in range(3)]
    cold = engine.generate_batch(prompts[:1], max_new_tokens=6)
    computed = engine.stats()["kv_tokens_computed"]
    warm = engine.generate_batch(prompts, max_new_tokens=6)
    assert warm[0].token_ids == cold[0].token_ids
    reference = tiny_engine(tiny_tokenizer, "contiguous", slots=1)
    assert [c.token_ids for c in warm] == [reference.generate(p, max_new_tokens=6).token_ids for p in prompts]
    new_prompt_tokens = engine.stats()["kv_tokens_computed"] - computed - 3 * 5  # minus the decoded tokens
    assert new_prompt_tokens < 3 * 203 - 2 * 192  # the second and third requests reused at least the prefix


def test_a_hash_collision_is_caught_by_comparing_ids(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, ids: 42)  # every block collides
    engine = prefix_engine(tiny_tokenizer)
    engine.generate(SYSTEM[:40], max_new_tokens=2)
    other = [250 - t for t in SYSTEM[:40]]
    logits, seq = engine.prefill(other)
    assert seq.kv.num_cached == 0
    reference, ref_seq = tiny_engine(tiny_tokenizer, "contiguous").prefill(other)
    assert torch.allclose(logits, reference, atol=1e-5)
    seq.release()
    ref_seq.release()


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first_and_tails_first():
    blocks = BlockManager(num_blocks=6, block_size=4, block_bytes=1, prefix_cache=PrefixCache())
    a, a_ids = BlockTable(), list(range(1, 18))  # 17 tokens: 4 full blocks + 1
    assert blocks.allocate(a, a_ids, 17)
    blocks.advance(a, a_ids, 17)
    blocks.free(a)
    assert blocks.num_free == 6 and blocks.prefix.num_cached == 4  # cached blocks still count as free memory
    b, b_ids = BlockTable(), list(range(100, 112))
    assert blocks.allocate(b, b_ids, 13)  # 4 blocks: the 2 never-cached ones, then 2 evictions
    assert blocks.prefix.evictions == 2 and blocks.prefix.misses == 4 + 2  # a: 4 full blocks, b: 2
    blocks.free(b)  # never computed, so never cached: straight back to the free list
    again = BlockTable()
    assert blocks.allocate(again, a_ids, 17)  # the head of `a` survived: its two first blocks hit
    assert again.num_cached == 8 and blocks.prefix.hits == 2 and blocks.num_free == 1
    other = BlockTable()
    assert blocks.allocate(other, b_ids[:9], 9) is False  # 3 blocks, 1 free: nothing held, nothing leaked
    assert other.blocks == [] and blocks.num_free == 1
    blocks.free(again)
    assert blocks.num_free == 6 and not any(blocks.ref_counts)


def test_shared_blocks_are_reference_counted_not_copied():
    blocks = BlockManager(num_blocks=8, block_size=4, block_bytes=1, prefix_cache=PrefixCache())
    ids = list(range(1, 10))
    first = BlockTable()
    assert blocks.allocate(first, ids, 10)
    blocks.advance(first, ids, 9)
    second = BlockTable()
    assert blocks.allocate(second, ids, 10)
    assert second.blocks[:2] == first.blocks[:2] and second.blocks[2] != first.blocks[2]
    assert [blocks.ref_counts[b] for b in first.blocks[:2]] == [2, 2]
    blocks.free(first)
    blocks.free(second)
    assert blocks.num_free == 8 and not any(blocks.ref_counts)
