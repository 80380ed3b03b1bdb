"""ModelConfig: the architecture of a Llama-family decoder, read from an HF config.json, GGUF metadata or a preset."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


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
    rope_scaling: dict[str, Any] | None = None  # llama3-style frequency scaling, as in HF configs
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        """Build from a preset (the keys of this dataclass); unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**values)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json (Llama, Qwen2, Mistral, SmolLM)."""
        arch = hf.get("model_type", "llama")
        if arch not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported model_type {arch!r}: inferlab loads Llama-family decoders (llama, qwen2, mistral)")
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "default"):
            raise ValueError(f"unsupported rope scaling {scaling!r}")
        n_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            hidden_dim=hf["intermediate_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=dict(scaling) if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3" else None,
            max_seq_len=hf.get("max_position_embeddings", 2048),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
        )

    @classmethod
    def from_gguf_fields(cls, meta: dict[str, Any], has_output_weight: bool) -> "ModelConfig":
        """Build from GGUF key/values (`llama.*`); tied embeddings when the file has no output.weight."""
        arch = meta["general.architecture"]
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"unsupported GGUF architecture {arch!r}: inferlab loads llama and qwen2")
        p = f"{arch}."
        n_heads = int(meta[p + "attention.head_count"])
        dim = int(meta[p + "embedding_length"])
        return cls(
            vocab_size=int(meta.get(p + "vocab_size", len(meta["tokenizer.ggml.tokens"]))),
            dim=dim,
            n_layers=int(meta[p + "block_count"]),
            n_heads=n_heads,
            n_kv_heads=int(meta.get(p + "attention.head_count_kv", n_heads)),
            hidden_dim=int(meta[p + "feed_forward_length"]),
            head_dim=int(meta.get(p + "rope.dimension_count", dim // n_heads)),
            norm_eps=float(meta[p + "attention.layer_norm_rms_epsilon"]),
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            max_seq_len=int(meta[p + "context_length"]),
            tie_embeddings=not has_output_weight,
            qkv_bias=arch == "qwen2",
        )

