"""One request at a time, outside the engine loop: the single-sequence reference path.

A `Sequence` holds one request's KV state: a slot of the contiguous cache, blocks of the paged pool, or
(cache=none) just its token ids, recomputed in full at every step as the baseline the KV-cache study
measures against. `InferenceEngine.prefill` / `decode_step` (the contract) drive one; so do the studies
that time a single stream's steps, and `generate` on the contiguous cache and on cache=none.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from inferlab.engine.block_manager import BlockManager, BlockTable
from inferlab.engine.kv_cache import CachedAttend, SlotPool
from inferlab.engine.paged import PagedKVCache, forward_paged
from inferlab.errors import CapacityError
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.transformer import Transformer, causal_attend


class Sequence(ABC):
    """One request's KV state. `forward(new_ids)` appends tokens and returns the last position's logits."""

    def __init__(self, model: Transformer, device: torch.device) -> None:
        self.model, self.device, self.length = model, device, 0

    @abstractmethod
    def forward(self, token_ids: list[int]) -> Tensor: ...

    def release(self) -> None:
        """Give the KV memory back (idempotent)."""


class CachedSequence(Sequence):
    def __init__(
        self, model: Transformer, device: torch.device, pool: SlotPool, n_tokens: int, fused: FusedDecode | None = None
    ) -> None:
        super().__init__(model, device)
        self.pool, self.slot, self.fused = pool, pool.allocate(n_tokens), fused
        self.block_table = torch.tensor([[self.slot]], device=device)  # the slot is one max_seq_len block

    def forward(self, token_ids: list[int]) -> Tensor:
        n = len(token_ids)
        if self.fused is not None and self.fused.covers(n):
            cache = self.pool.cache
            logits = self.fused.extend(token_ids, cache.k, cache.v, self.block_table, self.length)
            self.length += n
            return logits[-1]
        tokens = torch.tensor([token_ids], device=self.device)
        positions = torch.arange(self.length, self.length + n, device=self.device).unsqueeze(0)
        attend = CachedAttend(self.pool.cache, self.length, n, slice(self.slot, self.slot + 1))
        logits = self.model(tokens, positions, attend, last_only=True)
        self.length += n
        return logits[0, -1]

    def release(self) -> None:
        if self.slot is not None:
            self.pool.release(self.slot)
            self.slot = None


class RecomputeSequence(Sequence):
    def __init__(self, model: Transformer, device: torch.device) -> None:
        super().__init__(model, device)
        self.token_ids: list[int] = []

    def forward(self, token_ids: list[int]) -> Tensor:
        self.token_ids += token_ids
        self.length = len(self.token_ids)
        tokens = torch.tensor([self.token_ids], device=self.device)
        positions = torch.arange(self.length, device=self.device).unsqueeze(0)
        return self.model(tokens, positions, causal_attend, last_only=True)[0, -1]


class PagedSequence(Sequence):
    """A single request's KV in blocks of the paged pool, its prompt's cached prefix blocks reused."""

    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        cache: PagedKVCache,
        blocks: BlockManager,
        prompt_ids: list[int],
        fused: FusedDecode | None = None,
    ) -> None:
        super().__init__(model, device)
        self.cache, self.blocks, self.kv, self.token_ids, self.fused = cache, blocks, BlockTable(), [], fused
        if not blocks.allocate(self.kv, prompt_ids, len(prompt_ids)):
            raise CapacityError(f"the KV pool has no room for {len(prompt_ids)} prompt tokens now; retry later")
        self.length = self.kv.num_computed

    def forward(self, token_ids: list[int]) -> Tensor:
        self.token_ids += token_ids
        if not self.blocks.ensure_room(self.kv, len(self.token_ids)):
            raise CapacityError("the KV pool ran out of blocks; retry later or raise cache.kv_budget_mb")
        start = self.kv.num_computed
        logits = forward_paged(self.model, self.cache, [self.token_ids[start:]], [start], [self.kv.blocks], self.fused)
        self.blocks.advance(self.kv, self.token_ids, len(self.token_ids) - start)
        self.length = self.kv.num_computed
        return logits[0]

    def release(self) -> None:
        self.blocks.free(self.kv)
