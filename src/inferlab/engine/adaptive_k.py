"""How many tokens one sequence drafts next round, from how often its drafts were accepted so far.

If each draft token is accepted with probability a, a round of k drafts emits 1 + a + ... + a^k tokens
on average (the accepted run plus the target's own token) and costs one target step (the verification:
on a CPU its k + 1 rows read the weights once, like a decode step) plus k draft steps of `draft_cost`
target steps each (the bytes a draft step reads over the target's). Each round takes the k in 0..max_k
with the most tokens per unit of cost (Leviathan et al. 2023, section 3.4). a is a running estimate
per sequence: text the draft knows well gets long rounds, text it does not gets short ones.

When even k = 1 costs more than it brings (a < draft_cost), the sequence decodes plainly for BACKOFF
tokens, then probes with one round of at least one draft: speculation resumes where it pays again.
The choice only ever depends on past rounds, so it keeps speculative sampling exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR = 0.8  # acceptance assumed before any evidence: a draft is used because it usually agrees
WEIGHT = 0.1  # each accepted or rejected draft token moves the estimate this far towards 1 or 0 (~10-token memory)
BACKOFF = 16  # plain decoding steps after speculation stopped paying, before the next probe


@dataclass
class AdaptiveK:
    max_k: int
    draft_cost: float  # one draft step, in target steps
    acceptance: float = PRIOR
    plain_left: int = field(default=0, init=False)  # plain steps before the next probe
    probing: bool = field(default=False, init=False)

    def next_k(self) -> int:
        if self.plain_left:
            self.plain_left -= 1
            self.probing = not self.plain_left
            return 0
        k = best_k(self.acceptance, self.draft_cost, self.max_k)
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
    """argmax over k in 0..max_k of expected tokens per round over its cost (ties: the shorter round)."""
    best, best_rate = 0, 1.0
    tokens, cost, run = 1.0, 1.0, 1.0
    for k in range(1, max_k + 1):
        run *= acceptance
        tokens, cost = tokens + run, cost + draft_cost
        if tokens / cost > best_rate * (1 + 1e-9):
            best, best_rate = k, tokens / cost
    return best
