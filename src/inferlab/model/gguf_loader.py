"""GGUF files: the metadata, and the weights under our module names (dequantized tensor by tensor).

llama.cpp's converter renames HF tensors (`blk.N.attn_q.weight`), fuses some (Phi-3's attn_qkv,
its gate+up as ffn_up), interleaves the RoPE halves of q/k rows for the llama architecture, and
stores Gemma's (1 + w) norms as 1 + w. `linear_sources` says, per decoder Linear, which file
tensors make it, so the float loader here and the block imports (quant/gguf_q4.py, quant/gguf_linear.py) read one
truth.
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from inferlab.errors import ModelLoadError
from inferlab.model.config import ModelConfig
from inferlab.model.gguf_blocks import BLOCK_LAYOUTS, ROW_LAYOUTS, dequantize_blocks
from inferlab.model.tokenizer import Tokenizer
from inferlab.native_memory import return_freed_memory

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
EMBEDDING_TENSOR = "token_embd.weight"
EMBEDDING = "tok_embeddings"  # a stand-in's name (load_gguf's defer_linears): quant/gguf_embedding.py keeps its blocks
TRIM_BYTES = 64 << 20  # loading hands freed temporaries back to the system every this many bytes of weights
Source = tuple[str, int | None]  # a file tensor's name (without .weight) and the heads to un-permute it by, if any


def read_gguf_fields(path: Path) -> dict[str, Any]:
    """The metadata alone (a random-init model's tokenizer, a file's type)."""
    return _read(path, lambda reader: reader.fields())


def open_gguf(path: Path) -> GGUFFile:
    """The parsed file, its tensors memory-mapped; a process parses a file once until release_gguf."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    return _parse_gguf(path.resolve(), path.stat().st_mtime_ns)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # the file's order: (columns, rows) for a matrix
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # (rows, columns), or (rows, bytes per row) for quantized types; a view of the mapping


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]  # key -> value, as gguf.GGUFReader's fields' contents()
    tensors: list[GGUFTensor]
    data: np.memmap  # the whole file


@functools.lru_cache(maxsize=4)
def _parse_gguf(path: Path, mtime_ns: int) -> GGUFFile:
    return _read(path, lambda reader: reader.file())


def _read(path: Path, parse: Callable[[_GGUFReader], Any]) -> Any:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic)")
    try:
        return parse(_GGUFReader(np.memmap(path, mode="r")))
    except (struct.error, UnicodeDecodeError, ValueError) as e:  # a damaged or truncated file
        raise ModelLoadError(f"{path}: unreadable GGUF ({e})") from e


class _GGUFReader:
    """A little-endian GGUF file read with struct: gguf.GGUFReader builds a numpy view per metadata item (~3 s
    and ~160 MiB for a 49k-token vocabulary, on every load), this reads each string as bytes (~0.1 s).
    After the magic: version u32, tensor count u64, key count u64; each key is a string (u64 length, UTF-8),
    a u32 value type and the value (an array: item type u32, count u64, the items); then per tensor its name,
    n_dims u32, the dims u64, type u32 and offset u64 into the data, which starts at the next multiple of
    general.alignment."""

    SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    STRING, ARRAY = 8, 9

    def __init__(self, data: np.memmap) -> None:
        self.data, self.bytes, self.offset = data, memoryview(data), 4

    def fields(self) -> dict[str, Any]:
        version = self.scalar("I")
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian file; convert it with llama.cpp's gguf tools")
        out: dict[str, Any] = {"GGUF.version": version}
        out["GGUF.tensor_count"], out["GGUF.kv_count"] = self.scalar("Q"), self.scalar("Q")
        for _ in range(out["GGUF.kv_count"]):
            key = self.string()
            out[key] = self.value(self.scalar("I"))
        return out

    def file(self) -> GGUFFile:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        fields = self.fields()
        infos = []
        for _ in range(fields["GGUF.tensor_count"]):
            name = self.string()
            dims = tuple(self.scalar("Q") for _ in range(self.scalar("I")))
            infos.append((name, dims, GGMLQuantizationType(self.scalar("I")), self.scalar("Q")))
        alignment = fields.get("general.alignment", 32)
        start = -(-self.offset // alignment) * alignment
        tensors = []
        for name, dims, kind, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            n_bytes = math.prod(dims) * block_bytes // block
            shape = tuple(reversed(dims))
            item = FLOAT_ITEMS.get(kind.name)
            view = self.data[start + offset : start + offset + n_bytes]
            data = view.view(item).reshape(shape) if item else view.reshape(quant_shape_to_byte_shape(shape, kind))
            tensors.append(GGUFTensor(name, kind, dims, n_bytes, start + offset, data))
        return GGUFFile(fields, tensors, self.data)

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.bytes, self.offset)
        self.offset += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        text = str(self.bytes[self.offset : self.offset + n], "utf-8")
        self.offset += n
        return text

    def value(self, kind: int) -> Any:
        if kind == self.STRING:
            return self.string()
        if kind in self.SCALARS:
            return self.scalar(self.SCALARS[kind])
        if kind != self.ARRAY:
            raise ValueError(f"unknown value type {kind} at byte {self.offset}")
        item, count = self.scalar("I"), self.scalar("Q")
        if item in self.SCALARS:
            dtype = np.dtype("<" + self.SCALARS[item])
            values = np.frombuffer(self.bytes, dtype, count, self.offset).tolist()
            self.offset += dtype.itemsize * count
            return values
        return [self.value(item) for _ in range(count)]


FLOAT_ITEMS = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}


def unpermute_qk(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's converter, which interleaves each head's two RoPE halves for its rotary kernel (w's rows: its
    first dimension, whatever the others, so a tensor's blocks move as its weights do)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


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
    defer_linears: bool = False,
) -> tuple[ModelConfig, dict[str, Tensor], Tokenizer, list[str]]:
    """(config, state in `dtype`, tokenizer, the Linears left as stand-ins). Each tensor is dequantized in row
    chunks straight into `dtype`; with `defer_linears` (a model quant/ will quantize), no decoder Linear is read
    here: its weight is a stand-in without memory (shape, dtype, device only), which quant/ replaces one layer at a
    time, importing the file's blocks where it can (Q4_1) or reading the layer's floats (`linear_reader`) and
    quantizing them, so the float model never exists whole; an untied embedding in a block format is left too (named
    EMBEDDING), for quant/ to keep as the file's blocks."""
    reader = open_gguf(path)
    meta = reader.fields
    tensors = {t.name: t for t in reader.tensors}
    made = 0

    def get(name: str, heads: int | None = None) -> Tensor:
        nonlocal made
        w = read_tensor(reader, tensors[name], dtype, heads)
        made += w.nbytes
        if made >= TRIM_BYTES:  # the conversion's temporaries stay resident in malloc's heap until trimmed
            return_freed_memory()
            made = 0
        return w

    factors = {n: get(n + ".weight").float().tolist() for n in ROPE_FACTOR_TENSORS if n + ".weight" in tensors}
    config = ModelConfig.from_gguf_fields(meta, "output.weight" in tensors, factors)
    arch = meta["general.architecture"]
    embedding = tensors[EMBEDDING_TENSOR]
    left: list[str] = []
    # an untied embedding in a block format stays the file's blocks (quant/gguf_embedding.py): a stand-in here
    if defer_linears and not config.tie_embeddings and embedding.tensor_type.name in ROW_LAYOUTS:
        state = {
            f"{EMBEDDING}.weight": torch.zeros((), dtype=dtype).expand(int(embedding.shape[1]), int(embedding.shape[0]))
        }
        left.append(EMBEDDING)
    else:
        state = {f"{EMBEDDING}.weight": get(EMBEDDING_TENSOR)}
    state["norm.weight"] = get("output_norm.weight")
    if "output.weight" in tensors:
        state["output.weight"] = get("output.weight")
    for i in range(config.n_layers):
        ours = f"layers.{i}."
        for dst, src in NORMS.items():
            if f"blk.{i}.{src}.weight" in tensors:
                state[f"{ours}{dst}.weight"] = get(f"blk.{i}.{src}.weight")
        for dst, parts in linear_sources(config, arch, set(tensors), i).items():
            files = [tensors[n + ".weight"] for n, _ in parts]
            if defer_linears:
                rows = sum(int(t.shape[1]) for t in files)  # GGUF shapes are (columns, rows)
                state[f"{ours}{dst}.weight"] = torch.zeros((), dtype=dtype).expand(rows, int(files[0].shape[0]))
                left.append(ours + dst)
            else:
                state[f"{ours}{dst}.weight"] = torch.cat([get(n + ".weight", h) for n, h in parts])
            if dst == "attention.wqkv" and config.qkv_bias:
                state[f"{ours}{dst}.bias"] = torch.cat([get(n + ".bias") for n, _ in parts])
    evict(reader)
    return config, state, Tokenizer.from_gguf_fields(meta), left


def linear_reader(path: Path, config: ModelConfig, dtype: torch.dtype) -> Callable[[str], Tensor]:
    """A deferred Linear's weight (module names as in Transformer: "layers.3.attention.wqkv"), read from the file
    in `dtype`, its parts fused and un-permuted as load_gguf would have."""
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"]

    def read(name: str) -> Tensor:
        layer, _, ours = name.removeprefix("layers.").partition(".")
        parts = linear_sources(config, arch, set(tensors), int(layer))[ours]
        weights = [read_tensor(reader, tensors[part + ".weight"], dtype, heads) for part, heads in parts]
        return torch.cat(weights) if len(weights) > 1 else weights[0]

    return read


def read_tensor(reader: GGUFFile, tensor: GGUFTensor, dtype: torch.dtype, heads: int | None = None) -> Tensor:
    """One file tensor in `dtype` (q/k rows un-permuted by `heads`), its file pages then dropped from the resident
    set."""
    w = dequantize(tensor, dtype)
    evict(reader, tensor)
    return unpermute_qk(w, heads) if heads else w


BLOCK_WEIGHTS = 32  # weights per block of Q4_1 and of Q8_0
Codes = tuple[Tensor, Tensor, Tensor]  # codes uint8 (N, K), scales fp32 (N, G), mins fp32 (N, G)


def q4_1_codes(blocks: np.ndarray) -> Codes:
    """A Q4_1 tensor's blocks, uint8 (N, G * 20) one row per output channel, as its codes, scales and mins. A block
    is 32 weights: fp16 d, fp16 m, then 16 bytes whose byte i holds weight i (low nibble) and weight i + 16 (high
    nibble); w = d * q + m."""
    n = blocks.shape[0]
    b = torch.from_numpy(np.array(blocks, dtype=np.uint8)).reshape(-1, 20)  # (N * G, 20); a copy: the file is read-only
    d = b[:, 0:2].contiguous().view(torch.float16).float()  # (N * G, 1)
    m = b[:, 2:4].contiguous().view(torch.float16).float()
    qs = b[:, 4:]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=1)  # (N * G, 32)
    return codes.reshape(n, -1), d.reshape(n, -1), m.reshape(n, -1)


def q8_0_codes(blocks: np.ndarray) -> tuple[Tensor, Tensor]:
    """A Q8_0 tensor's blocks, uint8 (N, G * 34), as int8 codes (N, K) and scales fp32 (N, G): a block is fp16 d, then
    32 int8 q; w = d * q."""
    n = blocks.shape[0]
    b = torch.from_numpy(np.array(blocks, dtype=np.uint8)).reshape(-1, 34)
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    return b[:, 2:].contiguous().view(torch.int8).reshape(n, -1), d.reshape(n, -1)


BLOCK_READERS = {"Q4_1": q4_1_codes, "Q8_0": q8_0_codes}  # the block types read here; others by gguf's dequantize


def block_values(blocks: np.ndarray, kind: str) -> Tensor:
    """Q4_1 or Q8_0 blocks (N, bytes per row) as fp32 weights (N, K), each w = d * q (+ m) rounded as gguf's own
    dequantize rounds it (two fp32 operations, not one fused): the same floats, in torch's vectorized ops rather than
    gguf's numpy, which is much slower on a whole model."""
    codes, scales, *mins = BLOCK_READERS[kind](blocks)
    n, groups = scales.shape
    values = codes.reshape(n, groups, BLOCK_WEIGHTS).float() * scales[..., None]
    for m in mins:  # Q4_1's
        values = values + m[..., None]
    return values.reshape(n, -1)


def dequantize(tensor, dtype: torch.dtype, chunk_elements: int = 1 << 22) -> Tensor:
    """A GGUF tensor as (rows, columns) (or (columns,)) in `dtype`, a few MiB of rows at a time: a quantized
    embedding never exists whole in fp32."""
    from gguf import quants

    data = tensor.data  # (rows, bytes per row) for quantized types, (rows, columns) or (columns,) otherwise
    kind = tensor.tensor_type.name

    def rows(part) -> Tensor:
        if kind in BLOCK_READERS and part.ndim == 2:
            return block_values(part, kind)
        if kind in BLOCK_LAYOUTS and part.ndim == 2:
            return dequantize_blocks(torch.from_numpy(np.array(part, dtype=np.uint8)), kind)
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
