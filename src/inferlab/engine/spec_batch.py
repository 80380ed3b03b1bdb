"""Speculation inside the engine loop: every decoding sequence drafts its own K, and the step's one flat forward
verifies them all.

The scheduler asks each decode's K (`wanted`: engine/adaptive_k.py, from the sequence's own acceptance so far
and from what a draft token costs in this loop, its drafting and its verified row, both timed; at most spec.k)
and gives it room for that many draft tokens past its next one where the budget and free blocks allow
(engine/scheduler.py); the drafter proposes within that room (engine/draft_pool.py: one draft forward per
draft step for all the sequences). A drafted sequence's segment of the step is then its last token and its
drafts, every row's logits wanted: K+1 next-token distributions. A sequence with no drafts this step (K = 0,
or a drafter with nothing to propose) is a plain decode of the step, exactly as with speculation off. Each
drafted sequence is rejection-sampled on its own with the acceptance rule of engine/speculative.py (at
temperature 0: the drafts kept while they equal the target's argmax), so its tokens are distributed exactly as
without speculation. The KV of the fed token and the accepted drafts is
counted (and, once a block is full, findable in the prefix cache); the rejected rows' KV is not, and the
blocks they took go back to the allocator. A round's tokens are streamed one by one through the request's
own `accept`, which ends it at EOS, a stop string or max_tokens wherever that falls in the round.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

from torch import Tensor

from inferlab.engine.adaptive_k import AdaptiveK, DraftCost, StepCost, draft_token_cost
from inferlab.engine.block_manager import BlockManager
from inferlab.engine.draft_pool import LoopDrafts
from inferlab.engine.drafters import Proposal
from inferlab.engine.scheduler import ScheduledBatch
from inferlab.engine.sequence import Request, StreamEvent
from inferlab.engine.speculative import SpecStats, Speculation, verify_proposal
from inferlab.model.transformer import Transformer


@dataclass
class LoopSpeculation:
    """What the engine loop holds with spec on: the drafts of its sequences and each one's K policy."""

    speculation: Speculation
    drafts: LoopDrafts
    blocks: BlockManager  # the target's: verification counts kept tokens and gives rejected rows' blocks back
    target: Transformer  # what a draft step's cost is counted in (adaptive K)
    policies: dict[Request, AdaptiveK] = field(default_factory=dict)
    proposals: dict[Request, Proposal] = field(default_factory=dict)  # this step's
    step_cost: StepCost = field(default_factory=StepCost)  # the loop's decode steps, timed (EngineLoop.step)
    draft_cost: DraftCost = field(default_factory=DraftCost)  # the drafting, timed here

    def wanted(self, decodes: list[Request]) -> list[int]:
        """The K each of a step's decodes would draft (the scheduler reserves their room from it)."""
        if not self.speculation.adaptive:
            return [self.speculation.k] * len(decodes)
        prior = self.speculation.drafter.calibration
        token_cost = draft_token_cost(self.step_cost, self.draft_cost, len(decodes), prior)
        if token_cost is not None and token_cost >= 1 and self.draft_cost.per_token() is not None:
            # a draft token, its drafting timed in this loop, costs a sequence's whole share of a plain step: no
            # acceptance pays for it (k + 1 tokens for 1 + k steps' worth), so none drafts, not even a probe
            # (each widens the batched step and runs a draft forward for nothing) until the load lightens
            return [0] * len(decodes)
        return [self._policy(r).next_k(token_cost) for r in decodes]

    def propose(self, batch: ScheduledBatch, running: Collection[Request]) -> dict[Request, list[int]]:
        """The drafts of each decode of `batch` given room for them, for this step's forward; decodes missing from
        the result (no room, or nothing proposed) decode plainly."""
        self.drafts.retain(running)
        for request in [r for r in self.policies if r not in running]:
            del self.policies[request]
        wants = [(r, room) for r, room in zip(batch.decodes, batch.lookahead) if room]
        calls, start = self.drafts.calls, time.perf_counter()
        proposals = self.drafts.propose(wants)
        drafted = sum(len(p.tokens) for p in proposals)
        if drafted:
            self.draft_cost.observe(drafted, time.perf_counter() - start)
        self.proposals = {r: p for (r, _), p in zip(wants, proposals) if p.tokens}
        for request, _ in wants:
            if request not in self.proposals:  # nothing proposed: the room reserved for drafts goes back
                self.blocks.trim(request.kv, request.num_tokens)
        plain = len(batch.decodes) - len(self.proposals)  # one target call and one token each
        self.speculation.totals.add(SpecStats(plain, self.drafts.calls - calls, 0, 0, plain))
        return {r: p.tokens for r, p in self.proposals.items()}

    def _policy(self, request: Request) -> AdaptiveK:
        policy = self.policies.get(request)
        if policy is None:
            cost = self.speculation.drafter.step_cost(self.target)
            policy = self.policies[request] = AdaptiveK(self.speculation.k, cost)
        return policy

    def verify(self, request: Request, rows: Tensor) -> list[StreamEvent]:
        """The step's (1 + k, vocab) logits of a drafted decode -> its kept tokens' events."""
        proposal = self.proposals[request]
        drafts = proposal.tokens
        self.blocks.advance(request.kv, request.token_ids, 1)  # the fed token's KV is the sequence's either way
        n, last = verify_proposal(rows, proposal, request.params, request.generator)
        events = []
        for token in [*drafts[:n], last]:
            events += request.accept(token)
            if request.finished:
                break
        policy = self.policies.get(request)
        if policy is not None:
            policy.observe(len(drafts), n)
        if not request.finished:
            self.blocks.advance(request.kv, request.token_ids, n)
            self.blocks.trim(request.kv, request.num_tokens)
            self.drafts.rollback(request, request.kv.num_computed)
        self.speculation.totals.add(SpecStats(1, 0, len(drafts), n, n + 1))
        return events
