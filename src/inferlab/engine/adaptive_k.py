"""How many tokens one sequence drafts next round, from how often its drafts were accepted so far.

If each draft token is accepted with probability a, a round of k drafts emits 1 + a + ... + a^k tokens
on average (the accepted run plus the target's own token) and costs one target step (the verification:
on a CPU its k + 1 rows read the weights once, like a decode step) plus k draft steps of `draft_cost`
target steps each (the bytes a draft step reads over the target's). Each round takes the k in 0..max_k
with the most tokens per unit of cost (Leviathan et al. 2023, section 3.4). a is a running estimate
per sequence: text the draft knows well gets long rounds, text it does not gets short ones.

In the engine loop a verification is rows of a batched step, and there each row costs: at c=8 the step's
8 x (k + 1) rows take several one-row steps' time (the lm_head and attention per row, the kernel's rows per
pass), and so do the draft's rows. The loop times both: StepCost fits its decode steps as seconds = a + b * rows,
DraftCost its drafting per drafted token; one draft token then costs (b + drafting) over the sequence's share of
a plain step, (a + b * B) / B for B decodes (draft_token_cost): small for one sequence, large under load, where
speculation then falls back to plain decoding.

When even k = 1 costs more than it brings (a < the draft token's cost), the sequence decodes plainly for BACKOFF
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


@dataclass
class DraftCost:
    """Seconds of drafting per drafted token (a draft step's rows, its catching up on accepted tokens), over the
    recent steps (each weighted DECAY^age)."""

    seconds: float = 0.0
    tokens: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        self.seconds, self.tokens = DECAY * self.seconds + seconds, DECAY * self.tokens + tokens

    def per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens else None


def draft_token_cost(step: StepCost, draft: DraftCost, decodes: int) -> float | None:
    """One more draft token of a sequence (its drafting and its verified row), over the sequence's share of a plain
    step of `decodes` decodes; None until the loop has timed both."""
    a, b = step.fit()
    share = (a + b * decodes) / max(decodes, 1)
    drafting = draft.per_token()
    return (b + drafting) / share if drafting is not None and share > 0 else None
