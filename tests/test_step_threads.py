"""Small engine steps run on fewer intra-op threads (this thread only), and produce the same tokens."""

import os
import threading
import time
from dataclasses import replace

import pytest
import torch
from conftest import tiny_engine, tiny_model

from inferlab.engine.engine import InferenceEngine
from inferlab.engine.runtime.threads import StepThreads, omp_set_num_threads, on_own_thread
from inferlab.engine.spec.draft_model import ModelDrafter
from inferlab.engine.spec.session import Speculation
from inferlab.errors import EngineFailedError

needs_two = pytest.mark.skipif(
    torch.get_num_threads() < 2 or omp_set_num_threads() is None, reason="needs 2+ torch threads and OpenMP"
)


@needs_two
def test_a_small_step_runs_on_fewer_threads_of_this_thread_only():
    full, seen = torch.get_num_threads(), {}
    policy = StepThreads(threads=1, max_rows=2).team()
    with policy.step(rows=2):
        seen["small"] = torch.get_num_threads()
        other = threading.Thread(target=lambda: seen.update(other=torch.get_num_threads()))
        other.start()
        other.join()
    seen["after"] = torch.get_num_threads()
    with policy.step(rows=3):
        seen["large"] = torch.get_num_threads()
    with StepThreads().team().step(rows=1):  # off
        seen["off"] = torch.get_num_threads()
    assert seen == {"small": 1, "other": full, "after": full, "large": full, "off": full}


@needs_two
def test_the_engine_loop_steps_a_lone_decode_on_one_thread_with_the_same_tokens(tiny_tokenizer):
    off = tiny_engine(tiny_tokenizer, "paged")
    on = InferenceEngine(off.loaded, replace(off.config, small_steps=StepThreads(threads=1, max_rows=2)))
    forwards: list[tuple[int, int]] = []  # (rows, threads) of each step's forward

    def hook(stage, requests):
        if stage == "forward":
            forwards.append((sum(r.num_uncomputed for r in requests), torch.get_num_threads()))

    on.loop.fault_hook = hook
    prompts = [list(range(5, 25)), list(range(30, 41))]
    for prompt in prompts:
        assert on.generate(prompt, max_new_tokens=8).token_ids == off.generate(prompt, max_new_tokens=8).token_ids
    full = torch.get_num_threads()
    assert {n for rows, n in forwards if rows <= 2} == {1}  # the decodes
    assert {n for rows, n in forwards if rows > 2} == {full}  # the prompts


def os_threads() -> set[str]:
    """This process's OS threads (their ids)."""
    return set(os.listdir("/proc/self/task"))


def left_since(before: set[str], timeout: float = 15.0) -> list[str]:
    """The OS threads started after `before` was taken that are still alive after waiting up to `timeout` s, as
    "tid name state" (the Python name where Python knows the thread, else "native"), so that a failure says which.
    Threads of other tests that end meanwhile do not count: a worker of the test run holds threads of its earlier
    tests."""
    deadline = time.monotonic() + timeout
    while os_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    names = {str(t.native_id): t.name for t in threading.enumerate()}

    def state(tid: str) -> str:
        try:
            return open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "gone"

    return [f"{tid} {names.get(tid, 'native')} {state(tid)}" for tid in sorted(os_threads() - before)]


@needs_two
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_work_on_its_own_thread_leaves_no_openmp_team_behind():
    """What a parallel region started on a thread leaves (its OpenMP team) goes when that thread ends; the result
    and the exception come back to the caller."""
    big = torch.ones(1 << 22)
    before = os_threads()
    total = on_own_thread(lambda: float(big.add(1).sum()))
    assert total == 2 * big.numel()
    assert left_since(before) == []  # the team's threads end as their owner does, not before it returns
    with pytest.raises(ValueError, match="bad model"):
        on_own_thread(lambda: (_ for _ in ()).throw(ValueError("bad model")))


@needs_two
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_a_closed_or_dropped_engine_leaves_no_loop_thread_or_openmp_team_behind(tiny_tokenizer):
    """The engine loop's thread keeps an OpenMP team; beside the next engine's it made every parallel region of
    that one's steps wait on a futex. close() ends it (later requests are refused), and so does dropping the engine."""
    big = torch.ones(1 << 22)
    float(big.add(1).sum())  # this thread's own team, before counting
    before, loops_before = os_threads(), engine_loops()  # earlier tests' engines may still hold theirs
    engine = tiny_engine(tiny_tokenizer, "paged")
    want = engine.generate(list(range(5, 25)), max_new_tokens=4).token_ids
    assert engine_loops() - loops_before  # this engine's loop thread
    engine.close()
    assert left_since(before) == []  # the loop thread, and its OpenMP team
    with pytest.raises(EngineFailedError, match="closed"):
        engine.generate(list(range(5, 25)), max_new_tokens=4)
    dropped = tiny_engine(tiny_tokenizer, "paged")
    assert dropped.generate(list(range(5, 25)), max_new_tokens=4).token_ids == want
    del dropped
    assert left_since(before) == []


def engine_loops() -> set[threading.Thread]:
    """The engine loop threads alive in this process (of every engine not yet closed or collected)."""
    return {t for t in threading.enumerate() if t.name == "inferlab-engine"}


def test_a_draft_pool_is_allocated_off_the_callers_thread(tiny_tokenizer, monkeypatch):
    """Setting a drafter builds the loop's draft pool (a draft model's KV, zero-filled by OpenMP) on a thread that
    ends: on the caller's thread it left a team beside the loop's, and every later step ran at half speed."""
    import inferlab.engine.engine as engine_module

    loop_drafts, built_on = engine_module.loop_drafts, []

    def recording(*args, **kwargs):
        built_on.append(threading.get_ident())
        return loop_drafts(*args, **kwargs)

    monkeypatch.setattr(engine_module, "loop_drafts", recording)
    engine = tiny_engine(tiny_tokenizer, "paged")
    engine.speculation = Speculation(ModelDrafter(tiny_model(0, n_layers=1)), 3)
    assert built_on and threading.get_ident() not in built_on
    assert engine.generate(list(range(5, 25)), max_new_tokens=4).token_ids  # the pool serves the loop
    engine.close()
