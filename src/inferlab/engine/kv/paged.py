"""Paged KV cache: one pool of fixed-size blocks per layer, read and written through per-sequence block tables.

A sequence's KV no longer needs one region sized for the longest possible sequence: it holds
ceil(tokens / block_size) blocks anywhere in the pool, so many more sequences fit in the same memory.
The contiguous cache has the same layout with one max_seq_len block per slot, so the flat forward
(engine/model_runner.py) serves both, and batches of sequences of different lengths work the same over either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from inferlab.engine.kv.contiguous import KVCache, compute_kv_cache_bytes
from inferlab.engine.kv.int8 import KV_INT8, SCALE_DTYPE, dequantize_rows, quantize_rows
from inferlab.kernels.huge_pages import zeros_on_huge_pages
from inferlab.model.config import ModelConfig


@dataclass
class PagedKVCache:
    """k, v: (n_layers, num_blocks, n_kv_heads, block_size, head_dim); int8 codes with `k_scale`, `v_scale`
    (n_layers, num_blocks, n_kv_heads, block_size) fp32, one per row (kv/int8.py)."""

    k: Tensor
    v: Tensor
    decode_kernel: bool = False  # single-query steps through kernels.decode_attention (set by the engine)
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> PagedKVCache:
        """`dtype`: the model's, or KV_INT8 for codes and scales."""
        shape = (config.n_layers, num_blocks, config.n_kv_heads, block_size, config.head_dim)
        k, v = (zeros_on_huge_pages(shape, dtype, device) for _ in range(2))  # (kernels/huge_pages.py)
        if dtype != KV_INT8:
            return cls(k, v)
        k_scale, v_scale = (torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device) for _ in range(2))
        return cls(k, v, k_scale=k_scale, v_scale=v_scale)

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
        return sum(t.nbytes for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    def write(self, layer_idx: int, blocks: Tensor, offsets: Tensor, k: Tensor, v: Tensor) -> None:
        """Rows k, v (..., H_kv, D) at (blocks, offsets) (...) of layer `layer_idx`: converted, or quantized."""
        for pool, scales, rows in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            # advanced indices around a slice put the rows' dims first: the values are (..., H_kv, D)
            if scales is None:
                pool[layer_idx][blocks, :, offsets] = rows.to(pool.dtype)
            else:
                pool[layer_idx][blocks, :, offsets], scales[layer_idx][blocks, :, offsets] = quantize_rows(rows)

    def scales(self, layer_idx: int | None = None) -> tuple[Tensor | None, Tensor | None]:
        """The k and v scales of one layer (or all) for the kernels; (None, None) unless int8."""
        if self.k_scale is None or self.v_scale is None or layer_idx is None:
            return self.k_scale, self.v_scale
        return self.k_scale[layer_idx], self.v_scale[layer_idx]

    def read(self, layer_idx: int, gather: Callable[[Tensor], Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Layer `layer_idx`'s keys and values as `gather` picks them from a pool (blocks, H_kv, bs, ...), in `dtype`."""
        if self.k_scale is None or self.v_scale is None:
            return gather(self.k[layer_idx]).to(dtype), gather(self.v[layer_idx]).to(dtype)
        return (
            dequantize_rows(gather(self.k[layer_idx]), gather(self.k_scale[layer_idx]), dtype),
            dequantize_rows(gather(self.v[layer_idx]), gather(self.v_scale[layer_idx]), dtype),
        )


def blocks_for_budget(config: ModelConfig, budget_mb: float, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks a KV memory budget holds, by the same formula the calculator uses (int8: with scales)."""
    return int(budget_mb * 2**20) // compute_kv_cache_bytes(config, 1, block_size, dtype)
