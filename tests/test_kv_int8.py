"""INT8 KV cache (cache.kv_dtype=int8): int8 codes plus one fp32 scale per (token, kv head) row, held to a
dequantize-then-attend reference: the Python gather path, the decode_attention kernel and the fused decode
step (each kernel build this CPU runs: the `isa` fixture); and the memory it saves."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config, tiny_engine

from inferlab.api import load_engine
from inferlab.bench.studies.kv_memory import agreement, teacher_forced
from inferlab.engine.kv.contiguous import compute_kv_cache_bytes
from inferlab.engine.kv.int8 import dequantize_rows, quantize_rows
from inferlab.engine.kv.paged import PagedKVCache, blocks_for_budget
from inferlab.errors import InvalidRequestError
from inferlab.kernels.attention import decode_attention
from inferlab.kernels.build import cpu_gemv_available
from inferlab.kernels.gemv import GEMV_MAX_ROWS
from inferlab.model.transformer import PLAIN, AttentionSpan

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(not cpu_gemv_available(), reason="no AVX2 CPU or no C++ toolchain here")
MODEL = dict(dim=96, n_heads=6, n_kv_heads=2)  # head_dim 16, GQA groups of 3


def fake_quantized(x: torch.Tensor) -> torch.Tensor:
    return dequantize_rows(*quantize_rows(x), x.dtype)


def fake_quantized_attend(layer_idx: int, q, k, v, span: AttentionSpan = PLAIN):
    """The reference: no cache, every key and value rounded through int8 codes, causal attention over all."""
    return F.scaled_dot_product_attention(
        q, fake_quantized(k), fake_quantized(v), is_causal=q.shape[2] > 1, enable_gqa=True
    )


def test_quantized_rows_keep_their_largest_value_and_stay_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * torch.rand(5, 3, 1) * 10
    x[0, 0] = 0
    codes, scales = quantize_rows(x)
    assert codes.dtype == torch.int8 and scales.shape == (5, 3) and codes.abs().max() <= 127
    back = dequantize_rows(codes, scales, torch.float32)
    assert ((back - x).abs() <= scales[..., None] / 2 * (1 + 1e-6)).all()
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6)
    assert scales[0, 0] == 0 and (back[0, 0] == 0).all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [640, 16])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)])
def test_decode_attention_on_int8_pools_equals_dequantize_then_attend(isa, dtype, block_size, heads):
    """The kernel writes each sequence's new row as quantize_rows does (the same codes and scales), and
    attends as SDPA over the dequantized pool does."""
    torch.manual_seed(block_size)
    (n_heads, n_kv_heads), head_dim, lengths = heads, 64, [1, 8, 77, 600]
    per_sequence = -(-640 // block_size)
    shape = (1 + 4 * per_sequence, n_kv_heads, block_size, head_dim)
    k_pool, v_pool = (torch.randint(-127, 128, shape, dtype=torch.int8) for _ in range(2))
    k_scales, v_scales = (torch.rand(shape[:-1]) / 20 for _ in range(2))
    tables = torch.randperm(4 * per_sequence).add(1).view(4, per_sequence)  # block 0 belongs to nobody
    q = torch.randn(4, n_heads, 1, head_dim).to(dtype)
    k, v = (torch.randn(4, n_kv_heads, 1, head_dim).to(dtype) for _ in range(2))
    untouched = k_pool[0].clone(), k_scales[0].clone()
    out = decode_attention(q, k, v, k_pool, v_pool, tables, torch.tensor(lengths) - 1, k_scales, v_scales)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.equal(k_pool[0], untouched[0]) and torch.equal(k_scales[0], untouched[1])
    for b, length in enumerate(lengths):
        keys, values = (
            dequantize_rows(gather(pool, tables[b], length), gather(scales, tables[b], length), torch.float64)
            for pool, scales in ((k_pool, k_scales), (v_pool, v_scales))
        )  # (H_kv, length, D), in position order
        for pool, scales, new in ((k_pool, k_scales, k), (v_pool, v_scales, v)):
            codes, row_scales = quantize_rows(new[b, :, 0])
            last = gather(pool, tables[b], length)[:, -1], gather(scales, tables[b], length)[:, -1]
            assert torch.equal(last[0], codes) and torch.equal(last[1], row_scales)
        expected = F.scaled_dot_product_attention(q[b : b + 1].double(), keys[None], values[None], enable_gqa=True)
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        assert (out[b : b + 1].double() - expected).abs().max() <= tolerance * 3


def gather(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` rows of a pool (blocks, H_kv, bs, ...): (H_kv, length, ...)."""
    blocks = pool[table].transpose(0, 1)  # (H_kv, n, bs, ...)
    return blocks.reshape(blocks.shape[0], -1, *blocks.shape[3:])[:, :length]


def check_against_fake_quantized_recompute(engine) -> None:
    """A 41-token prompt, a 7-token chunk after it (the gather path over int8 blocks), 16 decode steps:
    each step's logits equal a full recompute with fake-quantized k/v, within fp32 summation noise."""
    assert engine.paged.k.dtype == torch.int8 and engine.paged.k_scale is not None
    tokens = list(range(20, 61))
    logits, seq = engine.prefill(tokens)
    chunk = list(range(70, 77))
    for step in range(17):
        expected = engine.model(torch.tensor([tokens]), torch.arange(len(tokens))[None], fake_quantized_attend)[0, -1]
        assert (logits.float() - expected).abs().max() <= 1e-4, step
        new = chunk if step == 0 else [int(expected.argmax())]
        tokens += new
        logits = seq.forward(new)
    seq.release()


def test_int8_kv_python_path_equals_fake_quantized_recompute(tiny_tokenizer):
    check_against_fake_quantized_recompute(
        tiny_engine(tiny_tokenizer, "paged", kernels="portable", kv_dtype=torch.int8, **MODEL)
    )


@needs_kernels
def test_int8_kv_fused_decode_step_equals_fake_quantized_recompute(isa, tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, "paged", kernels="fast", kv_dtype=torch.int8, **MODEL)
    assert engine.fused is not None and engine.paged.decode_kernel
    check_against_fake_quantized_recompute(engine)


@needs_kernels
@pytest.mark.parametrize("kernels", ["portable", "fast"])
def test_int8_kv_engine_loop_batches_as_it_runs_alone(isa, tiny_tokenizer, kernels):
    """More sequences than the fused step takes (the decode_attention kernel on the int8 pool), prompts of
    different lengths: each batched completion equals the same prompt run alone; no block is left held."""
    engine = tiny_engine(tiny_tokenizer, "paged", kernels=kernels, kv_dtype=torch.int8, **MODEL)
    prompts = [list(range(30 + i, 40 + 3 * i)) for i in range(GEMV_MAX_ROWS + 2)]
    batched = engine.generate_batch(prompts, max_new_tokens=8)
    alone = [engine.generate(p, max_new_tokens=8).token_ids for p in prompts]
    assert [c.token_ids for c in batched] == alone
    assert engine.stats()["kv_blocks_used"] == 0


def test_int8_pool_holds_about_twice_the_bf16_blocks_in_the_same_budget():
    config = tiny_config(dim=256, n_heads=4, n_kv_heads=2, n_layers=3)  # head_dim 64, as SmolLM2's
    per_token = 2 * 3 * 2 * (64 + 4)  # codes and one fp32 scale per (layer, k/v, kv head)
    assert compute_kv_cache_bytes(config, 2, 10, torch.int8) == 2 * 10 * per_token
    int8_blocks = blocks_for_budget(config, 1, 16, torch.int8)
    assert int8_blocks == 2**20 // (16 * per_token)
    assert int8_blocks >= 1.85 * blocks_for_budget(config, 1, 16, torch.bfloat16)
    assert int8_blocks >= 3.7 * blocks_for_budget(config, 1, 16, torch.float32)
    cache = PagedKVCache.allocate(config, int8_blocks, 16, torch.int8, CPU)
    assert cache.nbytes == compute_kv_cache_bytes(config, int8_blocks, 16, torch.int8) <= 2**20


def test_engine_says_and_measures_its_int8_kv(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, "paged", kv_dtype=torch.int8, **MODEL)
    assert "in int8" in engine.describe()
    block_bytes = compute_kv_cache_bytes(engine.loaded.config, 1, 16, torch.int8)
    assert engine.stats()["kv_bytes_per_block"] == block_bytes == engine.paged.nbytes // engine.paged.num_blocks


def test_agreement_of_logits_counts_equal_argmaxes_and_averages_kl():
    reference = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    other = torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]])  # the second position's pick differs
    top1, kl = agreement(reference, other)
    expected = F.kl_div(F.log_softmax(other, -1), F.log_softmax(reference, -1), log_target=True, reduction="none")
    assert top1 == 0.5 and kl == pytest.approx(expected.sum(-1).mean().item()) and kl > 0
    assert agreement(reference, reference) == (1.0, 0.0)


@pytest.mark.parametrize("kernels", [None, pytest.param("fast", marks=needs_kernels)])
def test_teacher_forced_int8_kv_agrees_with_the_full_precision_kv(tiny_tokenizer, one_thread, kernels):
    """kv_memory's check on a tiny model: the same KV twice agrees at every position with KL 0; int8 KV, whose
    rows are within half a code of the full-precision ones, keeps most picks at a small but nonzero KL."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (48,)).tolist()
    forced = {}
    for name, kv_dtype in [("full", None), ("again", None), ("int8", torch.int8)]:
        engine = tiny_engine(tiny_tokenizer, "paged", kernels=kernels, kv_dtype=kv_dtype, **MODEL)
        forced[name] = teacher_forced(engine, ids, 16)
        assert engine.stats()["kv_blocks_used"] == 0
    assert forced["full"].shape == (32, engine.loaded.config.vocab_size) and forced["full"].dtype == torch.float32
    assert agreement(forced["full"], forced["again"]) == (1.0, 0.0)
    top1, kl = agreement(forced["full"], forced["int8"])
    assert 0.9 <= top1 <= 1 and 0 < kl < 1e-3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"cache": "contiguous", "cache.kv_dtype": "int8"}, "cache.kv_dtype=int8 needs cache=paged"),
        ({"cache.kv_dtype": "fp8"}, "cache.kv_dtype must be auto or int8"),
    ],
)
def test_int8_kv_is_refused_where_it_does_not_apply(overrides, message):
    with pytest.raises(InvalidRequestError, match=message):
        load_engine(device="cpu", **overrides)
