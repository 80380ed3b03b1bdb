"""The matrix products of the CPU kernels (csrc/gemv.h): fp32, bf16, int8 and int4 weights, each weight row
read from memory once per call, with the RMSNorm or SwiGLU before the product fused in.

The kernel takes any number of rows. On dense fp32/bf16 weights `F.linear` (oneDNN's GEMM, which reuses each
weight across rows in registers) wins beyond GEMV_MAX_ROWS rows, so the Python model's plain layers keep it there,
except bf16 layers held in blocks of rows for the avx512 build (pack_bf16), whose kernel keeps up with it at any rows;
quantized layers take the kernel at any number of rows (it outruns `_weight_int8pack_mm` at many rows too) unless
they hold a dense copy: int8 beyond GEMV_MAX_ROWS, on the amx build beyond INT8_TILES_MAX_ROWS, int4 beyond
INT4_KERNEL_MAX_ROWS (on the amx build INT4_KERNEL_MAX_ROWS_AMX) and only on AMX CPUs (elsewhere its many-row
kernel outruns oneDNN's bf16 GEMM over a copy: fused_decode.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferlab.kernels.build import active_isa, bf16_block_rows, cpu_gemv_available, kernel_ops
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


def packs_bf16(weight: Tensor) -> bool:
    """The chosen build reads these bf16 (N, K) CPU weights laid out in blocks of rows (pack_bf16): the avx512 build,
    N a multiple of its 16 rows and K one the kernel takes. Elsewhere they stay rows: the avx2 build widens them, and
    the amx build's tiles read 16 rows of 32 columns straight from the rows (csrc/amx.h: Bf16Tiles)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu" or not cpu_gemv_available():
        return False
    rows, (n, k) = bf16_block_rows(), weight.shape
    return rows > 0 and n % rows == 0 and k % GEMV_K_STEP == 0 and k <= GEMV_MAX_K


def pack_bf16(weight: Tensor, rows: int | None = None) -> Tensor:
    """bf16 (N, K) weights as csrc/gemv.h's Bf16Blocks reads them (where packs_bf16): (N / 16, K / 2, 32), row n's
    columns 2p and 2p + 1 at [n / 16, p, 2 (n % 16)] and the one after, so that one 64-byte vector holds a pair of
    columns of 16 rows (`rows`: the chosen build's, unless given). The same values, rearranged: unpack_bf16 undoes
    it."""
    n, k = weight.shape
    rows = rows or bf16_block_rows()
    return weight.reshape(n // rows, rows, k // 2, 2).transpose(1, 2).reshape(n // rows, k // 2, 2 * rows).contiguous()


def unpack_bf16(blocks: Tensor) -> Tensor:
    """The (N, K) rows of pack_bf16's blocks (a new tensor)."""
    count, pairs, width = blocks.shape
    return blocks.reshape(count, pairs, width // 2, 2).transpose(1, 2).reshape(count * width // 2, 2 * pairs)


def prepared_input(x: Tensor, norm: RMSNorm | None, gated: bool) -> Tensor:
    """What a fused kernel does to its input, for the paths that run it as separate ops."""
    if gated:
        return swiglu(x)
    return x if norm is None else norm(x)


class GemvLinear(nn.Module):
    """An nn.Linear that decodes through the CPU kernel (with the RMSNorm or SwiGLU before it fused in)
    and leaves larger products to `F.linear`; a KernelLayer (layer.py)."""

    fuses_input = True  # model/transformer.py: linear_after_norm, linear_after_glu

    def __init__(self, linear: nn.Linear, pack: bool = False) -> None:
        """`pack`: bf16 weights the build reads in blocks (packs_bf16) are held so, in place of their rows (not for a
        weight another module shares: a tied embedding looks its rows up)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        if pack and packs_bf16(linear.weight):
            self.weight = nn.Parameter(pack_bf16(linear.weight.detach()), requires_grad=False)
        self.use_kernel = True

    def packed(self) -> bool:
        """The weight is held in bf16 blocks (pack_bf16)."""
        return self.weight.dim() == 3

    def plain_weight(self) -> Tensor:
        """The (N, K) weight (for a packed one, a new tensor each call: the portable path's, not the served one)."""
        return unpack_bf16(self.weight) if self.packed() else self.weight

    def on_kernel(self) -> bool:
        """Products go to the kernel: asked to, and blocks only on a build that reads them (tests switch builds)."""
        return self.use_kernel and (not self.packed() or (cpu_gemv_available() and bf16_block_rows() > 0))

    def kernel_weights(self) -> KernelWeights | None:
        weight_format = "bf16_blocks" if self.packed() else FLOAT_FORMATS.get(self.weight.dtype)
        if not self.on_kernel() or weight_format is None:
            return None
        return KernelWeights(weight_format, self.weight, bias=self.bias)

    def forward(self, x: Tensor, norm: RMSNorm | None = None, gated: bool = False) -> Tensor:
        # blocks at any rows: the kernel's many-row products over them run about as fast as oneDNN's GEMM, which
        # would need the rows back (csrc/gemv.h: Bf16Blocks)
        max_rows = None if self.packed() else GEMV_MAX_ROWS
        if self.on_kernel() and gemv_fits(x, self.in_features * (1 + gated), max_rows):
            return gemv(x, self.weight, None, self.bias, norm, gated)
        x = prepared_input(x, norm, gated)
        weight = self.plain_weight()
        if x.dtype != weight.dtype:  # fp32 rows over bf16 weights: the LM head's fp32 logits, many rows
            return widened_linear(x, weight, self.bias)
        return F.linear(x, weight, self.bias)
