"""The engine loop: one thread owns the model and the KV memory and runs steps while there is work.

One step (`EngineLoop.step`) = schedule -> run -> sample -> stream. The scheduler picks every running sequence's
decode token and prompt chunks up to its token budget; they run as ONE flat forward (engine/model_runner.py); each
request whose tokens are all in samples its next token through its own sampling state; its events go to its
`emit`, which hands them to whoever waits (an asyncio queue for the server, a plain queue for `generate`). Requests
come and go from any thread (`add`, `cancel`); only this thread touches tensors. With speculation on
(engine/spec/in_loop.py), each decode's segment also carries its sequence's drafts, and "sample" verifies them:
several tokens per sequence per step, the same tokens as without. What is timed around a step (the step counters,
engine/runtime/step_stats.py; adaptive K's timings) hooks in around the run and after the hand-off, outside it.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor

from inferlab.engine.kv.block_manager import BlockManager
from inferlab.engine.kv.paged import PagedKVCache
from inferlab.engine.model_runner import FlatBatch, Segment, forward_flat, runs_fused
from inferlab.engine.request import Request, StreamEvent
from inferlab.engine.runtime.mailbox import batched
from inferlab.engine.runtime.step_stats import StepStats
from inferlab.engine.runtime.threads import StepTeam, StepThreads
from inferlab.engine.sampling import argmax_rows
from inferlab.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from inferlab.engine.spec.in_loop import LoopSpeculation
from inferlab.errors import EngineFailedError, GenerationError
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.transformer import Transformer

log = logging.getLogger(__name__)

# Tests inject a fault here: called with the stage ("forward", "sample") and the requests it covers;
# raising an Exception fails that work, raising a BaseException (SystemExit) stops the engine loop.
FaultHook = Callable[[str, "list[Request]"], None]

_LOOPS: weakref.WeakSet[EngineLoop] = weakref.WeakSet()  # the loops whose thread has started


@atexit.register
def _stop_loops() -> None:
    """At interpreter exit, before finalization: a daemon loop thread still inside a torch op (GIL released) when
    finalization starts is ended by pthread_exit as it retakes the GIL, through C++ frames that may not unwind,
    and the process aborts ("terminate called without an active exception", exit status 134)."""
    for loop in list(_LOOPS):
        loop.stop()


class EngineLoop:
    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        blocks: BlockManager,
        config: SchedulerConfig,
        fused: FusedDecode | None,
        lock: threading.Lock,
    ) -> None:
        """`lock` is the engine's: one forward at a time, whichever path runs it."""
        self.model, self.cache, self.blocks, self.fused, self.lock = model, cache, blocks, fused, lock
        self.scheduler = Scheduler(blocks, config)
        self.failure: str | None = None  # why the loop stopped; set once, then every request is refused
        self.fault_hook: FaultHook | None = None  # tests only
        self.speculation: LoopSpeculation | None = None  # drafts verified in the step's forward (set_speculation)
        self._wake = threading.Condition()  # the loop sleeps on it while there is nothing to do
        self._thread: threading.Thread | None = None
        self._stopping = False  # stop(): the loop returns after its current step
        self.threads: StepTeam = StepThreads().team()  # each step's intra-op team (engine/runtime/threads.py)
        self.stats = StepStats()  # where the steps' time goes (engine/runtime/step_stats.py)

    # ---- the front door's side: any thread -------------------------------------------------------
    def add(self, request: Request, bounded: bool = True) -> None:
        """Queue a request (refused before anything runs: CapacityError, OverloadedError, EngineFailedError)."""
        if self.failure is None:
            self.scheduler.add(request, bounded)
        if self.failure is not None:  # checked again: the loop may have stopped (and drained) meanwhile
            self.scheduler.finish(request)
            raise EngineFailedError(self.failure)
        with self._wake:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run_loop, name="inferlab-engine", daemon=True)
                self._thread.start()
                _LOOPS.add(self)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """Cancel (a no-op once it ended); the loop frees its blocks before its next forward."""
        if not request.finished:
            self.scheduler.cancel(request)
            with self._wake:
                self._wake.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop after its current step and wait (up to `timeout` s) for its thread, and with it the OpenMP
        team of worker threads it keeps; requests still queued, and every later one, are refused (EngineFailedError).
        For the engine's close() and the process's exit (_stop_loops)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():  # a finalizer may run on the loop itself
            thread.join(timeout)

    def set_speculation(self, speculation: LoopSpeculation | None) -> None:
        """Draft and verify inside the loop (None: plain decoding). Call it holding `lock`."""
        self.speculation = speculation
        self.scheduler.drafts_wanted = speculation.wanted if speculation is not None else None

    # ---- the loop's own thread ---------------------------------------------------------------------
    def _run_loop(self) -> None:
        """Run steps while there is work. A failure of one request's work fails that request alone (`_run`);
        the scheduler failing fails the requests it held; anything that escapes stops the loop for good:
        `failure` says why (the server's /health turns 503 and the process exits), and every waiting
        request is told at once."""
        try:
            while True:
                with self._wake, self.stats.idle():
                    self._wake.wait_for(lambda: self._stopping or self.scheduler.has_work())
                    if self._stopping:
                        self._refuse_all("the engine was closed")
                        return
                with self.stats.step(), self.lock:
                    began = time.perf_counter()
                    progressed = self._step_and_hand_off()
                    if self.speculation is not None:  # the whole step, schedule to hand-off, judges its K
                        self.speculation.handed_off(time.perf_counter() - began)
                if not progressed:  # waiting for memory another path holds: do not spin
                    with self._wake:
                        self._wake.wait(0.005)
        except BaseException as error:
            self._refuse_all(f"the engine loop stopped: {type(error).__name__} {error}".strip())
            log.critical("%s; every request is refused from now on", self.failure, exc_info=error)

    def _refuse_all(self, reason: str) -> None:
        """The loop ends: `failure` says why, and every request it holds is told."""
        self.failure = reason
        for request in self.scheduler.drain():
            deliver(request, EngineFailedError(reason))

    def _step_and_hand_off(self) -> bool:
        """One step; its events reach each event loop in one wakeup as it leaves `batched()` (the hand-off, timed).
        A failed step drops the requests it held: the scheduler's own state is in doubt, so it starts from empty."""
        with batched():
            try:
                progressed = self.step()
            except Exception as error:
                progressed = True
                log.error("an engine step failed; its requests are dropped", exc_info=error)
                for request in self.scheduler.drain():
                    deliver(request, GenerationError(f"the engine step failed ({type(error).__name__})"))
            handoff = time.perf_counter()
        self.stats.handoff_s += time.perf_counter() - handoff
        return progressed

    @torch.inference_mode()
    def step(self) -> bool:
        """One turn: schedule -> run (one flat forward) -> sample and stream. Call it holding `lock` (the loop
        does). Returns whether any token was computed."""
        with self.stats.timed("schedule"):
            batch = self.scheduler.schedule()
        if not batch.work:
            return False
        drafts = self.speculation.propose(batch, self.scheduler.running) if self.speculation else {}
        rows = batch.num_rows + sum(len(d) for d in drafts.values())
        with self._timing(batch, rows), self.threads.step(rows):  # on the threads the CPUs hold
            self._run(batch.work, drafts)
        return True

    @contextmanager
    def _timing(self, batch: ScheduledBatch, rows: int) -> Iterator[None]:
        """The hooks that time a step's run: the step counters' (a step that fed prompts) and speculation's (a step
        of decodes alone, which adaptive K weighs)."""
        speculation = self.speculation.timing(batch, rows) if self.speculation is not None else nullcontext()
        with self.stats.run(prompts=bool(batch.prefills)), speculation:
            yield

    def _run(self, work: list[tuple[Request, int]], drafts: dict[Request, list[int]]) -> None:
        """Feed each request its next `n` uncomputed tokens (and its `drafts`), all in one forward; sample those
        whose tokens are all in.

        A forward that raises is run again request by request (rewriting the same KV positions), so only
        the request that caused it fails; a request whose sampling, stop check or text fails fails alone.
        """
        try:
            logits, argmax = self._forward(work, drafts)
        except Exception as error:
            if len(work) == 1:
                self._fail(work[0][0], "forward", error)
            else:
                for item in work:
                    self._run([item], drafts)
            return
        with self.stats.timed("sample"):
            for (request, n), rows, token in zip(work, logits, argmax):
                try:
                    events = self._sample(request, rows, n, request in drafts, token)
                except Exception as error:
                    self._fail(request, "sample", error)
                    continue
                if request.finished:  # free first: a client that saw the closing event finds the memory back
                    self.scheduler.finish(request)
                if events and events[0].ttft_ms is not None:
                    self.stats.first_token(events[0].ttft_ms / 1e3)
                for event in events:
                    deliver(request, event)

    def _forward(
        self, work: list[tuple[Request, int]], drafts: dict[Request, list[int]]
    ) -> tuple[list[Tensor], list[int | None]]:
        """The step's one forward: each request's logits rows (n_logits, vocab), as `segment` asks, and the
        argmax of its last row (None without rows), taken for every request in one call."""
        if self.fault_hook is not None:
            self.fault_hook("forward", [r for r, _ in work])
        stats = self.stats
        with stats.timed("pack"):
            segments = [segment(r, n, drafts.get(r, [])) for r, n in work]
            batch = FlatBatch.pack(segments, self.cache.k.device)
        decode_rows = sum(len(s.tokens) for s, (r, _) in zip(segments, work) if r.num_uncomputed == 1)
        stats.count(decode_rows, batch.num_rows - decode_rows, runs_fused(self.fused, batch))
        with stats.timed("forward"):
            logits = forward_flat(self.model, self.cache, batch, self.fused, stats)
        counts = [s.n_logits for s in segments]
        with stats.timed("sample"):
            return list(logits.split(counts)), last_row_argmax(logits, counts)

    def _sample(self, request: Request, rows: Tensor, n: int, drafted: bool, argmax: int | None) -> list[StreamEvent]:
        """Record the `n` computed tokens; the events of the next token once the prompt is all in (of the
        tokens its drafts' verification keeps, for a `drafted` decode); `argmax` is its last row's."""
        if request.records_prompt_logits:
            request.record_prompt_logits(request.kv.num_computed, rows)
        if not drafted:
            self.blocks.advance(request.kv, request.token_ids, n)
            if request.num_uncomputed:
                return []  # a prompt chunk: its next token comes after the last chunk
        if self.fault_hook is not None:
            self.fault_hook("sample", [request])
        if drafted and self.speculation is not None:
            return self.speculation.verify(request, rows)
        return request.sample(rows[-1], argmax)

    def _fail(self, request: Request, stage: str, error: Exception) -> None:
        log.error("request %d failed in its %s; the others continue", request.request_id, stage, exc_info=error)
        request.finish_reason = "error"
        self.scheduler.finish(request)
        deliver(
            request,
            GenerationError(
                f"generation failed in this request's {stage} step "
                f"({type(error).__name__}); the server log has the details"
            ),
        )


def segment(request: Request, n: int, drafts: list[int]) -> Segment:
    """A request's next `n` tokens and its drafts; the logits wanted: every row of a prompt whose
    log-probabilities are asked, the last row once its tokens are all in (and every draft's), none for a
    prompt chunk with more to come."""
    start = request.kv.num_computed
    n_logits = n if request.records_prompt_logits else int(start + n == request.num_tokens) + len(drafts)
    return Segment(request.token_ids[start : start + n] + drafts, start, request.kv.blocks, n_logits)


def last_row_argmax(logits: Tensor, counts: list[int]) -> list[int | None]:
    """The argmax of each request's last row of `logits` (None for a request with no rows, `counts` of them each)."""
    ends = itertools.accumulate(counts)
    lasts = [end - 1 for end, count in zip(ends, counts) if count]
    picks = iter(argmax_rows(logits if len(lasts) == logits.shape[0] else logits[lasts]))
    return [next(picks) if count else None for count in counts]


def deliver(request: Request, item: StreamEvent | BaseException) -> None:
    try:
        request.emit(item)
    except RuntimeError:  # the client's event loop is gone: nobody is listening
        request.cancelled = True
