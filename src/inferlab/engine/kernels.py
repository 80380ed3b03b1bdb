"""The matmul kernel for each plain Linear, chosen once at load for the device and dtype.

On CPU in fp32 the default BLAS path reads weights far below the memory bandwidth for the
matrix-vector products of decoding; the same weight reordered once into oneDNN's blocked layout
runs about twice as fast on the LM head. bf16 and CUDA keep `F.linear`, which is already the best
there. Quantized layers (quant/) carry their own kernels and are left alone.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class PackedLinear(nn.Module):
    """A Linear whose weight is prepacked for oneDNN; `weight` stays for state_dict and reference use."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        # the batch-size hint only tunes the layout; 1 is the decode case this exists for
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def cpu_fp32_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def select_kernels(model: nn.Module, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Swap each plain nn.Linear for the fastest kernel this device offers; return the swapped names."""
    if not cpu_fp32_packing_available(device, dtype):
        return []
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, PackedLinear(child))
                swapped.append(f"{name}.{child_name}" if name else child_name)
    return swapped
