"""GGUF files: the metadata, and the weights under our module names (dequantized tensor by tensor).

llama.cpp's converter renames HF tensors (`blk.N.attn_q.weight`), fuses some (Phi-3's attn_qkv,
its gate+up as ffn_up), interleaves the RoPE halves of q/k rows for the llama architecture, and
stores Gemma's (1 + w) norms as 1 + w. `linear_sources` says, per decoder Linear, which file
tensors make it, so the float loader here and the Q4_1 import (quant/gguf_q4.py) read one truth.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from inferlab.errors import ModelLoadError
from inferlab.model.config import ModelConfig
from inferlab.model.tokenizer import Tokenizer

ROPE_FACTOR_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")
# ours <- the file's, per layer, where the layer has them (the sandwich and q/k norms only in those families)
NORMS = {
    "attention_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
    "post_attention_norm": "post_attention_norm",
    "post_ffn_norm": "post_ffw_norm",
    "attention.q_norm": "attn_q_norm",
    "attention.k_norm": "attn_k_norm",
}
Source = tuple[str, int | None]  # a file tensor's name (without .weight) and the heads to un-permute it by, if any


def read_gguf_fields(path: Path) -> dict[str, Any]:
    return {name: field.contents() for name, field in open_gguf(path).fields.items()}


def open_gguf(path: Path):
    """The parsed file, memory-mapped; parsing the vocabulary takes seconds, so a process does it once."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    return _parse_gguf(path.resolve(), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parse_gguf(path: Path, mtime_ns: int):
    from gguf import GGUFReader

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic)")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueErrors/IndexErrors on damaged files
        raise ModelLoadError(f"{path}: unreadable GGUF ({e})") from e


def unpermute_qk(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's converter, which interleaves each head's two RoPE halves for its rotary kernel."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def linear_sources(config: ModelConfig, arch: str, names: set[str], layer: int) -> dict[str, list[Source]]:
    """Our decoder Linears of one layer (as in Transformer) -> the file tensors whose rows they concatenate."""
    g = f"blk.{layer}."
    permute = arch == "llama"  # the other architectures keep the HF row order
    if g + "attn_qkv.weight" in names:
        qkv: list[Source] = [("attn_qkv", None)]
    else:
        qkv = [
            ("attn_q", config.n_heads if permute else None),
            ("attn_k", config.n_kv_heads if permute else None),
            ("attn_v", None),
        ]
    gate_up: list[Source] = (
        [("ffn_gate", None), ("ffn_up", None)] if g + "ffn_gate.weight" in names else [("ffn_up", None)]
    )
    return {
        "attention.wqkv": [(g + n, h) for n, h in qkv],
        "attention.wo": [(g + "attn_output", None)],
        "feed_forward.w13": [(g + n, h) for n, h in gate_up],
        "feed_forward.w2": [(g + "ffn_down", None)],
    }


def load_gguf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, Tensor], Tokenizer]:
    from gguf import quants

    reader = open_gguf(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str, heads: int | None = None) -> Tensor:
        t = tensors[name]
        w = torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        return (unpermute_qk(w, heads) if heads else w).to(dtype)

    factors = {n: get(n + ".weight").float().tolist() for n in ROPE_FACTOR_TENSORS if n + ".weight" in tensors}
    config = ModelConfig.from_gguf_fields(meta, "output.weight" in tensors, factors)
    arch = meta["general.architecture"]
    state = {"tok_embeddings.weight": get("token_embd.weight"), "norm.weight": get("output_norm.weight")}
    if "output.weight" in tensors:
        state["output.weight"] = get("output.weight")
    for i in range(config.n_layers):
        ours = f"layers.{i}."
        for dst, src in NORMS.items():
            if f"blk.{i}.{src}.weight" in tensors:
                state[f"{ours}{dst}.weight"] = get(f"blk.{i}.{src}.weight")
        for dst, parts in linear_sources(config, arch, set(tensors), i).items():
            state[f"{ours}{dst}.weight"] = torch.cat([get(n + ".weight", h) for n, h in parts])
            if dst == "attention.wqkv" and config.qkv_bias:
                state[f"{ours}{dst}.bias"] = torch.cat([get(n + ".bias") for n, _ in parts])
    return config, state, Tokenizer.from_gguf_fields(meta)
