"""Turning logits into the next token: greedy, temperature, top-k, top-p, seeded per request."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from inferlab.errors import InvalidRequestError


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy:
            return None
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution sampling draws from: (..., vocab) logits -> (..., vocab) probs, in fp32.

    Also what speculative decoding compares draft and target against, so both share one definition.
    """
    # shift first and keep T a normal fp32 number: a tiny temperature (say 1e-300) must sharpen towards
    # greedy, not overflow x / T to inf (or underflow T to 0) and turn the softmax into nan
    logits = logits.float()
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p; the first one always stays, even
        # for a top_p (say 1e-50) that rounds to 0 in fp32, or every token would go and the softmax be nan
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from (vocab,) logits."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))
