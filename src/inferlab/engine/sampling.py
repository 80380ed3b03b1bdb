"""Turning logits into the next token: greedy, temperature, top-k, top-p, seeded per request.

`SamplingParams` also carries what reads a request's token history (penalties, logit bias, min_tokens;
engine/logits.py applies them) and what the request reports back (log-probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from inferlab.engine.grammar import Constraint
from inferlab.errors import InvalidRequestError

MAX_LOGPROBS = 20  # top alternatives a request may ask for per token (OpenAI's limit)


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # end the request like EOS does
    ignore_eos: bool = False  # EOS is an ordinary token: generate max_new_tokens
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    presence_penalty: float = 0.0  # minus this once for every token already generated
    frequency_penalty: float = 0.0  # minus this times how often a token was generated
    repetition_penalty: float = 1.0  # a token of the prompt or output: logit / p if > 0, else logit * p
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to those tokens' logits
    logprobs: int | None = None  # report each generated token's log-probability and this many top ones
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (computed in the prefill)
    constraint: Constraint | None = None  # what the output must match (engine/grammar.py); None: anything

    def __post_init__(self) -> None:
        least = 0 if self.prompt_logprobs is not None else 1  # prompt log-probabilities alone generate nothing
        if self.max_new_tokens < least:
            raise InvalidRequestError(f"max_new_tokens must be >= {least}, got {self.max_new_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]")
        if self.min_tokens < 0 or self.min_tokens > self.max_new_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
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

    def history_fields(self) -> list[str]:
        """The fields set to something that reads the request's token history or reports log-probabilities."""
        defaults = {
            "min_tokens": 0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "logit_bias": {},
            "logprobs": None,
            "prompt_logprobs": None,
        }
        return [name for name, default in defaults.items() if getattr(self, name) != default]

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


def argmax_rows(logits: Tensor) -> list[int]:
    """Each row's argmax of (R, vocab) logits, the first of equal maxima as torch.argmax takes it.

    numpy's on the CPU: its vectorized argmax over a vocabulary's row is an order of magnitude faster than torch's,
    and torch's opens a parallel region from a few rows on, which on a busy machine waits for a core another process
    holds. numpy has no bf16: bf16 logits are widened to fp32 first (exact, and order-preserving), which is cheaper
    than comparing their int16 bits in numpy (four whole-row temporaries).
    """
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return logits.argmax(-1).tolist()
    return logits.float().numpy().argmax(-1).tolist()


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """One index drawn from (vocab,) probabilities (any non-negative weights), as torch.multinomial draws it: the
    inverse of their float64 running sum at one uniform of `generator`.

    torch.multinomial over a whole vocabulary is much slower on the CPU and opens a parallel region (which on a busy
    machine waits for a core another process holds); speculative sampling draws once per draft token besides every
    round's own token."""
    if probs.device.type != "cpu":
        return int(torch.multinomial(probs, 1, generator=generator))
    cumulative = np.cumsum(probs.numpy(), dtype=np.float64)
    point = float(torch.rand((), dtype=torch.float64, generator=generator)) * cumulative[-1]
    index = int(np.searchsorted(cumulative, point, side="right"))  # the first entry whose sum passes the point
    return index if index < len(cumulative) else int(np.flatnonzero(probs.numpy())[-1])  # point rounded to the sum


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from (vocab,) logits."""
    if params.greedy:
        return argmax_rows(logits[None])[0]
    return draw(probabilities(logits, params), generator)
