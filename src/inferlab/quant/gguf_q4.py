"""GGUF Q4_1 blocks -> Int4GroupLinear codes, so precision=int4 runs the 4-bit weights the file holds.

A Q4_1 block is 32 weights: fp16 d, fp16 m, then 16 bytes whose byte i holds weight i (low nibble)
and weight i + 16 (high nibble); w = d * q + m. Rows are fused and un-permuted exactly as the loader
does with the dequantized weights (permuting whole rows of a row-wise quantized matrix is lossless).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from inferlab.model.config import ModelConfig
from inferlab.model.gguf_loader import evict, linear_sources, open_gguf, unpermute_qk  # the loader's parse and layout

Q4_1_GROUP = 32
Codes = tuple[Tensor, Tensor, Tensor]  # codes uint8 (N, K), scales fp32 (N, G), mins fp32 (N, G)


def q4_1_codes(blocks: np.ndarray) -> Codes:
    """blocks: uint8 (N, G * 20), one row per output channel, as the file holds a Q4_1 tensor (model/gguf_loader.py)."""
    n = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(-1, 20)  # (N * G, 20)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # (N * G, 1)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = b[:, 4:]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=1)  # (N * G, 32)
    return (
        torch.from_numpy(codes).reshape(n, -1),
        torch.from_numpy(d).reshape(n, -1),
        torch.from_numpy(m).reshape(n, -1),
    )


def _rows(codes: Codes, fix) -> Codes:
    return tuple(fix(t) for t in codes)  # type: ignore[return-value]


def _cat(parts: list[Codes]) -> Codes:
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def read_q4_1_linears(path: Path, config: ModelConfig) -> dict[str, Callable[[], Codes]]:
    """Per decoder Linear (module names as in Transformer) whose parts are all Q4_1: a reader of its codes,
    called when the layer is built, so one layer's unpacked codes exist at a time, never the model's."""
    from gguf import GGMLQuantizationType

    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"]

    def is_q4_1(name: str) -> bool:
        return tensors[name + ".weight"].tensor_type == GGMLQuantizationType.Q4_1

    def get(name: str, n_heads: int | None) -> Codes:
        codes = q4_1_codes(tensors[name + ".weight"].data)
        evict(reader, tensors[name + ".weight"])  # the blocks are copied out: their file pages can go
        return _rows(codes, lambda w: unpermute_qk(w, n_heads)) if n_heads else codes

    found: dict[str, Callable[[], Codes]] = {}
    for i in range(config.n_layers):
        for ours, parts in linear_sources(config, arch, set(tensors), i).items():
            if all(is_q4_1(name) for name, _ in parts):
                found[f"layers.{i}.{ours}"] = functools.partial(lambda p: _cat([get(*part) for part in p]), parts)
    return found
