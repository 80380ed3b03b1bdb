"""The engine-thread -> event-loop hand-off: every event arrives, in order, one wakeup per engine step."""

import asyncio
import threading

import pytest
from conftest import tiny_engine

from inferlab.engine.engine import GenerationRequest
from inferlab.engine.runtime.mailbox import batched, mailbox
from inferlab.engine.sampling import SamplingParams


def post_from_thread(work) -> None:
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def test_posts_outside_a_batch_arrive_at_once_and_in_order():
    async def main():
        box, queue = mailbox(), asyncio.Queue()
        post_from_thread(lambda: [box.post(queue, i) for i in range(5)])
        return [await asyncio.wait_for(queue.get(), 5) for _ in range(5)]

    assert asyncio.run(main()) == list(range(5))


def test_a_batch_wakes_each_loop_once_with_everything_in_order():
    async def main():
        box, queues = mailbox(), [asyncio.Queue() for _ in range(3)]
        assert mailbox() is box  # one per event loop

        def step() -> None:
            with batched():
                for i in range(4):
                    for q in queues:
                        box.post(q, i)
                with batched():  # nested: joins the outer batch
                    box.post(queues[0], 4)
                assert all(q.empty() for q in queues)  # nothing handed over inside the batch

        wakeups = box.wakeups
        post_from_thread(step)
        got = [[await asyncio.wait_for(q.get(), 5) for _ in range(4)] for q in queues]
        assert await asyncio.wait_for(queues[0].get(), 5) == 4
        return got, box.wakeups - wakeups

    got, wakeups = asyncio.run(main())
    assert got == [[0, 1, 2, 3]] * 3 and wakeups == 1


def test_a_closed_loop_refuses_posts():
    loop = asyncio.new_event_loop()
    box = mailbox(loop)
    with batched():  # the loop closes before the batch is handed over: leaving it does not raise
        box.post(asyncio.Queue(), 1)
        loop.close()
    with pytest.raises(RuntimeError):  # the engine marks the request cancelled
        box.post(asyncio.Queue(), 2)


def test_concurrent_streams_wake_the_event_loop_about_once_per_step(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, "paged")
    reference = tiny_engine(tiny_tokenizer, "contiguous", slots=1)
    prompts = [list(range(5 + i, 15 + 2 * i)) for i in range(6)]
    params = SamplingParams(max_new_tokens=12)

    async def collect(prompt):
        return [e.token_id async for e in engine.submit(GenerationRequest(prompt, params)) if e.token_id is not None]

    async def main():
        box = mailbox()
        with engine._lock:  # all six start together, so they decode in the same steps
            streams = [collect(p) for p in prompts]
            tasks = [asyncio.ensure_future(s) for s in streams]
            await asyncio.sleep(0)
        return await asyncio.gather(*tasks), box.wakeups

    outputs, wakeups = asyncio.run(main())
    assert outputs == [reference.generate(p, max_new_tokens=12).token_ids for p in prompts]
    events = sum(len(o) + 1 for o in outputs)  # tokens and closing events
    assert wakeups <= 12 + 2 < events  # about one per step (12 decode steps, a prefill), not one per event
