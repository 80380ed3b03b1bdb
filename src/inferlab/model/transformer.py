"""A Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

q/k/v and gate/up are fused into one Linear each (loaders concatenate the checkpoint's rows), so a
decode step runs 4 matrix-vector products per layer instead of 7. Attention is delegated to an
`attend` callable so one model serves every cache layout: recompute, contiguous slots, paged blocks.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferlab.model.config import ModelConfig


class Attend(Protocol):
    """Writes this step's k/v where the cache keeps them and attends q over everything visible."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...
    # q: (B, n_heads, T, head_dim); k, v: (B, n_kv_heads, T, head_dim) -> (B, n_heads, T, head_dim)


def causal_attend(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """No cache: attend causally within this forward (the recompute baseline)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # normalized in fp32, scaled in the model's dtype (as HF does): one fused kernel, not seven ops
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_frequencies(config: ModelConfig) -> Tensor:
    """Inverse frequencies (head_dim / 2,), with llama3-style scaling when the config asks for it."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = config.rope_scaling
    if s:
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, H, T, D); cos, sin: (B, 1, T, D), sin negated on its first half (Transformer.reset_rope).
    # Rotate-half layout, as HF checkpoints store q/k: x * cos + (-x2, x1) * sin, the sign being in `sin`
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def linear_after_norm(linear: nn.Module, norm: RMSNorm, x: Tensor) -> Tensor:
    """linear(norm(x)), in one call where the linear's kernel normalizes its input rows itself."""
    if getattr(linear, "fuses_input", False):
        return linear(x, norm=norm)
    return linear(norm(x))


def swiglu(gate_up: Tensor) -> Tensor:
    # gate_up: (..., 2 * hidden) = [gate, up] -> silu(gate) * up (..., hidden)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_after_swiglu(linear: nn.Module, gate_up: Tensor) -> Tensor:
    """linear(swiglu(gate_up)), in one call where the linear's kernel gates its input rows itself."""
    if getattr(linear, "fuses_input", False):
        return linear(gate_up, gated=True)
    return linear(swiglu(gate_up))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split = (q_size + kv_size, kv_size)
        self.wqkv = nn.Linear(config.dim, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.wo = nn.Linear(q_size, config.dim, bias=False)

    def forward(self, x: Tensor, norm: RMSNorm, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        B, T, _ = x.shape
        qk, v = linear_after_norm(self.wqkv, norm, x).split(self.split, dim=-1)
        # q and k heads rotated together: (B, n_heads + n_kv_heads, T, head_dim)
        qk = apply_rope(qk.view(B, T, self.n_heads + self.n_kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        q, k = qk.split((self.n_heads, self.n_kv_heads), dim=1)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        out = attend(self.layer_idx, q, k, v)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(config.dim, 2 * config.hidden_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x: Tensor, norm: RMSNorm) -> Tensor:
        return linear_after_swiglu(self.w2, linear_after_norm(self.w13, norm, x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, layer_idx)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        h = x + self.attention(x, self.attention_norm, cos, sin, attend)
        return h + self.feed_forward(h, self.ffn_norm)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)build the cos/sin tables (max_seq_len, head_dim) in fp32, stored in the weights' dtype and device.

        Loaders call it again once the weights are materialized: a model built on the meta device
        has meta tables.
        """
        weight = self.tok_embeddings.weight
        positions = torch.arange(self.config.max_seq_len, dtype=torch.float32, device=weight.device)
        angles = torch.outer(positions, rope_frequencies(self.config).to(weight.device))
        angles = torch.cat((angles, angles), dim=-1)  # (max_seq_len, head_dim)
        sin = angles.sin()
        sin[:, : self.config.head_dim // 2] *= -1  # the rotate-half sign (apply_rope)
        self.register_buffer("rope_cos", angles.cos().to(weight.dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(weight.dtype), persistent=False)

    def forward(self, tokens: Tensor, positions: Tensor, attend: Attend = causal_attend,
                last_only: bool = False) -> Tensor:
        # tokens, positions: (B, T) -> logits (B, T, vocab), or (B, 1, vocab) with last_only
        x = self.tok_embeddings(tokens)
        cos = self.rope_cos[positions].unsqueeze(1)  # (B, 1, T, head_dim)
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer in self.layers:
            x = layer(x, cos, sin, attend)
        if last_only:
            x = x[:, -1:]
        return linear_after_norm(self.output, self.norm, x)
