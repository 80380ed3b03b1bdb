"""INT8 KV rows: each (token, kv head) row of head_dim values as int8 codes and one fp32 scale.

scale = max|x| / 127 and code = round(x / scale) (to nearest, ties to even), so a row's largest value is
exact and every other is within scale / 2; a row of zeros keeps scale 0. The C++ kernels
(kernels/csrc/attention.h, KvPool<int8_t>) write the same codes from the same fp32 arithmetic.
"""

from __future__ import annotations

import torch
from torch import Tensor

KV_INT8 = torch.int8
SCALE_DTYPE = torch.float32


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., D) -> codes (..., D) int8, scales (...) fp32."""
    x = x.float()
    scale = x.abs().amax(-1) / 127
    codes = torch.round(x / torch.where(scale > 0, scale, 1)[..., None]).to(KV_INT8)
    return codes, scale


def dequantize_rows(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """codes (..., D) int8, scales (...) -> (..., D) in `dtype`."""
    return (codes.float() * scales[..., None]).to(dtype)
