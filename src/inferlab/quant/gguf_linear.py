"""A Linear whose weights are a GGUF file's blocks as it stores them (K-quants and the 32-weight block formats), each
part of a fused projection in its own format, so precision=gguf serves a Q4_K_M file's mixed tensors as they are.

The blocks are read by model/gguf_blocks.py's layouts; Q4_K, Q6_K, Q5_0 and Q8_0 ones are held as the kernels' int4 tiles where
those kernels run (quant/gguf_tiles.py: the same bytes and numbers, read as one stream at any number of rows). Rows are fused and un-permuted exactly as the loader does with
the dequantized weights (a block holds part of one row, so moving whole rows moves whole blocks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferlab.errors import QuantizationError
from inferlab.kernels.aten import int4_layout
from inferlab.kernels.build import int4_tile_rows
from inferlab.kernels.gemv import gemv, gemv_fits, prepared_input
from inferlab.kernels.layer import KernelWeights
from inferlab.model.config import ModelConfig
from inferlab.model.gguf_blocks import BLOCK_LAYOUTS, dequantize_blocks
from inferlab.model.gguf_loader import evict, linear_sources, open_gguf, unpermute_qk
from inferlab.model.transformer import RMSNorm
from inferlab.quant.gguf_tiles import (
    PAIR,
    in_row_chunks,
    q4_k_blocks,
    q4_k_tiles,
    q5_0_blocks,
    q5_0_tiles,
    q6_k_blocks,
    q6_k_tiles,
    q8_0_blocks,
    q8_0_tiles,
)

Part = tuple[str, Tensor]  # a block format's name and its blocks uint8 (rows, blocks per row, bytes per block)
# The block formats held as int4 tiles (quant/gguf_tiles.py): each one's tiles from blocks and back, its kernel format,
# and the blocks a tile's super-block takes (a part is tiled where they divide its blocks per row)
TILED: dict[str, tuple[Callable[[Tensor, int], Tensor], Callable[[Tensor], Tensor], str, int]] = {
    "Q4_K": (q4_k_tiles, q4_k_blocks, "q4_k_tiles", 1),
    "Q6_K": (q6_k_tiles, q6_k_blocks, "q6_k_tiles", 1),
    "Q5_0": (q5_0_tiles, q5_0_blocks, "q5_0_tiles", PAIR),
    "Q8_0": (q8_0_tiles, q8_0_blocks, "q8_0_tiles", PAIR),
}


class GGUFBlockLinear(nn.Module):
    """Drop-in for nn.Linear over GGUF blocks: `parts` stacked along the output rows, each in its own block format.

    The kernels read the blocks where they are (kernels/csrc/ggml_blocks.h), Q4_K, Q6_K, Q5_0 and Q8_0 ones as int4 tiles made at load
    (quant/gguf_tiles.py), at any number of activation rows; the
    portable path (`use_kernel=False`) dequantizes them in torch (model/gguf_blocks.py, gguf's own values) and runs
    F.linear. A KernelLayer (kernels/layer.py)."""

    fuses_input = True  # model/transformer.py: linear_after_norm, linear_after_glu

    def __init__(self, linear: nn.Linear, parts: list[Part], use_kernel: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kinds = tuple(kind for kind, _ in parts)
        for i, (kind, blocks) in enumerate(parts):
            weights, size = BLOCK_LAYOUTS[kind]
            if (
                blocks.dtype != torch.uint8
                or blocks.dim() != 3
                or blocks.shape[1:] != (linear.in_features // weights, size)
            ):
                raise QuantizationError(
                    f"{kind} blocks of shape {tuple(blocks.shape)} do not make {linear.in_features} inputs"
                )
        self.use_kernel, self.dtype = use_kernel, linear.weight.dtype
        for i, (kind, blocks) in enumerate(parts):
            self._store(i, kind, blocks.to(linear.weight.device))
        if sum(blocks.shape[0] for _, blocks in parts) != self.out_features:
            raise QuantizationError(f"the GGUF parts' rows do not add up to {self.out_features}")
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def _store(self, i: int, kind: str, blocks: Tensor) -> None:
        """Hold part i as the kernels read it fastest: the TILED formats as the active build's int4 tiles where their
        blocks of rows and columns divide the part's, else (and for the other formats and the reference path) the
        blocks as they are."""
        layout = int4_layout(blocks.device, self.dtype, blocks.shape[0], self.in_features) if self.use_kernel else ""
        tiled = kind in TILED and layout == "tiles" and blocks.shape[1] % TILED[kind][3] == 0
        held = in_row_chunks(TILED[kind][0], blocks, int4_tile_rows()) if tiled else blocks
        self.register_buffer(f"blocks_{i}", held)

    def _held(self) -> list[tuple[str, Tensor]]:  # each part's kind and what holds it: blocks, or int32 tiles
        return [(kind, getattr(self, f"blocks_{i}")) for i, kind in enumerate(self.kinds)]

    def parts(self) -> list[Part]:
        """Each part's kind and its blocks (from tiles: made again, as the file stored them)."""
        return [(kind, TILED[kind][1](held) if held.dtype == torch.int32 else held) for kind, held in self._held()]

    def dequantize(self) -> Tensor:
        """The fp32 weights (N, K) the reference path multiplies."""
        return torch.cat([dequantize_blocks(blocks, kind) for kind, blocks in self.parts()])

    def kernel_weights(self) -> KernelWeights | None:
        if not self.use_kernel:
            return None
        for i, (kind, held) in enumerate(self._held()):
            if held.dtype == torch.int32 and held.shape[-1] != int4_tile_rows():  # another build's (tests switch)
                self._store(i, kind, TILED[kind][1](held))
        held = self._held()
        biases = self.bias.split([self.rows(t) for _, t in held]) if self.bias is not None else None
        parts = [
            KernelWeights(
                TILED[kind][2] if t.dtype == torch.int32 else "gguf", t, bias=None if biases is None else biases[i]
            )
            for i, (kind, t) in enumerate(held)
        ]
        first = parts[0]
        return KernelWeights(first.format, first.weight, bias=first.bias, stacked=tuple(parts[1:]))

    @staticmethod
    def rows(held: Tensor) -> int:
        """The weight rows of a part's blocks or tiles."""
        return held.shape[0] * held.shape[-1] if held.dtype == torch.int32 else held.shape[0]

    def forward(self, x: Tensor, norm: RMSNorm | None = None, gated: bool = False) -> Tensor:
        weights = self.kernel_weights() if gemv_fits(x, self.in_features * (1 + gated), None) else None
        if weights is None:
            return F.linear(prepared_input(x, norm, gated), self.dequantize().to(x.dtype), self.bias)
        if not weights.stacked:
            return gemv(x, weights.weight, None, weights.bias, norm, gated)
        x = prepared_input(x, norm, gated)  # once for every part
        return torch.cat([gemv(x, p.weight, None, p.bias, None, False) for p in weights.every_part()], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, formats={'+'.join(self.kinds)}"


def read_block_linears(path: Path, config: ModelConfig) -> dict[str, Callable[[], list[Part]]]:
    """Per decoder Linear (module names as in Transformer) whose parts are all in block formats the kernels read: a
    reader of its parts, called when the layer is built, so one layer's blocks are copied out of the file at a time."""
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"]

    def kind(name: str) -> str:
        return tensors[name + ".weight"].tensor_type.name

    def get(name: str, n_heads: int | None) -> Part:
        tensor = tensors[name + ".weight"]
        weights, size = BLOCK_LAYOUTS[kind(name)]
        rows = np.array(tensor.data, dtype=np.uint8)  # (rows, bytes per row): a copy, the file goes
        evict(reader, tensor)
        # shaped as blocks before torch sees them: a torch view would keep its base (kernels/huge_pages.py)
        blocks = torch.from_numpy(rows.reshape(rows.shape[0], -1, size))
        return kind(name), unpermute_qk(blocks, n_heads) if n_heads else blocks

    found: dict[str, Callable[[], list[Part]]] = {}
    for i in range(config.n_layers):
        for ours, sources in linear_sources(config, arch, set(tensors), i).items():
            if all(kind(name) in BLOCK_LAYOUTS for name, _ in sources):
                found[f"layers.{i}.{ours}"] = functools.partial(lambda s: _merged([get(*src) for src in s]), sources)
    return found


def _merged(parts: list[Part]) -> list[Part]:
    """Neighbouring parts of one format as one (q and k of one format are a single stream for the kernel)."""
    out: list[Part] = []
    for kind, blocks in parts:
        if out and out[-1][0] == kind:
            out[-1] = (kind, torch.cat([out[-1][1], blocks]))
        else:
            out.append((kind, blocks))
    return out
