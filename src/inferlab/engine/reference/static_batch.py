"""Static batching with left padding over the contiguous cache: the classic way to serve B prompts at once.

Prompts are right-aligned, so every sequence writes the same cache column at each step and one
(B, T) forward serves them all; each gets its own positions (counted from its first real token)
and a key mask that hides the padding. The batch runs until its longest request ends: finished
rows keep computing, the waste continuous batching removes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from inferlab.engine.kv.contiguous import KVCache
from inferlab.engine.request import Request
from inferlab.model.transformer import PLAIN, AttentionSpan, Transformer, attend_over

PAD_ID = 0  # any valid id: padded positions are masked out of every real query


@dataclass
class LeftPaddedAttend:
    """Writes at column `start` of the batch's slots; each query sees real keys up to itself.

    A padding query sees only itself (never an empty row, which some attention kernels turn into NaN).
    """

    cache: KVCache
    slots: Tensor  # (B,) slot ids
    start: int
    key_mask: Tensor  # (B, max_seq_len), True = a real token
    n_new: int
    mask: Tensor = field(init=False)

    def __post_init__(self) -> None:
        end = self.start + self.n_new
        device = self.key_mask.device
        query = torch.arange(self.start, end, device=device)[:, None]
        keys = torch.arange(end, device=device)[None, :]
        visible = (keys <= query)[None] & self.key_mask[:, None, :end]  # (B, T, end)
        self.mask = (visible | (keys == query)[None]).unsqueeze(1)  # (B, 1, T, end)

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, span: AttentionSpan = PLAIN) -> Tensor:
        keys, values = self.cache.update(layer_idx, k, v, self.start, self.slots)
        if not span.plain:  # a window counts cache columns: each row's padding shifts queries and keys alike
            query_index = torch.arange(self.start, self.start + self.n_new, device=q.device)
            return attend_over(q, keys, values, query_index, span, self.mask)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, enable_gqa=True)


class LeftPaddedBatch:
    """B prompts held in B slots of the contiguous cache, aligned on their last prompt token."""

    def __init__(self, model: Transformer, cache: KVCache, slots: list[int], prompts: list[list[int]]) -> None:
        device = cache.k.device
        self.model, self.cache, self.prompts = model, cache, prompts
        self.width = max(len(p) for p in prompts)
        self.pad = torch.tensor([self.width - len(p) for p in prompts], device=device)  # (B,)
        self.slots = torch.tensor(slots, device=device)
        columns = torch.arange(cache.max_seq_len, device=device)
        self.key_mask = columns[None, :] >= self.pad[:, None]  # (B, max_seq_len)
        self.length = 0  # columns written

    def prefill(self) -> Tensor:
        """All prompts at once -> next-token logits (B, vocab)."""
        rows = [[PAD_ID] * (self.width - len(p)) + p for p in self.prompts]
        return self.forward(torch.tensor(rows, device=self.cache.k.device))

    def decode(self, token_ids: list[int]) -> Tensor:
        """One token per sequence -> logits (B, vocab)."""
        return self.forward(torch.tensor(token_ids, device=self.cache.k.device)[:, None])

    @torch.inference_mode()
    def forward(self, tokens: Tensor) -> Tensor:
        # tokens: (B, T) -> (B, vocab)
        T = tokens.shape[1]
        columns = self.length + torch.arange(T, device=tokens.device)
        positions = (columns[None, :] - self.pad[:, None]).clamp(min=0)  # (B, T)
        attend = LeftPaddedAttend(self.cache, self.slots, self.length, self.key_mask, T)
        logits = self.model(tokens, positions, attend, last_only=True)[:, -1]
        self.length += T
        return logits


def run_static_batch(batch: LeftPaddedBatch, requests: list[Request], lock: threading.Lock) -> None:
    """Generate until every request has ended; each request's events go to its own `emit`."""
    with lock:
        logits = batch.prefill()
    while True:
        for request, row in zip(requests, logits):
            if not request.finished:
                for event in request.sample(row):
                    request.emit(event)
        if all(r.finished for r in requests):
            return
        with lock:
            logits = batch.decode([PAD_ID if r.finished else r.output_ids[-1] for r in requests])
