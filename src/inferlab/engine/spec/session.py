"""One request speculating alone, and what the engine holds for spec=ngram|draft|self.

The target's prompt runs first, alone, exactly as without speculation (the engine's own prefill, through the same
KV cache), and each round then feeds the last sampled token plus the K draft tokens through the step that decodes
one token (TargetSequence): K+1 next-token distributions from one forward, judged by the acceptance rule
(spec/acceptance.py). Where a row's result does not depend on how many rows its call has, greedy output is the very
output of plain decoding, bit for bit; elsewhere it may differ where two logits tie within rounding. Both caches
roll back by keeping a length; rejected entries are overwritten later. With `spec.adaptive`, each sequence picks its
round's K from its own acceptance so far (spec/adaptive_k.py).

`Speculation` is what the engine holds: the drafter, K, and the counters over every request; `speculative_generate`
(the contract) runs one request with a target and a draft, outside any engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from inferlab.engine.model_runner import SlotRunner
from inferlab.engine.request import Request, StreamEvent
from inferlab.engine.sampling import SamplingParams
from inferlab.engine.spec.acceptance import verify_proposal
from inferlab.engine.spec.adaptive_k import Acceptance, AdaptiveK
from inferlab.engine.spec.draft_model import ModelDrafter
from inferlab.engine.spec.proposers import Drafter, DraftState
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.transformer import Transformer


class TargetSequence(Protocol):
    """The target's KV state of one sequence (the engine's SingleSequence, or a SlotRunner)."""

    def verify_rows(self, token_ids: list[int]) -> Tensor:
        """The KV of `token_ids` written after the kept tokens; logits (n, vocab), none kept yet."""
        ...

    def keep(self, n: int) -> None:
        """The first `n` tokens of the last `verify_rows` stay cached; the rest are overwritten later."""
        ...


@dataclass
class SpecStats:
    target_calls: int = 0  # target forwards (the first one is the prefill, which gives the first token)
    draft_calls: int = 0  # draft model forwards
    proposed: int = 0  # draft tokens offered for verification
    accepted: int = 0  # draft tokens the target kept
    generated: int = 0  # tokens emitted (accepted + one per round), before stop/length truncation

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per target call (0..K), the prefill's included; tokens per call is about this + 1."""
        return self.accepted / self.target_calls if self.target_calls else 0.0

    @property
    def target_calls_per_token(self) -> float:
        return self.target_calls / self.generated if self.generated else 0.0

    def add(self, other: SpecStats) -> None:
        for name in ("target_calls", "draft_calls", "proposed", "accepted", "generated"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "target_calls_per_token": self.target_calls_per_token,
        }


@dataclass
class SpecResult:
    tokens: list[int]  # generated ids, without the end-of-sequence token
    finish_reason: str  # "stop" (an eos id) | "length"
    stats: SpecStats


# ---- one sequence --------------------------------------------------------------------------------


@dataclass
class SpecSession:
    """One request's speculative generation: call `step()` until it says done; `tokens` is the output so far."""

    draft: DraftState
    prompt_ids: list[int]
    params: SamplingParams
    k: int
    max_new_tokens: int
    sequence: TargetSequence  # the target's KV, the prompt prefilled
    first_logits: Tensor | None  # (vocab,) the prefill's, for the first token; None once the first round used them
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    totals: SpecStats | None = None  # counters shared across sessions (the engine's), added to each round
    policy: AdaptiveK | None = None  # K per round from this sequence's acceptance; None: always k
    cached: int = field(init=False)  # tokens the target holds the KV of: the context but the last token

    def __post_init__(self) -> None:
        self.cached = len(self.prompt_ids)

    @torch.inference_mode()
    def step(self) -> list[int]:
        """One draft-and-verify round; returns the 1..k+1 tokens it emitted."""
        context = self.prompt_ids + self.tokens
        draft_calls = self.draft.calls
        first = self.first_logits  # the first round takes the first token from the prefill, as plain decoding does
        if first is not None:
            k = 0
        else:
            k = min(self.policy.next_k() if self.policy else self.k, self.max_new_tokens - len(self.tokens) - 1)
        proposal = self.draft.propose(context, k, self.params, self.generator)
        drafts = proposal.tokens
        # (k+1, vocab): the rows of the last token and the drafts, each as the one-token step would compute it
        logits = first[None] if first is not None else self.sequence.verify_rows(context[self.cached :] + drafts)
        self.first_logits = None
        n, last = verify_proposal(logits, proposal, self.params, self.generator)
        emitted = drafts[:n] + [last]
        if self.policy is not None and drafts:
            self.policy.observe(len(drafts), n)
        kept = len(context) + n  # KV of the context and the accepted drafts stays; `last` is fed next round
        self.sequence.keep(kept - self.cached)
        self.cached = kept
        self.draft.rollback(kept)
        self.tokens += emitted
        round_stats = SpecStats(1, self.draft.calls - draft_calls, len(drafts), n, len(emitted))
        for stats in (self.stats, self.totals) if self.totals is not None else (self.stats,):
            stats.add(round_stats)
        return emitted


@dataclass
class Speculation:
    """What the engine holds for spec=ngram|draft|self: the drafter (shared weights) and K (the bound, when adaptive)."""

    drafter: Drafter
    k: int
    adaptive: bool = False
    totals: SpecStats = field(default_factory=SpecStats)  # over every request, for the engine's stats()
    # every round of the engine loop's sequences in one running estimate, where a new sequence's starts
    # (spec/in_loop.py): a drafter that agrees rarely (a small trained draft on free text, ~0.3) then does not
    # draft each new request's first rounds at a loss on the prior's 0.8 alone
    acceptance: Acceptance = field(default_factory=Acceptance)

    def counters(self) -> dict[str, int]:
        t = self.totals
        return {
            "spec_target_calls": t.target_calls,
            "spec_draft_calls": t.draft_calls,
            "spec_proposed": t.proposed,
            "spec_accepted": t.accepted,
            "spec_generated": t.generated,
        }

    @torch.inference_mode()
    def start(
        self,
        target: Transformer,
        prompt_ids: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        generator: torch.Generator | None,
        fused: FusedDecode | None = None,
        prefilled: tuple[Tensor, TargetSequence] | None = None,
    ) -> SpecSession:
        """A session over `prefilled` (the prompt's last logits and the target's KV state holding it, from
        the engine's own prefill), or over a KV cache of its own (through `fused` where given), prefilled here."""
        if prefilled is None:
            # the target is fed at most the prompt, the generated tokens but the last, and the drafts of a round
            # whose size is capped by what is left to generate: prompt + max_new_tokens positions suffice
            runner = SlotRunner.alone(target, len(prompt_ids) + max_new_tokens, fused)
            prefilled = runner.forward(list(prompt_ids), last_only=True)[-1], runner
        first_logits, sequence = prefilled
        draft = self.drafter.start(len(prompt_ids) + max_new_tokens)
        policy = AdaptiveK(max_k=self.k, draft_cost=self.drafter.step_cost(target)) if self.adaptive else None
        return SpecSession(
            draft,
            list(prompt_ids),
            params,
            self.k,
            max_new_tokens,
            sequence,
            first_logits,
            generator,
            totals=self.totals,
            policy=policy,
        )


def stream_events(session: SpecSession, request: Request, lock: threading.Lock) -> Iterator[StreamEvent]:
    """The engine's events for one speculative request: each round's tokens as soon as they are verified."""
    while not request.finished:
        with lock:
            tokens = session.step()
        for token in tokens:
            yield from request.accept(token)
            if request.finished:
                break


def speculative_generate(
    target_model: Transformer,
    draft_model: Transformer | Drafter,
    prompt_ids: list[int],
    K: int = 4,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 64,
    seed: int | None = None,
    eos_ids: set[int] | frozenset[int] = frozenset(),
    adaptive: bool = False,
) -> SpecResult:
    """Generate with `draft_model` (a Transformer sharing the vocabulary, or any Drafter) proposing K tokens
    (at most K per round with `adaptive`, spec/adaptive_k.py).

    Stops after `max_new_tokens` or at an id in `eos_ids` (not included in the tokens).
    """
    drafter = draft_model if isinstance(draft_model, Drafter) else ModelDrafter(draft_model)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    session = Speculation(drafter, K, adaptive).start(
        target_model, prompt_ids, params, max_new_tokens, params.make_generator(target_model.rope_cos.device)
    )
    while len(session.tokens) < max_new_tokens:
        session.step()
        hit = next((i for i, t in enumerate(session.tokens) if t in eos_ids), None)
        if hit is not None:
            return SpecResult(session.tokens[:hit], "stop", session.stats)
    return SpecResult(session.tokens[:max_new_tokens], "length", session.stats)
