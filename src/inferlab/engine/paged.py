"""Paged KV cache: one pool of fixed-size blocks per layer, read and written through per-sequence block tables.

A sequence's KV no longer needs one region sized for the longest possible sequence: it holds
ceil(tokens / block_size) blocks anywhere in the pool, so many more sequences fit in the same memory.
The contiguous cache has the same layout with one max_seq_len block per slot, so `PagedAttend` serves
both, and batched decoding of sequences of different lengths works the same over either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from inferlab.engine.kv_cache import KVCache, compute_kv_cache_bytes
from inferlab.kernels.attention import decode_attention
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.config import ModelConfig
from inferlab.model.transformer import PLAIN, AttentionSpan, Transformer, attend_over


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


@dataclass
class PagedAttend:
    """The `attend` for one forward of B sequences, each feeding T new tokens after its own cached ones.

    `starts` (B,) are the tokens each sequence already holds; its new tokens go to positions
    start .. start + T - 1, through its row of `block_tables` (B, max_blocks). Keys are gathered per
    sequence into (B, H, L, D), L the longest sequence; the mask hides each one's padding and future.
    """

    cache: PagedKVCache
    block_tables: Tensor  # (B, max_blocks) int64, unused entries any valid block id
    starts: Tensor  # (B,) int64
    n_new: int
    mask: Tensor | None = field(init=False, default=None)  # None: one query each, through decode_attention

    def __post_init__(self) -> None:
        if not (self.n_new == 1 and self.cache.decode_kernel):
            self._gather_plan()

    def _gather_plan(self) -> None:
        """Where this forward's k/v go and which positions each query sees, for the gather-and-SDPA path."""
        bs, device = self.cache.block_size, self.block_tables.device
        positions = self.starts[:, None] + torch.arange(self.n_new, device=device)  # (B, T)
        self.write_blocks = self.block_tables.gather(1, positions // bs)  # (B, T)
        self.write_offsets = positions % bs  # (B, T)
        self.length = int(self.starts.max()) + self.n_new
        self.read_blocks = -(-self.length // bs)
        keys = torch.arange(self.length, device=device)
        self.positions = positions
        self.mask = (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # (B, 1, T, L)

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, span: AttentionSpan = PLAIN) -> Tensor:
        k_pool, v_pool = self.cache.k[layer_idx], self.cache.v[layer_idx]  # (num_blocks, H, bs, D)
        if self.mask is None:
            if span.plain:
                return decode_attention(q, k, v, k_pool, v_pool, self.block_tables, self.starts)
            self._gather_plan()  # the kernel attends over every earlier key: this layer's span needs the gather
        # advanced indices around a slice put (B, T) first: the values are (B, T, H, D)
        k_pool[self.write_blocks, :, self.write_offsets] = k.transpose(1, 2).to(k_pool.dtype)
        v_pool[self.write_blocks, :, self.write_offsets] = v.transpose(1, 2).to(v_pool.dtype)
        keys, values = self._gather(k_pool), self._gather(v_pool)
        if not span.plain:
            return attend_over(q, keys.to(q.dtype), values.to(q.dtype), self.positions, span)
        return F.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), attn_mask=self.mask, enable_gqa=True
        )

    def _gather(self, pool: Tensor) -> Tensor:
        """Each sequence's first `length` positions, in order: (B, H, L, D)."""
        if self.read_blocks == 1:  # also the contiguous cache: slice the slot instead of copying all of it
            return pool[self.block_tables[:, 0], :, : self.length]
        blocks = pool[self.block_tables[:, : self.read_blocks]]  # (B, nb, H, bs, D)
        B, nb, H, bs, D = blocks.shape
        return blocks.permute(0, 2, 1, 3, 4).reshape(B, H, nb * bs, D)[:, :, : self.length]


def forward_paged(
    model: Transformer,
    cache: PagedKVCache,
    new_tokens: list[list[int]],
    starts: list[int],
    block_tables: list[list[int]],
    fused: FusedDecode | None = None,
    every_position: bool = False,
) -> Tensor:
    """Run B sequences that each feed the same number T of new tokens; return each one's last logits (B, vocab),
    or with `every_position` every new position's (B, T, vocab) (prompt log-probabilities).

    A decode step (T = 1) of few enough sequences runs as one `fused` call where the engine built one.
    """
    device = cache.k.device
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in block_tables], device=device)
    start = torch.tensor(starts, device=device)
    tokens = torch.tensor(new_tokens, device=device)  # (B, T)
    if fused is not None and tokens.shape[1] == 1 and fused.covers(tokens.shape[0]):
        logits = fused(tokens[:, 0], cache.k, cache.v, tables, start)
        return logits[:, None] if every_position else logits
    positions = start[:, None] + torch.arange(tokens.shape[1], device=device)
    attend = PagedAttend(cache, tables, start, tokens.shape[1])
    logits = model(tokens, positions, attend, last_only=not every_position)
    return logits if every_position else logits[:, -1]
