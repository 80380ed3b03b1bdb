"""Paged KV blocks against the contiguous cache: attention, batched forwards, and the pool's memory."""

import torch
from conftest import tiny_config, tiny_engine, tiny_model

from inferlab.engine.kv.block_manager import BlockManager, BlockTable
from inferlab.engine.kv.contiguous import CachedAttend, KVCache, compute_kv_cache_bytes
from inferlab.engine.kv.paged import PagedKVCache, blocks_for_budget
from inferlab.engine.model_runner import FlatAttend, FlatBatch, Segment, forward_paged
from inferlab.engine.reference.single import forward_together

CPU = torch.device("cpu")


def test_flat_attention_equals_contiguous_attention():
    """One sequence's prompt, a chunk and a decode row through scattered paged blocks, against the
    contiguous cache's own attention."""
    torch.manual_seed(0)
    config = tiny_config()
    H, KV, D, n_cached, n_new = config.n_heads, config.n_kv_heads, config.head_dim, 21, 6
    contiguous = KVCache(config, slots=1, max_seq_len=64, dtype=torch.float32, device=CPU)
    paged = PagedKVCache.allocate(config, num_blocks=12, block_size=4, dtype=torch.float32, device=CPU)
    table = [9, 2, 11, 0, 5, 7, 3]  # scattered blocks: 28 positions
    for start, n in ((0, n_cached), (n_cached, n_new), (n_cached + n_new, 1)):  # prompt, chunk, decode
        q, k, v = torch.randn(1, H, n, D), torch.randn(1, KV, n, D), torch.randn(1, KV, n, D)
        batch = FlatBatch.pack([Segment(list(range(n)), start, table)], CPU)
        for layer in range(config.n_layers):
            expected = CachedAttend(contiguous, start, n)(layer, q, k, v)
            got = FlatAttend(paged, batch)(layer, q, k, v)
            assert torch.allclose(got, expected, atol=1e-6), (got - expected).abs().max()
    # every written position landed in its block: block table[p // 4], offset p % 4
    for p in range(n_cached + n_new + 1):
        block, offset = table[p // 4], p % 4
        assert torch.equal(paged.k[1, block, :, offset], contiguous.k[1, 0, :, p])


def test_batched_paged_forward_matches_single_requests_at_every_step(tiny_tokenizer):
    model = tiny_model()
    single = tiny_engine(tiny_tokenizer, "contiguous", slots=1)  # same seed: same weights
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 33, 2)]
    paged = PagedKVCache.allocate(model.config, num_blocks=40, block_size=8, dtype=torch.float32, device=CPU)
    blocks = BlockManager(40, 8, block_bytes=1)
    tables = [BlockTable() for _ in prompts]
    tokens: list[list[int]] = []
    last_logits = []
    for table, prompt in zip(tables, prompts):  # prefills one by one, as the engine loop runs them
        assert blocks.allocate(table, prompt, len(prompt) + 1)
        last_logits.append(forward_paged(model, paged, [prompt], [0], [table.blocks])[0])
        blocks.advance(table, prompt, len(prompt))
        tokens.append(list(prompt))
    references = []
    for prompt in prompts:
        logits, seq = single.prefill(prompt)
        steps = [logits]
        for _ in range(12):
            steps.append(single.decode_step(int(torch.argmax(steps[-1])), seq))
        seq.release()
        references.append(steps)
    logits = torch.stack(last_logits)
    for step in range(13):
        for b in range(len(prompts)):
            assert torch.allclose(logits[b], references[b][step], atol=1e-5), (step, b)
        if step == 12:
            break
        nxt = [int(torch.argmax(row)) for row in logits]
        for table, seq_tokens, token in zip(tables, tokens, nxt):
            seq_tokens.append(token)
            assert blocks.ensure_room(table, len(seq_tokens))
        logits = forward_paged(
            model, paged, [[t] for t in nxt], [t.num_computed for t in tables], [t.blocks for t in tables]
        )  # one batched decode, four lengths
        for table, seq_tokens in zip(tables, tokens):
            blocks.advance(table, seq_tokens, 1)


def test_paged_sequences_decoding_together_match_each_decoding_alone(tiny_tokenizer):
    """forward_together (the profile study's batched steps): one flat forward for every sequence's next token gives
    each the logits its own decode steps give on the contiguous engine, without autograd's record (the profile study
    reads them with numpy: int8 at 16 sequences on an AVX2 build runs the Python model there, and failed so); their
    blocks all go back on release."""
    engine = tiny_engine(tiny_tokenizer, "paged")
    reference = tiny_engine(tiny_tokenizer, "contiguous", slots=1)  # same seed: same weights
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 33)]
    seqs, firsts = zip(*[engine.prefill(p, reserve_tokens=8)[::-1] for p in prompts])
    logits = torch.stack(firsts)
    together = [logits]
    for _ in range(6):
        logits = forward_together(list(seqs), [[int(torch.argmax(row))] for row in logits])
        assert not logits.requires_grad
        together.append(logits)
    for b, prompt in enumerate(prompts):
        want, seq = reference.prefill(prompt)
        for step in together:
            torch.testing.assert_close(step[b], want, atol=1e-5, rtol=0)
            want = reference.decode_step(int(torch.argmax(want)), seq)
        seq.release()
    assert [s.length for s in seqs] == [len(p) + 6 for p in prompts]
    for seq in seqs:
        seq.release()
    assert not any(engine.blocks.ref_counts)


def test_paged_engine_generates_what_the_contiguous_engine_generates(tiny_tokenizer):
    prompt = list(range(40, 80))
    outputs = [
        tiny_engine(tiny_tokenizer, mode).generate(prompt, max_new_tokens=24).token_ids
        for mode in ("contiguous", "paged")
    ]
    assert len(outputs[0]) == 24 and outputs[0] == outputs[1]


def test_pool_memory_equals_the_calculator():
    config = tiny_config(n_layers=3)
    block_bytes = compute_kv_cache_bytes(config, 1, 16, torch.float32)
    n = blocks_for_budget(config, budget_mb=1, block_size=16, dtype=torch.float32)
    assert n == 2**20 // block_bytes
    cache = PagedKVCache.allocate(config, n, 16, torch.float32, CPU)
    assert cache.nbytes == compute_kv_cache_bytes(config, n, 16, torch.float32) <= 2**20


def test_a_request_holds_only_the_blocks_its_tokens_need(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, "paged", slots=1)  # a pool as large as one 256-token slot
    logits, seq = engine.prefill(list(range(10, 50)))  # 40 tokens
    stats = engine.stats()
    assert stats["kv_blocks_total"] == 16 and stats["kv_blocks_used"] == 3  # ceil(40 / 16)
    measured = stats["kv_blocks_used"] * stats["kv_bytes_per_block"]
    assert measured == compute_kv_cache_bytes(engine.loaded.config, 1, 48, torch.float32)
    seq.release()
    assert engine.stats()["kv_blocks_used"] == 0
