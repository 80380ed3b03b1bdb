"""Proposers: cheap guesses of the next K tokens that speculative decoding verifies with the target.

A `Drafter` holds what requests share (a draft model's weights, its measured costs); a request speculating alone
drafts through its own `DraftState` (`Drafter.start`), and the engine loop's sequences draft together through
`LoopDrafts`, one batch a draft step. Two kinds of drafter: n-gram prompt lookup, here (no model: copy what followed
the latest earlier occurrence of the context's last n tokens), and a draft model sharing the target's vocabulary
(spec/draft_model.py).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inferlab.engine.request import Request
from inferlab.engine.sampling import SamplingParams
from inferlab.engine.spec.adaptive_k import StepCost
from inferlab.engine.spec.calibration import Calibration, timed_lines
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.transformer import Transformer


@dataclass
class Proposal:
    tokens: list[int]  # up to k draft tokens
    probs: Tensor | None  # (len(tokens), vocab) the distributions they were drawn from; None = deterministic


class DraftState(ABC):
    """The drafter of one request speculating alone (spec/session.py). `calls` counts model forwards (0 for
    model-free drafters)."""

    calls: int = 0

    @abstractmethod
    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Up to `k` tokens continuing `context` (prompt + generated so far)."""

    def rollback(self, length: int) -> None:
        """`context[:length]` is confirmed; forget anything cached beyond it."""


class Drafter(ABC):
    """What every request speculating with it shares: a draft model's weights and its measured costs."""

    name: str
    calibration: Calibration | None = None  # the costs measure_cost timed, the engine loop's prior

    @abstractmethod
    def start(self, capacity: int) -> DraftState:
        """State for a new sequence of at most `capacity` tokens."""

    def models(self) -> list[Transformer]:
        """The models it runs (their kernels are chosen with the target's, kernels/select.py)."""
        return []

    def build_fused(self, device: torch.device, dtype: torch.dtype, kernels: str) -> None:
        """Once its models' kernels are chosen: their fused C++ decode steps, where they apply."""

    def step_cost(self, target: Transformer) -> float:
        """One draft step in target decode steps (spec/adaptive_k.py)."""
        return 0.0

    def measure_cost(self, target: Transformer, target_fused: FusedDecode | None, rows: int = 1) -> None:
        """Time target (and draft) steps of 1 and `rows` rows, for `step_cost` and `calibration`: the target's rows
        are what a verification costs; a drafter without a model drafts for nothing."""
        ((a, b),) = timed_lines([(target, target_fused)], rows)
        self.calibration = Calibration(a, b, 0.0, 0.0)


class LoopDrafts(ABC):
    """The drafts of an engine-loop step's sequences (spec/in_loop.py), and each sequence's draft state between
    steps."""

    calls: int = 0  # draft forwards, one per sequence per draft step (the per-request path counts the same)

    @abstractmethod
    def propose(self, wants: list[tuple[Request, int]], timed: StepCost) -> list[Proposal]:
        """Up to k tokens continuing each request's tokens, for every (request, k); the rows and seconds of each draft
        step of one token a sequence go to `timed` (what drafting costs, spec/adaptive_k.py)."""

    def unseen(self, request: Request) -> int:
        """Rows of the request's first draft step: its tokens the draft has not seen (one: the last token)."""
        return 1

    @abstractmethod
    def rollback(self, request: Request, length: int) -> None:
        """The request's first `length` tokens are confirmed; forget any draft state beyond them."""

    @abstractmethod
    def retain(self, requests: Collection[Request]) -> None:
        """Drop the state of every request not in `requests` (finished, cancelled, preempted)."""


@dataclass
class SequenceDrafts(LoopDrafts):
    """Any drafter, sequence by sequence (n-gram lookup needs nothing more)."""

    drafter: Drafter
    states: dict[Request, DraftState] = field(default_factory=dict)

    def propose(self, wants: list[tuple[Request, int]], timed: StepCost) -> list[Proposal]:
        proposals, start = [], time.perf_counter()
        for request, k in wants:
            state = self.states.get(request)
            if state is None:
                state = self.states[request] = self.drafter.start(len(request.prompt_ids) + request.max_new_tokens)
            calls = state.calls
            proposals.append(state.propose(request.token_ids, k, request.params, request.generator))
            self.calls += state.calls - calls
        if wants:  # one draft step: every sequence's lookup
            timed.observe(len(wants), time.perf_counter() - start)
        return proposals

    def rollback(self, request: Request, length: int) -> None:
        state = self.states.get(request)
        if state is not None:
            state.rollback(length)

    def retain(self, requests: Collection[Request]) -> None:
        for request in [r for r in self.states if r not in requests]:
            del self.states[request]


# ---- n-gram prompt lookup ------------------------------------------------------------------------


@dataclass
class NgramDrafter(Drafter, DraftState):
    """Propose the continuation of the latest earlier match of the context's last n tokens (n from max to min).

    Deterministic, so its proposals are point masses: the target accepts token d with probability p(d).
    """

    max_n: int = 3
    min_n: int = 1
    name: str = "ngram"

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {self.min_n}..{self.max_n}")

    def start(self, capacity: int) -> DraftState:
        return self  # stateless

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        return Proposal(lookup_continuation(context, k, self.min_n, self.max_n), None)


def lookup_continuation(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest matching suffix (at most k tokens)."""
    if k < 1:
        return []
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):  # latest match first, never the suffix itself
            if context[start + n - 1] == suffix[-1] and context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []
