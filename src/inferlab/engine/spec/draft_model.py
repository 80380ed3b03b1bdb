"""A draft model: the drafter (its weights, its fused step, its cost) and the one loop that drafts with it.

The loop (`ModelDrafts.propose`) drafts any number of sequences at once: each draft step of the sequences still
drafting is ONE flat forward (engine/model_runner.py, on the draft's fused C++ step where it has one, in groups of
the rows that step covers), and a sequence stops drafting at its own K or after a proposal the draft gives less than
`min_confidence`. What differs is only where each sequence's draft KV lives:
- a request speculating alone (spec/session.py): a slot of its own (`SlotDrafts`, through `ModelDraftState`), a
  batch of one. Its first step feeds what the draft has not seen (the whole prompt, then the last token and the
  accepted drafts); rollback lowers the slot's length.
- the engine loop with spec=self (the target's own weights at fewer bits): the target's own blocks
  (`TargetKVDrafts`). The draft attends over the target's KV of the kept tokens and writes its drafts' past them;
  verification overwrites those. Nothing to prefill, nothing to roll back, no memory of its own.
- the engine loop with another draft model: blocks of a paged pool of its own, a table per sequence (`DraftPool`).
  Its first step feeds what it has not seen (the last token, the accepted drafts, or the whole context after a
  preemption), rollback lowers the table's count, and a sequence whose draft KV finds no free block drafts nothing
  that round.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor

from inferlab.engine.kv.block_manager import BlockManager, BlockTable
from inferlab.engine.kv.contiguous import compute_kv_cache_bytes
from inferlab.engine.kv.paged import PagedKVCache
from inferlab.engine.model_runner import FlatBatch, Segment, SlotRunner, forward_flat
from inferlab.engine.request import Request
from inferlab.engine.sampling import SamplingParams, argmax_rows, draw, probabilities
from inferlab.engine.spec.adaptive_k import StepCost
from inferlab.engine.spec.calibration import Calibration, timed_lines
from inferlab.engine.spec.proposers import Drafter, DraftState, LoopDrafts, Proposal, SequenceDrafts
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.transformer import Transformer
from inferlab.quant.apply import weight_bytes


@dataclass
class ModelDrafter(Drafter):
    """Drafts token by token with a model; stops a round early at a proposal it gives less than
    `min_confidence` probability (its argmax's softmax when greedy): the tokens after an unsure one are
    rarely accepted, and each costs a draft step and a verified row."""

    model: Transformer
    name: str = "draft"
    min_confidence: float = 0.0
    fused: FusedDecode | None = None  # the draft's own fused decode step (build_fused); None: the Python model
    # the target's own weights (spec=self): in the engine loop it drafts over the target's KV (TargetKVDrafts)
    target_kv: bool = False
    calibration: Calibration | None = None  # measure_cost's, which step_cost and the engine loop's prior are
    int8_from_rows: int = 0  # its fused steps of this many rows or more take int8 activation codes (FusedDecode.build)

    def start(self, capacity: int) -> DraftState:
        return ModelDraftState(self, capacity)

    def models(self) -> list[Transformer]:
        return [self.model]

    def build_fused(self, device: torch.device, dtype: torch.dtype, kernels: str) -> None:
        self.fused = FusedDecode.build(self.model, device, dtype, kernels, self.int8_from_rows)

    def step_cost(self, target: Transformer) -> float:
        """As measured (a draft token: its draft step and its verified row), else what decoding reads every step:
        the draft's bytes over the target's."""
        if self.calibration is not None:
            return self.calibration.token_cost()
        return weight_bytes(self.model) / weight_bytes(target)

    def measure_cost(self, target: Transformer, target_fused: FusedDecode | None, rows: int = 1) -> None:
        (a, b), (draft_a, draft_b) = timed_lines([(target, target_fused), (self.model, self.fused)], rows)
        self.calibration = Calibration(a, b, draft_a, draft_b)


def pick_draft_token(
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    vocab: int,
    min_confidence: float,
    dists: list[Tensor],
) -> tuple[int, float]:
    """The draft token from its (vocab,) logits, and the draft's probability of it; at T > 0 the distribution it
    was drawn from goes to `dists` (the acceptance rule needs it). Greedy: the argmax, by argmax_rows (torch's argmax
    over a vocabulary of bf16 logits is a sizeable share of a small draft's step), its softmax only when
    `min_confidence` asks for it."""
    if params.greedy:
        row = logits.float()  # widened once, for the argmax and the confidence
        token = argmax_rows(row[None])[0]
        return token, float(torch.softmax(row, -1)[token]) if min_confidence else 1.0
    q = draft_distribution(logits, params, vocab)
    token = draw(q, generator)
    dists.append(q)
    return token, float(q[token])


def draft_distribution(logits: Tensor, params: SamplingParams, vocab: int) -> Tensor:
    """What a draft samples its proposal from, over the whole vocabulary: (vocab,) from the logits of its head,
    zero past them where the head holds only the first ids (spec.draft_vocab)."""
    q = probabilities(logits, params)
    return q if q.shape[-1] == vocab else torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))


# ---- the draft loop ------------------------------------------------------------------------------


class Drafted(Protocol):
    """What the draft loop reads of a sequence: its tokens so far and its sampling state (an engine-loop Request)."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def generator(self) -> torch.Generator | None: ...


S = TypeVar("S", bound=Drafted)


class ModelDrafts(ABC, Generic[S]):
    """The draft model drafting every sequence it is given: one flat forward per draft step, in groups of rows its
    fused step covers. Where each sequence's draft KV lives is the subclass's."""

    calls: int = 0  # draft forwards, one per sequence per draft step

    def __init__(self, drafter: ModelDrafter, cache: PagedKVCache) -> None:
        self.drafter, self.cache = drafter, cache

    def propose(self, wants: list[tuple[S, int]], timed: StepCost | None = None) -> list[Proposal]:
        """Up to k tokens continuing each sequence's tokens, for every (sequence, k); the rows and seconds of each
        draft step of one token a sequence go to `timed` (what drafting costs, spec/adaptive_k.py)."""
        tokens: list[list[int]] = [[] for _ in wants]
        dists: list[list[Tensor]] = [[] for _ in wants]
        feeds = {i: self._first_feed(s) for i, (s, k) in enumerate(wants) if k > 0}
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
                seq, k = wants[i]
                self._fed(seq, len(feed.tokens))
                token, confidence = pick_draft_token(row, seq.params, seq.generator, vocab, min_confidence, dists[i])
                tokens[i].append(token)
                if len(tokens[i]) < k and confidence >= min_confidence:
                    feeds[i] = Segment([token], feed.start + len(feed.tokens), feed.blocks)
            if timed is not None and all(len(feed.tokens) == 1 for feed in live.values()):
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
    def _first_feed(self, seq: S) -> Segment:
        """What the draft has not seen of the sequence's tokens, where it writes their KV."""

    @abstractmethod
    def _room(self, seq: S, feed: Segment) -> bool:
        """Whether the feed's KV has room (else the sequence drafts no further this round)."""

    @abstractmethod
    def _fed(self, seq: S, n: int) -> None:
        """`n` more tokens of the sequence's draft KV are written."""


@dataclass
class Lone:
    """A request speculating alone, as the draft loop reads it."""

    token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None


class SlotDrafts(ModelDrafts[Lone]):
    """One sequence's draft KV in a slot of its own (`runner`, seen as one block), rolled back by its length."""

    def __init__(self, drafter: ModelDrafter, capacity: int) -> None:
        self.runner = SlotRunner.alone(drafter.model, capacity, drafter.fused)
        super().__init__(drafter, PagedKVCache.over_slots(self.runner.cache))
        self.blocks = [self.runner.slot]

    def _first_feed(self, seq: Lone) -> Segment:
        return Segment(seq.token_ids[self.runner.length :], self.runner.length, self.blocks)

    def _room(self, seq: Lone, feed: Segment) -> bool:
        return feed.start + len(feed.tokens) <= self.runner.cache.max_seq_len

    def _fed(self, seq: Lone, n: int) -> None:
        self.runner.length += n


class ModelDraftState(DraftState):
    """A draft model's state for one request speculating alone: the draft loop over a batch of one."""

    def __init__(self, drafter: ModelDrafter, capacity: int) -> None:
        self.drafts = SlotDrafts(drafter, capacity)
        self.runner = self.drafts.runner  # the draft's KV: tokens the draft has seen, `runner.length` of them

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        (proposal,) = self.drafts.propose([(Lone(context, params, generator), k)])
        self.calls = self.drafts.calls
        return proposal

    def rollback(self, length: int) -> None:
        self.runner.length = min(self.runner.length, length)


class TargetKVDrafts(ModelDrafts[Request], LoopDrafts):
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


class DraftPool(ModelDrafts[Request], LoopDrafts):
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
