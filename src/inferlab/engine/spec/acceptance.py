"""The acceptance rule: which draft tokens the target keeps, so that speculation changes no token's distribution.

The target computes K+1 next-token distributions p in one forward (after the last sampled token and after each of
the K drafts). Draft token i is accepted with probability min(1, p_i/q_i), q_i the draft's distribution it was
drawn from; at the first rejection the round ends with a token drawn from the normalized residual max(0, p_i - q_i);
if all K pass, a bonus token is drawn from p_K. Every emitted token is then distributed exactly as the target alone
would sample it (Leviathan et al. 2023, Chen et al. 2023); at temperature 0 the rule reduces to "keep the drafts
while they equal the target's argmax". A request speculating alone (spec/session.py) and the engine loop's
sequences (spec/in_loop.py) verify through the same `verify_proposal`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inferlab.engine.sampling import SamplingParams, argmax_rows, draw, probabilities
from inferlab.engine.spec.proposers import Proposal


def acceptance_probability(p_draft: Tensor, q_draft: Tensor) -> Tensor:
    """min(1, p/q) for each draft token, from the target's and the draft's probability of it. (k,) -> (k,)"""
    return (p_draft / q_draft).clamp(max=1.0)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """Where to resample after a rejection: normalized max(0, p - q). (vocab,) -> (vocab,)"""
    residual = (p - q).clamp(min=0.0)
    total = residual.sum()
    return residual / total if total > 0 else p  # p == q up to rounding: a rejection had probability ~0


def verify(p: Tensor, drafts: list[int], q: Tensor | None, generator: torch.Generator | None) -> tuple[int, int]:
    """Rejection-sample the drafts against the target: (how many accepted, the token that ends the round).

    p: (k+1, vocab) target distributions after each prefix; q: (k, vocab) the draft's, or None when the
    drafts were deterministic (point masses: q(d) = 1, residual = p without d).
    """
    k = len(drafts)
    d = torch.tensor(drafts, device=p.device, dtype=torch.long)
    if q is None:
        q = torch.zeros_like(p[:k]).scatter_(1, d.unsqueeze(1), 1.0)
    rows = torch.arange(k, device=p.device)
    accept = torch.rand(k, device=p.device, generator=generator) < acceptance_probability(p[rows, d], q[rows, d])
    n = int(accept.long().cumprod(0).sum()) if k else 0
    final = residual_distribution(p[n], q[n]) if n < k else p[k]
    return n, draw(final, generator)


def verify_greedy(target_logits: Tensor, drafts: list[int]) -> tuple[int, int]:
    """Temperature 0: keep drafts while they equal the target's argmax, then emit the target's own choice."""
    choice = argmax_rows(target_logits)  # (k+1,)
    n = 0
    while n < len(drafts) and drafts[n] == choice[n]:
        n += 1
    return n, choice[n]


def verify_proposal(
    logits: Tensor, proposal: Proposal, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, int]:
    """The target's (k+1, vocab) logits against a proposal: (drafts accepted, the token that ends the round),
    greedy at temperature 0, else rejection-sampled."""
    if params.greedy:
        return verify_greedy(logits, proposal.tokens)
    return verify(probabilities(logits, params), proposal.tokens, proposal.probs, generator)
