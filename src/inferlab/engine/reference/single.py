"""One request at a time, outside the engine loop: the single-sequence reference path.

A `SingleSequence` is one request's KV state on this path (what `InferenceEngine.prefill` returns and
`decode_step` takes as its `kv_cache`, the contract): a slot of the contiguous cache (`CachedSequence`), blocks of
the paged pool (`PagedSequence`), or, with cache=none, just its token ids, recomputed in full at every step
(`RecomputeSequence`, the baseline the KV-cache study measures against). The studies that time a single stream's
steps drive one, and so does `generate` on the contiguous cache and on cache=none. Paged sequences also decode
together, one flat forward for all (`forward_together`: the profile study's batched steps).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from inferlab.engine.kv.block_manager import BlockManager, BlockTable
from inferlab.engine.kv.contiguous import SlotPool
from inferlab.engine.kv.paged import PagedKVCache
from inferlab.engine.model_runner import FlatBatch, Segment, SlotRunner, forward_flat, forward_paged
from inferlab.errors import CapacityError
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.transformer import Transformer, causal_attend


class SingleSequence(ABC):
    """One request's KV state on the single-sequence path. `forward(new_ids)` appends tokens and returns the last
    position's logits.

    Speculative decoding verifies through the state the prompt was prefilled into (engine/spec/session.py):
    `verify_rows(ids)` writes the KV of tokens after the kept ones and returns every row's logits, each
    through the step that decodes one token here; `keep(n)` then keeps the first n of them.
    """

    length: int  # tokens whose KV the state holds

    def __init__(self, model: Transformer, device: torch.device) -> None:
        self.model, self.device = model, device

    @abstractmethod
    def forward(self, token_ids: list[int]) -> Tensor: ...

    @abstractmethod
    def verify_rows(self, token_ids: list[int]) -> Tensor: ...

    @abstractmethod
    def keep(self, n: int) -> None: ...

    def release(self) -> None:
        """Give the KV memory back (idempotent)."""


class CachedSequence(SingleSequence):
    """A request's KV in one slot of the contiguous cache, written by the model runner's SlotRunner."""

    def __init__(
        self, model: Transformer, device: torch.device, pool: SlotPool, n_tokens: int, fused: FusedDecode | None = None
    ) -> None:
        super().__init__(model, device)
        self.pool, self.slot = pool, pool.allocate(n_tokens)
        self.runner = SlotRunner(model, pool.cache, self.slot, fused)
        self.length = 0

    def forward(self, token_ids: list[int]) -> Tensor:
        logits = self.runner.forward(token_ids, last_only=True)
        self.length = self.runner.length
        return logits[-1]

    def verify_rows(self, token_ids: list[int]) -> Tensor:
        return self.runner.verify_rows(token_ids)

    def keep(self, n: int) -> None:
        self.runner.keep(n)
        self.length = self.runner.length

    def release(self) -> None:
        if self.slot is not None:
            self.pool.release(self.slot)
            self.slot = None


class RecomputeSequence(SingleSequence):
    def __init__(self, model: Transformer, device: torch.device) -> None:
        super().__init__(model, device)
        self.token_ids: list[int] = []
        self.pending: list[int] = []  # the last verify_rows' tokens
        self.length = 0

    def forward(self, token_ids: list[int]) -> Tensor:
        self.token_ids += token_ids
        self.length = len(self.token_ids)
        return self._recompute(self.token_ids, last_only=True)[-1]

    def verify_rows(self, token_ids: list[int]) -> Tensor:
        self.pending = list(token_ids)
        return self._recompute(self.token_ids + self.pending, last_only=False)[-len(token_ids) :]

    def keep(self, n: int) -> None:
        self.token_ids += self.pending[:n]
        self.length = len(self.token_ids)

    def _recompute(self, token_ids: list[int], last_only: bool) -> Tensor:
        tokens = torch.tensor([token_ids], device=self.device)
        positions = torch.arange(len(token_ids), device=self.device).unsqueeze(0)
        return self.model(tokens, positions, causal_attend, last_only=last_only)[0]


class PagedSequence(SingleSequence):
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
        self.pending: list[int] = []  # the last verify_rows' tokens
        if not blocks.allocate(self.kv, prompt_ids, len(prompt_ids)):
            raise CapacityError(f"the KV pool has no room for {len(prompt_ids)} prompt tokens now; retry later")
        self.length = self.kv.num_computed

    def forward(self, token_ids: list[int]) -> Tensor:
        return forward_together([self], [token_ids])[0]

    def verify_rows(self, token_ids: list[int]) -> Tensor:
        """Rows past the kept tokens, in blocks this sequence holds; nothing counted (or findable in the prefix
        cache) until `keep`: rejected tokens' KV stays in room the next rows overwrite."""
        n, start = len(token_ids), self.kv.num_computed
        if not self.blocks.ensure_room(self.kv, start + n):
            raise CapacityError("the KV pool ran out of blocks; retry later or raise cache.kv_budget_mb")
        self.pending = list(token_ids)
        batch = FlatBatch.pack([Segment(self.pending, start, self.kv.blocks, n_logits=n)], self.device)
        return forward_flat(self.model, self.cache, batch, self.fused)  # the engine loop's step, one row each

    def keep(self, n: int) -> None:
        self.token_ids += self.pending[:n]
        self.blocks.advance(self.kv, self.token_ids, n)
        self.length = self.kv.num_computed

    def release(self) -> None:
        self.blocks.free(self.kv)


@torch.inference_mode()
def forward_together(seqs: list[PagedSequence], token_ids: list[list[int]]) -> Tensor:
    """Feed each sequence (of one engine's pool) its new tokens, all in one flat forward; each one's last logits
    (B, vocab). The decode step of several sequences as the engine loop runs it, outside the loop (the profile
    study)."""
    for seq, ids in zip(seqs, token_ids):
        if not seq.blocks.ensure_room(seq.kv, len(seq.token_ids) + len(ids)):
            raise CapacityError("the KV pool ran out of blocks; retry later or raise cache.kv_budget_mb")
        seq.token_ids += ids
    starts = [seq.kv.num_computed for seq in seqs]
    new_tokens = [seq.token_ids[start:] for seq, start in zip(seqs, starts)]
    first = seqs[0]
    logits = forward_paged(first.model, first.cache, new_tokens, starts, [seq.kv.blocks for seq in seqs], first.fused)
    for seq, start in zip(seqs, starts):
        seq.blocks.advance(seq.kv, seq.token_ids, len(seq.token_ids) - start)
        seq.length = seq.kv.num_computed
    return logits
