"""What the spec_decode study reports: acceptance, target calls per token, and wall-clock speedup.

Both sides run the same code (`SpecSession` over a single-slot KV cache); the target-only baseline is
simply K = 0, so the speedup isolates speculation itself from any other difference between paths.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from inferlab.engine.drafters import NgramDrafter
from inferlab.engine.sampling import SamplingParams
from inferlab.engine.speculative import Speculation, SpecStats
from inferlab.model.transformer import Transformer


@dataclass
class SpecMeasurement:
    drafter: str
    k: int
    temperature: float
    tokens: int  # generated per pass over the prompts (each prompt runs to max_new_tokens)
    acceptance_rate: float  # accepted / proposed draft tokens
    mean_accepted_length: float  # draft tokens accepted per target forward (0..k)
    target_calls_per_token: float  # 1.0 for the baseline; (k+1)^-1 at best
    draft_calls_per_token: float
    spec_s: float  # median wall time of one pass, speculative
    baseline_s: float  # median wall time of one pass, target only
    speedup: float  # baseline_s / spec_s
    outputs_match: bool | None  # temperature 0: speculative tokens == target-only tokens (None when sampling)

    def as_dict(self) -> dict:
        return asdict(self)


def measure_speculation(target: Transformer, speculation: Speculation, prompts: list[list[int]],
                        temperature: float = 0.0, max_new_tokens: int = 64, top_p: float = 1.0, top_k: int = 0,
                        seed: int = 0, repeats: int = 3) -> SpecMeasurement:
    """Run every prompt with `speculation` and with the target alone, `repeats` times (after one warm-up pass)."""
    baseline = Speculation(NgramDrafter(), 0)
    spec_times, base_times = [], []
    stats = SpecStats()
    for rep in range(repeats + 1):  # pass 0 warms up; its time is not kept
        spec_s, spec_out, spec_stats = _run_pass(target, speculation, prompts, temperature, max_new_tokens, top_p, top_k, seed)
        base_s, base_out, _ = _run_pass(target, baseline, prompts, temperature, max_new_tokens, top_p, top_k, seed)
        if rep:
            spec_times.append(spec_s)
            base_times.append(base_s)
        stats = spec_stats
    spec_median, base_median = statistics.median(spec_times), statistics.median(base_times)
    tokens = stats.generated
    return SpecMeasurement(
        drafter=speculation.drafter.name, k=speculation.k, temperature=temperature, tokens=tokens,
        acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length,
        target_calls_per_token=stats.target_calls_per_token, draft_calls_per_token=stats.draft_calls / tokens,
        spec_s=spec_median, baseline_s=base_median, speedup=base_median / spec_median,
        outputs_match=spec_out == base_out if temperature == 0.0 else None)


def _run_pass(target: Transformer, speculation: Speculation, prompts: list[list[int]], temperature: float,
              max_new_tokens: int, top_p: float, top_k: int, seed: int) -> tuple[float, list[list[int]], SpecStats]:
    total = SpecStats()
    outputs = []
    device = target.rope_cos.device
    _synchronize(device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed + i)
        session = speculation.start(target, prompt, params, max_new_tokens, params.make_generator(device))
        while len(session.tokens) < max_new_tokens:
            session.step()
        outputs.append(session.tokens)
        total.add(session.stats)
    _synchronize(device)
    return time.perf_counter() - start, outputs, total


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
