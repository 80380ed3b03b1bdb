"""Drafting for every sequence of an engine-loop step: each one's next K tokens, the draft model batched.

A draft model (spec=self, spec=draft) keeps every sequence's KV in blocks of a paged pool of its own, so
one draft step of all the sequences still drafting is ONE flat forward (engine/flat.py, on the draft's
fused C++ step where it has one): the first step feeds what each draft has not seen yet (its last token,
the accepted drafts, or a whole context after a preemption), the next ones each sequence's last draft.
A sequence stops drafting at its own K or after a proposal the draft gives less than `min_confidence`.
Rollback lowers a table's count; a sequence whose draft KV finds no free block drafts nothing that round.
Drafters without a model (n-gram lookup) propose sequence by sequence through their own DraftState.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inferlab.engine.block_manager import BlockManager, BlockTable
from inferlab.engine.drafters import Drafter, DraftState, ModelDrafter, Proposal
from inferlab.engine.flat import FlatBatch, Segment, forward_flat
from inferlab.engine.kv_cache import compute_kv_cache_bytes
from inferlab.engine.paged import PagedKVCache
from inferlab.engine.sampling import probabilities
from inferlab.engine.sequence import Request


class LoopDrafts(ABC):
    """The drafts of a step's sequences, and each sequence's draft state between steps."""

    calls: int = 0  # draft forwards, one per sequence per draft step (the per-request path counts the same)

    @abstractmethod
    def propose(self, wants: list[tuple[Request, int]]) -> list[Proposal]:
        """Up to k tokens continuing each request's tokens, for every (request, k)."""

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

    def propose(self, wants: list[tuple[Request, int]]) -> list[Proposal]:
        proposals = []
        for request, k in wants:
            state = self.states.get(request)
            if state is None:
                state = self.states[request] = self.drafter.start(len(request.prompt_ids) + request.max_new_tokens)
            calls = state.calls
            proposals.append(state.propose(request.token_ids, k, request.params, request.generator))
            self.calls += state.calls - calls
        return proposals

    def rollback(self, request: Request, length: int) -> None:
        state = self.states.get(request)
        if state is not None:
            state.rollback(length)

    def retain(self, requests: Collection[Request]) -> None:
        for request in [r for r in self.states if r not in requests]:
            del self.states[request]


class DraftPool(LoopDrafts):
    """A draft model's KV for every sequence in blocks of its own pool; one draft forward per draft step."""

    def __init__(self, drafter: ModelDrafter, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.drafter = drafter
        config, dtype = drafter.model.config, drafter.model.rope_cos.dtype
        self.cache = PagedKVCache.allocate(config, num_blocks, block_size, dtype, device)
        self.blocks = BlockManager(num_blocks, block_size, compute_kv_cache_bytes(config, 1, block_size, dtype))
        self.tables: dict[Request, BlockTable] = {}
        self.calls = 0

    def propose(self, wants: list[tuple[Request, int]]) -> list[Proposal]:
        tokens: list[list[int]] = [[] for _ in wants]
        dists: list[list[Tensor]] = [[] for _ in wants]
        feeds = {i: r.token_ids[self._table(r).num_computed :] for i, (r, k) in enumerate(wants) if k > 0}
        while feeds:
            segments, drafting = [], []
            for i, feed in feeds.items():
                table = self._table(wants[i][0])
                if self.blocks.ensure_room(table, table.num_computed + len(feed)):
                    segments.append(Segment(feed, table.num_computed, table.blocks))
                    drafting.append(i)
            if not segments:
                break
            batch = FlatBatch.pack(segments, self.cache.k.device)
            logits = forward_flat(self.drafter.model, self.cache, batch, self.drafter.fused)  # (len(drafting), vocab)
            self.calls += len(drafting)
            next_feeds = {}
            for i, row in zip(drafting, logits):
                request, k = wants[i]
                self._table(request).num_computed += len(feeds[i])
                token, confidence = self._pick(request, row, dists[i])
                tokens[i].append(token)
                if len(tokens[i]) < k and confidence >= self.drafter.min_confidence:
                    next_feeds[i] = [token]
            feeds = next_feeds
        return [Proposal(t, torch.stack(d) if d else None) for t, d in zip(tokens, dists)]

    def _pick(self, request: Request, logits: Tensor, dists: list[Tensor]) -> tuple[int, float]:
        """The draft token from its (vocab,) logits, and the draft's probability of it; at T > 0 the
        distribution it was drawn from goes to `dists` (the acceptance rule needs it)."""
        params = request.params
        if params.greedy:
            token = int(torch.argmax(logits))
            confidence = float(torch.softmax(logits.float(), -1)[token]) if self.drafter.min_confidence else 1.0
            return token, confidence
        q = probabilities(logits, params)
        token = int(torch.multinomial(q, 1, generator=request.generator))
        dists.append(q)
        return token, float(q[token])

    def _table(self, request: Request) -> BlockTable:
        table = self.tables.get(request)
        if table is None:
            table = self.tables[request] = BlockTable()
        return table

    def rollback(self, request: Request, length: int) -> None:
        table = self.tables.get(request)
        if table is not None:
            table.num_computed = min(table.num_computed, length)

    def retain(self, requests: Collection[Request]) -> None:
        for request in [r for r in self.tables if r not in requests]:
            self.blocks.free(self.tables.pop(request))


def loop_drafts(drafter: Drafter, num_blocks: int, block_size: int, device: torch.device) -> LoopDrafts:
    """A draft model's pool (as many blocks as the target's), or sequence-by-sequence drafting."""
    if isinstance(drafter, ModelDrafter):
        return DraftPool(drafter, num_blocks, block_size, device)
    return SequenceDrafts(drafter)
