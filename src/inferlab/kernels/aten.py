"""The aten integer matmuls behind the quantized modules, and the one device check that picks them.

Decoding reads every weight once per token, so the win comes from kernels that read int8 / packed
int4 directly instead of a dequantized copy. On the CPU, with bf16 activations `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu` beat a bf16 F.linear, but with fp32 or fp16 activations both are several times
slower than a dense F.linear, so on CPU only bf16 takes them. Every case the kernels do not cover runs the
portable dequantize-then-linear reference instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inferlab.kernels.build import cpu_gemv_available, int4_tile_rows

INT4_OFFSET = 8  # the int4pack kernels compute w = (q - 8) * scale + zero


def int8_kernel_fits(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type == "cpu":
        return dtype == torch.bfloat16
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def int8_mm(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    # x: (M, K); weight: int8 (N, K); scales: (N,) -> (M, N)
    return torch.ops.aten._weight_int8pack_mm(x, weight, scales.to(x.dtype))


def int4_layout(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int) -> str:
    """How a layer's int4 weights are stored, for the kernel that will read them.

    "tiles": the CPU kernels' blocks of rows (kernels/csrc/gemv.h: Int4Format's tiles; quant/int4.py), where they
    are built and their blocks divide the rows; "rows": nibble rows, read by those kernels too (tiling them at
    every call) and by the dequantize-then-linear reference; "cpu" / "cuda": aten's opaque int4pack layouts.
    """
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_gemv_available():
        return "tiles" if int4_tiles_fit(out_features) else "rows"
    if device.type == "cpu" and dtype == torch.bfloat16 and out_features % 16 == 0:
        return "cpu"
    if device.type == "cuda" and dtype == torch.bfloat16 and out_features % 8 == 0 and in_features % 32 == 0:
        return "cuda"
    return "rows"


def int4_tiles_fit(out_features: int) -> bool:
    """The chosen CPU kernel build's blocks of int4 tile rows divide `out_features`."""
    return out_features % int4_tile_rows() == 0


def _inner_k_tiles(in_features: int) -> int:
    """The CUDA kernel tiles K by 16 * innerKTiles (2, 4 or 8): the largest that divides K."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def to_int4pack(codes: Tensor, layout: str) -> Tensor:
    """codes: uint8 (N, K) in [0, 15] -> the kernel's opaque packed weight (0.5 byte per weight)."""
    if layout == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    # the CUDA converter takes two codes per byte, the even column in the high nibble
    pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(codes.shape[1]))


def int4pack_scales_and_zeros(scales: Tensor, mins: Tensor) -> Tensor:
    """(N, G) scale and min of w = q * scale + min -> (G, N, 2) for the kernels' (q - 8) * scale + zero."""
    zeros = mins.float() + INT4_OFFSET * scales.float()
    return torch.stack((scales.float(), zeros), dim=-1).transpose(0, 1).contiguous().to(scales.dtype)


def int4_mm(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor, layout: str) -> Tensor:
    # x: (M, K) -> (M, N)
    sz = scales_and_zeros.to(x.dtype)
    if layout == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, sz)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, sz)
