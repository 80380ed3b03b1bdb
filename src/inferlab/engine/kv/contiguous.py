"""Contiguous KV cache: pre-allocated per-slot buffers, written in place, and the slot pool over them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from inferlab.engine.kv.int8 import KV_INT8, SCALE_DTYPE
from inferlab.errors import CapacityError
from inferlab.kernels.attention import decode_attention
from inferlab.kernels.huge_pages import zeros_on_huge_pages
from inferlab.model.config import ModelConfig
from inferlab.model.transformer import PLAIN, AttentionSpan, attend_over


def compute_kv_cache_bytes(config: ModelConfig, batch_size: int, seq_len: int, dtype: torch.dtype) -> int:
    """K and V for every layer: 2 * layers * kv_heads * head_dim * seq_len * bytes * batch; an int8 cache
    also holds one fp32 scale per head_dim row: 2 * layers * kv_heads * (head_dim + 4) * seq_len * batch."""
    row = config.head_dim * torch.empty(0, dtype=dtype).element_size()
    if dtype == KV_INT8:
        row += torch.empty(0, dtype=SCALE_DTYPE).element_size()
    return 2 * config.n_layers * config.n_kv_heads * row * seq_len * batch_size


class KVCache:
    """Buffers k, v: (n_layers, slots, n_kv_heads, max_seq_len, head_dim), allocated once."""

    def __init__(self, config: ModelConfig, slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device):
        shape = (config.n_layers, slots, config.n_kv_heads, max_seq_len, config.head_dim)
        self.k = zeros_on_huge_pages(shape, dtype, device)  # (kernels/huge_pages.py)
        self.v = zeros_on_huge_pages(shape, dtype, device)
        self.k_layers = [self.k[i] for i in range(config.n_layers)]  # per-layer views: less indexing per step
        self.v_layers = [self.v[i] for i in range(config.n_layers)]
        self.slots, self.max_seq_len = slots, max_seq_len
        self.decode_kernel = False  # single-query steps through kernels.decode_attention (set by the engine,
        # from kernels.decode_attention_applies)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(
        self, layer_idx: int, k_val: Tensor, v_val: Tensor, start_pos: int, slots: slice = slice(0, 1)
    ) -> tuple[Tensor, Tensor]:
        """Write k/v (B, n_kv_heads, T, head_dim) at [start_pos, start_pos + T) of `slots`, in place.

        Returns views of everything written so far for those slots: (B, n_kv_heads, start_pos + T, head_dim).
        """
        end = start_pos + k_val.shape[2]
        k, v = self.k_layers[layer_idx], self.v_layers[layer_idx]  # (slots, n_kv_heads, max_seq_len, head_dim)
        k[slots, :, start_pos:end] = k_val
        v[slots, :, start_pos:end] = v_val
        return k[slots, :, :end], v[slots, :, :end]


@dataclass
class CachedAttend:
    """The `attend` for one forward over a run of slots that share a start position.

    `key_mask` (B, start_pos + T), True = attend, hides left padding in a batch; otherwise a single
    query needs no mask and a chunk starting at 0 is plainly causal.
    """

    cache: KVCache
    start_pos: int
    n_new: int
    slots: slice = field(default_factory=lambda: slice(0, 1))  # a slice: indexing it gives views
    key_mask: Tensor | None = None
    mask: Tensor | None = field(init=False, default=None)
    block_tables: Tensor | None = field(init=False, default=None)  # (B, 1): the slots, for decode_attention
    positions: Tensor | None = field(init=False, default=None)  # (B,): start_pos

    def __post_init__(self) -> None:
        if self.n_new == 1 and self.key_mask is None and self.cache.decode_kernel:
            device = self.cache.k.device  # each slot is one block of max_seq_len positions
            self.block_tables = torch.arange(self.slots.start, self.slots.stop, device=device)[:, None]
            self.positions = torch.full((self.slots.stop - self.slots.start,), self.start_pos, device=device)
        end = self.start_pos + self.n_new
        needs_causal = self.n_new > 1 and self.start_pos > 0
        if needs_causal or self.key_mask is not None:
            device = self.cache.k.device
            query_pos = torch.arange(self.start_pos, end, device=device).unsqueeze(1)
            mask = (torch.arange(end, device=device).unsqueeze(0) <= query_pos).unsqueeze(0)  # (1, T, end)
            if self.key_mask is not None:
                mask = mask & self.key_mask[:, None, :end]  # (B, T, end)
            self.mask = mask.unsqueeze(1)  # (B or 1, 1, T, end)

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, span: AttentionSpan = PLAIN) -> Tensor:
        cache = self.cache
        if self.block_tables is not None and span.plain:
            # one call writes this step's k/v into the slots' buffers and attends
            return decode_attention(
                q, k, v, cache.k_layers[layer_idx], cache.v_layers[layer_idx], self.block_tables, self.positions
            )
        keys, values = cache.update(layer_idx, k, v, self.start_pos, self.slots)
        if not span.plain:
            query_index = torch.arange(self.start_pos, self.start_pos + self.n_new, device=q.device)
            return attend_over(q, keys, values, query_index, span, self.mask)
        causal = self.mask is None and self.n_new > 1  # then start_pos == 0: plain causal prefill
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, is_causal=causal, enable_gqa=True)


@dataclass
class SlotPool:
    """Hands out cache slots; refuses a request whose KV need cannot fit, with the numbers that say why."""

    cache: KVCache
    config: ModelConfig
    free: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.free = list(range(self.cache.slots))[::-1]

    def check_fits(self, n_tokens: int) -> None:
        if n_tokens > self.cache.max_seq_len:
            need = compute_kv_cache_bytes(self.config, 1, n_tokens, self.cache.k.dtype)
            have = compute_kv_cache_bytes(self.config, 1, self.cache.max_seq_len, self.cache.k.dtype)
            raise CapacityError(
                f"request needs KV for {n_tokens} tokens ({need / 2**20:.1f} MiB) but a slot holds "
                f"{self.cache.max_seq_len} tokens ({have / 2**20:.1f} MiB); shorten the prompt or max_new_tokens"
            )

    def allocate(self, n_tokens: int) -> int:
        self.check_fits(n_tokens)
        if not self.free:
            raise CapacityError(f"all {self.cache.slots} KV slots are in use")
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)

    @property
    def used(self) -> int:
        return self.cache.slots - len(self.free)
