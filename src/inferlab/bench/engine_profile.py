"""Where an inferlab server's engine spent a load: its own step counters (/v1/metrics), before and after.

The engine loop counts its steps, token rows and each phase's seconds (engine/runtime/step_stats.py) and the server
the CPU time of its process and its HTTP event loop; the difference of two scrapes around one load, over
its steps or its wall time, says what a step held and where its time went: the forward (and its attention
outside the matrix products; and per token row, what one more sequence costs at that load), scheduling and
packing, sampling, the hand-off to the event loop, the engine thread waiting for a core, the loop idle for lack
of work; and with speculation on, how much it drafted and how much of that was kept.
"""

from __future__ import annotations

import httpx

PROFILE_COLUMNS = (
    "steps_per_s",
    "decode_rows_per_step",
    "prompt_rows_per_step",
    "fused_steps_pct",
    "step_ms",
    "forward_ms",
    "forward_ms_per_row",
    "attention_ms",
    "schedule_ms",
    "sample_ms",
    "handoff_ms",
    "off_cpu_ms",
    "idle_pct",
    "prompt_step_ms",
    "engine_ttft_ms",
    "event_loop_cpu_pct",
    "process_cpu_pct",
)


# With speculation on (engine/spec/in_loop.py), over the same load: tokens per target round of a sequence (1 where it
# decodes plainly), draft tokens it proposed per round (adaptive K's mean, its plain rounds included), and the share
# of the proposed drafts the target kept (0 when none was proposed)
SPEC_COLUMNS = ("tokens_per_target_call", "drafts_per_round", "spec_acceptance")


def scrape(url: str) -> dict[str, float]:
    """The counters of the inferlab server at `url` (its /v1/metrics numbers)."""
    metrics = httpx.get(f"{url}/v1/metrics", timeout=30).json()
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def step_profile(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """The PROFILE_COLUMNS of one load of `wall_s` seconds from the counters scraped before and after it."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    steps = max(d["engine_steps"], 1.0)
    rows = max(d["engine_decode_rows"] + d["engine_prompt_rows"], 1.0)

    def per_step(*names: str) -> float:
        return 1e3 * sum(d[f"engine_{n}_s"] for n in names) / steps

    return {
        "steps_per_s": d["engine_steps"] / wall_s,
        "decode_rows_per_step": d["engine_decode_rows"] / steps,
        "prompt_rows_per_step": d["engine_prompt_rows"] / steps,
        "fused_steps_pct": 100 * d["engine_fused_steps"] / steps,
        "step_ms": per_step("step"),
        "forward_ms": per_step("forward"),
        "forward_ms_per_row": 1e3 * d["engine_forward_s"] / rows,  # what a token row costs at this load
        "attention_ms": per_step("attention"),
        "schedule_ms": per_step("schedule", "pack"),
        "sample_ms": per_step("sample"),
        "handoff_ms": per_step("handoff"),
        "off_cpu_ms": per_step("step") - per_step("cpu"),
        "idle_pct": 100 * d["engine_idle_s"] / wall_s,
        "prompt_step_ms": 1e3 * d["engine_prompt_step_s"] / max(d["engine_prompt_steps"], 1.0),
        "engine_ttft_ms": 1e3 * d["engine_first_token_s"] / max(d["engine_first_tokens"], 1.0),
        "event_loop_cpu_pct": 100 * d["cpu_s_event_loop"] / wall_s,
        "process_cpu_pct": 100 * d["cpu_s_process"] / wall_s,
    } | (spec_profile(d) if "spec_target_calls" in d else {})


def spec_profile(d: dict[str, float]) -> dict[str, float]:
    """The SPEC_COLUMNS from the differences `d` of the speculation counters over a load."""
    rounds = max(d["spec_target_calls"], 1.0)
    return {
        "tokens_per_target_call": d["spec_generated"] / rounds,
        "drafts_per_round": d["spec_proposed"] / rounds,
        "spec_acceptance": d["spec_accepted"] / max(d["spec_proposed"], 1.0),
    }
