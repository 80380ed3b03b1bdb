"""Single-query attention through block tables (csrc/attention.h): each decode step's softmax(q K^T) V."""

from __future__ import annotations

import torch
from torch import Tensor

from inferlab.kernels.build import fast_kernels_apply, kernel_ops

DECODE_ATTENTION_MAX_HEAD_DIM = 256


def decode_attention_applies(device: torch.device, dtype: torch.dtype, head_dim: int, kernels: str) -> bool:
    """Whether a KV cache of this device, dtype and head_dim takes its single-query steps through
    `decode_attention`: decided once, when the cache is built."""
    return (
        fast_kernels_apply(device, dtype, kernels) and head_dim % 8 == 0 and head_dim <= DECODE_ATTENTION_MAX_HEAD_DIM
    )


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    positions: Tensor,
    k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
) -> Tensor:
    """Write each sequence's k, v at its position of the pools, then softmax(q K^T / sqrt(d)) V over its
    positions 0..position, read through its row of `block_tables`.

    q: (B, H, 1, D); k, v: (B, H_kv, 1, D); k_pool, v_pool: (num_blocks, H_kv, block_size, D), written in
    place (the contiguous cache is one max_seq_len block per slot); block_tables: (B, n) int64;
    positions: (B,) int64; H a multiple of H_kv -> (B, H, 1, D). int8 pools hold codes, with `k_scales`,
    `v_scales` (num_blocks, H_kv, block_size) fp32 one per row (engine/kv/int8.py): the new rows are
    quantized as they are written and the old ones dequantized as they are read.
    """
    return kernel_ops().decode_attention(
        q, k, v, k_pool, v_pool, block_tables, positions, k_scales, v_scales, q.shape[-1] ** -0.5
    )
