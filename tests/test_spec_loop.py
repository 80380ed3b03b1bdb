"""Speculation inside the engine loop: every decode drafts, the step's one forward verifies them all.

Against references: spec off's greedy tokens (single requests) for every drafter, under random arrivals,
cancellations and preemptions with every block coming back; at T > 0 the exact target distribution."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from conftest import tiny_engine
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_scheduler import assert_single_request_tokens, check_invariants, fake_request, operations, run_operations
from test_spec import TOY_PROMPT, chi_square_pvalue, exact_sequence_probs, perturbed, toy_model

from inferlab.engine.engine import InferenceEngine
from inferlab.engine.request import Request
from inferlab.engine.sampling import SamplingParams
from inferlab.engine.scheduler import ScheduledBatch
from inferlab.engine.spec.adaptive_k import BACKOFF, MAX_BACKOFF, MIN_SAMPLES, PRIOR, WEIGHT, plan_k
from inferlab.engine.spec.calibration import Calibration
from inferlab.engine.spec.draft_model import ModelDrafter
from inferlab.engine.spec.proposers import Drafter, NgramDrafter
from inferlab.engine.spec.session import Speculation
from inferlab.kernels.build import cpu_gemv_available
from inferlab.model.loader import LoadedModel
from inferlab.model.transformer import Transformer
from inferlab.quant.self_draft import self_draft

pytestmark = pytest.mark.usefixtures("one_thread")

# draft: a model of its own (its KV in a pool of its own); self: the target's weights at int4 drafting over the
# target's KV (self-subset: its LM head over the first 100 ids only; self-fused: on its own fused C++ step, its draft
# steps of 2 rows or more on int8 activation codes, conf/spec/self.yaml's default); copy: the target itself in a
# pool of its own, every draft accepted
DRAFTERS = ["ngram", "draft", "self", "self-subset", "self-fused", "copy"]


def drafter(kind: str, target: Transformer) -> Drafter:
    if kind == "ngram":
        return NgramDrafter()
    if kind == "draft":
        return ModelDrafter(perturbed(target, 0.01, seed=1), min_confidence=0.3)
    if kind in ("self", "self-subset", "self-fused"):
        draft = self_draft(target, "int4", draft_vocab=100 if kind == "self-subset" else 0)
        fused = kind == "self-fused"
        own = ModelDrafter(draft, "self", min_confidence=0.1, target_kv=True, int8_from_rows=2 if fused else 0)
        if fused and cpu_gemv_available():  # else it drafts on the Python model, as "self"
            own.build_fused(torch.device("cpu"), torch.float32, "fast")
            assert own.fused is not None
        return own
    return ModelDrafter(target)


def loop_engine(
    tokenizer, model: Transformer | None, kv_blocks: int, block_size: int = 4, prefix: bool = False, **scheduler
) -> InferenceEngine:
    """A paged engine over `model` (None: the tiny one) whose every way in goes through the engine loop."""
    base = tiny_engine(tokenizer, "paged")
    loaded = base.loaded if model is None else LoadedModel(model, tokenizer, model.config, "toy")
    config = replace(
        base.config,
        kv_blocks=kv_blocks,
        block_size=block_size,
        prefix_cache=prefix,
        scheduler=replace(base.config.scheduler, **scheduler),
    )
    return InferenceEngine(loaded, config)


def speculate(engine: InferenceEngine, drafter: Drafter, k: int, adaptive: bool) -> None:
    """Speculation on; adaptive K's costs as on a large target, whose step is mostly its fixed cost (20 ms + 0.1 ms a
    row, a draft step 1 ms + 0.1 ms a row), so that the tiny models' steps, all alike, do not talk it out of
    drafting: K then follows the sequences' acceptances."""
    engine.speculation = Speculation(drafter, k, adaptive)
    engine.loop.speculation._costs = lambda: (lambda rows: 0.020 + 0.0001 * rows, lambda rows: 0.001 + 0.0001 * rows)


@pytest.fixture(scope="module")
def greedy_reference(tiny_tokenizer):
    """(prompt, max_new) -> spec off's single-request greedy tokens, each computed once."""
    engine = tiny_engine(tiny_tokenizer, "contiguous", slots=1)
    return functools.cache(lambda prompt, max_new: engine.generate(list(prompt), max_new_tokens=max_new).token_ids)


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("adaptive", [False, True])
def test_batched_speculation_gives_spec_off_greedy_tokens(tiny_tokenizer, greedy_reference, kind, adaptive):
    """Several requests speculating together, drafts of different lengths verified in one forward each step:
    each one's single-request tokens, stop strings and max_tokens cut inside a round, every block back."""
    engine = loop_engine(tiny_tokenizer, None, kv_blocks=64, prefix=True)
    speculate(engine, drafter(kind, engine.model), 4, adaptive)
    steps: list[int] = []
    step = engine.loop.step
    engine.loop.step = lambda: steps.append(1) or step()
    prompts = [list(range(5, 25)), [7, 8, 9] * 6, list(range(40, 47)), [3, 1, 4, 1, 5, 9, 2, 6]]
    lengths = [24, 17, 3, 30]
    completions = engine.generate_batch(prompts, max_new_tokens=24)
    for prompt, completion in zip(prompts, completions):
        assert completion.token_ids == greedy_reference(tuple(prompt), 24)
        assert completion.timings.completion_tokens == len(completion.token_ids)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 or stats["prefix_cache_blocks"] >= stats["kv_blocks_used"]
    assert stats["spec_proposed"] > 0 and 0 < stats["spec_generated"] <= sum(len(c.token_ids) for c in completions)
    if kind != "ngram":
        assert stats["spec_accepted"] > 0
    if kind == "copy":
        assert len(steps) < 24  # several tokens per sequence per step
    full = engine.generate(prompts[0], max_new_tokens=24)
    stop = engine.tokenizer.decode(full.token_ids[5:7])
    cut = engine.generate(prompts[0], max_new_tokens=24, stop=stop)
    want = tiny_engine(tiny_tokenizer, "contiguous", slots=1).generate(prompts[0], max_new_tokens=24, stop=stop)
    assert (cut.text, cut.finish_reason) == (want.text, want.finish_reason)
    for length in lengths:
        assert engine.generate(prompts[1], max_new_tokens=length).token_ids == greedy_reference(
            tuple(prompts[1]), length
        )


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    ops=operations,
    kind=st.sampled_from(DRAFTERS),
    k=st.integers(1, 5),
    adaptive=st.booleans(),
    kv_blocks=st.integers(5, 9),
    prefix=st.booleans(),
    max_running=st.integers(2, 5),
    budget=st.integers(1, 24),
)
def test_speculating_loop_never_leaks_and_gives_single_request_tokens(
    tiny_tokenizer, greedy_reference, ops, kind, k, adaptive, kv_blocks, prefix, max_running, budget
):
    """The engine loop with speculation on under random arrivals, cancels and preemptions: every block of the
    target's pool and of the draft's comes back, and every finished request has spec off's greedy tokens."""
    engine = loop_engine(
        tiny_tokenizer, None, kv_blocks, prefix=prefix, max_running=max_running, max_batched_tokens=budget
    )
    speculate(engine, drafter(kind, engine.model), k, adaptive)

    def step(requests: list[Request]) -> None:
        engine.loop.step()
        check_invariants(engine.scheduler)
        assert all(not r.kv.blocks or r in engine.scheduler.running for r in requests)

    requests = run_operations(engine, ops, step)
    assert not engine.scheduler.has_work()
    event(f"preempted: {engine.scheduler.preemptions > 0}")
    event(f"accepted: {engine.stats()['spec_accepted'] > 0}")
    assert engine.blocks.num_free == kv_blocks and not any(engine.blocks.ref_counts)
    drafts = engine.loop.speculation.drafts
    drafts.retain([])
    if hasattr(drafts, "blocks"):
        assert drafts.blocks.num_free == drafts.blocks.num_blocks and not any(drafts.blocks.ref_counts)
    assert_single_request_tokens(requests, greedy_reference)


N_TOY = 800


@pytest.mark.parametrize("kind", ["draft", "self", "self-subset", "ngram"])
def test_batched_speculation_samples_the_target_distribution(tiny_tokenizer, kind):
    """T = 1 through the loop, many requests (each its own seed) speculating in the same steps: the
    3-token sequences follow the target's exact distribution (Pearson's test, as test_spec.py's)."""
    target = toy_model(11, n_layers=2)
    params = SamplingParams(max_new_tokens=3, temperature=1.0)
    exact = exact_sequence_probs(target, TOY_PROMPT, 3, params)
    engine = loop_engine(tiny_tokenizer, target, kv_blocks=256, max_running=16)
    draft = {
        "draft": ModelDrafter(toy_model(12), min_confidence=0.6),
        "self": ModelDrafter(self_draft(target, "int8"), min_confidence=0.6, target_kv=True),
        # its head over ids 0 and 1 only: q is zero at 2 and 3, which the target's residual still reaches
        "self-subset": ModelDrafter(self_draft(target, "int8", draft_vocab=2), min_confidence=0.6, target_kv=True),
        "ngram": NgramDrafter(max_n=2),
    }[kind]
    engine.speculation = Speculation(draft, 2, adaptive=False)
    requests = []
    for seed in range(N_TOY):
        request = engine._new_request(TOY_PROMPT, replace(params, seed=seed), lambda e: None)
        request.eos_ids = set()  # every id of the toy vocabulary is a token
        engine.scheduler.add(request, bounded=False)
        requests.append(request)
    while engine.scheduler.has_work():
        engine.loop.step()
    assert engine.stats()["spec_accepted"] > 0
    counts: dict = {}
    for request in requests:
        key = tuple(request.output_ids)
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, exact, N_TOY) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.full)])
def test_real_model_batched_spec_self_gives_spec_off_tokens(precision):
    """SmolLM2, 4 chat prompts together through the engine loop, spec=self (its int4 draft over the target's
    KV) against spec off: the same greedy tokens, the drafts mostly accepted, every block back. Every step on the
    fused step: bf16 numerics differ between it and the Python model (which rounds every activation to bf16), which
    takes steps beyond the fused step's rows on AMX CPUs (32, or BF16_TILES_MAX_ROWS on the amx build). So steps of
    at most 32 rows, and no prefix cache: the second run would find its prompts cached and prefill only their last
    blocks, and how many prompts the loop's first step holds depends on when it starts stepping (all four: 163 rows;
    one: ~40). Adaptive K is off, so that every step drafts wherever drafting would not pay (a machine without the
    C++ kernels: the loop then rightly proposed nothing, and losslessness went untested)."""
    from inferlab.api import load_engine

    engine = load_engine(
        precision=precision,
        spec="self",
        **{"cache.prefix": False, "scheduler.max_batched_tokens": 32, "spec.adaptive": False},
    )
    speculation = engine.speculation
    prompts = [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a bicycle stays upright.",
        "List three facts about the Moon.",
        "What is the capital of France, and why is it famous?",
    ]
    ids = [engine.encode_prompt(p, chat=True) for p in prompts]
    engine.speculation = None
    plain = engine.generate_batch(ids, max_new_tokens=48)
    engine.speculation = speculation
    got = engine.generate_batch(ids, max_new_tokens=48)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    stats = engine.stats()
    assert stats["spec_accepted"] > stats["spec_proposed"] / 2 and stats["requests_running"] == 0


def test_a_measured_draft_cost_is_what_adaptive_k_counts(tiny_tokenizer):
    """measure_cost times both models' steps; step_cost (adaptive K's draft cost), the engine loop's prior and the
    startup line give it."""
    engine = loop_engine(tiny_tokenizer, None, kv_blocks=64)
    draft = drafter("draft", engine.model)
    bytes_cost = draft.step_cost(engine.model)
    draft.measure_cost(engine.model, engine.fused, rows=5)
    calibration = draft.calibration
    assert calibration is not None and min(calibration.a, calibration.b, calibration.draft_b) >= 0
    assert calibration.draft_a + calibration.draft_b > 0
    assert draft.step_cost(engine.model) == calibration.token_cost() != bytes_cost
    engine.speculation = Speculation(draft, 4, adaptive=True)
    assert f"a draft token costs {calibration.token_cost():.2f} target steps" in engine.describe()
    target, draft = engine.loop.speculation._costs()  # nothing timed in the loop yet: the calibration's lines
    assert target(5) == pytest.approx(calibration.a + 5 * calibration.b)
    assert draft(5) == pytest.approx(calibration.draft_a + 5 * calibration.draft_b)


def test_the_load_time_timing_gives_way_to_the_loops_own(tiny_tokenizer):
    """Before the loop has timed a draft step, the calibration's draft line scaled as its target steps were (the
    machine twice as busy as at load here); a faster draft step timed in the loop, and the draft line is at its level
    (a calibration taken in a burst of load does not keep speculation from paying)."""
    engine = loop_engine(tiny_tokenizer, None, kv_blocks=64)
    draft = drafter("self", engine.model)
    draft.calibration = Calibration(a=0.008, b=0.002, draft_a=0.010, draft_b=0.002)
    engine.speculation = Speculation(draft, 4, adaptive=True)
    loop = engine.loop.speculation
    for rows in (1, 4, 8):
        loop.step_cost.observe(rows, 2 * (0.008 + 0.002 * rows))
    target, draft_step = loop._costs()
    assert target(8) == pytest.approx(0.048) and draft_step(8) == pytest.approx(2 * 0.026)
    loop.draft_cost.observe(1, 0.003)
    assert loop._costs()[1](8) == pytest.approx(0.026 * 0.003 / 0.012)


def test_no_sequence_drafts_while_the_timed_rows_cost_more_than_any_acceptance_brings(tiny_tokenizer):
    """Under load a step's drafts (their draft steps and verified rows, timed in the loop) may cost more than even
    drafts that are all accepted bring: once drafting steps were timed whole there, no sequence drafts, not even a
    probe, until the load lightens. Priced so but never timed whole, the decodes still probe: prices err."""
    engine = loop_engine(tiny_tokenizer, None, kv_blocks=64)
    engine.speculation = Speculation(drafter("self", engine.model), 4, adaptive=True)
    loop = engine.loop.speculation
    for _ in range(MIN_SAMPLES):  # steps of 8 ms + 2 ms a row, draft steps of 2 ms + 1 ms a row
        for rows in (1, 4, 8, 16):
            loop.step_cost.observe(rows, 0.008 + 0.002 * rows)
            loop.draft_cost.observe(rows, 0.002 + 0.001 * rows)
    requests = [fake_request(i, [1, 2, 3], 16) for i in range(8)]
    # 8 decodes: 8 tokens in 24 ms; drafting one each and all accepted, 16 tokens in 40 + 10 ms
    assert [loop.wanted(requests) for _ in range(BACKOFF)][-1] == [1] * 8  # a probe: only prices say no
    for _ in range(MIN_SAMPLES):
        loop.timed.observe(8, 1, 16.0, 16, 0.050)
    assert all(loop.wanted(requests) == [0] * 8 for _ in range(3 * BACKOFF))
    assert loop.wanted(requests[:1])[0] > 0  # alone: 1 token in 10 ms, or up to 5 in 18 + 4 x 3 ms


def test_every_decode_probes_after_backoff_steps_where_only_the_estimates_hold_drafting_back(tiny_tokenizer):
    """A probe costs a draft step and a verified row for each decode: after BACKOFF plain steps, then twice as many
    after each probe that did not resume drafting."""
    engine = loop_engine(tiny_tokenizer, None, kv_blocks=64)
    engine.speculation = Speculation(drafter("self", engine.model), 4, adaptive=True)
    loop = engine.loop.speculation
    for _ in range(MIN_SAMPLES):  # steps of 16 ms + 1 ms a row, draft steps of 1 ms + 0.2 ms a row
        for rows in (1, 4, 8, 16, 40):
            loop.step_cost.observe(rows, 0.016 + 0.001 * rows)
            loop.draft_cost.observe(rows, 0.001 + 0.0002 * rows)
    requests = [fake_request(i, [1, 2, 3], 16) for i in range(4)]
    assert loop.wanted(requests)[0] > 0  # the prior estimate (0.8): long rounds pay here
    for request in requests:
        loop.acceptances[request].acceptance = 0.01  # drafts that were all rejected
    backoff = BACKOFF
    for _ in range(6):  # probes in vain: each next one waits twice as long, up to MAX_BACKOFF steps
        assert [loop.wanted(requests) for _ in range(backoff - 1)] == [[0] * 4] * (backoff - 1)
        assert loop.wanted(requests) == [1] * 4  # every decode probes together
        backoff = min(2 * backoff, MAX_BACKOFF)
    assert backoff == MAX_BACKOFF
    for request in requests:
        loop.acceptances[request].acceptance = 0.9  # the probes' drafts were accepted: drafting resumes
    assert loop.wanted(requests)[0] > 0 and loop.backoff == BACKOFF


@pytest.mark.parametrize("kind, unseen", [("draft", 12), ("self", 1), ("ngram", 1)])
def test_a_first_draft_step_feeds_what_the_draft_has_not_seen(tiny_tokenizer, kind, unseen):
    """A draft model with a KV pool of its own first reads a request's whole context (then, after plain steps, their
    tokens); the self draft reads the target's KV and n-gram lookup reads nothing: one row each."""
    engine = loop_engine(tiny_tokenizer, None, kv_blocks=64)
    speculate(engine, drafter(kind, engine.model), 4, adaptive=True)
    request = fake_request(0, list(range(5, 17)), 8)
    drafts = engine.loop.speculation.drafts
    assert drafts.unseen(request) == unseen
    if kind == "draft":
        with torch.inference_mode():  # as the engine loop's step runs it
            drafts.propose([(request, 1)], engine.loop.speculation.draft_cost)
        request.output_ids.append(3)  # the target's next token
        assert drafts.unseen(request) == 1


def test_a_drafter_without_a_model_is_timed_for_its_verified_rows(tiny_tokenizer):
    """n-gram lookup drafts for nothing, but its drafts' rows are verified: measure_cost times the target's steps."""
    engine = loop_engine(tiny_tokenizer, None, kv_blocks=64)
    ngram = NgramDrafter()
    ngram.measure_cost(engine.model, engine.fused, rows=5)
    calibration = ngram.calibration
    assert calibration is not None and calibration.a + calibration.b > 0 and calibration.b >= 0
    assert (calibration.draft_a, calibration.draft_b) == (0.0, 0.0)


def test_a_round_with_room_but_no_proposal_counts_as_a_rejected_draft(tiny_tokenizer):
    """An n-gram lookup that finds no match proposes nothing: the round brought no token, and the sequence's estimate
    falls as after a rejection (else a free-text request that rarely matches keeps the prior's 0.8, and the step's
    plan counts on drafts it never makes); a match keeps the estimate to its proposals' fate."""
    engine = loop_engine(tiny_tokenizer, None, kv_blocks=64)
    speculate(engine, NgramDrafter(), 4, adaptive=True)
    loop = engine.loop.speculation
    unmatched, matched = fake_request(0, list(range(5, 17)), 8), fake_request(1, [7, 8, 9] * 4, 8)
    for request in (unmatched, matched):
        engine.blocks.ensure_room(request.kv, request.num_tokens)
        request.kv.num_computed = request.num_tokens - 1
    batch = ScheduledBatch(decodes=[unmatched, matched], lookahead=[3, 3])
    drafts = loop.propose(batch, [unmatched, matched])
    assert unmatched not in drafts and drafts[matched] == [7, 8, 9]
    assert loop.acceptances[unmatched].acceptance == pytest.approx(PRIOR * (1 - WEIGHT))
    assert matched not in loop.acceptances or loop.acceptances[matched].acceptance == PRIOR


def test_a_new_sequence_starts_from_the_loops_running_estimate(tiny_tokenizer):
    """Every verified round (and every round that proposed nothing) also moves one estimate over all the loop's
    sequences (the Speculation's), and a new sequence starts from it, not from the prior: a drafter that agrees
    rarely (a small trained draft on free text: ~0.3) no longer drafts each new request's first rounds at a loss on
    the prior's 0.8 alone."""
    engine = loop_engine(tiny_tokenizer, None, kv_blocks=64)
    speculate(engine, NgramDrafter(), 4, adaptive=True)
    loop = engine.loop.speculation
    unmatched = fake_request(0, list(range(5, 17)), 8)
    engine.blocks.ensure_room(unmatched.kv, unmatched.num_tokens)
    unmatched.kv.num_computed = unmatched.num_tokens - 1
    for _ in range(10):  # rounds with room and no match: rejected drafts
        loop.propose(ScheduledBatch(decodes=[unmatched], lookahead=[3]), [unmatched])
    overall = engine.speculation.acceptance.acceptance
    assert overall == pytest.approx(PRIOR * (1 - WEIGHT) ** 10)
    newcomer = fake_request(1, [7, 8, 9] * 4, 8)
    loop.wanted([newcomer])
    assert loop.acceptances[newcomer].acceptance == overall
    # the estimate is the drafter's: it outlives the loop's hold on it (spec swapped off and on again)
    speculation = engine.speculation
    engine.speculation = None
    engine.speculation = speculation
    engine.loop.speculation.wanted([newcomer])
    assert engine.loop.speculation.acceptances[newcomer].acceptance == overall


def test_the_step_after_a_request_ends_decodes_plainly(tiny_tokenizer):
    """A closed-loop client sends its next request as soon as one ends: the step after an end drafts nothing, so that
    the new prompt does not wait out K draft steps before its own step."""
    engine = loop_engine(tiny_tokenizer, None, kv_blocks=64)
    speculate(engine, drafter("self", engine.model), 4, adaptive=True)
    loop = engine.loop.speculation
    requests = [fake_request(i, [1, 2, 3], 16) for i in range(3)]
    assert loop.wanted(requests)[0] > 0
    requests[0].finish_reason = "length"
    assert loop.wanted(requests[1:]) == [0, 0] and loop.planned is None
    loop.propose(ScheduledBatch(decodes=requests[1:], lookahead=[0, 0]), requests[1:])  # forgets the ended request
    assert loop.wanted(requests[1:])[0] > 0


def test_the_loop_judges_each_k_by_its_whole_steps(tiny_tokenizer):
    """Each step of decodes alone is timed whole, from its schedule to its tokens handed over, with the tokens it
    brought, under the (decodes, K) its plan chose: a K whose steps brought fewer tokens a second than plain steps
    (here: every drafting step made slow) is no longer chosen, though its pieces' prices say it pays."""
    engine = loop_engine(tiny_tokenizer, None, kv_blocks=256)
    speculate(engine, drafter("copy", engine.model), 4, adaptive=True)
    loop = engine.loop.speculation
    step_done = loop.step_done
    loop.step_done = lambda decodes, tokens, seconds: step_done(decodes, tokens, seconds * (100 if tokens > 1 else 1))
    prompts = [list(range(5 + i, 17 + i)) for i in range(3)]
    engine.generate_batch(prompts, max_new_tokens=40)
    timed = loop.timed.yields
    assert timed and all(decodes in (1, 2, 3) and 0 <= k <= 4 for decodes, k in timed)
    judged = [decodes for (decodes, k), steps in timed.items() if k and len(steps) >= MIN_SAMPLES]
    assert judged, "no K was timed often enough to be judged"
    requests = [fake_request(i, [1, 2, 3], 16) for i in range(judged[0])]
    target, draft = loop._costs()
    assert plan_k([0.9] * len(requests), 4, target, draft) > 0  # the pieces' prices: drafting pays
    assert loop.wanted(requests) == [0] * len(requests)
