"""The engine loop's step counters add up to what ran: every token row counted once, as a decode or a prompt row."""

import time

from conftest import tiny_engine

from inferlab.engine.runtime.step_stats import StepStats

PROMPTS = [list(range(5, 5 + n)) for n in (7, 30, 19)]


def test_step_counters_count_every_row_and_first_token(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, "paged", slots=4)
    engine.generate_batch(PROMPTS, max_new_tokens=6)
    stats = engine.stats()
    prompt_rows, decode_rows = sum(len(p) for p in PROMPTS), len(PROMPTS) * 5  # the 6th token is sampled, never fed
    assert stats["engine_prompt_rows"] == prompt_rows and stats["engine_decode_rows"] == decode_rows
    assert stats["engine_first_tokens"] == len(PROMPTS) and stats["engine_first_token_s"] > 0
    assert 1 <= stats["engine_prompt_steps"] <= stats["engine_steps"] <= prompt_rows + decode_rows
    # read while the loop may still close its last step: only what that step had finished before its last event
    assert all(stats[f"engine_{p}_s"] > 0 for p in ("schedule", "pack", "forward", "sample"))
    assert stats["engine_attention_s"] <= stats["engine_forward_s"]


def test_a_wait_under_way_counts_up_to_each_snapshot_only():
    # counters scraped around a load hold the idle time between the scrapes, not a wait begun before the first
    stats = StepStats()
    with stats.idle():
        time.sleep(0.05)
        first = stats.snapshot()["engine_idle_s"]
        time.sleep(0.05)
        second = stats.snapshot()["engine_idle_s"]
    total = stats.snapshot()["engine_idle_s"]
    assert 0.05 <= first < second <= total
    assert "engine__idle_since" not in stats.snapshot()
