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


def load_gguf(
    path: Path,
    dtype: torch.dtype = torch.float32,
    leave_q4_1: bool = False,
) -> tuple[ModelConfig, dict[str, Tensor], Tokenizer, list[str]]:
    """(config, state in `dtype`, tokenizer, the Linears left as stand-ins). Each tensor is dequantized in row
    chunks straight into `dtype`; with `leave_q4_1`, a Linear whose parts are all Q4_1 is not dequantized at all:
    its weight is a stand-in without memory (shape, dtype, device only) that quant/ replaces with the blocks."""
    from gguf import GGMLQuantizationType

    reader = open_gguf(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str, heads: int | None = None) -> Tensor:
        w = dequantize(tensors[name], dtype)
        evict(reader, tensors[name])
        return unpermute_qk(w, heads) if heads else w

    factors = {n: get(n + ".weight").float().tolist() for n in ROPE_FACTOR_TENSORS if n + ".weight" in tensors}
    config = ModelConfig.from_gguf_fields(meta, "output.weight" in tensors, factors)
    arch = meta["general.architecture"]
    state = {"tok_embeddings.weight": get("token_embd.weight"), "norm.weight": get("output_norm.weight")}
    if "output.weight" in tensors:
        state["output.weight"] = get("output.weight")
    left: list[str] = []
    for i in range(config.n_layers):
        ours = f"layers.{i}."
        for dst, src in NORMS.items():
            if f"blk.{i}.{src}.weight" in tensors:
                state[f"{ours}{dst}.weight"] = get(f"blk.{i}.{src}.weight")
        for dst, parts in linear_sources(config, arch, set(tensors), i).items():
            files = [tensors[n + ".weight"] for n, _ in parts]
            if leave_q4_1 and all(t.tensor_type == GGMLQuantizationType.Q4_1 for t in files):
                rows = sum(int(t.shape[1]) for t in files)  # GGUF shapes are (columns, rows)
                state[f"{ours}{dst}.weight"] = torch.zeros((), dtype=dtype).expand(rows, int(files[0].shape[0]))
                left.append(ours + dst)
            else:
                state[f"{ours}{dst}.weight"] = torch.cat([get(n + ".weight", h) for n, h in parts])
            if dst == "attention.wqkv" and config.qkv_bias:
                state[f"{ours}{dst}.bias"] = torch.cat([get(n + ".bias") for n, _ in parts])
    evict(reader)
    return config, state, Tokenizer.from_gguf_fields(meta), left


def dequantize(tensor, dtype: torch.dtype, chunk_elements: int = 1 << 22) -> Tensor:
    """A GGUF tensor as (rows, columns) (or (columns,)) in `dtype`, a few MiB of rows at a time: a quantized
    embedding never exists whole in fp32."""
    from gguf import quants

    data = tensor.data  # (rows, bytes per row) for quantized types, (rows, columns) or (columns,) otherwise

    def rows(part) -> Tensor:
        try:
            values = quants.dequantize(part, tensor.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"{tensor.name}: unsupported GGUF quantization {tensor.tensor_type.name}") from None
        return torch.from_numpy(np.array(values, dtype=np.float32))

    if data.ndim == 1:
        return rows(data).to(dtype)
    out = torch.empty((data.shape[0], int(tensor.shape[0])), dtype=dtype)
    step = max(1, chunk_elements // out.shape[1])
    for start in range(0, out.shape[0], step):
        out[start : start + step] = rows(data[start : start + step])
    return out


def evict(reader, tensor=None) -> None:
    """Drop the file's pages (or one tensor's) from this process's resident set; they stay in the page cache
    and the mapping stays, so a later read faults them back in. A loaded model's RSS is then its own weights,
    not the file's as well."""
    import mmap

    mapping = getattr(reader.data, "_mmap", None)
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    if tensor is None:
        mapping.madvise(mmap.MADV_DONTNEED)
        return
    start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE  # the pages wholly or partly this tensor's
    mapping.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + int(tensor.n_bytes) - start)


def release_gguf() -> None:
    """Forget the parsed files (their metadata objects are ~160 MiB for a 49k-token vocabulary), once the engine
    holds everything it needs from them."""
    _parse_gguf.cache_clear()
