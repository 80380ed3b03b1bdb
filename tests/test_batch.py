"""Batched generation of prompts of different lengths against one request at a time."""

import pytest
import torch
from conftest import tiny_engine

from inferlab.engine.reference.static_batch import LeftPaddedBatch

PROMPTS = [list(range(5, 5 + n)) for n in (7, 30, 19, 3)]


def single_request_tokens(tokenizer, max_new_tokens: int) -> list[list[int]]:
    engine = tiny_engine(tokenizer, "contiguous", slots=1)
    return [engine.generate(p, max_new_tokens=max_new_tokens).token_ids for p in PROMPTS]


@pytest.mark.parametrize("mode", ["contiguous", "paged", "none"])
def test_generate_batch_gives_each_prompt_its_single_request_tokens(tiny_tokenizer, mode):
    engine = tiny_engine(tiny_tokenizer, mode, slots=4)
    batched = engine.generate_batch(PROMPTS, max_new_tokens=20)
    assert [c.token_ids for c in batched] == single_request_tokens(tiny_tokenizer, 20)
    assert all(c.finish_reason == "length" and c.timings.completion_tokens == 20 for c in batched)
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["requests_running"] == 0


def test_left_padded_logits_match_single_requests_at_every_step(tiny_tokenizer):
    batch_engine = tiny_engine(tiny_tokenizer, "contiguous", slots=4)
    single = tiny_engine(tiny_tokenizer, "contiguous", slots=4)  # each prompt alone in its own slot
    batch = LeftPaddedBatch(batch_engine.model, batch_engine.kv_cache, [3, 0, 2, 1], PROMPTS)
    logits = batch.prefill()
    sequences = [single.prefill(p) for p in PROMPTS]
    expected = [lg for lg, _ in sequences]
    for _ in range(16):
        for b in range(len(PROMPTS)):
            assert torch.allclose(logits[b], expected[b], atol=1e-5), (logits[b] - expected[b]).abs().max()
        tokens = [int(torch.argmax(row)) for row in logits]
        logits = batch.decode(tokens)
        expected = [single.decode_step(t, seq) for t, (_, seq) in zip(tokens, sequences)]
    for _, seq in sequences:
        seq.release()


def test_batches_larger_than_the_slots_run_in_waves(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, "contiguous", slots=2)
    assert [c.token_ids for c in engine.generate_batch(PROMPTS, max_new_tokens=8)] == single_request_tokens(
        tiny_tokenizer, 8
    )
    assert engine.pool.used == 0


def test_each_sequence_stops_on_its_own(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, "contiguous", slots=4)
    free_run = engine.generate_batch(PROMPTS, max_new_tokens=12)
    stop = free_run[1].text[3:5]  # a stop string only the second prompt is known to reach
    stopped = engine.generate_batch(PROMPTS, max_new_tokens=12, stop=[stop])
    assert stopped[1].finish_reason == "stop" and stopped[1].text == free_run[1].text[:3]
    for free, other in zip(free_run, stopped):
        if stop not in free.text:
            assert other.token_ids == free.token_ids
