"""ModelConfig: the architecture of a Llama-family decoder, read from an HF config.json, GGUF metadata or a preset.

Every family is the Llama decoder plus a few declared differences (the fields after `qkv_bias`, each
defaulting to Llama's choice), the way transformers' "modular" files describe Qwen3 or Gemma as
edits of Llama. `FAMILIES` names the fixed differences of each HF model_type; the values a checkpoint
chooses (windows, soft-caps, rotary fraction, rope scaling) are read from its config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from inferlab.errors import ModelLoadError

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
ROPE_TYPES = ("llama3", "linear", "longrope", "freq_factors")  # beside the default (unscaled) rotation

GEMMA = dict(norm_offset=True, sandwich_norms=True, scale_embeddings=True)
FAMILIES: dict[str, dict[str, Any]] = {  # HF model_type -> what differs from Llama, whatever the checkpoint's values
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma2": GEMMA,
    "gemma3_text": {**GEMMA, "qk_norm": True},
    "phi3": {},
}
GGUF_GEMMA = dict(sandwich_norms=True, scale_embeddings=True)  # llama.cpp's converter stores Gemma norms as 1 + w
GGUF_FAMILIES: dict[str, dict[str, Any]] = {  # general.architecture -> the same differences, GGUF-side
    "llama": {},  # also Mistral, TinyLlama, SmolLM
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma2": {**GGUF_GEMMA, "window_pattern": 2, "scale_by_dim_layers": (46,)},
    "gemma3": {
        **GGUF_GEMMA,
        "qk_norm": True,
        "window_pattern": 6,
        "local_theta": 10000.0,
        "scale_by_dim_layers": (62,),
    },
    "phi3": {},
}


@dataclass
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    head_dim: int = 0  # 0 -> dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": llama3 | linear | longrope, ...}, as in HF configs
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections
    # ---- the declared differences from Llama (Qwen3, Gemma 2/3, Phi-3, Mistral) ----
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    activation: str = "silu"  # the MLP's gate: silu (SwiGLU) | gelu_tanh (GeGLU, Gemma)
    sandwich_norms: bool = False  # RMSNorms on the attention and MLP outputs as well as inputs (Gemma 2/3)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(dim), rounded to the weights' dtype)
    query_scale: float = 0.0  # attention scores' scale; 0 -> head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c); 0 = off (Gemma 2)
    final_softcap: float = 0.0  # the same on the logits (Gemma 2)
    sliding_window: int = 0  # a query sees itself and the window - 1 keys before it; 0 = off (Mistral, Gemma)
    sliding_layers: list[int] | None = None  # the layers with the window; None = all of them
    rope_local_theta: float = 0.0  # the sliding layers' own unscaled rope base; 0 = the global one (Gemma 3)
    rotary_dim: int = 0  # leading dims of each head that RoPE rotates; 0 -> head_dim (Phi-3's partial rotary)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.rotary_dim == 0:
            self.rotary_dim = self.head_dim
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.activation not in ACTIVATIONS.values():
            raise ModelLoadError(f"unsupported activation {self.activation!r}: inferlab runs {sorted(ACTIVATIONS)}")
        rope_type = (self.rope_scaling or {}).get("rope_type")
        if self.rope_scaling is not None and rope_type not in ROPE_TYPES:
            raise ModelLoadError(f"unsupported rope scaling {rope_type!r}: inferlab runs {list(ROPE_TYPES)}")

    def window(self, layer_idx: int) -> int | None:
        """The layer's sliding window, or None where it never narrows what a query sees in max_seq_len."""
        if not self.sliding_window or self.sliding_window >= self.max_seq_len:
            return None
        return self.sliding_window if self.sliding_layers is None or layer_idx in self.sliding_layers else None

    def local_rope(self, layer_idx: int) -> bool:
        """The layer rotates with the sliding layers' own table (Gemma 3's local layers)."""
        sliding = self.sliding_window and (self.sliding_layers is None or layer_idx in self.sliding_layers)
        return bool(self.rope_local_theta) and bool(sliding)

    @property
    def plain_attention(self) -> bool:
        """Every layer's attention is causal softmax(q k / sqrt(d)) v over all earlier keys (query scaling is
        folded into q): what the single-query attention kernel computes."""
        return not self.attn_softcap and all(self.window(i) is None for i in range(self.n_layers))

    @property
    def llama_layer(self) -> bool:
        """Every layer is exactly the Llama layer with one rope table: what the fused C++ decode step runs."""
        return (
            self.plain_attention
            and not (
                self.qk_norm or self.sandwich_norms or self.final_softcap or self.rope_local_theta or self.query_scale
            )
            and self.activation == "silu"
            and self.embed_scale == 1.0
            and self.rotary_dim == self.head_dim
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """Build from a preset (the keys of this dataclass); unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ModelLoadError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**values)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json (transformers 4.x or 5.x spelling) of a family in FAMILIES."""
        arch = hf.get("model_type", "llama")
        if arch not in FAMILIES:
            hint = " (inferlab reads the text decoder of gemma3_text checkpoints)" if arch == "gemma3" else ""
            raise ModelLoadError(f"unsupported model_type {arch!r}{hint}: inferlab loads {sorted(FAMILIES)}")
        family = FAMILIES[arch]
        quantized = hf.get("quantization_config")
        if quantized:
            method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else quantized
            raise ModelLoadError(
                f"unsupported quantization {method!r} in config.json: inferlab loads float "
                "checkpoints (bf16/fp16/fp32) and quantizes them itself, or GGUF files"
            )
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        rope, local_rope = _hf_rope(hf)
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if activation not in ACTIVATIONS:
            raise ModelLoadError(f"unsupported activation {activation!r}: inferlab runs {sorted(ACTIVATIONS)}")
        window, sliding_layers = _hf_sliding_window(hf)
        rotary = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        gemma = family.get("scale_embeddings", False)
        return cls(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            hidden_dim=hf["intermediate_size"],
            head_dim=head_dim,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(rope, hf),
            max_seq_len=hf.get("max_position_embeddings", 2048),
            tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            qkv_bias=family.get("qkv_bias", False) or bool(hf.get("attention_bias", False)),
            qk_norm=family.get("qk_norm", False),
            activation=ACTIVATIONS[activation],
            sandwich_norms=family.get("sandwich_norms", False),
            embed_scale=math.sqrt(hf["hidden_size"]) if gemma else 1.0,
            query_scale=float(hf["query_pre_attn_scalar"]) ** -0.5 if gemma else 0.0,
            attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
            sliding_window=window,
            sliding_layers=sliding_layers,
            rope_local_theta=float(local_rope.get("rope_theta", 0.0)),
            rotary_dim=int(head_dim * rotary),
        )

    @classmethod
    def from_gguf_fields(
        cls, meta: dict[str, Any], has_output_weight: bool, rope_factors: dict[str, list[float]] | None = None
    ) -> ModelConfig:
        """Build from GGUF key/values (`<arch>.*`, as llama.cpp's converter writes them); tied embeddings when
        the file has no output.weight. `rope_factors`: the file's rope_freqs / rope_factors_{long,short} tensors."""
        arch = meta["general.architecture"]
        if arch not in GGUF_FAMILIES:
            raise ModelLoadError(f"unsupported GGUF architecture {arch!r}: inferlab loads {sorted(GGUF_FAMILIES)}")
        family = GGUF_FAMILIES[arch]

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        n_heads = int(key("attention.head_count"))
        dim = int(key("embedding_length"))
        n_layers = int(key("block_count"))
        head_dim = int(key("attention.key_length", dim // n_heads))
        window = int(key("attention.sliding_window", 0))
        pattern = key("attention.sliding_window_pattern", family.get("window_pattern"))
        if isinstance(pattern, list):  # one flag per layer
            sliding_layers = [i for i, flag in enumerate(pattern) if flag]
        elif pattern:  # every pattern-th layer global, as llama.cpp's set_swa_pattern
            sliding_layers = [i for i in range(n_layers) if i % int(pattern) < int(pattern) - 1]
        else:
            sliding_layers = None
        gemma = family.get("scale_embeddings", False)
        # llama.cpp's Gemma query scale: 1/sqrt(head_dim), but 1/sqrt(dim / heads) for the 27B models
        attention_scale = key("attention.scale") or (
            (dim // n_heads if n_layers in family.get("scale_by_dim_layers", ()) else head_dim) ** -0.5
            if gemma
            else 0.0
        )
        return cls(
            vocab_size=int(key("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(key("attention.head_count_kv", n_heads)),
            hidden_dim=int(key("feed_forward_length")),
            head_dim=head_dim,
            norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(key, rope_factors or {}),
            max_seq_len=int(key("context_length")),
            tie_embeddings=not has_output_weight,
            qkv_bias=family.get("qkv_bias", False),
            qk_norm=family.get("qk_norm", False),
            activation="gelu_tanh" if gemma else "silu",
            sandwich_norms=family.get("sandwich_norms", False),
            embed_scale=math.sqrt(dim) if gemma else 1.0,
            query_scale=float(attention_scale),
            attn_softcap=float(key("attn_logit_softcapping", 0.0)),
            final_softcap=float(key("final_logit_softcapping", 0.0)),
            sliding_window=window,
            sliding_layers=sliding_layers if window else None,
            rope_local_theta=float(key("rope.freq_base_swa", family.get("local_theta", 0.0))),
            rotary_dim=int(key("rope.dimension_count", head_dim)),
        )


def _gguf_rope_scaling(key: Any, factors: dict[str, list[float]]) -> dict[str, Any] | None:
    if "rope_freqs" in factors:  # Llama 3.1+: per-frequency divisors (llama3 scaling, precomputed)
        return {"rope_type": "freq_factors", "factors": factors["rope_freqs"]}
    if "rope_factors_long" in factors:  # Phi-3's LongRoPE
        return {
            "rope_type": "longrope",
            "long_factor": factors["rope_factors_long"],
            "short_factor": factors["rope_factors_short"],
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "attention_factor": float(key("rope.scaling.attn_factor", 1.0)),
        }
    kind = key("rope.scaling.type", "none")
    if kind == "none" or (kind == "linear" and float(key("rope.scaling.factor", 1.0)) == 1.0):
        return None
    if kind != "linear":
        raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r}: inferlab runs linear, rope_freqs and LongRoPE")
    return {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}


def _hf_rope(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global rope parameters, the sliding layers' own): transformers 5 nests them per layer type."""
    rope = dict(hf.get("rope_parameters") or {})
    if "full_attention" in rope:
        return dict(rope["full_attention"]), dict(rope.get("sliding_attention") or {})
    local = {"rope_theta": hf["rope_local_base_freq"]} if "rope_local_base_freq" in hf else {}
    return rope, local


def _rope_scaling(rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any] | None:
    scaling = dict(hf.get("rope_scaling") or rope)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope scaling {rope_type!r}: inferlab runs {list(ROPE_TYPES)}")
    scaling["rope_type"] = rope_type
    if rope_type == "longrope":  # HF's defaults: the factor from the two lengths, attention factor from it
        original = scaling.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        scaling["original_max_position_embeddings"] = original
        factor = scaling.get("factor") or hf["max_position_embeddings"] / original
        if scaling.get("attention_factor") is None:
            scaling["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {k: v for k, v in scaling.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}


def _hf_sliding_window(hf: dict[str, Any]) -> tuple[int, list[int] | None]:
    """(window, the layers that have it): `layer_types` where the config lists them, else Qwen's or Mistral's rule."""
    window = hf.get("sliding_window") or 0
    if not window or hf.get("use_sliding_window") is False:
        return 0, None
    types = hf.get("layer_types")
    if types:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        return (window, sliding) if sliding else (0, None)
    if "max_window_layers" in hf:  # Qwen2 before layer_types: the layers from max_window_layers on
        return window, list(range(hf["max_window_layers"], hf["num_hidden_layers"]))
    return window, None
