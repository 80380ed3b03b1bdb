"""What a request's own history does to its logits before sampling, and the log-probabilities it reports.

The definitions are OpenAI's and vLLM's, applied in vLLM's order: logit bias, then min_tokens (its stop
tokens masked), then the penalties on the raw token history:
- repetition_penalty p, over the prompt and the output: a seen token's logit l becomes l / p if l > 0,
  else l * p (p > 1 discourages repeats);
- frequency_penalty f and presence_penalty r, over the output only: l - f * count - r * (count > 0).
Log-probabilities are the model's own (the log-softmax of the raw logits, before any of this or the
temperature), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inferlab.engine.sampling import SamplingParams


@dataclass
class TokenLogprob:
    """One position: its token's log-probability and the `top` most likely tokens there, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def process_logits(
    logits: Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int], stop_ids: Collection[int]
) -> Tensor:
    """(vocab,) logits -> the (vocab,) logits sampling draws from, in fp32; unchanged when nothing applies."""
    if not changes_logits(params):
        return logits
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    # ids the vocabulary does not have (a client may name any) can never be sampled: they change nothing
    bias = {t: b for t, b in params.logit_bias.items() if t < vocab}
    if bias:
        logits[torch.tensor(list(bias), device=logits.device)] += torch.tensor(
            list(bias.values()), device=logits.device
        )
    stops = sorted(t for t in stop_ids if t < vocab)
    if len(output_ids) < params.min_tokens and stops:
        logits[torch.tensor(stops, device=logits.device)] = float("-inf")
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=logits.device), minlength=vocab)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(prompt_ids, dtype=torch.long, device=logits.device)] = True
        p = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
        logits.clamp_(max=torch.finfo(logits.dtype).max)  # a tiny penalty (say 1e-300) must not divide to inf
    if params.frequency_penalty or params.presence_penalty:
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return logits


def changes_logits(params: SamplingParams) -> bool:
    """Whether `process_logits` does anything for these params (else sampling reads the raw logits)."""
    return bool(
        params.logit_bias
        or params.min_tokens
        or params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
    )


def log_probs(logits: Tensor) -> Tensor:
    """(..., vocab) raw logits -> log-probabilities, in fp32."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprob(logprobs: Tensor, token_id: int, top: int) -> TokenLogprob:
    """The entry for one position from its (vocab,) log-probabilities."""
    best = torch.topk(logprobs, top) if top else None
    pairs = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    return TokenLogprob(token_id, float(logprobs[token_id]), pairs)
