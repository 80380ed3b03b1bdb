"""Speculation inside the engine loop: every decoding sequence drafts up to the step's K, and the step's one flat
forward verifies them all.

The scheduler asks the decodes' K in a step of decodes alone (`wanted`: spec/adaptive_k.py's plan_k, from the
sequences' own acceptance so far, from what the loop's target steps and draft steps take by rows, and from what
its whole steps at each K brought; at most spec.k; 0 in the step after a request ended, when its successor's
prompt is likely on its way) and gives each room for that many draft tokens past its next one where the budget
and free blocks allow (engine/scheduler.py); the drafter proposes within that room (spec/draft_model.py: one
draft forward per draft step for all the sequences). A drafted sequence's segment of the step is then its last
token and its drafts, every row's logits wanted: K+1 next-token distributions. A sequence with no drafts this step
(K = 0, or a drafter with nothing to propose) is a plain decode of the step, exactly as with speculation off. Each
drafted sequence is rejection-sampled on its own with the acceptance rule of spec/acceptance.py (at temperature 0:
the drafts kept while they equal the target's argmax), so its tokens are distributed exactly as without
speculation. The KV of the fed token and the accepted drafts is counted (and, once a block is full, findable in the
prefix cache); the rejected rows' KV is not, and the blocks they took go back to the allocator. A round's tokens are
streamed one by one through the request's own `accept`, which ends it at EOS, a stop string or max_tokens wherever
that falls in the round. A constrained request's K+1 distributions are masked by its grammar after each draft
prefix first, so a draft the grammar forbids has probability 0 under the target and is rejected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import Tensor

from inferlab.engine.kv.block_manager import BlockManager
from inferlab.engine.request import Request, StreamEvent
from inferlab.engine.scheduler import ScheduledBatch
from inferlab.engine.spec.acceptance import verify_proposal
from inferlab.engine.spec.adaptive_k import (
    BACKOFF,
    LOOP_MIN_GAIN,
    LOOP_SHORTER_WITHIN,
    MAX_BACKOFF,
    Acceptance,
    StepCost,
    StepYields,
    expected_tokens,
    plan_k,
)
from inferlab.engine.spec.calibration import Calibration
from inferlab.engine.spec.proposers import LoopDrafts, Proposal
from inferlab.engine.spec.session import SpecStats, Speculation
from inferlab.model.transformer import Transformer


@dataclass
class LoopSpeculation:
    """What the engine loop holds with spec on: the drafts of its sequences and each one's K policy."""

    speculation: Speculation
    drafts: LoopDrafts
    blocks: BlockManager  # the target's: verification counts kept tokens and gives rejected rows' blocks back
    target: Transformer  # what a draft step's cost is counted in (adaptive K)
    acceptances: dict[Request, Acceptance] = field(default_factory=dict)
    proposals: dict[Request, Proposal] = field(default_factory=dict)  # this step's
    step_cost: StepCost = field(default_factory=StepCost)  # the loop's decode steps, timed (`timing`)
    draft_cost: StepCost = field(default_factory=StepCost)  # the draft steps, timed by the drafts (propose)
    timed: StepYields = field(default_factory=StepYields)  # what whole steps at each K brought (`step_done`)
    planned: tuple[int, int, float] | None = None  # this step's decodes, K and expected tokens, until step_done
    last_decodes: int | None = None  # the last step's decodes, if it had decodes alone
    plain_steps: int = 0  # steps in a row that no decode drafted while drafts that are all accepted would pay
    backoff: int = BACKOFF  # such steps before every decode probes
    ran: tuple[int, int] | None = None  # the step under way, if of decodes alone: its decodes and the tokens it brought

    def wanted(self, decodes: list[Request]) -> list[int]:
        """The K each of a step's decodes would draft (the scheduler reserves their room from it): one K for all,
        from their acceptances and the loop's timed steps (adaptive_k.plan_k)."""
        if not self.speculation.adaptive:
            return [self.speculation.k] * len(decodes)
        if any(r.finished for r in self.acceptances):
            # a request ended last step, and a closed-loop client sends the next at once: it would wait out a step of
            # K draft steps before its prompt, so this one decodes plainly (`propose` then forgets the finished)
            self.planned = self.last_decodes = None
            return [0] * len(decodes)
        acceptances = [self._acceptance(r).acceptance for r in decodes]
        target, draft = self._costs()
        first_rows = sum(self.drafts.unseen(r) for r in decodes)
        k = self._plan(acceptances, target, draft, first_rows)
        # timed only after a step of as many decodes alone: one after prompts or an end hands new streams their
        # first tokens beside a busy client, and runs slower than the steps that follow
        steady, self.last_decodes = self.last_decodes == len(decodes), len(decodes)
        self.planned = (len(decodes), k, expected_tokens(acceptances, k)[k]) if steady else None
        return [k] * len(decodes)

    def _plan(
        self, acceptances: list[float], target: Callable[[int], float], draft: Callable[[int], float], first_rows: int
    ) -> int:
        max_k = self.speculation.k
        perfect = plan_k([1.0] * len(acceptances), max_k, target, draft, first_rows, self.timed, LOOP_MIN_GAIN)
        if not perfect and self.timed.drafting_timed(len(acceptances), max_k):
            self.plain_steps = 0  # drafting was timed here, and no acceptance would pay for it (under load): no probe
            return 0
        k = plan_k(acceptances, max_k, target, draft, first_rows, self.timed, LOOP_MIN_GAIN, LOOP_SHORTER_WITHIN)
        if k:
            self.plain_steps, self.backoff = 0, BACKOFF
            return k
        self.plain_steps += 1
        if self.plain_steps < self.backoff:
            return 0
        # the estimates held speculation back for `backoff` steps: every decode probes (and if that does not resume
        # drafting, the next probe waits twice as long)
        self.plain_steps, self.backoff = 0, min(2 * self.backoff, MAX_BACKOFF)
        return 1

    @contextmanager
    def timing(self, batch: ScheduledBatch, rows: int) -> Iterator[None]:
        """Around the run of a step of `rows` rows (EngineLoop.step): a step of decodes alone is what adaptive K weighs,
        its run timed by rows (`step_cost`), its tokens kept for `handed_off`."""
        self.ran = None
        if batch.prefills:
            yield
            return
        generated = sum(len(r.output_ids) for r in batch.decodes)
        start = time.perf_counter()
        yield
        self.step_cost.observe(rows, time.perf_counter() - start)
        self.ran = len(batch.decodes), sum(len(r.output_ids) for r in batch.decodes) - generated

    def handed_off(self, seconds: float) -> None:
        """The step just ended took `seconds` from its schedule to its tokens handed to the streams."""
        ran, self.ran = self.ran, None
        if ran is not None:
            self.step_done(*ran, seconds)

    def step_done(self, decodes: int, tokens: int, seconds: float) -> None:
        """A step of `decodes` decodes alone brought `tokens` in `seconds`, from its schedule to its tokens handed to
        the streams: what judges its K (StepYields)."""
        if self.planned is not None and self.planned[0] == decodes:
            _, k, expected = self.planned
            self.timed.observe(decodes, k, expected, tokens, seconds)
        self.planned = None

    def _acceptance(self, request: Request) -> Acceptance:
        if request not in self.acceptances:
            self.acceptances[request] = Acceptance(self.speculation.acceptance.acceptance)
        return self.acceptances[request]

    def _observe(self, request: Request, proposed: int, accepted: int) -> None:
        self._acceptance(request).observe(proposed, accepted)
        self.speculation.acceptance.observe(proposed, accepted)

    def _costs(self) -> tuple[Callable[[int], float], Callable[[int], float]]:
        """Seconds of a target step and of a draft step, by rows: as the loop timed them, the load-time Calibration
        (scaled as the loop's target steps were to it) where it has not; without a calibration, in one-row target
        steps with a draft step costing the drafter's own estimate (its bytes)."""
        prior = self.speculation.drafter.calibration
        if prior is None:
            prior = Calibration(1.0, 0.0, self.speculation.drafter.step_cost(self.target), 0.0)
        a, b = self.step_cost.fit((prior.a, prior.b)) or (prior.a, prior.b)
        scale = (a + b) / (prior.a + prior.b)  # the machine now against at load
        draft_prior = (prior.draft_a * scale, prior.draft_b * scale)
        return self.step_cost.curve((a, b)), self.draft_cost.curve(self.draft_cost.fit(draft_prior) or draft_prior)

    def propose(self, batch: ScheduledBatch, running: Collection[Request]) -> dict[Request, list[int]]:
        """The drafts of each decode of `batch` given room for them, for this step's forward; decodes missing from
        the result (no room, or nothing proposed) decode plainly."""
        self.drafts.retain(running)
        if batch.prefills:
            self.last_decodes = None
        for request in [r for r in self.acceptances if r not in running]:
            del self.acceptances[request]
        wants = [(r, room) for r, room in zip(batch.decodes, batch.lookahead) if room]
        calls = self.drafts.calls
        proposals = self.drafts.propose(wants, self.draft_cost)
        self.proposals = {r: p for (r, _), p in zip(wants, proposals) if p.tokens}
        for request, _ in wants:
            if request not in self.proposals:  # nothing proposed: the room reserved for drafts goes back
                self.blocks.trim(request.kv, request.num_tokens)
                # and the round brought nothing, as a rejected draft would: an n-gram lookup that rarely matches (a
                # free-text request) has its estimate fall, where only its rare proposals' fate kept it at the prior
                self._observe(request, 1, 0)
        plain = len(batch.decodes) - len(self.proposals)  # one target call and one token each
        self.speculation.totals.add(SpecStats(plain, self.drafts.calls - calls, 0, 0, plain))
        return {r: p.tokens for r, p in self.proposals.items()}

    def verify(self, request: Request, rows: Tensor) -> list[StreamEvent]:
        """The step's (1 + k, vocab) logits of a drafted decode -> its kept tokens' events."""
        proposal = self.proposals[request]
        drafts = proposal.tokens
        self.blocks.advance(request.kv, request.token_ids, 1)  # the fed token's KV is the sequence's either way
        if request.grammar is not None:  # the target's distributions as the grammar allows them at each draft
            rows = request.grammar.mask_drafts(rows, drafts)
        n, last = verify_proposal(rows, proposal, request.params, request.generator)
        events, kept = [], 0
        for token in [*drafts[:n], last]:
            events += request.accept(token)
            kept += 1
            if request.finished:  # EOS, a stop string or max_tokens inside the round: the rest is not generated
                break
        self._observe(request, len(drafts), n)
        if not request.finished:
            self.blocks.advance(request.kv, request.token_ids, n)
            self.blocks.trim(request.kv, request.num_tokens)
            self.drafts.rollback(request, request.kv.num_computed)
        self.speculation.totals.add(SpecStats(1, 0, len(drafts), n, kept))
        return events
