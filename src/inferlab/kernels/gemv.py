"""The matrix products of the CPU kernels (csrc/gemv.h): fp32, bf16, int8 and int4 weights, each weight row
read from memory once per call, with the RMSNorm or SwiGLU before the product fused in.

The kernel takes any number of rows. On dense fp32/bf16 weights `F.linear` (oneDNN's GEMM, which reuses each
weight across rows in registers) wins beyond GEMV_MAX_ROWS rows, so the Python model's plain layers keep it there;
quantized layers take the kernel at any number of rows (it outruns `_weight_int8pack_mm` at many rows too) unless
they hold a dense copy: int8 beyond GEMV_MAX_ROWS, on the amx build beyond INT8_TILES_MAX_ROWS, int4 beyond
INT4_KERNEL_MAX_ROWS (on the amx build INT4_KERNEL_MAX_ROWS_AMX) and only on AMX CPUs (elsewhere its many-row
kernel outruns oneDNN's bf16 GEMM over a copy: fused_decode.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferlab.kernels.build import active_isa, cpu_gemv_available, kernel_ops
from inferlab.kernels.layer import DenseCopyLayer, KernelWeights
from inferlab.model.transformer import RMSNorm, swiglu, widened_linear

GEMV_MAX_ROWS = 8  # rows up to which the kernel runs a dense layer (csrc/gemv.h: kDecodeRows)
# rows up to which the int4 kernel runs a layer that holds a bf16 copy (AMX CPUs only: layer.DenseCopyLayer): about
# where the Python model over the copies (oneDNN on the AMX tiles) overtakes the fused kernel on a prompt
INT4_KERNEL_MAX_ROWS = 64
# the same on the amx build, whose fused step takes a step of more rows in bf16, the copies' numbers: up to 55 rows
# dequantized from the int4 tiles in cache, from 56 the copies streamed (fused_decode.py: dense_from_rows; csrc/amx.h:
# Int4DequantTiles): from 16 rows the tiles' bf16 products of the dequantized weights take less time than the int4
# kernel's, whose time grows with every row. A sequence's numbers then depend on whether its step held 16 rows
INT4_KERNEL_MAX_ROWS_AMX = 15
# rows up to which a bf16 model's step stays on the fused kernel on AMX CPUs (larger ones: the Python model, whose
# F.linear runs oneDNN's GEMM on the tiles, which overtakes the kernel on a prompt about there)
BF16_KERNEL_MAX_ROWS = 32
# the same on the amx build, whose bf16 products run on the tiles too (csrc/amx.h; there also a quantized layer's bf16
# copy, kernels/fused_decode.py): about where oneDNN's GEMM, which packs its operands for the tiles better than the
# plan's streaming products, catches up with the fused step on a prompt chunk
BF16_TILES_MAX_ROWS = 192
# rows up to which an int8 layer that holds a dense copy takes the kernel on the amx build, whose int8 products of 6 or
# more rows run on the tiles (csrc/amx.h: Int8Tiles; elsewhere GEMV_MAX_ROWS): about where the Python model over the
# bf16 copies catches up with the fused step on a prompt chunk
INT8_TILES_MAX_ROWS = 192
GEMV_K_STEP, GEMV_MAX_K = 16, 32768  # kStep and the K limit in csrc/gemv.h
FLOAT_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def gemv_fits(x: Tensor, width: int, max_rows: int | None = GEMV_MAX_ROWS) -> bool:
    """The kernel covers this call: CPU, at most `max_rows` rows (None: any) of `width` features, a multiple of 16
    up to GEMV_MAX_K."""
    return (
        x.device.type == "cpu"
        and (max_rows is None or x.numel() <= max_rows * width)
        and width % GEMV_K_STEP == 0
        and width <= GEMV_MAX_K
        and x.dtype in (torch.float32, torch.bfloat16)
        and cpu_gemv_available()
    )


def int8_kernel_max_rows() -> int:
    """Rows up to which an int8 layer holding a dense copy still takes the kernel, on the build this process runs."""
    return INT8_TILES_MAX_ROWS if on_tiles_build() else GEMV_MAX_ROWS


def int4_kernel_max_rows() -> int:
    """Rows up to which an int4 layer holding a bf16 copy still takes the kernel, on the build this process runs."""
    return INT4_KERNEL_MAX_ROWS_AMX if on_tiles_build() else INT4_KERNEL_MAX_ROWS


def on_tiles_build() -> bool:
    """This process runs the kernels' build that multiplies on AMX tiles (kernels/isa.py)."""
    isa = active_isa()
    return isa is not None and isa.tiles


def quantized_max_rows(layer: DenseCopyLayer) -> int | None:
    """Rows a quantized layer runs on the kernel: any number, or its kernel_max_rows when it holds a dense copy for
    more (kernels/layer.py's DenseCopyLayer), which then goes to `F.linear`."""
    return None if layer.dense is None else layer.kernel_max_rows


def gemv(
    x: Tensor,
    weight: Tensor,
    scales: Tensor | None,
    bias: Tensor | None,
    norm: RMSNorm | None,
    gated: bool,
    mins: Tensor | None = None,
    int8_activations: bool = False,
    bf16_from_rows: int = 0,
) -> Tensor:
    """prepare(x) @ W.T * scales + bias, each part only when given, in one pass over the weight.

    prepare = rmsnorm with `norm`; with `gated`, x is [gate, up] (..., 2K) and prepare = silu(gate) * up.
    x: (..., K) fp32 | bf16 -> (..., N) in x's dtype. W is `weight` (N, K) fp32 | bf16 | int8 with
    per-row `scales` (N,) for int8; or int4: `weight` uint8 (N, K / 2) nibble codes (quant/int4.py's
    pack_nibbles) with `scales`, `mins` (N, K / group_size), w = q * scale + min (the group size is
    read off their shape); int4 `weight` may also be the kernel's tiles (quant/int4.py's tile_rows), scales and
    mins then views of theirs. `int8_activations`: int4 weights meet int8 activation codes per block of 32
    columns instead of int16 ones per row (a speculative draft's: FusedDecode.build). `bf16_from_rows` (> 0): int4
    tiles times this many rows or more are multiplied in bf16 on the amx build, the numbers of the layer's bf16 copy
    (csrc/amx.h: Int4DequantTiles; the fused step does so from its dense_from_rows).
    """
    norm_weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
    return kernel_ops().gemv(x, weight, scales, bias, norm_weight, eps, mins, gated, int8_activations, bf16_from_rows)


def prepared_input(x: Tensor, norm: RMSNorm | None, gated: bool) -> Tensor:
    """What a fused kernel does to its input, for the paths that run it as separate ops."""
    if gated:
        return swiglu(x)
    return x if norm is None else norm(x)


class GemvLinear(nn.Module):
    """An nn.Linear that decodes through the CPU kernel (with the RMSNorm or SwiGLU before it fused in)
    and leaves larger products to `F.linear`; a KernelLayer (layer.py)."""

    fuses_input = True  # model/transformer.py: linear_after_norm, linear_after_glu

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.use_kernel = True

    def kernel_weights(self) -> KernelWeights | None:
        weight_format = FLOAT_FORMATS.get(self.weight.dtype)
        if not self.use_kernel or weight_format is None:
            return None
        return KernelWeights(weight_format, self.weight, bias=self.bias)

    def forward(self, x: Tensor, norm: RMSNorm | None = None, gated: bool = False) -> Tensor:
        if self.use_kernel and gemv_fits(x, self.in_features * (1 + gated)):
            return gemv(x, self.weight, None, self.bias, norm, gated)
        x = prepared_input(x, norm, gated)
        if x.dtype != self.weight.dtype:  # fp32 rows over bf16 weights: the LM head's fp32 logits, many rows
            return widened_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
