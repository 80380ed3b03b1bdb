"""The whole forward step in one C++ call (csrc/decode_step.cpp), where every layer can run on the CPU kernels.

The Python model makes ~35 tensor-op calls per layer and token; on a 2-core CPU their dispatch alone
is ~7 ms of a 20-40 ms step. `FusedDecode` hands the model's weights to a C++ plan once, at load, and
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

# Token rows one step takes at most (many_rows_limit may choose fewer). The kernels take any number; the bound keeps a step's fp32 activation buffers
# (~6 KiB per row per hidden unit of the MLP: ~20 MiB at SmolLM2's 1536) and its latency in check, and is
# above any prompt chunk the schedulers make (scheduler.max_batched_tokens).
FUSED_MAX_ROWS = 2048
# On the amx build, a step of many sequences stays fused beyond many_rows_limit while its sequences bring at most this
# many rows each on average (prompt chunks of up to 128 tokens, decodes): the Python model attends sequence by sequence
# (~3-4 ms a sequence over SmolLM2's 30 layers), which costs it more than oneDNN's GEMM gains; a long chunk's rows,
# each attending its own keys in the plan, go to the Python model (its SDPA). SmolLM2 int4 on the AMX Xeon, one step of
# S sequences x R new rows after a cached prefix of P tokens, the Python model vs fused, ms: P = 112: 16 x 16 162 vs 89,
# 32 x 8 236 vs 92, 8 x 32 139 vs 92, 2 x 100 95 vs 79, 3 x 96 119 vs 104, 2 x 128 104 vs 87, 16 decodes + a 240-row
# chunk 114 vs 110; P = 16 (a burst of new prompts): 16 x 16 144 vs 73, 2 x 128 102-112 vs 80-83, 3 x 128 150 vs 136,
# 4 x 96 154 vs 130, 4 x 128 146 vs 144, 1 x 256 97 vs 90, 1 x 511 185 vs 225; bf16 and int8 alike (2 x 128: 117 vs
# 83, 117 vs 87; 4 x 128: 169 vs 175, 171 vs 171)
SHORT_CHUNK_ROWS = 128


def projection_parts(linear: nn.Module, with_copy: bool = True) -> list[Tensor] | None:
    """[weight, scales, mins, bias, dense copy] as the C++ plan takes a projection (absent parts empty; the copy: a
    DenseCopyLayer's bf16 one, with `with_copy`), or None when this layer does not run on the gemv kernel."""
    weights = linear.kernel_weights() if isinstance(linear, KernelLayer) else None
    if weights is None or linear.in_features % GEMV_K_STEP or linear.in_features > GEMV_MAX_K:
        return None
    copy = bf16_copy(linear) if with_copy else None
    return [*weights.parts(), copy.detach() if copy is not None else weights.weight.new_empty(0)]


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
    BF16_TILES_MAX_ROWS as well (SmolLM2 int4, prompts of 128 tokens ~1.4x as fast). int4 layers hold copies only on
    AMX CPUs; elsewhere every int4 step runs fused. Measured on SmolLM2 (AVX-512 without AMX, one thread), int4 fused
    against the Python model over dense bf16 copies: 16 rows 25-34 vs 56-64 ms, 32 rows 56-84 vs 92 ms, 64 rows
    98-134 vs 117-128 ms; batch-1 prompts of 128 tokens 450-570 vs 500-510 tok/s, of 512 420-430 vs 480-530
    (oneDNN's GEMM multiplies ~1.3x faster per row than the int16-code kernel; the copies cost 256 MiB). Without AMX
    bf16 weights stay on the fused step though oneDNN is faster there too (361 vs 584, 307 vs 545): its fp32
    activations kept mixed steps within the real-model tolerance then, the bf16 Python model did not (on the AMX Xeon
    the real-model mixed-step test passes with the Python model beyond 32 rows); fp32 354 vs 330, 318 vs 321."""
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
        # by up to 2^-9) were the bf16 step's largest error of its own (SmolLM2 bf16 against fp32, teacher-forced
        # over 62 positions: mean 1 - cosine 1.58e-4 -> 1.31e-4, worst cosine 0.99831 -> 0.99866)
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
