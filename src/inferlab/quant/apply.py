"""quantize_model: swap a decoder's nn.Linear layers for quantized ones in place, and say what changed.

The decoder's Linears get the asked format; "gguf" keeps a GGUF file's own blocks (quant/gguf_linear.py) for every
Linear the file stores in a block format the kernels read, each part in its own. The LM head gets int8 in both modes: it is the layer
perplexity is most sensitive to (llama.cpp's 4-bit files keep it at 6-8 bits; this model's GGUF keeps
the tied embedding at Q8_0). A tied embedding then looks its rows up in the head's int8 matrix, so
the two still share one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from inferlab.errors import QuantizationError
from inferlab.kernels.aten import int8_kernel_fits
from inferlab.kernels.build import cpu_gemv_available
from inferlab.model.gguf_loader import EMBEDDING, linear_reader
from inferlab.native_memory import return_freed_memory
from inferlab.quant.gguf_embedding import GGUFEmbedding, read_gguf_embedding
from inferlab.quant.gguf_linear import GGUFBlockLinear, read_block_linears
from inferlab.quant.gguf_q4 import Q4_1_GROUP, read_q4_1_linears
from inferlab.quant.int4 import Int4GroupLinear, check_group_size
from inferlab.quant.int8 import Int8Embedding, Int8Linear

MODES = ("int8", "int4", "gguf")
QUANTIZED = (Int8Linear, Int4GroupLinear, Int8Embedding, GGUFBlockLinear, GGUFEmbedding)
HEAD = "output"


@dataclass
class LayerQuant:
    name: str
    format: str  # "int8" | "int4" | "gguf:<its parts' block types>" ("gguf:Q4_K+Q6_K")
    source: str  # "quantized" (from the float weights) | "gguf_q4_1" | "gguf_blocks" (the file's blocks, as they are)
    kernel: str  # "gemv" (kernels/csrc) | "int8pack" | "cpu" | "cuda" (int4pack) | "rows" (dequantize-then-linear)
    bytes_before: int
    bytes_after: int


@dataclass
class QuantReport:
    mode: str
    group_size: int | None
    layers: list[LayerQuant] = field(default_factory=list)
    bytes_before: int = 0  # all weights of the model, each shared tensor counted once
    bytes_after: int = 0

    def summary(self) -> str:
        sources = sorted({layer.source for layer in self.layers})
        kernels = sorted({layer.kernel for layer in self.layers})
        return (
            f"{self.mode}{f' g={self.group_size}' if self.group_size else ''}: {len(self.layers)} Linears "
            f"(from {', '.join(sources)}; kernels {', '.join(kernels)}), weights "
            f"{self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB"
        )


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the state dict, each tensor once (tied weights are shared, not doubled). Counted per tensor,
    not per storage: on huge pages every weight is a view of one arena (kernels/huge_pages.py)."""
    seen: dict[int, int] = {}
    for tensor in model.state_dict().values():
        seen[tensor.data_ptr()] = max(seen.get(tensor.data_ptr(), 0), tensor.nbytes)
    return sum(seen.values())


def dense_copy_bytes(model: nn.Module) -> int:
    """Bytes of the dequantized copies quantized layers keep for many-row steps (kernels/layer.py: DenseCopyLayer):
    memory beside the weights that a decode step does not read."""
    return sum(m.dense.nbytes for m in model.modules() if getattr(m, "dense", None) is not None)


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's state dict: what a product with its weights reads."""
    return sum(t.nbytes for t in module.state_dict().values())


def _kernel(module: nn.Module) -> str:
    """The kernel a decode step runs: gemv (kernels/csrc), int8pack, aten's int4pack "cpu" / "cuda", or "rows"
    (the dequantize-then-linear reference)."""
    device = next(module.buffers()).device
    if module.kernel_weights() is not None and device.type == "cpu" and cpu_gemv_available():
        return "gemv"
    if isinstance(module, Int4GroupLinear):
        return module.layout
    if isinstance(module, GGUFBlockLinear):
        return "rows"
    return "int8pack" if module.use_kernel and int8_kernel_fits(device, module.scales.dtype) else "rows"


def quantize_model(
    model: nn.Module,
    mode: str,
    group_size: int | None = None,
    gguf_path: Path | None = None,
    stand_ins: list[str] | None = None,
    use_kernel: bool = True,
) -> QuantReport:
    """Quantize in place; with `gguf_path`, int4 at group size 32 imports the file's Q4_1 blocks losslessly, and
    the `stand_ins` the loader left unread (gguf_loader.load_gguf's defer_linears) are read from it one at a time;
    "gguf" imports every decoder Linear the file keeps in a block format the kernels read (the others, float in the
    file, stay float).

    `group_size` applies to int4 only (None -> 64). Checks every layer before changing any, so a refused
    model is left as it was.
    """
    if mode not in MODES:
        raise QuantizationError(f"unknown quantization {mode!r}; use one of {list(MODES)}")
    if any(isinstance(m, QUANTIZED) for m in model.modules()):
        raise QuantizationError("the model is already quantized; load it again to quantize another way")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if not linears:
        raise QuantizationError(
            "the model has no nn.Linear layers to quantize (quantize before swapping in other kernels)"
        )
    if mode == "int4":
        group_size = group_size or 64
        for name, linear in linears.items():
            if name != HEAD:
                try:
                    check_group_size(group_size, linear.in_features)
                except QuantizationError as e:
                    raise QuantizationError(f"{name}: {e}") from None
    else:
        group_size = None
    if mode == "gguf" and gguf_path is None:
        raise QuantizationError("precision=gguf serves a GGUF file's own blocks; this model was not loaded from one")
    imported: dict = {}
    if gguf_path and mode == "int4" and group_size == Q4_1_GROUP:
        imported = read_q4_1_linears(gguf_path, model.config)
    elif gguf_path and mode == "gguf":
        imported = read_block_linears(gguf_path, model.config)
    deferred = set(stand_ins or ()) - set(imported) - {EMBEDDING}
    if deferred and gguf_path is None:
        raise QuantizationError(f"{sorted(deferred)[0]}: a stand-in weight without its GGUF file to read it from")
    read = linear_reader(gguf_path, model.config, model.tok_embeddings.weight.dtype) if deferred and gguf_path else None

    report = QuantReport(mode, group_size, bytes_before=weight_bytes(model))
    if EMBEDDING in (stand_ins or ()) and gguf_path is not None:  # an untied embedding: the file's blocks as they are
        weight = model.tok_embeddings.weight
        model.tok_embeddings = read_gguf_embedding(gguf_path, weight.dtype, weight.device)
    # each float layer goes as soon as its quantized one is in (popped, not kept to the end), its memory handed back
    # at once (malloc keeps freed tensors below its mmap threshold resident, which would raise the load's peak),
    # and the head first: a tied embedding's float matrix (49152 x 576) never coexists with the quantized decoder
    for name in sorted(linears, key=lambda n: n != HEAD):
        linear = linears.pop(name)
        if read is not None and name in deferred:  # this layer's floats, read now and gone once it is quantized
            linear.weight = nn.Parameter(read(name), requires_grad=False)
        if name == HEAD or mode == "int8":
            new: nn.Module = Int8Linear(linear, use_kernel=use_kernel, logit_head=name == HEAD)
        elif mode == "gguf":
            if name not in imported:  # float in the file: stays as it is
                continue
            new = GGUFBlockLinear(linear, imported[name](), use_kernel=use_kernel)
        else:
            codes = imported[name]() if name in imported else None  # one layer's codes at a time
            new = Int4GroupLinear(linear, group_size, use_kernel=use_kernel, codes=codes)
        report.layers.append(
            LayerQuant(
                name,
                _format(new),
                ("gguf_blocks" if mode == "gguf" else "gguf_q4_1") if name in imported else "quantized",
                _kernel(new),
                module_bytes(linear),
                module_bytes(new),
            )
        )
        _set_submodule(model, name, new)
        if name == HEAD and linear.weight is getattr(getattr(model, "tok_embeddings", None), "weight", None):
            model.tok_embeddings = Int8Embedding(new)
        del linear
        return_freed_memory()
    report.bytes_after = weight_bytes(model)
    return report


def _format(module: nn.Module) -> str:
    if isinstance(module, GGUFBlockLinear):
        return "gguf:" + "+".join(module.kinds)
    return "int8" if isinstance(module, Int8Linear) else "int4"


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
