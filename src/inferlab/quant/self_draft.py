"""A model's own weights at fewer bits, as a draft for speculative decoding (spec=self): nothing to train.

On a CPU a decode step costs about the bytes of weights it reads, so a copy of the target at int4 (or
int8) drafts as many times faster than the target verifies as it reads fewer bytes, and it agrees with the target
on most tokens. The copy is a second module tree that shares every tensor it does not requantize with the target (norms,
rope tables, an embedding that is only looked up, an LM head already at int8): the float weights are
never held twice. Its decoder Linears are quantized like precision=int4|int8 quantizes them (int4 in
groups of 32, so a GGUF's Q4_1 blocks import as they are; the LM head at int8, a tied embedding reading
the head's int8 rows).

The LM head is a large share of what a small model's draft reads per token (SmolLM2-135M: 49,152 x 576, 28 MB
at int8 of its int4 draft's ~108 MB). A draft only has to propose tokens the target will likely keep, so
`spec.draft_vocab` keeps the head's first N ids only: BPE ids follow the merge order, so the first ones are the
common tokens. It stays lossless, the target verifies every proposal: at temperature 0 the draft proposes its
argmax over the N ids, at T > 0 its distribution is over them and zero elsewhere, which the rejection rule
handles (a token it never proposes is reached through the residual max(0, p - q) = p there). It is off by
default (conf/spec/self.yaml): a chat answer uses enough later ids that their rejections cost more than the
smaller head saves.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from inferlab.errors import QuantizationError
from inferlab.model.transformer import Transformer
from inferlab.quant.gguf_linear import GGUFBlockLinear
from inferlab.quant.gguf_q4 import Q4_1_GROUP, read_q4_1_linears
from inferlab.quant.int4 import Int4GroupLinear
from inferlab.quant.int8 import Int8Embedding, Int8Linear

DRAFT_PRECISIONS = ("int4", "int8")
# gguf: a K-quant file's blocks, already as small as an int4 draft's (Q4_K 4.5 bits a weight, Q4_0 4.5)
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5, "gguf": 0.5}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def weight_format(model: Transformer) -> str:
    """How the decoder's Linears hold their weights: int4 | int8 | gguf | fp32 | bf16 | fp16."""
    layer = model.layers[0].feed_forward.w2
    if isinstance(layer, Int4GroupLinear):
        return "int4"
    if isinstance(layer, GGUFBlockLinear):
        return "gguf"
    if isinstance(layer, Int8Linear):
        return "int8"
    return DTYPE_NAMES[layer.weight.dtype]


def check_draft_precision(target: Transformer, draft_precision: str) -> None:
    """Refuse a draft that would read as many bytes per step as the target: it could not pay."""
    if draft_precision not in DRAFT_PRECISIONS:
        raise QuantizationError(f"spec.draft_precision={draft_precision!r}; use one of {list(DRAFT_PRECISIONS)}")
    target_format = weight_format(target)
    if BYTES_PER_WEIGHT[draft_precision] >= BYTES_PER_WEIGHT[target_format]:
        smaller = [p for p in DRAFT_PRECISIONS if BYTES_PER_WEIGHT[p] < BYTES_PER_WEIGHT[target_format]]
        fix = f"use spec.draft_precision={smaller[0]}" if smaller else "use a float or int8 target, or spec=ngram"
        raise QuantizationError(
            f"spec=self: an {draft_precision} draft reads no fewer bytes than this {target_format} target; {fix}"
        )


def self_draft(
    target: Transformer, draft_precision: str, gguf_path: Path | None = None, draft_vocab: int = 0
) -> Transformer:
    """The target's weights at `draft_precision` as a second model sharing everything else with it.

    `gguf_path`: the file the target came from; an int4 draft imports its Q4_1 blocks instead of
    requantizing the (dequantized) float weights. `draft_vocab` (0: all): the draft's LM head holds only the
    first that many ids of the vocabulary (its logits are theirs), see draft_head.
    """
    check_draft_precision(target, draft_precision)
    head = target.output
    rows = draft_vocab if 0 < draft_vocab < target.config.vocab_size else target.config.vocab_size
    whole = rows == target.config.vocab_size
    shared: dict[int, object] = {id(t): t for t in (*target.parameters(), *target.buffers())}
    if isinstance(head, Int8Linear):  # already what a draft's head is: share the modules themselves
        shared.update({id(head): head, id(target.tok_embeddings): target.tok_embeddings})
    draft = copy.deepcopy(target, shared)  # new modules, the same tensors
    imported = read_q4_1_linears(gguf_path, target.config) if gguf_path and draft_precision == "int4" else {}
    for name, layer in list(target.named_modules()):
        if not hasattr(layer, "in_features") or layer is head:
            continue  # not a Linear, or the head (below; a tied int8 one is also named tok_embeddings.head)
        if draft_precision == "int8":
            new: nn.Module = Int8Linear(float_linear(layer))
        else:
            new = Int4GroupLinear(float_linear(layer), Q4_1_GROUP, codes=imported[name]() if name in imported else None)
        draft.set_submodule(name, new)
    if not (isinstance(head, Int8Linear) and whole):  # else the target's int8 head itself
        draft.output = Int8Linear(first_rows(float_linear(head), rows), logit_head=True)
        if whole and head.weight is getattr(target.tok_embeddings, "weight", None):
            draft.tok_embeddings = Int8Embedding(draft.output)  # else the target's own embedding, shared
    return draft.eval()


def first_rows(linear: nn.Module, rows: int) -> nn.Module:
    """`linear` itself, or a Linear of its first `rows` outputs viewing its weight (transient: quantized next)."""
    if rows == linear.out_features:
        return linear
    part = nn.Linear(linear.in_features, rows, bias=linear.bias is not None, device="meta")
    part.weight = nn.Parameter(linear.weight[:rows], requires_grad=False)
    if linear.bias is not None:
        part.bias = nn.Parameter(linear.bias[:rows], requires_grad=False)
    return part


def float_linear(layer: nn.Module) -> nn.Module:
    """`layer` with a float `weight` to quantize from: itself, or an int8 layer's dequantized copy (transient)."""
    if not isinstance(layer, Int8Linear):
        return layer
    dense = nn.Linear(
        layer.in_features,
        layer.out_features,
        bias=layer.bias is not None,
        device=layer.weight.device,
        dtype=layer.scales.dtype,
    )
    with torch.no_grad():
        dense.weight.copy_(layer.dequantize())
        if layer.bias is not None:
            dense.bias.copy_(layer.bias)
    return dense
