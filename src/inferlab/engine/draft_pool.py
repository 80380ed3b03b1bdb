"""Drafting for every sequence of an engine-loop step: each one's next K tokens, the draft model batched.

One draft step of all the sequences still drafting is ONE flat forward (engine/model_runner.py, on the draft's
fused C++ step where it has one, in groups of the rows that step covers); a sequence stops drafting at
its own K or after a proposal the draft gives less than `min_confidence`. Where the draft's KV lives:
- spec=self (the target's own weights at fewer bits): in the target's own blocks. The draft attends over
  the target's KV of the kept tokens and writes its drafts' past them; verification overwrites those.
  Nothing to prefill, nothing to roll back, no memory of its own.
- another draft model: blocks of a paged pool of its own, a table per sequence. Its first step feeds what
  it has not seen (the last token, the accepted drafts, or the whole context after a preemption), rollback
  lowers the table's count, and a sequence whose draft KV finds no free block drafts nothing that round.
Drafters without a model (n-gram lookup) propose sequence by sequence through their own DraftState.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inferlab.engine.adaptive_k import StepCost
from inferlab.engine.drafters import Drafter, DraftState, ModelDrafter, Proposal, pick_draft_token
from inferlab.engine.kv.block_manager import BlockManager, BlockTable
from inferlab.engine.kv.contiguous import compute_kv_cache_bytes
from inferlab.engine.kv.paged import PagedKVCache
from inferlab.engine.model_runner import FlatBatch, Segment, forward_flat
from inferlab.engine.sequence import Request


class LoopDrafts(ABC):
    """The drafts of a step's sequences, and each sequence's draft state between steps."""

    calls: int = 0  # draft forwards, one per sequence per draft step (the per-request path counts the same)

    @abstractmethod
    def propose(self, wants: list[tuple[Request, int]], timed: StepCost) -> list[Proposal]:
        """Up to k tokens continuing each request's tokens, for every (request, k); the rows and seconds of each draft
        step of one token a sequence go to `timed` (what drafting costs, engine/adaptive_k.py)."""

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


class ModelDrafts(LoopDrafts):
    """A draft model drafting every sequence of a step: one flat forward per draft step, in groups of rows its
    fused step covers. Where each sequence's draft KV lives is the subclass's."""

    def __init__(self, drafter: ModelDrafter, cache: PagedKVCache) -> None:
        self.drafter, self.cache = drafter, cache

    def propose(self, wants: list[tuple[Request, int]], timed: StepCost) -> list[Proposal]:
        tokens: list[list[int]] = [[] for _ in wants]
        dists: list[list[Tensor]] = [[] for _ in wants]
        feeds = {i: self._first_feed(r) for i, (r, k) in enumerate(wants) if k > 0}
        vocab, min_confidence = self.drafter.model.config.vocab_size, self.drafter.min_confidence
        while feeds:
            live = {i: feed for i, feed in feeds.items() if self._room(wants[i][0], feed)}
            if not live:
                break
            start = time.perf_counter()  # a draft step: its forward and its picks (which wait for the device)
            logits = self._forward(list(live.values()))  # (len(live), vocab)
            self.calls += len(live)
            feeds = {}
            for (i, feed), row in zip(live.items(), logits):
                request, k = wants[i]
                self._fed(request, len(feed.tokens))
                token, confidence = pick_draft_token(
                    row, request.params, request.generator, vocab, min_confidence, dists[i]
                )
                tokens[i].append(token)
                if len(tokens[i]) < k and confidence >= min_confidence:
                    feeds[i] = Segment([token], feed.start + len(feed.tokens), feed.blocks)
            if all(len(feed.tokens) == 1 for feed in live.values()):
                # timed by rows: draft steps of one token a sequence (a catching-up feed is a prompt chunk, a
                # prompt-long one on the Python model: its rows cost otherwise, and a line through both fits neither)
                timed.observe(len(live), time.perf_counter() - start)
        return [Proposal(t, torch.stack(d) if d else None) for t, d in zip(tokens, dists)]

    def _forward(self, segments: list[Segment]) -> Tensor:
        """Each segment's last logits; as few calls as the draft's fused step allows (a prompt-long segment runs
        alone, on the Python model where the fused step does not cover it)."""
        fused, device = self.drafter.fused, self.cache.k.device
        limit = fused.max_rows if fused is not None else None
        groups: list[list[Segment]] = [[]]
        for seg in segments:
            if groups[-1] and limit is not None and sum(len(s.tokens) for s in groups[-1]) + len(seg.tokens) > limit:
                groups.append([])
            groups[-1].append(seg)
        return torch.cat(
            [forward_flat(self.drafter.model, self.cache, FlatBatch.pack(g, device), fused) for g in groups]
        )

    @abstractmethod
    def _first_feed(self, request: Request) -> Segment:
        """What the draft has not seen of the request's tokens, where it writes their KV."""

    @abstractmethod
    def _room(self, request: Request, feed: Segment) -> bool:
        """Whether the feed's KV has room (else the request drafts no further this round)."""

    @abstractmethod
    def _fed(self, request: Request, n: int) -> None:
        """`n` more tokens of the request's draft KV are written."""


class TargetKVDrafts(ModelDrafts):
    """spec=self: the target's own weights drafting over the target's KV. The draft reads the kept tokens'
    KV as the target wrote it (nothing to prefill, nothing to roll back) and writes its drafts' past them, in
    the room the scheduler reserved; the step's verification overwrites those rows with the target's own
    before any attends over them (each layer writes a step's rows first), so nothing the draft wrote stays."""

    def _first_feed(self, request: Request) -> Segment:
        return Segment(request.token_ids[-1:], request.kv.num_computed, request.kv.blocks)

    def _room(self, request: Request, feed: Segment) -> bool:
        return True  # drafts end before the last reserved position: the room holds them

    def _fed(self, request: Request, n: int) -> None:
        pass

    def rollback(self, request: Request, length: int) -> None:
        pass

    def retain(self, requests: Collection[Request]) -> None:
        pass


class DraftPool(ModelDrafts):
    """A draft model's KV for every sequence in blocks of its own pool, a table each, rolled back by its count."""

    def __init__(self, drafter: ModelDrafter, num_blocks: int, block_size: int, device: torch.device) -> None:
        config, dtype = drafter.model.config, drafter.model.rope_cos.dtype
        super().__init__(drafter, PagedKVCache.allocate(config, num_blocks, block_size, dtype, device))
        self.blocks = BlockManager(num_blocks, block_size, compute_kv_cache_bytes(config, 1, block_size, dtype))
        self.tables: dict[Request, BlockTable] = {}

    def _table(self, request: Request) -> BlockTable:
        table = self.tables.get(request)
        if table is None:
            table = self.tables[request] = BlockTable()
        return table

    def _first_feed(self, request: Request) -> Segment:
        table = self._table(request)
        return Segment(request.token_ids[table.num_computed :], table.num_computed, table.blocks)

    def unseen(self, request: Request) -> int:
        table = self.tables.get(request)
        return len(request.token_ids) - (table.num_computed if table is not None else 0)

    def _room(self, request: Request, feed: Segment) -> bool:
        return self.blocks.ensure_room(self._table(request), feed.start + len(feed.tokens))

    def _fed(self, request: Request, n: int) -> None:
        self._table(request).num_computed += n

    def rollback(self, request: Request, length: int) -> None:
        table = self.tables.get(request)
        if table is not None:
            table.num_computed = min(table.num_computed, length)

    def retain(self, requests: Collection[Request]) -> None:
        for request in [r for r in self.tables if r not in requests]:
            self.blocks.free(self.tables.pop(request))


def loop_drafts(drafter: Drafter, target_cache: PagedKVCache, device: torch.device) -> LoopDrafts:
    """The target's KV for spec=self, a pool of its own for another draft model (as many blocks as the
    target's), sequence-by-sequence drafting for the rest."""
    if isinstance(drafter, ModelDrafter) and drafter.target_kv:
        return TargetKVDrafts(drafter, target_cache)
    if isinstance(drafter, ModelDrafter):
        return DraftPool(drafter, target_cache.num_blocks, target_cache.block_size, device)
    return SequenceDrafts(drafter)
