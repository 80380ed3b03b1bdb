"""Calibration: what a target step and a draft step cost by rows, timed once at load, before the engine loop has
timed its own.

Speculation pays where a draft token costs less than what its acceptance brings, and both the target's verification
(k + 1 rows) and the draft's steps cost by their rows: `timed_lines` times each model's steps of one row and of many,
and `Calibration` holds the two lines adaptive K prices rounds with (spec/adaptive_k.py) until the loop's own
timings of its steps take over.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import torch

from inferlab.engine.model_runner import SlotRunner
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.transformer import Transformer

MEASURE_CONTEXT = 32  # tokens before the timed steps
MEASURE_REPEATS = 8  # timed steps of each kind


@dataclass(frozen=True)
class Calibration:
    """A drafter's costs timed at load (its measure_cost: timed_lines), what adaptive K counts until the
    engine loop has timed its own: a target step of `rows` rows takes a + b * rows seconds, a draft step of `rows`
    rows draft_a + draft_b * rows (0 for a drafter without a model)."""

    a: float
    b: float
    draft_a: float
    draft_b: float

    def token_cost(self) -> float:
        """One draft token (its draft step and its verified row) of one sequence, in its one-row target steps."""
        return (self.draft_a + self.draft_b + self.b) / (self.a + self.b)


@torch.inference_mode()
def timed_lines(models: list[tuple[Transformer, FusedDecode | None]], rows: int) -> list[tuple[float, float]]:
    """Each model's steps as seconds = a + b * rows: steps of one row and of `rows` rows, after a short context, taken
    in turn MEASURE_REPEATS times; the first model's fastest one-row step, the others as the median of their ratios to
    the one-row step of their turn (timed one model after the other, or each by its fastest step, a burst of load on a
    shared machine lands on one model only and the ratio swings by several times). Timed, not read off the weights'
    bytes: a draft's step costs more than its bytes say where its kernels do more arithmetic per byte (int4's)."""
    runners = [SlotRunner.alone(model, MEASURE_CONTEXT + rows, fused) for model, fused in models]
    for runner in runners:
        runner.forward(list(range(MEASURE_CONTEXT)), last_only=True)
    runs = [functools.partial(runner.verify_rows, [1] * n) for runner in runners for n in (1, rows)]
    turns = []
    for _ in range(MEASURE_REPEATS):
        turn = []
        for run in runs:
            start = time.perf_counter()
            logits = run()
            if logits.is_cuda:  # a step's kernels run after the call returns
                torch.cuda.synchronize(logits.device)
            turn.append(time.perf_counter() - start)
        turns.append(turn)
    one = min(t[0] for t in turns)
    seconds = [one] + [one * statistics.median(t[i] / t[0] for t in turns) for i in range(1, len(runs))]
    return [line(seconds[i], seconds[i + 1], rows) for i in range(0, len(runs), 2)]


def line(one: float, many: float, rows: int) -> tuple[float, float]:
    """(a, b) of seconds = a + b * rows through a step of one row and one of `rows` rows (b in 0..one)."""
    b = min(max(0.0, (many - one) / (rows - 1)), one) if rows > 1 else 0.0
    return one - b, b
