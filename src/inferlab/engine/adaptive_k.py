"""How many tokens one sequence drafts next round, from how often its drafts were accepted so far.

If each draft token is accepted with probability a, a round of k drafts emits 1 + a + ... + a^k tokens
on average (the accepted run plus the target's own token) and costs one target step (the verification:
on a CPU its k + 1 rows read the weights once, like a decode step) plus k draft steps of `draft_cost`
target steps each (the bytes a draft step reads over the target's). Each round takes the k in 0..max_k
with the most tokens per unit of cost (Leviathan et al. 2023, section 3.4). a is a running estimate
per sequence: text the draft knows well gets long rounds, text it does not gets short ones.

In the engine loop a verification is rows of a batched step, and there each row costs: at c=8 the step's
8 x (k + 1) rows take several one-row steps' time (the lm_head and attention per row, the kernel's rows per
pass). StepCost fits the loop's own step times as seconds = a + b * rows, and each draft then also costs
`row_cost` = b over the sequence's share of a plain step, (a + b * B) / B for B decodes: near 0 for one
sequence, large under load, where speculation then falls back to plain decoding.

When even k = 1 costs more than it brings (a < draft_cost + row_cost), the sequence decodes plainly for BACKOFF
tokens, then probes with one round of at least one draft: speculation resumes where it pays again.
The choice only ever depends on past rounds, so it keeps speculative sampling exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR = 0.8  # acceptance assumed before any evidence: a draft is used because it usually agrees
WEIGHT = 0.1  # each accepted or rejected draft token moves the estimate this far towards 1 or 0 (~10-token memory)
BACKOFF = 16  # plain decoding steps after speculation stopped paying, before the next probe
DECAY = 0.98  # each step's weight in the step-cost fit shrinks by this per later step (~50-step memory)
MIN_ROWS_VARIANCE = 1.0  # rows^2: below it the steps seen do not tell a row's cost from the step's


@dataclass
class AdaptiveK:
    max_k: int
    draft_cost: float  # one draft step, in target steps
    acceptance: float = PRIOR
    plain_left: int = field(default=0, init=False)  # plain steps before the next probe
    probing: bool = field(default=False, init=False)

    def next_k(self, row_cost: float = 0.0) -> int:
        """This round's K; `row_cost`: one more verified row, in units of this sequence's plain step (StepCost)."""
        if self.plain_left:
            self.plain_left -= 1
            self.probing = not self.plain_left
            return 0
        k = best_k(self.acceptance, self.draft_cost + row_cost, self.max_k)
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


@dataclass
class StepCost:
    """A target step's seconds as a + b * rows, least squares over the steps seen (each weighted DECAY^age).
    Until the steps seen vary in rows, b = 0: a verification costs one step whatever its rows."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weights, rows, rows^2, seconds, rows * seconds

    def observe(self, rows: int, seconds: float) -> None:
        self.sums = [DECAY * s for s in self.sums]
        for i, value in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            self.sums[i] += value

    def fit(self) -> tuple[float, float]:
        """(a, b): seconds per step and per row, both >= 0; (0, 0) before any step."""
        w, r, rr, t, rt = self.sums
        if w == 0:
            return 0.0, 0.0
        mean_r, mean_t = r / w, t / w
        variance = rr / w - mean_r * mean_r
        b = max(0.0, (rt / w - mean_r * mean_t) / variance) if variance >= MIN_ROWS_VARIANCE else 0.0
        return max(0.0, mean_t - b * mean_r), b

    def row_cost(self, decodes: int) -> float:
        """One more row in a step of `decodes` one-token decodes, over one decode's share of that step."""
        a, b = self.fit()
        share = (a + b * decodes) / max(decodes, 1)
        return b / share if share > 0 else 0.0
