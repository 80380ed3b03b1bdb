"""The matmul kernel for each Linear, chosen once at load for the device (`device.kernels`).

Decoding multiplies a handful of activation rows by every weight matrix, so its speed is how fast
the weights stream from memory. On CPU the library paths fall well short of that for these
matrix-vector products (measured on the 121 matrices of SmolLM2-135M, 2 threads: F.linear fp32
13.5 GB/s, oneDNN-prepacked 17.3, this kernel 22.9), so inferlab builds its own AVX2 kernels on first
use and caches the build: csrc/gemv.h (fp32, bf16, int8 and int4 weights, one pass over each row),
csrc/attention.h (one query per sequence through block tables) and csrc/decode_step.cpp (the whole
decode step, engine/fused_decode.py). The GEMV takes calls of at most GEMV_MAX_ROWS rows; prompts
and large batches are GEMMs, where `F.linear` is the right tool.
`kernels=portable`, other devices, and machines without AVX2 or a C++ compiler keep `F.linear`.
"""
from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferlab.kernels.huge_pages import move_weights_to_huge_pages
from inferlab.errors import InvalidRequestError
from inferlab.model.transformer import RMSNorm, swiglu
from inferlab.paths import cache_dir

GEMV_MAX_ROWS, GEMV_K_STEP, GEMV_MAX_K = 8, 16, 8192  # kMaxRows, kStep and the K limit in csrc/gemv.h
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("gemv.cpp", "decode_attention.cpp", "decode_step.cpp")]
DECODE_ATTENTION_MAX_HEAD_DIM = 256
KERNEL_CHOICES = ("fast", "portable")

log = logging.getLogger(__name__)


@functools.cache
def cpu_gemv_available() -> bool:
    """Build (first call on a machine: ~30 s; then cached) and load the AVX2 kernels; False where they cannot."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    from torch.utils.cpp_extension import load

    build_dir = cache_dir() / "kernels" / f"torch-{torch.__version__}"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        print("inferlab: building the CPU decode kernels (once per machine) ...", file=sys.stderr, flush=True)
    try:
        # -fopenmp for at::parallel_for's pragmas: the process's libgomp is torch's, so the threads are torch's
        load(name="inferlab_kernels", sources=[str(p) for p in SOURCES], build_directory=str(build_dir),
             extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
             is_python_module=False)
    except Exception as error:  # no compiler, no ninja: the portable path serves
        log.warning("CPU decode kernels unavailable (%s); using F.linear", str(error).splitlines()[0])
        return False
    return True


def gemv_fits(x: Tensor, width: int) -> bool:
    """The kernel covers this call: CPU, at most GEMV_MAX_ROWS rows of `width` features, a multiple of 16 up to 8192."""
    return (x.device.type == "cpu" and x.numel() <= GEMV_MAX_ROWS * width and width % GEMV_K_STEP == 0
            and width <= GEMV_MAX_K and x.dtype in (torch.float32, torch.bfloat16) and cpu_gemv_available())


def gemv(x: Tensor, weight: Tensor, scales: Tensor | None, bias: Tensor | None, norm: RMSNorm | None,
         gated: bool, mins: Tensor | None = None) -> Tensor:
    """prepare(x) @ W.T * scales + bias, each part only when given, in one pass over the weight.

    prepare = rmsnorm with `norm`; with `gated`, x is [gate, up] (..., 2K) and prepare = silu(gate) * up.
    x: (..., K) fp32 | bf16 -> (..., N) in x's dtype. W is `weight` (N, K) fp32 | bf16 | int8 with
    per-row `scales` (N,) for int8; or int4: `weight` uint8 (N, K / 2) nibble codes (quant/int4.py's
    pack_nibbles) with `scales`, `mins` (N, K / group_size), w = q * scale + min (the group size is
    read off their shape).
    """
    norm_weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
    return torch.ops.inferlab.gemv(x, weight, scales, bias, norm_weight, eps, mins, gated)


def prepared_input(x: Tensor, norm: RMSNorm | None, gated: bool) -> Tensor:
    """What a fused kernel does to its input, for the paths that run it as separate ops."""
    if gated:
        return swiglu(x)
    return x if norm is None else norm(x)


def decode_attention_applies(device: torch.device, dtype: torch.dtype, head_dim: int, kernels: str) -> bool:
    """Whether a KV cache of this device, dtype and head_dim takes its single-query steps through
    `decode_attention`: decided once, when the cache is built."""
    return (fast_kernels_apply(device, dtype, kernels) and head_dim % 8 == 0
            and head_dim <= DECODE_ATTENTION_MAX_HEAD_DIM)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor,
                     positions: Tensor) -> Tensor:
    """Write each sequence's k, v at its position of the pools, then softmax(q K^T / sqrt(d)) V over its
    positions 0..position, read through its row of `block_tables`.

    q: (B, H, 1, D); k, v: (B, H_kv, 1, D); k_pool, v_pool: (num_blocks, H_kv, block_size, D), written in
    place (the contiguous cache is one max_seq_len block per slot); block_tables: (B, n) int64;
    positions: (B,) int64; H a multiple of H_kv -> (B, H, 1, D)
    """
    return torch.ops.inferlab.decode_attention(q, k, v, k_pool, v_pool, block_tables, positions, q.shape[-1] ** -0.5)


class GemvLinear(nn.Module):
    """An nn.Linear that decodes through the CPU kernel (with the RMSNorm or SwiGLU before it fused in)
    and leaves larger products to `F.linear`."""

    fuses_input = True  # model/transformer.py: linear_after_norm, linear_after_swiglu

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: Tensor, norm: RMSNorm | None = None, gated: bool = False) -> Tensor:
        if gemv_fits(x, self.in_features * (1 + gated)):
            return gemv(x, self.weight, None, self.bias, norm, gated)
        return F.linear(prepared_input(x, norm, gated), self.weight, self.bias)


def fast_kernels_apply(device: torch.device, dtype: torch.dtype, kernels: str) -> bool:
    if kernels not in KERNEL_CHOICES:
        raise InvalidRequestError(f"device.kernels={kernels!r}; use one of {list(KERNEL_CHOICES)}")
    return (kernels == "fast" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and cpu_gemv_available())


def select_kernels(model: nn.Module, device: torch.device, dtype: torch.dtype, kernels: str) -> list[str]:
    """Swap each plain nn.Linear for the kernel chosen for this device; return the swapped names.

    Quantized layers (quant/) pick their own kernels per call and are left alone, except that
    `kernels=portable` sends them down their dequantize-then-linear reference path too. On CPU with
    `kernels=fast` the weights then move onto huge pages (engine/huge_pages.py).
    """
    fast = fast_kernels_apply(device, dtype, kernels)
    swapped = []
    for name, module in list(model.named_modules()):
        if hasattr(module, "use_kernel"):
            module.use_kernel = kernels == "fast"
        for child_name, child in list(module.named_children()):
            if fast and type(child) is nn.Linear:
                setattr(module, child_name, GemvLinear(child))
                swapped.append(f"{name}.{child_name}" if name else child_name)
    if kernels == "fast" and device.type == "cpu":
        moved = move_weights_to_huge_pages(model)
        log.info("weights on huge pages: %.1f MiB", moved / 2**20)
    return swapped
