"""Group-wise INT4 weight-only quantization: asymmetric (scale, min) per group of K, two codes per byte.

w ≈ q * scale + min with q in [0, 15] (the convention of GGUF's Q4_1, so its blocks import as they are).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferlab.errors import QuantizationError
from inferlab.kernels.aten import int4_layout, int4_mm, int4_tiles_fit, int4pack_scales_and_zeros, to_int4pack
from inferlab.kernels.build import int4_tile_rows
from inferlab.kernels.gemv import gemv, gemv_fits, int4_kernel_max_rows, prepared_input, quantized_max_rows
from inferlab.kernels.isa import amx_bf16_usable
from inferlab.kernels.layer import KernelWeights
from inferlab.model.transformer import RMSNorm

GROUP_SIZES = (32, 64, 128)
NIBBLE_LAYOUTS = ("tiles", "rows")  # the layouts the CPU kernels and the reference path read (the others: int4pack)


def check_group_size(group_size: int, in_features: int) -> None:
    if group_size not in GROUP_SIZES:
        raise QuantizationError(f"int4 group_size={group_size} is not supported; use one of {list(GROUP_SIZES)}")
    if in_features % group_size:
        raise QuantizationError(
            f"in_features={in_features} is not divisible by int4 group_size={group_size}; "
            f"pick a group size that divides it or leave this layer unquantized"
        )


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes (N, K) in [0, 15] -> (N, K/2), column 2j in the low nibble and 2j+1 in the high one."""
    return codes[:, ::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """(N, K/2) -> uint8 codes (N, K)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(1)


def tile_rows(packed: Tensor, scales: Tensor, mins: Tensor, rows: int) -> Tensor:
    """Nibble rows (N, K/2) with scales and mins (N, G) that fp16 holds exactly -> int4 tiles int32
    (N / rows, K/8 + G, rows): per block of `rows` weight rows, each 4-byte chunk of 8 codes as `rows` values of
    consecutive rows, then per group one line of the rows' fp16 scales and their fp16 mins, the layout in which
    the CPU kernels read int4 weights as one stream (kernels/csrc/gemv.h: Int4Format's tiles; `rows`:
    kernels.build.int4_tile_rows). The same values, rearranged: untile_rows undoes it."""
    halves = [t.half() for t in (scales, mins)]
    if not all(torch.equal(h.float(), t.float()) for h, t in zip(halves, (scales, mins))):
        raise QuantizationError("int4 tiles hold fp16 scales and mins: these are not all fp16 values")
    blocks, groups = packed.shape[0] // rows, scales.shape[1]
    codes = packed.contiguous().view(torch.int32).view(blocks, rows, -1).transpose(1, 2)
    lines = torch.stack([h.view(blocks, rows, groups).transpose(1, 2) for h in halves], dim=2)  # (blocks, G, 2, rows)
    return torch.cat([codes, lines.reshape(blocks, groups, 2 * rows).view(torch.int32)], dim=1)


def tile_parts(tiles: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Views of int4 tiles' codes int32 (N / rows, K/8, rows), scales and mins fp16 (N / rows, G, rows)."""
    rows = tiles.shape[2]
    codes, lines = tiles.split([tiles.shape[1] - groups, groups], dim=1)
    halves = lines.view(torch.float16)  # (N / rows, G, 2 rows): each group's scales, then its mins
    return codes, halves[..., :rows], halves[..., rows:]


def untile_rows(tiles: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """int4 tiles -> nibble rows uint8 (N, K/2), scales and mins fp32 (N, G): tile_rows' inputs, copied out."""
    codes, scales, mins = (t.transpose(1, 2).reshape(-1, t.shape[1]) for t in tile_parts(tiles, groups))
    return codes.view(torch.uint8), scales.float(), mins.float()


def quantize_groups_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """weight (N, K) -> codes uint8 (N, K), scales and mins fp32 (N, K / group_size), both fp16 values (as GGUF's
    Q4_1 stores them; the kernels' tiles hold them so), the codes those rounded ones give."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    if not torch.isfinite(w).all() or w.abs().amax() > torch.finfo(torch.float16).max:
        raise QuantizationError("int4 keeps its scales and mins in fp16: weights must be finite and below 65504")
    mins, maxs = w.amin(dim=-1).half().float(), w.amax(dim=-1)
    scales = ((maxs - mins) / 15).half().float().clamp(min=2**-24)  # fp16's smallest step: no zero scale
    codes = torch.round((w - mins[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.view(n, k), scales, mins


def dequantize_groups_int4(codes: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """codes (N, K), scales and mins (N, G) -> fp32 (N, K): q * scale + min, in that order (GGUF's arithmetic)."""
    n, k = codes.shape
    q = codes.float().view(n, scales.shape[1], -1)
    return (q * scales.float()[..., None] + mins.float()[..., None]).view(n, k)


class Int4GroupLinear(nn.Module):
    """Drop-in for nn.Linear with 4-bit weights (0.5 byte each) and a (scale, min) per group of inputs.

    The weights are stored once, in the layout of the kernel that will read them (kernels/aten.py's
    int4_layout): on CPU the C++ kernels' tiles of rows (`weight` int32, tile_rows; the fused decode step reads
    them where they are, so they are never held twice), or the CPU or CUDA int4pack layout when the device and
    activation dtype have one, else plain nibble rows (`weight`, `scales`, `mins`) read by the
    dequantize-then-linear reference (`use_kernel=False` forces it; tests compare the two). Tiles and rows both
    serve the reference path too, and the kernels whichever build runs (tiles are laid out again for another
    build's rows per block: tests switch builds). `codes=(q, scales, mins)` takes precomputed codes (GGUF Q4_1
    blocks) instead of quantizing `linear.weight`; `linear` then only supplies shape, bias, dtype and device. A
    KernelLayer (kernels/layer.py).
    """

    weight: Tensor  # tiles int32 (N / L, K/8 + G, L), nibble rows uint8 (N, K/2) or int4pack
    scales: Tensor | None  # rows only, fp32 (N, G)
    mins: Tensor | None

    def __init__(
        self,
        linear: nn.Linear,
        group_size: int = 64,
        use_kernel: bool = True,
        codes: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> None:
        super().__init__()
        check_group_size(group_size, linear.in_features)
        weight = linear.weight
        q, scales, mins = codes if codes is not None else quantize_groups_int4(weight.detach(), group_size)
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        self.layout = (
            int4_layout(weight.device, weight.dtype, self.out_features, self.in_features) if use_kernel else "rows"
        )
        self.use_kernel = use_kernel
        if self.layout in NIBBLE_LAYOUTS:  # scales and mins kept in fp32: the kernel reads them so, the reference too
            d = weight.device
            self._store_nibbles(pack_nibbles(q.to(d)), scales.to(d, torch.float32), mins.to(d, torch.float32))
        else:
            q, scales, mins = (
                q.to(weight.device),
                scales.to(weight.device, weight.dtype),
                mins.to(weight.device, weight.dtype),
            )
            self.register_buffer("weight", to_int4pack(q, self.layout))
            self.register_buffer("scales_and_zeros", int4pack_scales_and_zeros(scales, mins))  # (G, N, 2)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.register_buffer("dense", None, persistent=False)  # dequantized, for many rows (keep_dense_copy)

    def _store_nibbles(self, packed: Tensor, scales: Tensor, mins: Tensor) -> None:
        """Hold nibble rows (N, K/2) and their scales and mins (N, G) in self.layout: as they are ("rows"), or as
        the active kernel build's tiles ("tiles": all in `weight`)."""
        tiles = self.layout == "tiles"
        self.register_buffer("weight", tile_rows(packed, scales, mins, int4_tile_rows()) if tiles else packed)
        self.register_buffer("scales", None if tiles else scales)
        self.register_buffer("mins", None if tiles else mins)

    def nibble_rows(self) -> tuple[Tensor, Tensor, Tensor]:
        """The nibble rows uint8 (N, K/2) and fp32 scales and mins (N, G), whichever of the two layouts holds them
        (tiles: copied out)."""
        if self.layout == "tiles":
            return untile_rows(self.weight, self.in_features // self.group_size)
        if self.layout != "rows":
            raise QuantizationError(
                f"weights in the {self.layout} int4pack layout are opaque; build with use_kernel=False"
            )
        assert self.scales is not None and self.mins is not None
        return self.weight, self.scales, self.mins

    def dequantize(self) -> Tensor:
        """The fp32 weights (N, K) the reference path multiplies."""
        packed, scales, mins = self.nibble_rows()
        return dequantize_groups_int4(unpack_nibbles(packed), scales, mins)

    def kernel_weights(self) -> KernelWeights | None:
        if not self.use_kernel or self.layout not in NIBBLE_LAYOUTS:
            return None
        if self.layout == "tiles" and self.weight.shape[2] != int4_tile_rows():
            # tiles of another kernel build (tests switch builds): laid out again for this one's blocks of rows, or
            # as rows where those do not divide N
            nibbles = self.nibble_rows()
            self.layout = "tiles" if int4_tiles_fit(self.out_features) else "rows"
            self._store_nibbles(*nibbles)
        if self.layout == "tiles":
            _, scales, mins = tile_parts(self.weight, self.in_features // self.group_size)
            return KernelWeights("int4_tiles", self.weight, scales, mins, self.bias, self.group_size)
        return KernelWeights("int4", self.weight, self.scales, self.mins, self.bias, self.group_size)

    fuses_input = True  # model/transformer.py: linear_after_norm, linear_after_glu

    @property
    def kernel_max_rows(self) -> int:  # kernels/layer.py's DenseCopyLayer
        return int4_kernel_max_rows()

    def dense_copy_pays(self, dtype: torch.dtype) -> bool:
        """Only a bf16 copy on an AMX CPU: there oneDNN's GEMM on the tiles beats the int4 kernel's beyond
        `kernel_max_rows`; elsewhere the kernel wins at every number of rows, and the copy costs 4x the weights."""
        return self.layout in NIBBLE_LAYOUTS and dtype == torch.bfloat16 and amx_bf16_usable()

    def keep_dense_copy(self, out: Tensor) -> int:
        self.dense = out.copy_(self.dequantize())
        return out.nbytes

    def forward(self, x: Tensor, norm: RMSNorm | None = None, gated: bool = False) -> Tensor:
        if self.layout in NIBBLE_LAYOUTS:
            fits = gemv_fits(x, self.in_features * (1 + gated), quantized_max_rows(self))
            weights = self.kernel_weights() if fits else None
            if weights is not None:
                return gemv(x, weights.weight, weights.scales, self.bias, norm, gated, weights.mins)
            copy = self.dense is not None and self.use_kernel and self.dense.dtype == x.dtype  # a prompt, a large batch
            weight = self.dense if copy else self.dequantize()
            return F.linear(prepared_input(x, norm, gated), weight.to(x.dtype), self.bias)
        x = prepared_input(x, norm, gated)
        if x.device.type != self.layout:
            raise QuantizationError(
                f"int4 weights packed for {self.layout} cannot run on {x.device}; "
                f"quantize on the device the model runs on"
            )
        y = int4_mm(x.reshape(-1, self.in_features), self.weight, self.group_size, self.scales_and_zeros, self.layout)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, layout={self.layout}"
        )
