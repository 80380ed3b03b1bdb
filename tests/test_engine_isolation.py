"""One request's failure stays its own: a fault injected inside the engine step (the fault hook), or a
sampling value at the edge of what the schema accepts, beside a greedy stream. Reference: the same stream
run alone, whose tokens must come out identical; the KV pool is empty afterwards."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import tiny_engine

from inferlab.engine.engine import GenerationRequest
from inferlab.errors import EngineFailedError, GenerationError

GREEDY, FAILING, EDGE = "The quick brown fox", "Lorem ipsum dolor", "Once upon a time"


def request(engine, prompt: str, **sampling) -> GenerationRequest:
    return GenerationRequest(prompt, engine.sampling_params(max_new_tokens=24, **sampling))


async def collect(events) -> list[int] | BaseException:
    """The token ids of one stream, or the error it ended with."""
    ids = []
    try:
        async for event in events:
            if event.token_id is not None:
                ids.append(event.token_id)
    except Exception as error:
        return error
    return ids


def run_together(engine, requests: list[GenerationRequest]) -> list[list[int] | BaseException]:
    async def main():
        streams = [engine.submit(r) for r in requests]  # all queued before the loop's first step
        return await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), timeout=120)

    return asyncio.run(main())


def fault_for(prompt_ids: list[int], stage: str, after_tokens: int = 3, error: BaseException = RuntimeError("fault")):
    """A hook that raises `error` at `stage` whenever the request with `prompt_ids` is in the work,
    once it has generated `after_tokens` tokens (so it fails mid-stream, batched with the others)."""

    def hook(at: str, requests) -> None:
        if at == stage and any(r.prompt_ids == prompt_ids and len(r.output_ids) >= after_tokens for r in requests):
            raise error

    return hook


def assert_idle(engine) -> None:
    deadline = time.perf_counter() + 5
    while (stats := engine.stats())["kv_blocks_used"] and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert stats["kv_blocks_used"] == 0 and stats["requests_running"] == stats["requests_waiting"] == 0, stats


@pytest.fixture(params=["contiguous", "paged"])
def engine(request, tiny_tokenizer, one_thread):
    return tiny_engine(tiny_tokenizer, cache_mode=request.param, slots=4)


@pytest.mark.parametrize("stage", ["forward", "sample"])
def test_a_request_failing_inside_the_step_fails_alone(engine, stage):
    (alone,) = run_together(engine, [request(engine, GREEDY)])
    engine.fault_hook = fault_for(engine.encode_prompt(FAILING), stage)
    greedy, failed, edge = run_together(
        engine,
        [
            request(engine, GREEDY),
            request(engine, FAILING, temperature=0.8, seed=1),
            request(engine, EDGE, temperature=1.0, top_p=1e-50, seed=2),
        ],
    )
    assert greedy == alone and len(alone) == 24
    assert isinstance(failed, GenerationError) and stage in str(failed) and "\n" not in str(failed)
    # top_p=1e-50 keeps only the top token: the greedy choice, never nan
    engine.fault_hook = None
    assert edge == run_together(engine, [request(engine, EDGE)])[0]
    assert_idle(engine)


def test_a_stopped_engine_loop_refuses_every_request_and_says_why(engine):
    engine.fault_hook = fault_for(engine.encode_prompt(FAILING), "forward", 1, SystemExit(3))
    greedy, failed = run_together(engine, [request(engine, GREEDY), request(engine, FAILING)])
    assert isinstance(greedy, EngineFailedError) and isinstance(failed, EngineFailedError)
    assert engine.failure and "SystemExit" in engine.failure
    with pytest.raises(EngineFailedError):
        run_together(engine, [request(engine, GREEDY)])
    assert_idle(engine)
