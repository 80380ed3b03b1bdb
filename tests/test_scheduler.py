"""Continuous batching: the allocator never leaks or over-admits, preemption recomputes exactly, submit() streams."""

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
from conftest import tiny_engine
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from inferlab.engine.engine import GenerationRequest, InferenceEngine
from inferlab.engine.kv.block_manager import BlockManager
from inferlab.engine.kv.prefix_cache import PrefixCache
from inferlab.engine.request import Request
from inferlab.engine.sampling import SamplingParams
from inferlab.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from inferlab.errors import CapacityError, OverloadedError

PREFIXES = [[1, 2, 3, 4, 5, 6], [9, 9, 9, 9], []]


def next_token(token_ids: list[int]) -> int:
    """The fake model: a deterministic function of the whole history, so recomputation must reproduce it."""
    return (sum(t * (i + 1) for i, t in enumerate(token_ids)) % 50) + 1


def expected_output(prompt: list[int], max_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def fake_request(i: int, prompt: list[int], max_new: int, priority: int = 0) -> Request:
    return Request(
        i,
        prompt,
        SamplingParams(max_new_tokens=max_new),
        max_new,
        text=None,
        eos_ids=set(),
        emit=lambda event: None,
        priority=priority,
    )


def fake_step(scheduler: Scheduler) -> ScheduledBatch:
    """What the engine's step does with the model replaced by `next_token`."""
    batch = scheduler.schedule()
    fake_run(scheduler, batch)
    return batch


def fake_run(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    """A scheduled step's work, each request fed and sampled with `next_token`."""
    check_invariants(scheduler)
    blocks = scheduler.blocks
    assert sum(n for _, n in batch.work) <= scheduler.config.max_batched_tokens
    for request, n in batch.work:
        assert len(request.kv.blocks) * blocks.block_size >= request.kv.num_computed + n  # room for what it writes
        blocks.advance(request.kv, request.token_ids, n)
        if request.num_uncomputed == 0:
            request.output_ids.append(next_token(request.token_ids))
            if len(request.output_ids) == request.max_new_tokens:
                request.finish_reason = "length"
                scheduler.finish(request)


def check_invariants(scheduler: Scheduler) -> None:
    blocks = scheduler.blocks
    held = [b for r in scheduler.running for b in r.kv.blocks]
    assert all(not r.kv.blocks for r in scheduler.waiting)
    for block in range(blocks.num_blocks):
        assert blocks.ref_counts[block] == held.count(block)
    free, parked = set(blocks.free_ids), set(blocks.prefix.lru if blocks.prefix else ())
    assert len(free) == len(blocks.free_ids) and not free & parked and not free & set(held)
    assert not parked & set(held)
    assert len(set(held)) + len(free) + len(parked) == blocks.num_blocks  # every block is somewhere, once
    assert len(scheduler.running) <= scheduler.config.max_running
    for request in scheduler.running:
        assert len(request.kv.blocks) >= blocks.blocks_for(request.kv.num_computed)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, 2), st.integers(1, 4), st.integers(2, 16), st.integers(0, 1)),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 3)),
    ),
    min_size=4,
    max_size=40,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    num_blocks=st.integers(6, 14),
    block_size=st.integers(2, 3),
    prefix=st.booleans(),
    max_running=st.integers(1, 6),
    budget=st.integers(1, 16),
)
def test_allocator_never_leaks_never_over_admits_and_preemption_recomputes_exactly(
    ops, num_blocks, block_size, prefix, max_running, budget
):
    blocks = BlockManager(num_blocks, block_size, block_bytes=1, prefix_cache=PrefixCache() if prefix else None)
    scheduler = Scheduler(blocks, SchedulerConfig(max_running=max_running, max_waiting=6, max_batched_tokens=budget))
    requests: list[Request] = []
    for op in ops:
        if op[0] == "arrive":
            _, which, suffix, max_new, priority = op
            prompt = PREFIXES[which] + [(len(requests) * 7 + j) % 40 + 10 for j in range(suffix)]
            request = fake_request(len(requests), prompt, max_new, priority)
            try:
                scheduler.add(request)
            except CapacityError:  # the whole pool could never hold it: refused before anything runs
                assert blocks.blocks_for(len(prompt) + max_new) > num_blocks
                continue
            except OverloadedError:
                assert len(scheduler.waiting) == 6
                continue
            requests.append(request)
        elif op[0] == "cancel" and requests:
            scheduler.cancel(requests[op[1] % len(requests)])
        elif op[0] == "step":
            for _ in range(op[1]):
                fake_step(scheduler)
    for _ in range(10_000):  # let everything still alive finish
        if not scheduler.has_work():
            break
        fake_step(scheduler)
    assert not scheduler.has_work()
    event(f"preempted: {scheduler.preemptions > 0}")
    assert blocks.num_free == num_blocks and not any(blocks.ref_counts)
    for request in requests:
        if request.finished:
            assert request.output_ids == expected_output(request.prompt_ids, request.max_new_tokens)
        else:
            assert request.cancelled


def test_waiting_requests_go_by_priority_then_arrival():
    scheduler = Scheduler(BlockManager(4, 4, 1), SchedulerConfig(max_running=1, max_waiting=8, max_batched_tokens=64))
    low, high, high_later = fake_request(0, [1, 2], 2, 5), fake_request(1, [3, 4], 2, 0), fake_request(2, [5], 2, 0)
    for request in (low, high, high_later):
        scheduler.add(request)
    order = []
    while scheduler.has_work():
        fake_step(scheduler)
        order += [r.request_id for r in scheduler.running if r.request_id not in order]
    assert order == [1, 2, 0]


def paged_engine(tokenizer, kv_blocks: int, block_size: int = 8, prefix: bool = False, **scheduler) -> InferenceEngine:
    engine = tiny_engine(tokenizer, "paged")
    config = replace(
        engine.config,
        kv_blocks=kv_blocks,
        block_size=block_size,
        prefix_cache=prefix,
        scheduler=replace(engine.config.scheduler, **scheduler),
    )
    return InferenceEngine(engine.loaded, config)


@pytest.mark.parametrize("prefix", [False, True])
def test_preempted_requests_finish_with_the_unpreempted_greedy_output(tiny_tokenizer, prefix):
    prompts = [list(range(10 + i, 22 + 2 * i)) for i in range(4)]
    reference = tiny_engine(tiny_tokenizer, "contiguous", slots=1)
    expected = [reference.generate(p, max_new_tokens=24).token_ids for p in prompts]
    engine = paged_engine(tiny_tokenizer, kv_blocks=7, prefix=prefix)  # 56 tokens; each request needs up to 42
    completions = engine.generate_batch(prompts, max_new_tokens=24)
    assert engine.stats()["preemptions"] > 0
    assert [c.token_ids for c in completions] == expected
    assert engine.stats()["kv_blocks_used"] == 0


def test_a_request_larger_than_the_pool_is_refused_at_once(tiny_tokenizer):
    engine = paged_engine(tiny_tokenizer, kv_blocks=4)  # 32 tokens

    async def submit():
        engine.submit(GenerationRequest(list(range(20)), SamplingParams(max_new_tokens=20)))

    with pytest.raises(CapacityError, match=r"40 tokens .* whole pool holds 32 tokens"):
        asyncio.run(submit())
    assert engine.stats()["requests_waiting"] == 0


async def collect(events) -> list[int]:
    return [e.token_id async for e in events if e.token_id is not None]


def test_a_full_wait_queue_refuses_new_requests_and_loses_nothing_running(tiny_tokenizer):
    engine = paged_engine(tiny_tokenizer, kv_blocks=32, max_waiting=2)
    params = SamplingParams(max_new_tokens=6)
    prompts = [list(range(5, 15)), list(range(20, 27))]

    async def main():
        with engine._lock:  # the loop cannot step: everything submitted now waits
            streams = [engine.submit(GenerationRequest(p, params)) for p in prompts]
            with pytest.raises(OverloadedError):
                engine.submit(GenerationRequest([1, 2, 3], params))
            assert engine.stats()["requests_waiting"] == 2
        return await asyncio.gather(*(collect(s) for s in streams))

    reference = tiny_engine(tiny_tokenizer, "contiguous", slots=1)
    assert asyncio.run(main()) == [reference.generate(p, max_new_tokens=6).token_ids for p in prompts]


def test_closing_the_stream_cancels_and_frees_blocks_while_others_continue(tiny_tokenizer):
    engine = paged_engine(tiny_tokenizer, kv_blocks=32)
    reference = tiny_engine(tiny_tokenizer, "contiguous", slots=1)
    survivor_prompt = list(range(50, 70))

    async def main():
        leaver = engine.submit(GenerationRequest(list(range(5, 40)), SamplingParams(max_new_tokens=200)))
        survivor = asyncio.ensure_future(
            collect(engine.submit(GenerationRequest(survivor_prompt, SamplingParams(max_new_tokens=30))))
        )
        seen = [await leaver.__anext__() for _ in range(3)]
        await leaver.aclose()  # the client went away
        tokens = await survivor
        deadline = time.monotonic() + 10
        while engine.stats()["kv_blocks_used"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return seen, tokens

    seen, tokens = asyncio.run(main())
    assert seen[0].ttft_ms is not None and [e.index for e in seen] == [0, 1, 2]
    assert tokens == reference.generate(survivor_prompt, max_new_tokens=30).token_ids
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["requests_running"] == stats["requests_waiting"] == 0


def test_per_request_sampling_params_in_one_batch(tiny_tokenizer):
    engine = paged_engine(tiny_tokenizer, kv_blocks=64)
    reference = tiny_engine(tiny_tokenizer, "contiguous", slots=1)
    cases = [
        (list(range(5, 25)), dict(temperature=0.0)),
        (list(range(30, 41)), dict(temperature=0.9, seed=7)),
        (list(range(60, 90)), dict(temperature=1.2, top_k=5, seed=3)),
        (list(range(90, 99)), dict(temperature=0.7, top_p=0.8, seed=11)),
    ]

    async def main():
        streams = [
            engine.submit(GenerationRequest(p, engine.sampling_params(max_new_tokens=16, **kw))) for p, kw in cases
        ]
        return await asyncio.gather(*(collect(s) for s in streams))  # all four decode in the same batches

    outputs = asyncio.run(main())
    assert outputs == [reference.generate(p, max_new_tokens=16, **kw).token_ids for p, kw in cases]


def test_a_long_prompt_is_chunked_and_never_stalls_running_decodes():
    """The decode token counts against the step's token budget; the prompt fills the rest."""
    scheduler = Scheduler(BlockManager(64, 4, 1), SchedulerConfig(max_running=4, max_waiting=8, max_batched_tokens=5))
    short = fake_request(0, [1, 2, 3], 30)
    scheduler.add(short)
    fake_step(scheduler)  # its prompt, then it decodes
    scheduler.add(fake_request(1, list(range(10, 33)), 4))  # 23 prompt tokens
    for _ in range(6):  # ceil(23 / 4) steps of prefill, each beside the short request's decode
        batch = scheduler.schedule()
        assert batch.decodes == [short] and sum(n for _, n in batch.work) <= 5
        for request, n in batch.work:
            scheduler.blocks.advance(request.kv, request.token_ids, n)
            if request.num_uncomputed == 0:
                request.output_ids.append(next_token(request.token_ids))
    assert scheduler.running[1].kv.num_computed == 23 and len(scheduler.running[1].output_ids) == 1


def test_only_the_drafts_a_sequence_will_propose_take_room_and_a_step_feeding_prompts_drafts_nothing():
    """With speculation on, each decode of a step of decodes alone gets room for its own K (asked per step): a
    sequence decoding plainly (K = 0) takes no block. A step that feeds a prompt asks no K and reserves nothing:
    its draft steps would hold the prompt back."""
    wanted = {0: 0, 1: 4, 2: 0}
    asked = []

    def drafts_wanted(decodes):
        asked.append([r.request_id for r in decodes])
        return [wanted[r.request_id] for r in decodes]

    scheduler = Scheduler(
        BlockManager(64, 4, 1),
        SchedulerConfig(max_running=4, max_waiting=8, max_batched_tokens=16),
        drafts_wanted=drafts_wanted,
    )
    plain, drafting = fake_request(0, [1, 2, 3, 4], 30), fake_request(1, [5, 6, 7, 8], 30)
    scheduler.add(plain)
    scheduler.add(drafting)
    fake_step(scheduler)  # both prompts; each has its first token now
    scheduler.add(fake_request(2, list(range(10, 40)), 4))  # 30 prompt tokens
    batch = scheduler.schedule()
    assert batch.decodes == [plain, drafting] and batch.lookahead == [] and asked == []
    assert len(plain.kv.blocks) == 2 and len(drafting.kv.blocks) == 2  # 5 positions each: no room for drafts
    assert batch.prefills[0][1] == 16 - 2  # the whole budget the decodes left
    fake_run(scheduler, batch)
    while True:  # the prompt's later chunks: still no drafts
        positions = drafting.num_tokens
        batch = scheduler.schedule()
        if not batch.prefills:  # three decodes alone
            break
        assert batch.lookahead == [] and asked == []
        fake_run(scheduler, batch)
    assert not batch.prefills and asked == [[0, 1, 2]] and batch.lookahead == [0, 4, 0]
    assert len(drafting.kv.blocks) * 4 >= positions + 4 > (len(drafting.kv.blocks) - 1) * 4  # room for its 4 drafts
    assert len(plain.kv.blocks) == -(-plain.num_tokens // 4)  # no more than its own positions


def test_chunked_prefill_through_the_engine_gives_single_request_tokens(tiny_tokenizer):
    prompts = [list(range(5, 45)), list(range(50, 61)), list(range(70, 103))]
    engine = paged_engine(tiny_tokenizer, kv_blocks=64, max_batched_tokens=7)
    reference = tiny_engine(tiny_tokenizer, "contiguous", slots=1)
    assert [c.token_ids for c in engine.generate_batch(prompts, max_new_tokens=10)] == [
        reference.generate(p, max_new_tokens=10).token_ids for p in prompts
    ]


@pytest.fixture(scope="module")
def greedy_reference(tiny_tokenizer):
    """(prompt, max_new) -> the single-request greedy tokens, each computed once."""
    engine = tiny_engine(tiny_tokenizer, "contiguous", slots=1)
    return functools.cache(lambda prompt, max_new: engine.generate(list(prompt), max_new_tokens=max_new).token_ids)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    ops=operations,
    kv_blocks=st.integers(4, 8),
    prefix=st.booleans(),
    max_running=st.integers(2, 5),
    budget=st.integers(1, 24),
)
def test_the_engine_loop_never_leaks_and_gives_single_request_tokens(
    tiny_tokenizer, greedy_reference, one_thread, ops, kv_blocks, prefix, max_running, budget
):
    """The real loop (one flat forward a step on the tiny model) under random arrivals, cancels and
    preemptions: every block comes back, and every finished request has its single-request greedy tokens."""
    engine = paged_engine(
        tiny_tokenizer, kv_blocks, block_size=4, prefix=prefix, max_running=max_running, max_batched_tokens=budget
    )

    def step(requests: list[Request]) -> None:
        engine.loop.step()
        check_invariants(engine.scheduler)

    requests = run_operations(engine, ops, step)
    assert not engine.scheduler.has_work()
    event(f"preempted: {engine.scheduler.preemptions > 0}")
    assert engine.blocks.num_free == kv_blocks and not any(engine.blocks.ref_counts)
    assert_single_request_tokens(requests, greedy_reference)


def run_operations(engine, ops, step: Callable[[list[Request]], None]) -> list[Request]:
    """Apply `operations()` (arrivals, cancels, steps) to `engine`, then step until no work is left; `step(requests)`
    runs one engine step and checks what it must. Returns the requests admitted."""
    requests: list[Request] = []
    for op in ops:
        if op[0] == "arrive":
            _, which, suffix, max_new, priority = op
            prompt = PREFIXES[which] + [(len(requests) * 7 + j) % 40 + 10 for j in range(suffix)]
            request = engine._new_request(
                prompt, SamplingParams(max_new_tokens=max_new), lambda e: None, priority=priority
            )
            try:
                engine.scheduler.add(request)
            except (CapacityError, OverloadedError):
                continue
            requests.append(request)
        elif op[0] == "cancel" and requests:
            engine.scheduler.cancel(requests[op[1] % len(requests)])
        elif op[0] == "step":
            for _ in range(op[1]):
                step(requests)
    for _ in range(10_000):
        if not engine.scheduler.has_work():
            break
        step(requests)
    return requests


def assert_single_request_tokens(requests: list[Request], greedy_reference) -> None:
    """Every finished request has its single-request greedy tokens; every other one was cancelled."""
    for request in requests:
        if request.finished:
            assert request.output_ids == greedy_reference(tuple(request.prompt_ids), request.max_new_tokens)
        else:
            assert request.cancelled


def test_every_way_in_on_the_paged_cache_goes_through_the_engine_loop(tiny_tokenizer):
    """generate, chat, stream_generate, submit and generate_batch all run as engine-loop steps on the paged
    cache, each giving the single-sequence reference's tokens."""
    engine = paged_engine(tiny_tokenizer, kv_blocks=64)
    reference = tiny_engine(tiny_tokenizer, "contiguous", slots=1)
    steps: list[int] = []
    step = engine.loop.step
    engine.loop.step = lambda: steps.append(1) or step()
    prompt, messages = list(range(5, 25)), [{"role": "user", "content": "Hello there"}]
    params = SamplingParams(max_new_tokens=8)

    def stream(method) -> list[int]:
        async def main() -> list[int]:  # submit queues at once: call it on a running event loop
            return await collect(method(GenerationRequest(prompt, params)))

        return asyncio.run(main())

    expected = reference.generate(prompt, max_new_tokens=8).token_ids
    ways = {
        "generate": lambda: engine.generate(prompt, max_new_tokens=8).token_ids,
        "chat": lambda: engine.chat(messages, max_new_tokens=8).token_ids,
        "stream_generate": lambda: stream(engine.stream_generate),
        "submit": lambda: stream(engine.submit),
        "generate_batch": lambda: engine.generate_batch([prompt, prompt[3:]], max_new_tokens=8)[0].token_ids,
    }
    for name, way in ways.items():
        before = len(steps)
        want = reference.chat(messages, max_new_tokens=8).token_ids if name == "chat" else expected
        assert way() == want, name
        assert len(steps) - before >= 8, name  # the prompt, then one step per further token (at least)
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["requests_running"] == 0
