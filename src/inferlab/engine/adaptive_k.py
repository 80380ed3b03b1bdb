"""How many tokens one sequence drafts next round, from how often its drafts were accepted so far.

If each draft token is accepted with probability a, a round of k drafts emits 1 + a + ... + a^k tokens
on average (the accepted run plus the target's own token) and costs one target step of k + 1 rows (the
verification: on a CPU its rows read the weights once, like a decode step, plus each row's arithmetic) and
k draft steps: 1 + k * `draft_cost` one-row target steps, a draft token costing its draft step and its
verified row (Calibration, timed at load; the draft's bytes over the target's before that). Each round takes
the k in 0..max_k with the most tokens per unit of cost (Leviathan et al. 2023, section 3.4). a is a running
estimate per sequence: text the draft knows well gets long rounds, text it does not gets short ones.

In the engine loop a verification is rows of a batched step, and there each row costs: at c=8 the step's
8 x (k + 1) rows take several one-row steps' time (the lm_head and attention per row, the kernel's rows per
pass), and so do the draft's rows. The loop times both: StepCost fits its decode steps as seconds = a + b * rows,
DraftCost its drafting per drafted token, each from the fastest of its recent timings (the load-time Calibration
until it has its own); one draft token then costs (b + drafting) over the sequence's share of a plain step,
(a + b * B) / B for B decodes (draft_token_cost): small for one sequence, large under load, where speculation
then falls back to plain decoding.

When even k = 1 costs more than it brings (a < the draft token's cost), the sequence decodes plainly for BACKOFF
tokens, then probes with one round of at least one draft: speculation resumes where it pays again.
The choice only ever depends on past rounds, so it keeps speculative sampling exact.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

PRIOR = 0.8  # acceptance assumed before any evidence: a draft is used because it usually agrees
WEIGHT = 0.1  # each accepted or rejected draft token moves the estimate this far towards 1 or 0 (~10-token memory)
BACKOFF = 16  # plain decoding steps after speculation stopped paying, before the next probe
WINDOW = 32  # the recent steps (and draftings) whose costs adaptive K counts
MIN_SAMPLES = 4  # timings of a row count before its fastest is a point of the fitted line
MIN_SPREAD = 3  # rows between the fewest and most rows timed before a row's cost is fitted


@dataclass
class AdaptiveK:
    max_k: int
    draft_cost: float  # one draft step, in target steps
    acceptance: float = PRIOR
    plain_left: int = field(default=0, init=False)  # plain steps before the next probe
    probing: bool = field(default=False, init=False)

    def next_k(self, token_cost: float | None = None) -> int:
        """This round's K; `token_cost`: a draft token's cost as measured (draft_token_cost), else `draft_cost`."""
        if self.plain_left:
            self.plain_left -= 1
            self.probing = not self.plain_left
            return 0
        k = best_k(self.acceptance, self.draft_cost if token_cost is None else token_cost, self.max_k)
        if k or self.probing:
            self.probing = False
            return max(k, min(1, self.max_k))
        self.plain_left = BACKOFF - 1
        self.probing = not self.plain_left
        return 0

    def observe(self, proposed: int, accepted: int) -> None:
        """A verified round: `accepted` drafts kept, then (if any was left) one rejected; later ones unseen."""
        for _ in range(accepted):
            self.acceptance += WEIGHT * (1.0 - self.acceptance)
        if accepted < proposed:
            self.acceptance -= WEIGHT * self.acceptance


def best_k(acceptance: float, draft_cost: float, max_k: int) -> int:
    """argmax over k in 0..max_k of expected tokens per round over its cost, 1 + k * draft_cost plain steps
    (ties: the shorter round)."""
    best, best_rate = 0, 1.0
    tokens, cost, run = 1.0, 1.0, 1.0
    for k in range(1, max_k + 1):
        run *= acceptance
        tokens, cost = tokens + run, cost + draft_cost
        if tokens / cost > best_rate * (1 + 1e-9):
            best, best_rate = k, tokens / cost
    return best


@dataclass(frozen=True)
class Calibration:
    """A drafter's costs timed at load (drafters.ModelDrafter.measure_cost), what adaptive K counts until the engine
    loop has timed its own: a target step of `rows` rows takes a + b * rows seconds, a draft token `draft`."""

    a: float
    b: float
    draft: float

    def token_cost(self) -> float:
        """One draft token (its draft step and its verified row) of one sequence, in its one-row target steps."""
        return (self.draft + self.b) / (self.a + self.b)


@dataclass
class StepCost:
    """A target step's seconds as a + b * rows, from the fastest of the last WINDOW steps at each row count (others on
    a shared machine only ever slow a step down: a decayed mean of them read a stray slow verification as a costly
    row, and with a few rows' spread a steep b left a near 0, a draft token costing more than a step, so that
    sequences went to plain decoding). A least-squares line through the row counts seen MIN_SAMPLES times once they
    span MIN_SPREAD rows; before that the prior's line (the load-time timing; without one, b = 0) scaled to the
    fastest step seen."""

    steps: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def observe(self, rows: int, seconds: float) -> None:
        self.steps.append((rows, seconds))

    def fit(self, prior: tuple[float, float] | None = None) -> tuple[float, float] | None:
        """(a, b): seconds per step and per row, both >= 0; `prior` before any step (None without one)."""
        if not self.steps:
            return prior
        fastest: dict[int, float] = {}
        for rows, seconds in self.steps:
            fastest[rows] = min(seconds, fastest.get(rows, math.inf))
        counts = Counter(rows for rows, _ in self.steps)
        seen = {rows: seconds for rows, seconds in fastest.items() if counts[rows] >= MIN_SAMPLES}
        if len(seen) < 2 or max(seen) - min(seen) < MIN_SPREAD:
            a, b = prior if prior is not None else (1.0, 0.0)
            scale = min(seconds / (a + b * rows) for rows, seconds in fastest.items())
            return a * scale, b * scale
        n = len(seen)
        mean_r, mean_t = sum(seen) / n, sum(seen.values()) / n
        slope = sum((r - mean_r) * (t - mean_t) for r, t in seen.items()) / sum((r - mean_r) ** 2 for r in seen)
        b = min(max(0.0, slope), mean_t / mean_r)
        return mean_t - b * mean_r, b


@dataclass
class DraftCost:
    """Seconds of drafting per drafted token (a draft step's rows, its catching up on accepted tokens): the fastest of
    the last WINDOW draftings."""

    per_token_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def observe(self, tokens: int, seconds: float) -> None:
        self.per_token_seconds.append(seconds / tokens)

    def per_token(self) -> float | None:
        return min(self.per_token_seconds, default=None)


def draft_token_cost(step: StepCost, draft: DraftCost, decodes: int, prior: Calibration | None = None) -> float | None:
    """One more draft token of a sequence (its drafting and its verified row), over the sequence's share of a plain
    step of `decodes` decodes; None before anything is timed. `prior` (the load-time timing) counts as one more
    timing of each, scaled to the steps the loop has timed (the machine may be busier or quieter now): a timing
    taken in a burst of load never keeps a sequence from drafting once the loop has drafted faster than that."""
    fit = step.fit((prior.a, prior.b) if prior is not None else None)
    if fit is None:
        return None
    a, b = fit
    timed = [t for t in (draft.per_token(),) if t is not None]
    if prior is not None:
        timed.append(prior.draft * (a + b) / (prior.a + prior.b))
    if not timed:
        return None
    share = (a + b * decodes) / max(decodes, 1)
    return (b + min(timed)) / share if share > 0 else None
