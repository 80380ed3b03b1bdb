"""The whole decode step as one C++ call (kernels/fused_decode.py) against the Python model it stands in for."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_engine, tiny_model

from inferlab.engine.kv.block_manager import BlockManager, BlockTable
from inferlab.engine.kv.paged import PagedKVCache
from inferlab.engine.model_runner import FlatBatch, Segment, SlotRunner, forward_flat, forward_paged
from inferlab.kernels.build import cpu_gemv_available
from inferlab.kernels.fused_decode import FUSED_MAX_ROWS, SHORT_CHUNK_ROWS, FusedDecode, many_rows_limit
from inferlab.kernels.gemv import (
    BF16_KERNEL_MAX_ROWS,
    BF16_TILES_MAX_ROWS,
    GEMV_MAX_ROWS,
    INT4_KERNEL_MAX_ROWS,
    INT8_TILES_MAX_ROWS,
)
from inferlab.kernels.select import keep_dense_copies

pytestmark = pytest.mark.skipif(not cpu_gemv_available(), reason="no AVX2 CPU or no C++ toolchain here")

CPU = torch.device("cpu")


def count_decode_forwards(engine) -> list[int]:
    """Record the Python model's single-token forwards: the fused step must leave none."""
    calls: list[int] = []
    forward = engine.model.forward

    def counting(tokens, *args, **kwargs):
        if tokens.shape[1] == 1:
            calls.append(tokens.shape[0])
        return forward(tokens, *args, **kwargs)

    engine.model.forward = counting
    return calls


@pytest.mark.parametrize("cache_mode", ["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_fused_decode_matches_the_python_model(isa, tiny_tokenizer, cache_mode, dtype, quant):
    """Prefill (Python model) then 30 decode steps (one C++ call each) vs the portable engine, teacher-forced:
    fp32 within summation-order noise; bf16 and the integer formats (int16 activation codes, fp32 residual
    stream) by cosine and the greedy token."""
    kwargs = dict(dtype=dtype, quant=quant, dim=96, n_heads=6, n_kv_heads=2, qkv_bias=True)  # GQA groups of 3, biases
    reference = tiny_engine(tiny_tokenizer, cache_mode, kernels="portable", **kwargs)
    fast = tiny_engine(tiny_tokenizer, cache_mode, kernels="fast", **kwargs)
    assert reference.fused is None and fast.fused is not None
    python_decodes = count_decode_forwards(fast)
    prompt = list(range(20, 61))  # 41 tokens: the paged sequence crosses into its fourth 16-token block
    ref_logits, ref_seq = reference.prefill(prompt)
    fast_logits, fast_seq = fast.prefill(prompt)
    for step in range(30):
        expected, got = ref_logits.float(), fast_logits.float()
        assert got.shape == expected.shape and fast_logits.dtype == ref_logits.dtype
        if dtype == torch.float32 and quant is None:
            assert (expected - got).abs().max() <= 1e-4, step
            assert int(expected.argmax()) == int(got.argmax()), step
        else:  # the same greedy token, but for a near-tie at the precision's resolution
            assert F.cosine_similarity(expected, got, dim=0) >= 0.999, step
            assert expected[got.argmax()] >= expected.max() - 0.05, step
        token = int(expected.argmax())
        ref_logits, fast_logits = reference.decode_step(token, ref_seq), fast.decode_step(token, fast_seq)
    assert python_decodes == []
    ref_seq.release()
    fast_seq.release()


def test_batched_paged_decode_of_sequences_of_different_lengths(isa, tiny_tokenizer):
    """Several sequences, each at its own position in its own scattered blocks, in one call: the
    same logits and the same cache contents as the Python model over the same block tables."""
    engine = tiny_engine(tiny_tokenizer, "paged", kernels="fast")
    model, fused = engine.model, engine.fused
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 33, 2, 9, 1, 25)]  # 7: two dot calls of 4 and 3 rows
    caches = {name: PagedKVCache.allocate(model.config, 64, 8, torch.float32, CPU) for name in ("python", "fused")}
    blocks = BlockManager(64, 8, block_bytes=1)
    blocks.free_ids.reverse()  # hand blocks out in an order unlike the sequences' positions
    tables = [BlockTable() for _ in prompts]
    for table, prompt in zip(tables, prompts):
        assert blocks.allocate(table, prompt, len(prompt) + 13)
        for cache in caches.values():
            forward_paged(model, cache, [prompt], [0], [table.blocks])
        blocks.advance(table, prompt, len(prompt))
    tokens = [list(p) for p in prompts]
    for step in range(12):
        nxt = [(7 * step + 31 * b) % 250 for b in range(len(prompts))]
        starts = [t.num_computed for t in tables]
        expected = forward_paged(model, caches["python"], [[t] for t in nxt], starts, [t.blocks for t in tables])
        got = forward_paged(model, caches["fused"], [[t] for t in nxt], starts, [t.blocks for t in tables], fused)
        assert (expected - got).abs().max() <= 1e-4, step
        for table, seq_tokens, token in zip(tables, tokens, nxt):
            seq_tokens.append(token)
            blocks.advance(table, seq_tokens, 1)
    assert (caches["python"].k - caches["fused"].k).abs().max() <= 1e-5
    assert (caches["python"].v - caches["fused"].v).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("dtype", "quant"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8"), (torch.float32, "int4")],
)
def test_a_mixed_step_of_decodes_and_prompt_chunks_equals_per_sequence_forwards(isa, tiny_tokenizer, dtype, quant):
    """One flat call: three sequences' decode tokens, a prompt chunk of a fourth (continuing its prompt) and the
    first chunk of a new one, rows interleaved, in scattered paged blocks. The logits of the rows asked for
    (each sequence's last, and one inside a chunk) match the portable Python model's forward of each sequence
    alone, and equal to the bit the fused step's own per-sequence calls (batch invariance), caches too."""
    kwargs = dict(dtype=dtype, quant=quant, dim=96, n_heads=6, n_kv_heads=2, qkv_bias=True)
    model = tiny_engine(tiny_tokenizer, "paged", kernels="portable", **kwargs).model
    fused = tiny_engine(tiny_tokenizer, "paged", kernels="fast", **kwargs).fused
    caches = {name: PagedKVCache.allocate(model.config, 64, 8, dtype, CPU) for name in ("python", "mixed", "alone")}
    blocks = BlockManager(64, 8, block_bytes=1)
    blocks.free_ids.reverse()
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9, 33, 0)]
    feeds = [[40], [41], [42], [(11 * i) % 250 for i in range(11)], [(7 * i + 3) % 250 for i in range(20)]]
    tables = [BlockTable() for _ in prompts]
    for table, prompt, feed in zip(tables, prompts, feeds):
        assert blocks.allocate(table, prompt, len(prompt) + len(feed))
        if prompt:
            for cache in caches.values():
                forward_paged(model, cache, [prompt], [0], [table.blocks])
    order = [(3, 0), (0, 0), *((4, i) for i in range(20)), (1, 0), *((3, i) for i in range(1, 11)), (2, 0)]
    width = max(len(t.blocks) for t in tables)
    padded = [t.blocks + [t.blocks[0]] * (width - len(t.blocks)) for t in tables]
    tokens = torch.tensor([feeds[s][i] for s, i in order])
    positions = torch.tensor([len(prompts[s]) + i for s, i in order])
    rows_of = {key: row for row, key in enumerate(order)}
    wanted = [(0, 0), (1, 0), (2, 0), (3, 10), (4, 19), (4, 6)]
    logit_rows = torch.tensor([rows_of[key] for key in wanted])
    cache = caches["mixed"]
    got = fused(tokens, cache.k, cache.v, torch.tensor([padded[s] for s, _ in order]), positions, logit_rows=logit_rows)
    assert got.shape == (len(wanted), model.config.vocab_size) and got.dtype == torch.float32  # whatever the dtype
    for (s, i), logits in zip(wanted, got):
        start = len(prompts[s])
        batch = FlatBatch.pack([Segment(feeds[s], start, tables[s].blocks, len(feeds[s]))], CPU)
        expected = forward_flat(model, caches["python"], batch)[i].float()
        if dtype == torch.float32 and quant is None:
            assert (expected - logits.float()).abs().max() <= 1e-4, (s, i)
        else:
            assert F.cosine_similarity(expected, logits.float(), dim=0) >= 0.999, (s, i)
        assert int(expected.argmax()) == int(logits.argmax()), (s, i)
        n = len(feeds[s])
        alone = fused(
            torch.tensor(feeds[s]),
            caches["alone"].k,
            caches["alone"].v,
            torch.tensor([padded[s]]).expand(n, -1),
            torch.arange(start, start + n),
        )
        assert torch.equal(alone[i], logits), (s, i)
    assert torch.equal(caches["mixed"].k, caches["alone"].k) and torch.equal(caches["mixed"].v, caches["alone"].v)


def test_a_few_tokens_of_one_sequence_run_as_the_rows_of_one_step(isa, tiny_tokenizer):
    """SlotRunner (the target of speculative decoding) feeds the tokens of its sequence as the rows of one
    fused step: the logits at every position equal the Python model's causal forward, and the cache ends the
    same."""
    engine = tiny_engine(tiny_tokenizer, kernels="fast")
    fast, reference = SlotRunner.alone(engine.model, 64, engine.fused), SlotRunner.alone(engine.model, 64)
    python_forwards: list[int] = []
    forward = engine.model.forward
    for n in (6, 12, 4, 1, 8, 3):
        ids = [(13 * n + 5 * i) % 250 for i in range(n)]
        expected = reference.forward(ids)
        engine.model.forward = lambda tokens, *a, **kw: (
            python_forwards.append(tokens.shape[1]) or forward(tokens, *a, **kw)
        )
        got = fast.forward(ids)
        engine.model.forward = forward
        assert got.shape == expected.shape == (n, engine.model.config.vocab_size)
        assert (expected - got).abs().max() <= 1e-4, n
    assert python_forwards == []
    assert fast.length == reference.length == 34
    assert (fast.cache.k[:, :, :, :34] - reference.cache.k[:, :, :, :34]).abs().max() <= 1e-5
    last = fast.forward([7, 8], last_only=True)
    assert last.shape == (1, engine.model.config.vocab_size)
    assert (last - reference.forward([7, 8], last_only=True)).abs().max() <= 1e-4


def test_the_engine_loop_decodes_a_batch_through_the_fused_step(isa, tiny_tokenizer):
    """generate_batch over the paged pool (continuous batching) gives what single requests give."""
    prompts = [list(range(40, 40 + n)) for n in (9, 30, 3)]
    fast = tiny_engine(tiny_tokenizer, "paged", kernels="fast")
    reference = tiny_engine(tiny_tokenizer, "contiguous", kernels="portable")
    python_decodes = count_decode_forwards(fast)
    batch = fast.generate_batch(prompts, max_new_tokens=12)
    assert [c.token_ids for c in batch] == [reference.generate(p, max_new_tokens=12).token_ids for p in prompts]
    assert python_decodes == []


def test_many_short_chunks_stay_fused_beyond_the_row_limit_on_the_amx_build(isa, tiny_tokenizer):
    """On the amx build a step of many sequences' short chunks runs fused past many_rows_limit (the Python model
    attends sequence by sequence); a long chunk does not, and on the other builds the limit is the rows alone. The
    engine loop's steps then run fused and give what single requests give."""
    fast = tiny_engine(tiny_tokenizer, "paged", kernels="fast", slots=4)
    plan = fast.fused.plan
    limit = 2 * SHORT_CHUNK_ROWS
    amx = FusedDecode(fast.model, plan, "amx", max_rows=limit)
    assert amx.covers(limit) and not amx.covers(limit + 1)  # one sequence: its rows alone
    assert amx.covers(SHORT_CHUNK_ROWS * 3, 3) and not amx.covers(SHORT_CHUNK_ROWS * 3 + 1, 3)
    assert not amx.covers(FUSED_MAX_ROWS + 1, FUSED_MAX_ROWS)
    assert not FusedDecode(fast.model, plan, "avx512", max_rows=limit).covers(limit + 1, 3)
    assert FusedDecode(fast.model, plan, "amx").covers(FUSED_MAX_ROWS)  # no row limit: nothing to add
    fused_rows: list[int] = []

    class Recording(FusedDecode):
        def __call__(self, tokens, *args, **kwargs):
            fused_rows.append(len(tokens))
            return super().__call__(tokens, *args, **kwargs)

    fast.fused = fast.loop.fused = Recording(fast.model, plan, "amx", max_rows=8)
    reference = tiny_engine(tiny_tokenizer, "contiguous", kernels="portable")
    prompts = [list(range(40, 40 + n)) for n in (9, 30, 3)]
    python_forwards: list[int] = []
    forward = fast.model.forward
    fast.model.forward = lambda tokens, *a, **k: python_forwards.append(tokens.shape[1]) or forward(tokens, *a, **k)
    batch = fast.generate_batch(prompts, max_new_tokens=6)
    assert [c.token_ids for c in batch] == [reference.generate(p, max_new_tokens=6).token_ids for p in prompts]
    assert python_forwards == [] and max(fused_rows) > 8  # the steps of the prompts' rows too


def test_what_the_fused_step_does_not_cover_keeps_the_python_model(isa, tiny_tokenizer, monkeypatch):
    fused = tiny_engine(tiny_tokenizer, kernels="fast").fused
    assert fused.covers(FUSED_MAX_ROWS) and not fused.covers(FUSED_MAX_ROWS + 1)
    # quantized layers with dense copies: oneDNN's GEMM over them serves many rows faster
    model = tiny_engine(tiny_tokenizer, kernels="fast", quant="int8").model
    assert many_rows_limit(model, isa) == FUSED_MAX_ROWS
    assert keep_dense_copies(model, torch.float32, 1024) > 0
    # the amx build multiplies int8 on AMX tiles, faster than oneDNN over the copies up to INT8_TILES_MAX_ROWS
    assert many_rows_limit(model, isa) == (INT8_TILES_MAX_ROWS if isa == "amx" else GEMV_MAX_ROWS)
    # int4 layers keep no dense copies but on AMX CPUs: elsewhere the int4 kernel across rows runs every int4 step
    monkeypatch.setattr("inferlab.quant.int4.amx_bf16_usable", lambda: False)
    model = tiny_engine(tiny_tokenizer, kernels="fast", quant="int4", dtype=torch.bfloat16).model
    keep_dense_copies(model, torch.bfloat16, 1024)
    assert many_rows_limit(model, isa) == FUSED_MAX_ROWS
    monkeypatch.setattr("inferlab.quant.int4.amx_bf16_usable", lambda: True)
    keep_dense_copies(model, torch.bfloat16, 1024)  # the amx build's plan multiplies the copies on its tiles
    assert many_rows_limit(model, isa) == (BF16_TILES_MAX_ROWS if isa == "amx" else INT4_KERNEL_MAX_ROWS)
    # bf16 layers: on AMX CPUs steps beyond BF16_KERNEL_MAX_ROWS rows go to the Python model's F.linear (oneDNN), beyond
    # BF16_TILES_MAX_ROWS on the build that multiplies bf16 on the tiles itself
    model = tiny_engine(tiny_tokenizer, kernels="fast", dtype=torch.bfloat16).model
    for amx, build, limit in (
        (False, isa, FUSED_MAX_ROWS),
        (True, "avx512", BF16_KERNEL_MAX_ROWS),
        (True, "amx", BF16_TILES_MAX_ROWS),
    ):
        monkeypatch.setattr("inferlab.kernels.fused_decode.amx_bf16_usable", lambda amx=amx: amx)
        assert many_rows_limit(model, build) == limit
    assert tiny_engine(tiny_tokenizer, kernels="portable").fused is None
    assert tiny_engine(tiny_tokenizer, "none", kernels="fast").fused is None  # the recompute baseline stays pure
    assert tiny_engine(tiny_tokenizer).fused is None  # plain nn.Linear layers: no kernel chosen
    assert tiny_engine(tiny_tokenizer, kernels="fast", dim=72, n_heads=9, n_kv_heads=3).fused is None  # K % 16
    model = tiny_model()
    assert FusedDecode.build(model, torch.device("cuda"), torch.float32, "fast") is None


def test_the_plan_refuses_positions_outside_the_cache(isa, tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, kernels="fast")
    cache = engine.kv_cache
    tokens, table = torch.tensor([5]), torch.tensor([[0]])
    with pytest.raises(RuntimeError, match="outside"):
        engine.fused(tokens, cache.k, cache.v, table, torch.tensor([cache.max_seq_len]))
    with pytest.raises(RuntimeError, match="block id"):
        engine.fused(tokens, cache.k, cache.v, torch.tensor([[cache.slots]]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="not a row"):
        engine.fused(tokens, cache.k, cache.v, table, torch.tensor([0]), logit_rows=torch.tensor([1]))
    none = engine.fused(tokens, cache.k, cache.v, table, torch.tensor([0]), logit_rows=torch.zeros(0, dtype=torch.long))
    assert none.shape == (0, engine.model.config.vocab_size)  # only the k/v written (a prompt chunk with more to come)


def test_the_bf16_step_stays_within_bf16_storage_of_fp32(isa, tiny_tokenizer):
    """bf16 weights; the fused step keeps activations, residual stream and rope (fp32 tables) in fp32, rounding
    only the KV cache and the logits to bf16 (and, on the amx build, each projection's input: the tiles take bf16). Teacher-forced against the fp32 model on the same (bf16-valued)
    weights, from the first token (the prompt is short enough to run on the fused step too), it stays within
    that rounding, and well closer than the portable path, which rounds every activation to bf16."""
    kwargs = dict(dim=96, n_heads=6, n_kv_heads=2, hidden_dim=192)
    reference = tiny_engine(tiny_tokenizer, kernels="portable", **kwargs)
    with torch.no_grad():
        for p in reference.model.parameters():
            p.copy_(p.bfloat16().float())
    prompt = [5, 60, 7, 200, 31, 9]
    tokens = reference.generate(prompt, max_new_tokens=40, temperature=0).token_ids
    errors = {}
    for name, engine in [
        ("reference", reference),
        ("fused", tiny_engine(tiny_tokenizer, dtype=torch.bfloat16, kernels="fast", **kwargs)),
        ("portable", tiny_engine(tiny_tokenizer, dtype=torch.bfloat16, kernels="portable", **kwargs)),
    ]:
        logits, seq = engine.prefill(prompt, reserve_tokens=len(tokens))
        steps = [logits.float()] + [engine.decode_step(t, seq).float() for t in tokens]
        seq.release()
        errors[name] = (
            steps
            if name == "reference"
            else torch.stack([1 - F.cosine_similarity(e, g, dim=0) for e, g in zip(errors["reference"], steps)])
        )
    # measured: fused mean 1 - cosine 8.3e-6 (with the model's bf16 rope tables: 1.13e-5), max 2.4e-5;
    # portable mean 7.4e-5, max 2.1e-4. The avx512 and amx builds round each projection's input to bf16 for their
    # bf16 dots (the residual stream stays fp32): mean 3.0e-5, max 5.5e-5 (amx), 5.9e-5 (avx512)
    if isa in ("avx512", "amx"):
        assert errors["fused"].mean() <= 4e-5 and errors["fused"].max() <= 1e-4
        assert errors["fused"].mean() <= errors["portable"].mean() / 2
    else:
        assert errors["fused"].mean() <= 1e-5 and errors["fused"].max() <= 5e-5
        assert errors["fused"].mean() <= errors["portable"].mean() / 4


def test_int8_activation_codes_stay_close_to_the_int16_ones(isa):
    """A draft's plan (int8_from_rows=1: int4 projections take int8 codes per 32 columns) against the served int4
    model's plan (int16 codes per row) on the same weights, teacher-forced over a prompt and 20 one-token steps:
    the logits stay close (measured on random weights: worst cosine 0.995) and each one-token step equals that row of one
    prompt-sized call (the codes are per row). A plan with int8 codes from 4 rows on gives a call of 3 rows the int16
    plan's logits and a call of 4 the int8 plan's."""
    from inferlab.quant import quantize_model

    model = tiny_model(3, dim=128, hidden_dim=256)
    quantize_model(model, "int4", 32)
    runners = {
        from_rows: SlotRunner.alone(
            model, 64, FusedDecode.build(model, CPU, torch.float32, "fast", int8_from_rows=from_rows)
        )
        for from_rows in (0, 1, 4)
    }
    tokens = torch.randint(0, model.config.vocab_size, (32,)).tolist()
    whole = {from_rows: runner.forward(tokens) for from_rows, runner in runners.items()}
    assert (F.cosine_similarity(whole[1], whole[0], dim=-1) >= 0.99).all()
    assert not torch.equal(whole[1], whole[0])
    stepped = SlotRunner.alone(model, 64, runners[1].fused)
    stepped.forward(tokens[:12])
    rows = torch.cat([stepped.forward([token]) for token in tokens[12:]])
    torch.testing.assert_close(rows, whole[1][12:], atol=1e-5, rtol=1e-4)
    by_rows = runners[4]
    for rows_in_call, codes_of in ((3, 0), (4, 1)):  # each call from the start: no KV of the other codes' rows
        by_rows.length = 0
        got = by_rows.forward(tokens[:rows_in_call])
        torch.testing.assert_close(got, whole[codes_of][:rows_in_call], atol=1e-5, rtol=1e-4)
