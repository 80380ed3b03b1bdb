"""GGUF Q4_1 blocks -> Int4GroupLinear codes, so precision=int4 runs the 4-bit weights the file holds.

The blocks are read by model/gguf_loader.py's q4_1_codes. Rows are fused and un-permuted exactly as the loader does
with the dequantized weights (permuting whole rows of a row-wise quantized matrix is lossless).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from inferlab.model.config import ModelConfig
from inferlab.model.gguf_loader import (  # the loader's parse, block layout and rows
    BLOCK_WEIGHTS,
    Codes,
    evict,
    linear_sources,
    open_gguf,
    q4_1_codes,
    unpermute_qk,
)

Q4_1_GROUP = BLOCK_WEIGHTS  # the int4 group size whose codes are the file's own blocks


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
