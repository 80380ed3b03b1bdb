"""What a linear layer exposes to run on the kernels: its weights in a format the gemv kernel reads, and the
switch between the fast kernels and the portable reference path.

The plain layers (gemv.GemvLinear) and the quantized ones (quant/) implement `KernelLayer`; the fused
decode step and `select_kernels` see layers only through it, so kernels/ never imports the layers' code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeGuard, runtime_checkable

import torch
from torch import Tensor

FORMAT_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "bf16_blocks": torch.bfloat16,
    "int8": torch.int8,
    "int4": torch.uint8,
    "int4_tiles": torch.int32,
    "gguf": torch.uint8,
    "q4_k_tiles": torch.int32,
    "q6_k_tiles": torch.int32,
    "q5_0_tiles": torch.int32,
    "q8_0_tiles": torch.int32,
}
INT4_FORMATS = ("int4", "int4_tiles")
# no scales beside the weight: none, or the blocks' own
UNSCALED_FORMATS = ("fp32", "bf16", "bf16_blocks", "gguf", "q4_k_tiles", "q6_k_tiles", "q5_0_tiles", "q8_0_tiles")


@dataclass(frozen=True)
class KernelWeights:
    """One projection's weights as csrc/gemv.h reads them: w = weight (fp32, bf16, or bf16 in blocks of 16 rows:
    kernels/gemv.py's pack_bf16), weight * scales (int8,
    one scale per row), or q * scale + min per group of `group_size` inputs (int4, two codes per byte; as nibble
    rows, or as the kernel's tiles of rows, quant/int4.py's tile_rows), or GGUF blocks as the file stores them
    (model/gguf_blocks.py; their size in bytes names the format), or Q4_K, Q6_K, Q5_0 or Q8_0 blocks as int4 tiles with
    the blocks' own factors (quant/gguf_tiles.py). `stacked`: further rows of the same projection,
    each part in its own format (a GGUF file may keep a fused projection's parts in different ones)."""

    format: str  # "fp32" | "bf16" | "bf16_blocks" | "int8" | "int4" | "int4_tiles" | "gguf" | "q4_k_tiles" | ...
    # (N, K) in FORMAT_DTYPES[format]; bf16_blocks: (N / 16, K / 2, 32); int4: uint8 (N, K / 2), column 2j in the low nibble; int4_tiles: int32
    # (N / L, K / 8 + G, L), blocks of L rows holding their codes, then per group their fp16 scales and mins; gguf:
    # uint8 (N, K / weights per block, bytes per block); q4_k_tiles: int32 (N / L, K / 8 + K / 256 * 5, L);
    # q6_k_tiles: int32 (N / L, K / 256, 53, L); q5_0_tiles, q8_0_tiles: int32 (N / L, K / 64, 11 or 17, L)
    weight: Tensor
    # int8: (N,); int4: fp32 (N, G = K / group_size); int4_tiles: fp16 (N / L, G, L) views of weight's
    scales: Tensor | None = None
    mins: Tensor | None = None  # int4: fp32 (N, G); int4_tiles: fp16 (N / L, G, L) views of weight's
    bias: Tensor | None = None  # (N,)
    group_size: int | None = None  # int4
    stacked: tuple[KernelWeights, ...] = ()

    def __post_init__(self) -> None:
        if FORMAT_DTYPES.get(self.format) != self.weight.dtype:
            raise ValueError(f"{self.format} weights must be {FORMAT_DTYPES.get(self.format)}, not {self.weight.dtype}")
        if (self.scales is None) != (self.format in UNSCALED_FORMATS):
            raise ValueError(f"{self.format} weights {'need' if self.scales is None else 'take no'} scales")
        if (self.mins is None or self.group_size is None) == (self.format in INT4_FORMATS):
            raise ValueError("int4 weights, and only they, have mins and a group size")

    def parts(self) -> list[Tensor]:
        """[weight, scales, mins, bias], absent ones empty: a projection (its first part) as the C++ decode plan takes
        it."""
        empty = self.weight.new_empty(0)
        return [empty if t is None else t.detach() for t in (self.weight, self.scales, self.mins, self.bias)]

    def every_part(self) -> tuple[KernelWeights, ...]:
        """This projection's parts in the order of their rows: itself, then the stacked ones."""
        return (self, *self.stacked)


@runtime_checkable
class KernelLayer(Protocol):
    """A linear layer y = x W^T + b that can run on the kernels."""

    in_features: int
    out_features: int
    use_kernel: bool  # True: the fast kernels where they apply; False: the portable reference path

    def kernel_weights(self) -> KernelWeights | None:
        """The weights as the gemv kernel reads them; None while this layer does not run on it (the
        portable path, or weights stored for another kernel)."""
        ...


class DenseCopyLayer(Protocol):
    """A quantized layer (int8, int4) that can also hold its weights dequantized, for products of many rows.

    The gemv kernel takes any number of rows, but a prompt chunk or a large decode batch is a GEMM, and
    there a dense bf16/fp32 GEMM (oneDNN) over a dequantized copy of int8 weights is faster than the int8
    kernel and an order of magnitude faster than dequantizing at every call (on the amx build, whose int8 products
    run on AMX tiles, only beyond INT8_TILES_MAX_ROWS rows: kernels/gemv.py):
    the copy trades memory for that speed, within `device.dense_copy_mb`. int4 keeps one only where oneDNN's
    bf16 GEMM runs on AMX tiles (kernels/isa.py: amx_bf16_usable), and only for steps of more than
    INT4_KERNEL_MAX_ROWS rows (kernels/gemv.py): elsewhere its kernel's GEMM (csrc/gemv.h) outruns oneDNN's bf16
    one at a few dozen rows and loses little on long prompts (kernels/fused_decode.py: many_rows_limit).
    The amx build's fused step takes an int4 layer's products in bf16, the copy's numbers, beyond
    INT4_KERNEL_MAX_ROWS_AMX rows, where its tiles overtake the kernel (kernels/fused_decode.py: dense_from_rows):
    up to 55 rows its int4 weights dequantized in cache, from there its copy streamed, up to BF16_TILES_MAX_ROWS; the
    Python model's F.linear takes longer steps.
    """

    in_features: int
    out_features: int
    dense: Tensor | None  # the copy, once kept
    kernel_max_rows: int  # with a copy, products of up to this many rows still take the kernel

    def dense_copy_pays(self, dtype: torch.dtype) -> bool:
        """A copy in `dtype` would serve many rows faster than the kernel, on this machine."""
        ...

    def keep_dense_copy(self, out: Tensor) -> int:
        """Hold the dequantized weights from now on, written into `out` (out_features, in_features) in the copy's
        dtype; return their bytes."""
        ...


def holds_dense_copy(module: object) -> TypeGuard[DenseCopyLayer]:
    """`module` is a DenseCopyLayer. Not isinstance on a runtime-checkable protocol: from Python 3.12 that looks for
    each member statically, and a module's `dense` lives in its buffers, so every quantized layer failed the check
    and none kept a copy (seen on Python 3.12.3)."""
    return callable(getattr(module, "keep_dense_copy", None))
