"""INT8 weight-only quantization: symmetric absmax per output channel, read as int8 by the matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferlab.kernels.aten import int8_kernel_fits, int8_mm
from inferlab.kernels.gemv import gemv, gemv_fits, int8_kernel_max_rows, prepared_input, quantized_max_rows
from inferlab.kernels.isa import amx_bf16_usable
from inferlab.kernels.layer import KernelWeights
from inferlab.model.transformer import RMSNorm


def quantize_rows_int8(weight: Tensor, chunk_elements: int = 1 << 20) -> tuple[Tensor, Tensor]:
    """weight (N, K) -> int8 codes (N, K) and fp32 scales (N,), s_i = max_j |W_ij| / 127.

    4 MiB of fp32 rows at a time, worked on in place: a large head (vocab x dim) never has fp32 temporaries of its
    whole size, and loading's peak is not raised by them."""
    codes = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    step = max(1, chunk_elements // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], step):
        w = weight[start : start + step].to(torch.float32, copy=True)  # worked on in place: never the caller's rows
        s = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        codes[start : start + step] = w.div_(s[:, None]).round_().clamp_(-127, 127)
        scales[start : start + step] = s
    return codes, scales


class Int8Linear(nn.Module):
    """Drop-in for nn.Linear holding int8 weights (N, K) and one scale per output row, in the activation dtype.

    `use_kernel=False` keeps the plain dequantize-then-linear path: the reference the kernel is tested against.
    `logit_head`: the layer is an LM head, which runs only on the rows whose logits a step wants (one a sequence), so
    it never keeps a dense copy (dense_copy_pays). A KernelLayer (kernels/layer.py).
    """

    def __init__(self, linear: nn.Linear, use_kernel: bool = True, logit_head: bool = False) -> None:
        super().__init__()
        self.logit_head = logit_head
        weight = linear.weight.detach()
        codes, scales = quantize_rows_int8(weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.use_kernel = use_kernel
        self.register_buffer("weight", codes)
        self.register_buffer("scales", scales.to(weight.dtype))
        self.register_buffer("dense", None, persistent=False)  # dequantized, for many rows (keep_dense_copy)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantize(self) -> Tensor:
        return self.weight.float() * self.scales.float()[:, None]

    def kernel_weights(self) -> KernelWeights | None:
        return KernelWeights("int8", self.weight, self.scales, bias=self.bias) if self.use_kernel else None

    fuses_input = True  # model/transformer.py: linear_after_norm, linear_after_glu

    @property
    def kernel_max_rows(self) -> int:  # kernels/layer.py's DenseCopyLayer
        return int8_kernel_max_rows()

    def dense_copy_pays(self, dtype: torch.dtype) -> bool:
        """A bf16 copy only where oneDNN's bf16 GEMM runs on AMX tiles (kernels/isa.py: amx_bf16_usable): elsewhere
        it is slower than the int8 kernel at every number of rows (without AVX-512 BF16 it converts its operands as
        it goes; with it but without AMX its pair dots do no more a cycle than the kernel's) and holds twice the
        weights. Never for an LM head: a step's logit rows are its sequences, a decode batch's few, and the fused step
        never reads the copy (kernels/fused_decode.py), so it only held memory (1,002 MiB at Llama-3.1-8B's head)."""
        if self.logit_head:
            return False
        return dtype != torch.bfloat16 or self.weight.device.type != "cpu" or amx_bf16_usable()

    def keep_dense_copy(self, out: Tensor) -> int:
        """kernels/layer.py's DenseCopyLayer: the same values the reference path computes at each call, into `out`
        (out_features, in_features) in the copy's dtype, 1 Mi weights at a time (a vocabulary-sized head's fp32
        temporary would raise loading's peak by its whole size)."""
        step = max(1, (1 << 20) // self.in_features)
        for start in range(0, self.out_features, step):
            rows = slice(start, start + step)
            out[rows] = self.weight[rows].float() * self.scales[rows].float()[:, None]
        self.dense = out
        return out.nbytes

    def forward(self, x: Tensor, norm: RMSNorm | None = None, gated: bool = False) -> Tensor:
        if self.use_kernel and gemv_fits(
            x, self.in_features * (1 + gated), quantized_max_rows(self)
        ):  # decode, or any rows without a dense copy
            return gemv(x, self.weight, self.scales, self.bias, norm, gated)
        x = prepared_input(x, norm, gated)
        if self.dense is not None and self.use_kernel and self.dense.dtype == x.dtype:  # a prompt, a large batch
            return F.linear(x, self.dense, self.bias)
        if self.use_kernel and int8_kernel_fits(x.device, x.dtype):
            y = int8_mm(x.reshape(-1, self.in_features), self.weight, self.scales)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantize().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.use_kernel}"


class Int8Embedding(nn.Module):
    """Token embeddings looked up in a tied LM head's int8 rows, so embedding and head share one int8 matrix.

    The head is registered as a submodule (like tied parameters, it moves with either owner).
    """

    def __init__(self, head: Int8Linear) -> None:
        super().__init__()
        self.head = head

    def forward(self, tokens: Tensor) -> Tensor:
        # tokens: (B, T) -> (B, T, dim) in the scales' (activation) dtype
        scales = self.head.scales
        return self.head.weight[tokens].to(scales.dtype) * scales[tokens].unsqueeze(-1)
