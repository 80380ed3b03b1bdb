"""Paged KV cache: one pool of fixed-size blocks per layer, read and written through per-sequence block tables.

A sequence's KV no longer needs one region sized for the longest possible sequence: it holds
ceil(tokens / block_size) blocks anywhere in the pool, so many more sequences fit in the same memory.
The contiguous cache has the same layout with one max_seq_len block per slot, so the flat forward
(engine/flat.py) serves both, and batches of sequences of different lengths work the same over either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from inferlab.engine.flat import FlatBatch, Segment, forward_flat
from inferlab.engine.kv_cache import KVCache, compute_kv_cache_bytes
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.config import ModelConfig
from inferlab.model.transformer import Transformer


@dataclass
class PagedKVCache:
    """k, v: (n_layers, num_blocks, n_kv_heads, block_size, head_dim)."""

    k: Tensor
    v: Tensor
    decode_kernel: bool = False  # single-query steps through kernels.decode_attention (set by the engine)

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> PagedKVCache:
        shape = (config.n_layers, num_blocks, config.n_kv_heads, block_size, config.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @classmethod
    def over_slots(cls, cache: KVCache) -> PagedKVCache:
        """The contiguous cache's buffers seen as blocks: slot i is block i of max_seq_len tokens (no copy)."""
        return cls(cache.k, cache.v, cache.decode_kernel)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def blocks_for_budget(config: ModelConfig, budget_mb: float, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks a KV memory budget holds, by the same formula the calculator uses."""
    return int(budget_mb * 2**20) // compute_kv_cache_bytes(config, 1, block_size, dtype)


def forward_paged(
    model: Transformer,
    cache: PagedKVCache,
    new_tokens: list[list[int]],
    starts: list[int],
    block_tables: list[list[int]],
    fused: FusedDecode | None = None,
) -> Tensor:
    """B sequences, each feeding its new tokens after its `starts` cached ones, in one flat forward
    (engine/flat.py): each one's last logits (B, vocab)."""
    segments = [Segment(t, s, b) for t, s, b in zip(new_tokens, starts, block_tables)]
    return forward_flat(model, cache, FlatBatch.pack(segments, cache.k.device), fused)
