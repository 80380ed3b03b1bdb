"""One engine step = one flat forward (engine/model_runner.py): decode rows and prompt chunks of several sequences
mixed in one batch give each sequence what its own full forward gives, for every weight format and both
cache layouts, on the fused C++ step and on the Python model, on random models and the real one."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_engine

from inferlab.api import load_engine
from inferlab.engine.kv.block_manager import BlockTable
from inferlab.engine.model_runner import FlatBatch, Segment, forward_flat
from inferlab.kernels.build import cpu_gemv_available
from inferlab.model.transformer import causal_attend

QUANT = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "int8": (torch.float32, "int8")}
QUANT["int4"] = (torch.float32, "int4")


def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """The sequence's own causal forward over all its tokens, no cache: (T, vocab) in fp32."""
    tokens = torch.tensor([token_ids])
    with torch.inference_mode():
        return model(tokens, torch.arange(len(token_ids))[None], causal_attend)[0].float()


@dataclass(frozen=True)
class Tolerance:
    """fp32: summation-order noise (`max_abs`) and the same greedy token; the other formats: a cosine and the
    greedy token but for a near-tie at the format's resolution (`tie`)."""

    max_abs: float | None = None
    min_cosine: float = 0.999
    tie: float = 0.05


EXACT, TINY = Tolerance(max_abs=1e-4), Tolerance()
# the real model's kernel paths are two bf16-level approximations of int8/int4 (tests/test_kernels_real_model.py);
# bf16's reference is the fp32 model's forward: a bf16 forward over the whole sequence rounds its residual stream to
# bf16, ~1 - cosine 3.4e-3 from fp32 on a 20-token prompt, where the fused step's bf16 products (their inputs rounded to
# bf16 on the avx512 and amx builds) are 5.4e-4 from it; against that reference 0.9949 was seen
REAL = {"fp32": Tolerance(max_abs=1e-3), "bf16": Tolerance(min_cosine=0.997, tie=0.3)}
REAL |= {"int8": Tolerance(min_cosine=0.99, tie=0.3), "int4": Tolerance(min_cosine=0.99, tie=0.3)}


def assert_close(expected: torch.Tensor, got: torch.Tensor, tol: Tolerance, what: str) -> None:
    for e, g in zip(expected, got.float()):
        if tol.max_abs is not None:
            assert (e - g).abs().max() <= tol.max_abs, what
            assert int(e.argmax()) == int(g.argmax()), what
        else:
            assert F.cosine_similarity(e, g, dim=0) >= tol.min_cosine, what
            assert e[g.argmax()] >= e.max() - tol.tie, what


def test_each_rows_block_table_is_its_sequences():
    segments = [
        Segment([1], 4, [3, 5]),
        Segment([2, 3, 4], 0, [7]),
        Segment([5], 20, [0, 1, 2]),
        Segment([6, 7], 2, [9]),
    ]
    batch = FlatBatch.pack(segments, torch.device("cpu"))
    expected = batch.block_tables.repeat_interleave(torch.tensor(batch.query_lens), dim=0)
    assert torch.equal(batch.row_tables(), expected)
    decodes = FlatBatch.pack([segments[0], segments[2]], torch.device("cpu"))
    assert torch.equal(decodes.row_tables(), decodes.block_tables)


DECODES = 8  # tokens each sequence holds past its prompt, fed one a step once its prompt is in


class Steps:
    """Sequences of an engine's KV memory fed through flat steps, each step checked against the sequence's own
    full forward. A sequence is its prompt and then DECODES tokens fixed ahead (teacher forcing): a causal model's
    logits at a position do not depend on what follows it, so one forward over each sequence's tokens is every
    step's reference."""

    def __init__(self, engine, reference_model, sequences: list[list[int]]) -> None:
        self.engine, self.tokens = engine, sequences
        self.prompt_lens = [len(s) - DECODES for s in sequences]
        self.expected = [reference_logits(reference_model, s) for s in sequences]  # (len, vocab) each
        self.tables = [BlockTable() for _ in sequences]
        for table, tokens, n in zip(self.tables, sequences, self.prompt_lens):
            assert engine.blocks.allocate(table, tokens[:n], len(tokens), reuse=False)

    def step(self, feeds: dict[int, int], every: frozenset[int] = frozenset(), tol: Tolerance = EXACT) -> None:
        """Feed sequence s its next feeds[s] tokens, all in one forward; a sequence in `every` wants all its
        rows' logits, one whose prompt is in its last row's. Checks each sequence's logits against its full
        forward."""
        segments = []
        for s, n in feeds.items():
            start = self.tables[s].num_computed
            end = start + n
            assert end <= len(self.tokens[s]), f"sequence {s} has no token {end - 1}"
            wanted = n if s in every else int(end >= self.prompt_lens[s])
            segments.append(Segment(self.tokens[s][start:end], start, self.tables[s].blocks, wanted))
        batch = FlatBatch.pack(segments, torch.device("cpu"))
        with torch.inference_mode():
            logits = forward_flat(self.engine.model, self.engine.paged, batch, self.engine.fused)
        rows = logits.split([seg.n_logits for seg in segments])
        for (s, n), seg, got in zip(feeds.items(), segments, rows):
            end = seg.start + n
            expected = self.expected[s][end - seg.n_logits : end]
            assert got.shape == expected.shape, s
            assert_close(expected, got, tol, f"sequence {s}")
            self.tables[s].num_computed = end

    def release(self) -> None:
        for table in self.tables:
            self.engine.blocks.free(table)


def mixed_steps(steps: Steps, tol: Tolerance, small: bool) -> None:
    """Prompts in chunks from 0, then steps mixing decodes with chunks that start mid-prompt and whole
    prompts; `small` keeps each step within 8 rows (what today's fused step covers)."""
    if small:
        steps.step({0: 3, 1: 4}, tol=tol)  # two chunks from 0
        steps.step({0: 2, 1: 3, 2: 3}, tol=tol)  # 0 ends its prompt, 1 continues, 2 starts
        steps.step({0: 1, 1: 1, 2: 2, 3: 4}, every=frozenset({3}), tol=tol)  # decode, ends, a prompt's logprobs
        for _ in range(3):
            steps.step({0: 1, 1: 1, 2: 1, 3: 1}, tol=tol)  # decodes only
        return
    steps.step({0: 5, 1: 17, 2: 9}, tol=tol)  # 0's whole prompt, chunks of 1 and 2
    steps.step({0: 1, 1: 16, 2: 24, 3: 11}, every=frozenset({3}), tol=tol)  # decode, chunk, end, logprobs
    steps.step({0: 1, 1: 1, 2: 1, 3: 1, 4: 30}, tol=tol)  # four decodes beside a 30-token prompt
    for _ in range(2):
        steps.step({s: 1 for s in range(5)}, tol=tol)


PROMPT_LENS, SMALL_PROMPT_LENS = (5, 40, 33, 11, 30), (5, 8, 5, 4, 1)


def sequences(tokens: list[int], starts: list[int], prompt_lens: tuple[int, ...]) -> list[list[int]]:
    """Sequence i: tokens from starts[i], its prompt_lens[i] prompt tokens and DECODES more."""
    return [tokens[s : s + n + DECODES] for s, n in zip(starts, prompt_lens)]


STARTS = [3 + 7 * s for s in range(5)]
SEQUENCES = sequences(list(range(256)), STARTS, PROMPT_LENS)
SMALL_SEQUENCES = sequences(list(range(256)), STARTS, SMALL_PROMPT_LENS)


@pytest.mark.parametrize("cache_mode", ["contiguous", "paged"])
@pytest.mark.parametrize("precision", list(QUANT))
@pytest.mark.parametrize("kernels", ["portable", "fast"])
@pytest.mark.parametrize("small", [True, False], ids=["fused-rows", "many-rows"])
def test_a_mixed_step_equals_each_sequences_own_forward(
    tiny_tokenizer, one_thread, cache_mode, precision, kernels, small
):
    if kernels == "fast" and not cpu_gemv_available():
        pytest.skip("no AVX2 CPU or no C++ toolchain here")
    dtype, quant = QUANT[precision]
    kwargs = dict(dtype=dtype, quant=quant, dim=96, n_heads=6, n_kv_heads=2, qkv_bias=True)
    engine = tiny_engine(tiny_tokenizer, cache_mode, slots=5, kernels=kernels, **kwargs)
    reference = tiny_engine(tiny_tokenizer, cache_mode, slots=1, kernels="portable", **kwargs).model
    assert (engine.fused is not None) == (kernels == "fast")
    steps = Steps(engine, reference, SMALL_SEQUENCES if small else SEQUENCES)
    mixed_steps(steps, EXACT if precision == "fp32" else TINY, small=small)
    steps.release()
    assert engine.blocks.num_used == 0


@pytest.mark.parametrize("kernels", ["portable", "fast"])
def test_a_step_of_prompt_chunks_alone_returns_no_logits_and_writes_their_kv(tiny_tokenizer, one_thread, kernels):
    """Every sequence still mid-prompt: no row's logits are wanted (R = 0), and the next step sees the KV."""
    if kernels == "fast" and not cpu_gemv_available():
        pytest.skip("no AVX2 CPU or no C++ toolchain here")
    engine = tiny_engine(tiny_tokenizer, "paged", slots=5, kernels=kernels)
    steps = Steps(engine, engine.model, SEQUENCES)
    segments = [Segment(SEQUENCES[s][:3], 0, steps.tables[s].blocks, n_logits=0) for s in (0, 1)]
    with torch.inference_mode():
        logits = forward_flat(engine.model, engine.paged, FlatBatch.pack(segments, torch.device("cpu")), engine.fused)
    assert logits.shape == (0, engine.model.config.vocab_size)
    steps.tables[0].num_computed = steps.tables[1].num_computed = 3
    steps.step({0: 2, 1: 5})  # the rest of 0's prompt and a chunk of 1's, over the KV written above
    steps.release()


def test_a_sliding_window_and_softcap_model_mixes_too(tiny_tokenizer, one_thread):
    """Gemma-style layers (a window on every other layer, soft-capped scores) through the flat attention's
    per-sequence spans."""
    kwargs = dict(sliding_window=6, sliding_layers=[0], attn_softcap=20.0)
    engine = tiny_engine(tiny_tokenizer, "paged", slots=5, **kwargs)
    steps = Steps(engine, engine.model, SEQUENCES)
    mixed_steps(steps, EXACT, small=False)
    steps.release()


# every format on the paged cache (the default); the contiguous slots (one block each, the same kernels) at fp32 and
# the default int4: the random models above cover the whole product. CI's suite takes fp32, int8 and int4 paged
# (bf16's fused step on the real model: test_kernels_real_model.py)
REAL_CASES = [
    *[(p, "paged") if p != "bf16" else pytest.param(p, "paged", marks=pytest.mark.full) for p in QUANT],
    pytest.param("fp32", "contiguous", marks=pytest.mark.full),
    pytest.param("int4", "contiguous", marks=pytest.mark.full),
]


@pytest.mark.slow
@pytest.mark.parametrize("precision,cache_mode", REAL_CASES)
def test_a_mixed_step_on_the_real_model(cache_mode, precision):
    """SmolLM2 in each format on its fastest path here: every step against each sequence's own full forward
    through the same model."""
    overrides = {"cache.max_seq_len": 256, "cache.slots": 5}
    if cache_mode == "paged":
        overrides["cache.kv_budget_mb"] = 32
    engine = load_engine(precision=precision, cache=cache_mode, device="cpu", **overrides)
    reference = load_engine(precision="fp32", cache="none", device="cpu").model if precision == "bf16" else None
    text = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived"
    ids = engine.tokenizer.encode(text * 3)
    starts = [0, 3, 7, 11, 2]
    steps = Steps(engine, reference or engine.model, sequences(ids, starts, PROMPT_LENS))
    mixed_steps(steps, REAL[precision], small=False)
    steps.release()
    small = Steps(engine, reference or engine.model, sequences(ids, starts, SMALL_PROMPT_LENS))
    mixed_steps(small, REAL[precision], small=True)
    small.release()
