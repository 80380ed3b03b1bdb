"""Put a model's layers on the kernels chosen for its device, once at load (`device.kernels`, `device.isa`)."""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from inferlab.kernels.build import fast_kernels_apply, use_isa
from inferlab.kernels.gemv import GemvLinear
from inferlab.kernels.huge_pages import TRIM_BYTES, move_weights_to_huge_pages, zeros_on_huge_pages
from inferlab.kernels.isa import resolve_isa
from inferlab.kernels.layer import KernelLayer, holds_dense_copy
from inferlab.native_memory import return_freed_memory

log = logging.getLogger(__name__)


def choose_isa(device: torch.device, kernels: str, isa: str) -> str | None:
    """Check `device.isa`; where the CPU kernels will run (CPU, `kernels=fast`), choose and build that
    instruction set's kernels now, before quantizing or swapping any layer. Returns the one chosen."""
    resolve_isa(isa)  # a name the CPU lacks, or no such name: one clear line, on any device
    if device.type != "cpu" or kernels != "fast":
        return None
    return use_isa(isa)


def select_kernels(
    model: nn.Module, device: torch.device, dtype: torch.dtype, kernels: str, dense_copy_mb: float = 0
) -> list[str]:
    """Swap each plain nn.Linear for the kernel chosen for this device; return the swapped names.

    Layers already on the kernels (KernelLayer: the quantized ones of quant/) pick their kernels per call
    and are left alone, except that `kernels=portable` sends them down their reference path too. bf16 weights are
    laid out in blocks of rows where the build reads them so (gemv.packs_bf16), in place of their rows. With
    `kernels=fast`, int8 layers (in bf16 only on AMX CPUs) and int4 ones on AMX CPUs also keep a
    dequantized copy for products of many rows when all the copies fit in `dense_copy_mb` (layer.DenseCopyLayer). On
    CPU the weights then move onto huge pages (huge_pages.py).
    """
    fast = fast_kernels_apply(device, dtype, kernels)
    # weights held by more than one module (a tied embedding's) keep their rows: the others look them up
    holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    plain: list[tuple[str, nn.Module, str]] = []  # (name, parent, child's name) of each plain Linear
    for name, module in model.named_modules():
        if isinstance(module, KernelLayer):
            module.use_kernel = kernels == "fast"
        plain += [(name, module, child_name) for child_name, c in module.named_children() if type(c) is nn.Linear]
    # the Linears themselves are not listed, so that a packed layer's rows are freed as it is swapped, and handed back
    # to the system every TRIM_BYTES (glibc keeps them in its heaps): else every bf16 weight existed twice at load's
    # peak (seen on SmolLM2-360M: 1.6 GiB for 1.0 GiB steady)
    swapped, packed = [], 0
    for name, module, child_name in plain if fast else []:
        weight = getattr(module, child_name).weight
        layer = GemvLinear(getattr(module, child_name), pack=holders[id(weight)] == 1)
        setattr(module, child_name, layer)
        swapped.append(f"{name}.{child_name}" if name else child_name)
        packed += weight.nbytes if layer.packed() else 0
        if packed >= TRIM_BYTES:
            return_freed_memory()
            packed = 0
    if kernels == "fast" and dense_copy_mb:
        keep_dense_copies(model, dtype, dense_copy_mb, device)
    if kernels == "fast" and device.type == "cpu":
        moved = move_weights_to_huge_pages(model)
        log.info("weights on huge pages: %.1f MiB", moved / 2**20)
    return swapped


def keep_dense_copies(
    model: nn.Module, dtype: torch.dtype, budget_mb: float, device: torch.device = torch.device("cpu")
) -> int:
    """Dequantized copies of every quantized layer whose copy pays here (layer.DenseCopyLayer), when they all fit in
    `budget_mb`; return their bytes."""
    layers = {id(m): m for m in model.modules() if holds_dense_copy(m) and m.dense_copy_pays(dtype)}.values()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    need = sum(m.out_features * m.in_features for m in layers) * itemsize
    if not layers or need > budget_mb * 2**20:
        if layers:
            log.info(
                "no dense copies of the quantized layers: %.0f MiB > device.dense_copy_mb=%g", need / 2**20, budget_mb
            )
        return 0
    # one arena of fresh (huge) pages for every copy, each a view at a 64-byte boundary: the weights' move to huge
    # pages leaves views where they are, and no copy rounds up to a page of its own
    sizes = [-(-m.out_features * m.in_features * itemsize // 64) * 64 for m in layers]
    arena = zeros_on_huge_pages((sum(sizes),), torch.uint8, device)
    offset, kept = 0, 0
    for m, size in zip(layers, sizes):
        view = arena[offset : offset + m.out_features * m.in_features * itemsize]
        kept += m.keep_dense_copy(view.view(dtype).view(m.out_features, m.in_features))
        offset += size
    log.info("dense copies of the quantized layers for many-row steps: %.1f MiB", kept / 2**20)
    return kept
