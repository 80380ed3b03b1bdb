"""A Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, and its declared variants.

The variants (model/config.py) switch small parts on, never copy the model: per-head q/k norms
(Qwen3, Gemma 3), GeGLU and norms after attention and MLP too (Gemma), scaled embeddings, soft-capped
scores and logits, sliding-window layers with their own rope table (Gemma 3), partial rotary (Phi-3).

q/k/v and gate/up are fused into one Linear each (loaders concatenate the checkpoint's rows), so a
decode step runs 4 matrix-vector products per layer instead of 7. Attention is delegated to an
`attend` callable so one model serves every cache layout: recompute, contiguous slots, paged blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferlab.model.config import ModelConfig


@dataclass(frozen=True)
class AttentionSpan:
    """What one layer's queries see beyond plain causal attention over every earlier key."""

    window: int | None = None  # sliding window: the query and the window - 1 keys before it
    softcap: float = 0.0  # scores -> softcap * tanh(scores / softcap); 0 = off

    @property
    def plain(self) -> bool:
        return self.window is None and not self.softcap


PLAIN = AttentionSpan()


class Attend(Protocol):
    """Writes this step's k/v where the cache keeps them and attends q over everything visible."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, span: AttentionSpan = PLAIN) -> Tensor: ...

    # q: (B, n_heads, T, head_dim); k, v: (B, n_kv_heads, T, head_dim) -> (B, n_heads, T, head_dim)


def attend_over(
    q: Tensor, keys: Tensor, values: Tensor, query_index: Tensor, span: AttentionSpan, mask: Tensor | None = None
) -> Tensor:
    """Causal attention narrowed to `span`, for every cache layout: keys are indexed 0..L-1 in order.

    q: (B, H, T, D); keys, values: (B, H_kv, L, D); query_index: (T,) or (B, T), each query's index on the
    key axis; mask: (B or 1, 1, T, L) bool, True = may attend (padding), or None -> (B, H, T, D)
    """
    key_index = torch.arange(keys.shape[2], device=q.device)
    query = query_index.unsqueeze(-1)  # (..., T, 1)
    visible = key_index <= query
    if span.window is not None:
        visible = visible & (key_index > query - span.window)
    visible = visible[:, None] if visible.dim() == 3 else visible[None, None]  # (B or 1, 1, T, L)
    if mask is not None:
        visible = visible & mask
    if not span.softcap:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.tanh((q @ keys.transpose(-1, -2)) * (q.shape[-1] ** -0.5 / span.softcap)) * span.softcap
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")).float(), dim=-1).to(q.dtype)
    return weights @ values


def causal_attend(layer_idx: int, q: Tensor, k: Tensor, v: Tensor, span: AttentionSpan = PLAIN) -> Tensor:
    """No cache: attend causally within this forward (the recompute baseline)."""
    if not span.plain:
        return attend_over(q, k, v, torch.arange(q.shape[2], device=q.device), span)
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # normalized in fp32, scaled in the model's dtype (as HF does): one fused kernel, not seven ops
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_frequencies(config: ModelConfig, local: bool = False) -> tuple[Tensor, float]:
    """(inverse frequencies (rotary_dim / 2,), the cos/sin scale), with the config's rope scaling.

    `local`: the sliding layers' own table (Gemma 3), unscaled. LongRoPE (Phi-3) takes its long factors
    when the context (max_seq_len) exceeds the original one, its short factors otherwise, as llama.cpp
    does (transformers switches per forward, by the longest position in it).
    """
    d = config.rotary_dim
    theta = config.rope_local_theta if local else config.rope_theta
    exponents = torch.arange(0, d, 2, dtype=torch.float64) / d
    s = None if local else config.rope_scaling
    kind = s["rope_type"] if s else None
    if kind == "longrope":
        long = config.max_seq_len > s["original_max_position_embeddings"]
        factors = torch.tensor(s["long_factor"] if long else s["short_factor"], dtype=torch.float64)
        return (1.0 / (factors * theta**exponents)).float(), float(s["attention_factor"])
    inv_freq = 1.0 / (theta**exponents)
    if kind == "freq_factors":  # a GGUF's rope_freqs: llama.cpp divides each frequency by its factor
        inv_freq = inv_freq / torch.tensor(s["factors"], dtype=torch.float64)
    elif kind == "linear":
        inv_freq = inv_freq / s["factor"]
    elif kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.float(), 1.0


def rope_tables(config: ModelConfig, device: torch.device, local: bool = False) -> tuple[Tensor, Tensor]:
    """cos, sin (max_seq_len, rotary_dim) in fp32, sin negated on its first half (the rotate-half sign of
    apply_rope)."""
    inv_freq, scale = rope_frequencies(config, local)
    positions = torch.arange(config.max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq.to(device))
    angles = torch.cat((angles, angles), dim=-1)
    sin = angles.sin() * scale
    sin[:, : config.rotary_dim // 2] *= -1
    return angles.cos() * scale, sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, H, T, D); cos, sin: (B, 1, T, R), R <= D rotated dims, sin negated on its first half
    # (Transformer.reset_rope). Rotate-half layout, as HF checkpoints store q/k: x * cos + (-x2, x1) * sin
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:  # partial rotary: the trailing dims pass through
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    return torch.addcmul(x * cos, x.roll(rotary // 2, dims=-1), sin)


def linear_after_norm(linear: nn.Module, norm: RMSNorm, x: Tensor) -> Tensor:
    """linear(norm(x)), in one call where the linear's kernel normalizes its input rows itself."""
    if getattr(linear, "fuses_input", False):
        return linear(x, norm=norm)
    return linear(norm(x))


def logits_fp32(output: nn.Module, norm: RMSNorm, x: Tensor) -> Tensor:
    """The LM head's logits, computed and returned in fp32 whatever the model's dtype.

    bf16's spacing near a logit of 25 is 0.125: rounded to it, a margin of 0.08 between the top two tokens becomes a
    tie, and greedy decoding follows whichever comes first. Kernel layers take fp32 rows over any weight format; any
    other head multiplies them by its weight widened to fp32 (widened_linear).
    """
    x = x.float()
    if getattr(output, "fuses_input", False) or output.weight.dtype == torch.float32:
        return linear_after_norm(output, norm, x)
    return widened_linear(norm(x), output.weight, output.bias)


def widened_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear of fp32 rows `x` over a lower-precision weight widened to fp32 a slice of its rows at a time, so that
    a large vocabulary's widened copy never exists whole."""
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    step = max(1, LOGIT_SLICE_VALUES // weight.shape[1])
    for start in range(0, weight.shape[0], step):
        part = slice(start, start + step)
        out[..., part] = F.linear(x, weight[part].float(), None if bias is None else bias[part].float())
    return out


LOGIT_SLICE_VALUES = 1 << 23  # weights widened to fp32 at a time by widened_linear (32 MiB)


def swiglu(gate_up: Tensor) -> Tensor:
    # gate_up: (..., 2 * hidden) = [gate, up] -> silu(gate) * up (..., hidden)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu(gate_up: Tensor) -> Tensor:
    # gelu with the tanh approximation (Gemma's gelu_pytorch_tanh)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATES = {"silu": swiglu, "gelu_tanh": geglu}


def linear_after_glu(linear: nn.Module, gate_up: Tensor, activation: str) -> Tensor:
    """linear(glu(gate_up)), in one call where the linear's kernel gates its input rows itself (SwiGLU only)."""
    if activation == "silu" and getattr(linear, "fuses_input", False):
        return linear(gate_up, gated=True)
    return linear(GATES[activation](gate_up))


def softcap(x: Tensor, cap: float) -> Tensor:
    return torch.tanh(x / cap) * cap


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split = (q_size + kv_size, kv_size)
        self.wqkv = nn.Linear(config.dim, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.wo = nn.Linear(q_size, config.dim, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.qk_norm = config.qk_norm
        # a query scale other than 1 / sqrt(head_dim), folded into q so every attention path applies it
        self.q_scale = config.query_scale * math.sqrt(self.head_dim) if config.query_scale else 1.0
        self.span = AttentionSpan(config.window(layer_idx), config.attn_softcap)

    def forward(self, x: Tensor, norm: RMSNorm, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        B, T, _ = x.shape
        qk, v = linear_after_norm(self.wqkv, norm, x).split(self.split, dim=-1)
        # q and k heads rotated together: (B, n_heads + n_kv_heads, T, head_dim)
        qk = qk.view(B, T, self.n_heads + self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = qk.split((self.n_heads, self.n_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q, k = apply_rope(qk, cos, sin).split((self.n_heads, self.n_kv_heads), dim=1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        # a plain layer calls attend as the Llama decoder always has (an attend may take no span)
        out = attend(self.layer_idx, q, k, v) if self.span.plain else attend(self.layer_idx, q, k, v, self.span)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.activation = config.activation
        self.w13 = nn.Linear(config.dim, 2 * config.hidden_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x: Tensor, norm: RMSNorm) -> Tensor:
        return linear_after_glu(self.w2, linear_after_norm(self.w13, norm, x), self.activation)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, layer_idx)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)
        if config.sandwich_norms:  # Gemma: each branch's output normalized before the residual add
            self.post_attention_norm = RMSNorm(config.dim, config.norm_eps)
            self.post_ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.sandwich_norms = config.sandwich_norms
        self.local_rope = config.local_rope(layer_idx)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        attended = self.attention(x, self.attention_norm, cos, sin, attend)
        h = x + (self.post_attention_norm(attended) if self.sandwich_norms else attended)
        fed = self.feed_forward(h, self.ffn_norm)
        return h + (self.post_ffn_norm(fed) if self.sandwich_norms else fed)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # nn.Embedding's own init (normal_) and arange have their meta-device kernels in Python: the first call
        # imports torch's references and sympy (~70 MiB resident for the rest of the process), and a loader's
        # meta model (model/loader.py) needs no values at all
        embedding = torch.empty(config.vocab_size, config.dim)
        if not embedding.is_meta:
            nn.init.normal_(embedding)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim, _weight=embedding)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)build the cos/sin tables (max_seq_len, rotary_dim) in fp32, stored in the weights' dtype and device;
        Gemma 3's sliding layers get a second pair (rope_local_*).

        Loaders call it again once the weights are materialized: a model built on the meta device
        has meta tables.
        """
        tables = {"rope": False, "rope_local": True} if self.config.rope_local_theta else {"rope": False}
        weight = self.tok_embeddings.weight
        for name, local in tables.items():
            if weight.is_meta:  # shapes only: torch's meta-device arange is Python (see __init__), and pointless here
                cos = sin = torch.empty(self.config.max_seq_len, self.config.rotary_dim, device="meta")
            else:
                cos, sin = rope_tables(self.config, weight.device, local)
            self.register_buffer(f"{name}_cos", cos.to(weight.dtype), persistent=False)
            self.register_buffer(f"{name}_sin", sin.to(weight.dtype), persistent=False)

    def limit_context(self, max_seq_len: int) -> None:
        """Serve sequences of at most `max_seq_len` tokens (what the KV memory holds, when less than the model's
        context): the rotary tables keep only those positions."""
        self.config.max_seq_len = max_seq_len
        for name, table in list(self.named_buffers(recurse=False)):
            if name.startswith("rope"):
                self.register_buffer(name, table[:max_seq_len].clone(), persistent=False)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        attend: Attend = causal_attend,
        last_only: bool = False,
        rows: Tensor | None = None,
    ) -> Tensor:
        # tokens, positions: (B, T) -> fp32 logits (B, T, vocab), or (B, 1, vocab) with last_only, or (B, R, vocab)
        # for `rows` (R,) indices into T: the LM head runs only where logits are wanted
        x = self.tok_embeddings(tokens)
        if self.config.embed_scale != 1.0:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        rope = {False: (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))}  # (B, 1, T, R)
        if self.config.rope_local_theta:
            rope[True] = (self.rope_local_cos[positions].unsqueeze(1), self.rope_local_sin[positions].unsqueeze(1))
        for layer in self.layers:
            x = layer(x, *rope[layer.local_rope], attend)
        if last_only:
            x = x[:, -1:]
        elif rows is not None:
            x = x[:, rows]
            if not rows.numel():  # a prompt chunk before the last: no logits wanted, no LM head run
                return x.new_empty(*x.shape[:2], self.config.vocab_size, dtype=torch.float32)
        logits = logits_fp32(self.output, self.norm, x)
        return softcap(logits, self.config.final_softcap) if self.config.final_softcap else logits
