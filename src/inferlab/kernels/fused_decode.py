"""The whole forward step in one C++ call (csrc/decode_step.cpp), where every layer can run on the CPU kernels.

The Python model makes ~35 tensor-op calls per layer and token; on a small CPU their dispatch alone is a large
share of a decode step. `FusedDecode` hands the model's weights to a C++ plan once, at load, and
then runs each step as one call: a flat batch of up to FUSED_MAX_ROWS token rows, each with its own
position and block table (decode tokens of many sequences and causal prompt chunks, mixed), embeddings
in, the logits of the rows asked for out, every layer's k/v written to the cache on the way. It reads
the cache through block tables, so it serves the contiguous slots (one max_seq_len block per slot) and
the paged pool alike. Longer steps and anything it does not cover (`FusedDecode.build` returns None)
keep the Python model, which is the reference the tests compare it with.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from inferlab.kernels.attention import DECODE_ATTENTION_MAX_HEAD_DIM
from inferlab.kernels.build import active_isa, fast_kernels_apply, kernel_classes
from inferlab.kernels.gemv import BF16_KERNEL_MAX_ROWS, BF16_TILES_MAX_ROWS, GEMV_K_STEP, GEMV_MAX_K, GemvLinear
from inferlab.kernels.isa import amx_bf16_usable
from inferlab.kernels.layer import KernelLayer, holds_dense_copy
from inferlab.model.transformer import Transformer, rope_tables

# Token rows one step takes at most (many_rows_limit may choose fewer). The kernels take any number; the bound keeps a
# step's fp32 activation buffers (~6 KiB per row per hidden unit of the MLP) and its latency in check, and is above any
# prompt chunk the schedulers make (scheduler.max_batched_tokens).
FUSED_MAX_ROWS = 2048
# On the amx build, a step of many sequences stays fused beyond many_rows_limit while its sequences bring at most this
# many rows each on average (prompt chunks of up to 128 tokens, decodes): the Python model attends sequence by sequence
# (every layer, a call per sequence), which costs it more than oneDNN's GEMM gains; a long chunk's rows, each
# attending its own keys in the plan, go to the Python model (its SDPA), where the GEMM's gain outweighs that.
SHORT_CHUNK_ROWS = 128


def projection_parts(linear: nn.Module, with_copy: bool = True) -> list[Tensor] | None:
    """[weight, scales, mins, bias, dense copy] as the C++ plan takes a projection (absent parts empty; the copy: a
    DenseCopyLayer's bf16 one, with `with_copy`), once per part of a stacked one (layer.KernelWeights), or None when
    this layer does not run on the gemv kernel."""
    weights = linear.kernel_weights() if isinstance(linear, KernelLayer) else None
    if weights is None or linear.in_features % GEMV_K_STEP or linear.in_features > GEMV_MAX_K:
        return None
    copy = bf16_copy(linear) if with_copy else None
    empty = weights.weight.new_empty(0)
    return [
        tensor
        for part in weights.every_part()
        for tensor in (*part.parts(), copy.detach() if copy is not None and part is weights else empty)
    ]


def bf16_copy(layer: nn.Module) -> Tensor | None:
    """A quantized layer's dense copy where the amx build's plan multiplies it on the tiles (bf16), else None."""
    copy = layer.dense if holds_dense_copy(layer) else None
    return copy if copy is not None and copy.dtype == torch.bfloat16 else None


def many_rows_limit(model: Transformer, isa: str) -> int:
    """FUSED_MAX_ROWS, or the fewest rows up to which a layer holding a dense copy for many rows still takes the
    kernel (layer.DenseCopyLayer's kernel_max_rows: int8 GEMV_MAX_ROWS, on the amx build INT8_TILES_MAX_ROWS, int4
    INT4_KERNEL_MAX_ROWS, on the amx build INT4_KERNEL_MAX_ROWS_AMX; oneDNN's bf16 GEMM over the copies is faster
    beyond; the LM head runs on a step's logit rows only, a few), and for bf16 layers on AMX CPUs
    BF16_KERNEL_MAX_ROWS (the Python model's F.linear runs oneDNN's GEMM on the tiles), or on the `isa` build that
    multiplies bf16 on the tiles itself (amx) BF16_TILES_MAX_ROWS. That build's plan also multiplies a quantized
    layer's bf16 copy on the tiles, beyond the rows its kernel takes (dense_from_rows): such layers stay fused up to
    BF16_TILES_MAX_ROWS as well (their prompts then run on the tiles inside the plan, with no Python model between).
    int4 layers hold copies only on AMX CPUs; elsewhere every int4 step runs fused: without the tiles, oneDNN's GEMM
    over a bf16 copy gains little per row on the int16-code kernel at prompt sizes, loses at a few rows, and the copy
    costs twice the int4 weights' memory. Without AMX, bf16 weights stay on the fused step at any rows: the avx512
    build's bf16 dots over weights in blocks of 16 rows (csrc/gemv.h: Bf16Blocks) run a prompt about as fast as
    oneDNN's GEMM or faster, and the avx2 build,
    slower there, keeps its fp32 activations and residual stream, closer to the fp32 model than the bf16 Python model,
    which rounds its residual stream (with AMX the Python model's tiles keep fp32 sums)."""
    limits = [
        max(m.kernel_max_rows, BF16_TILES_MAX_ROWS) if isa == "amx" and bf16_copy(m) is not None else m.kernel_max_rows
        for m in model.layers.modules()
        if holds_dense_copy(m) and m.dense is not None
    ]
    bf16 = any(isinstance(m, GemvLinear) and m.weight.dtype == torch.bfloat16 for m in model.layers.modules())
    if bf16 and amx_bf16_usable():  # oneDNN's bf16 GEMM on AMX tiles outruns the kernel beyond these rows
        limits.append(BF16_TILES_MAX_ROWS if isa == "amx" else BF16_KERNEL_MAX_ROWS)
    return min(limits, default=FUSED_MAX_ROWS)


def dense_from_rows(model: Transformer) -> int:
    """Rows from which the plan multiplies a decoder layer's dense copy instead of its quantized weights: one past the
    most its kernel takes (DenseCopyLayer's kernel_max_rows), as the Python model does (0: no copies)."""
    copies = [m for m in model.layers.modules() if holds_dense_copy(m) and bf16_copy(m) is not None]
    return min(m.kernel_max_rows for m in copies) + 1 if copies else 0


class FusedDecode:
    """One step of a Transformer over a flat batch of token rows: (tokens (N,), caches, block_tables (N, width),
    positions (N,), logit_rows (R,)) -> logits (R, vocab)."""

    def __init__(self, model: Transformer, plan: torch.ScriptObject, isa: str, max_rows: int = FUSED_MAX_ROWS) -> None:
        self.model, self.plan, self.isa = model, plan, isa  # isa: the kernels' build the plan runs on, for good
        self.max_rows = max_rows  # rows of one step it takes (covers), whatever the step holds
        # beyond max_rows, up to FUSED_MAX_ROWS, a step of at most this many rows per sequence (0: none)
        self.short_chunk_rows = SHORT_CHUNK_ROWS if isa == "amx" and max_rows < FUSED_MAX_ROWS else 0

    @classmethod
    def build(
        cls, model: Transformer, device: torch.device, dtype: torch.dtype, kernels: str, int8_from_rows: int = 0
    ) -> FusedDecode | None:
        """The plan of `model`'s step, or None where it does not run fused. `int8_from_rows`: int4 projections of this
        many rows or more (0: none) take int8 activation codes per block of 32 columns, not int16 ones per row
        (csrc/gemv.h's Int4Format: half the multiply-adds, ten times the logit error; for a speculative draft, whose
        errors cost only acceptance, or precision.activations=int8)."""
        config = model.config
        if (
            not config.llama_layer  # the plan runs exactly the Llama layer: other families keep the Python model
            or not fast_kernels_apply(device, dtype, kernels)
            or config.head_dim % 8
            or config.head_dim > DECODE_ATTENTION_MAX_HEAD_DIM
        ):
            return None
        output = projection_parts(model.output, with_copy=False)  # few rows: a step's logit rows
        layers = [
            [
                projection_parts(linear)
                for linear in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2)
            ]
            for layer in model.layers
        ]
        if output is None or any(parts is None for layer in layers for parts in layer):
            return None
        # The plan rotates q and k in fp32 with fp32 tables, not the model's own in its dtype: bf16 cos/sin (off
        # by up to 2^-9) are the bf16 step's largest error of its own against fp32
        rope_cos, rope_sin = rope_tables(config, torch.device("cpu"))
        plan = kernel_classes().DecodePlan(
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
            config.norm_eps,
            rope_cos,
            rope_sin,
            model.norm.weight.detach(),
            output,
            int8_from_rows,
            dense_from_rows(model),
        )
        for block, (wqkv, wo, w13, w2) in zip(model.layers, layers):
            plan.add_layer(block.attention_norm.weight.detach(), wqkv, wo, block.ffn_norm.weight.detach(), w13, w2)
        isa = active_isa().name
        return cls(model, plan, isa, many_rows_limit(model, isa))

    def covers(self, n_rows: int, sequences: int = 1) -> bool:
        """Whether a step of `n_rows` token rows of `sequences` sequences runs as one call of the plan."""
        short_chunks = n_rows <= min(FUSED_MAX_ROWS, self.short_chunk_rows * sequences)
        return 1 <= n_rows and (n_rows <= self.max_rows or short_chunks)

    def __call__(
        self,
        tokens: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        positions: Tensor,
        k_scales: Tensor | None = None,
        v_scales: Tensor | None = None,
        logit_rows: Tensor | None = None,
    ) -> Tensor:
        """tokens (N,), each at its position (N,) of the sequence whose block table is its row of block_tables
        (N, width); k_cache, v_cache (n_layers, num_blocks, n_kv_heads, block_size, head_dim), int8 codes with
        k_scales, v_scales (n_layers, num_blocks, n_kv_heads, block_size) fp32. Every row's k/v is written before
        any row attends, and each attends over its table up to its own position. Returns the logits (R, vocab) of
        the rows in logit_rows (int64 (R,); None: all N rows; empty: none), the LM head run for those only.
        """
        x = self.model.tok_embeddings(tokens)  # (N, dim)
        return self.plan.step(x, k_cache, v_cache, block_tables, positions, k_scales, v_scales, logit_rows)  # type: ignore[attr-defined]

    def extend(
        self,
        token_ids: list[int],
        k_cache: Tensor,
        v_cache: Tensor,
        block_table: Tensor,
        start: int,
        last_only: bool = False,
    ) -> Tensor:
        """n <= FUSED_MAX_ROWS new tokens of ONE sequence at positions start.. as the n rows of one step -> logits
        (n, vocab), or (1, vocab) of the last with `last_only`: the causal forward of the n tokens (a prompt, a
        speculative verification)."""
        n = len(token_ids)
        device = k_cache.device
        tokens = torch.tensor(token_ids, device=device)
        positions = torch.arange(start, start + n, device=device)
        last = torch.tensor([n - 1], device=device) if last_only else None
        return self(tokens, k_cache, v_cache, block_table.expand(n, -1), positions, logit_rows=last)
