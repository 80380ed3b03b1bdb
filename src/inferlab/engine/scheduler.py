"""Continuous batching policy: who waits, who runs this step, who is preempted when blocks run out.

Each step is one forward over at most `max_batched_tokens` tokens (vLLM V1's token budget): every
running sequence whose prompt is done decodes one token, and prompts fill the rest of the budget in
chunks, so a long prompt cannot stall those decodes.
With speculation on (`drafts_wanted` set), each decode of a step without prompt chunks also gets room for
the draft tokens its sequence will propose past its next one (its own K, chosen here), from the budget left
and free blocks only: a draft never preempts anyone, and a sequence decoding plainly takes none. A step that
feeds prompts drafts nothing: its K draft steps would run before the forward and hold those prompts back, every
new request's first token later for drafts that bring no more tokens than plain decoding does.
A waiting request is admitted only when the pool holds its prompt plus its first generated token.
When a decode needs a block and none is free, the latest admitted sequence is preempted: its blocks
are freed and it goes back to the front of the queue, to be recomputed (its full blocks often come
back from the prefix cache). Requests may be added and cancelled from any thread; `schedule` runs on
the engine loop's thread, which alone touches KV memory.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from inferlab.engine.kv.block_manager import BlockManager
from inferlab.engine.request import Request
from inferlab.errors import OverloadedError


@dataclass
class SchedulerConfig:
    max_running: int  # sequences in one step
    max_waiting: int  # queued requests beyond which `add` refuses (the server's 503)
    max_batched_tokens: int  # tokens one step's forward computes: decode tokens and prompt chunks together


@dataclass
class ScheduledBatch:
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens to feed this step)
    decodes: list[Request] = field(default_factory=list)  # each feeds its last sampled token
    lookahead: list[int] = field(default_factory=list)  # per decode (with drafts_wanted): its drafts' room

    @property
    def work(self) -> list[tuple[Request, int]]:
        """Every request of the step with its token count: the decodes first, then the prompt chunks."""
        return [(r, 1) for r in self.decodes] + self.prefills

    @property
    def num_rows(self) -> int:
        """Token rows the step feeds (before any drafts): one a decode, and the prompt chunks'."""
        return len(self.decodes) + sum(n for _, n in self.prefills)


# A step's decodes -> how many draft tokens each one's sequence will propose (speculation's K per sequence)
DraftsWanted = Callable[[list[Request]], list[int]]


class Scheduler:
    def __init__(
        self, blocks: BlockManager, config: SchedulerConfig, drafts_wanted: DraftsWanted | None = None
    ) -> None:
        """`drafts_wanted`: with speculation on, each decode's K (engine/spec/in_loop.py); None: no drafts."""
        self.blocks, self.config, self.drafts_wanted = blocks, config, drafts_wanted
        self.waiting: list[Request] = []  # ordered by (priority, arrival)
        self.running: list[Request] = []  # in admission order
        self.preemptions = 0
        self._mutex = threading.Lock()

    def add(self, request: Request, bounded: bool = True) -> None:
        """Queue a request, or refuse it before anything runs (never fits: CapacityError; queue full: Overloaded).

        `bounded=False` skips the wait-queue limit, for a caller that waits for its own batch.
        """
        self.blocks.check_fits(len(request.prompt_ids) + request.max_new_tokens)
        with self._mutex:
            if bounded and len(self.waiting) >= self.config.max_waiting:
                raise OverloadedError(f"the KV pool is busy and {len(self.waiting)} requests already wait; retry later")
            self._enqueue(request)

    def cancel(self, request: Request) -> None:
        """Mark a request cancelled; its memory is freed at the start of the next step (never mid-forward)."""
        request.cancelled = True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        with self._mutex:
            self._reap_cancelled()
            batch = ScheduledBatch()
            budget = self.config.max_batched_tokens
            preempted = self._schedule_decodes(batch, budget)
            budget -= len(batch.decodes)
            for request in self.running:  # prompts admitted earlier continue first
                if budget and request not in batch.decodes and request.num_uncomputed > 1:
                    n = min(request.num_uncomputed, budget)
                    batch.prefills.append((request, n))
                    budget -= n
            while budget and not preempted and self.waiting and len(self.running) < self.config.max_running:
                request = self.waiting[0]
                if not self.blocks.can_allocate(request.num_tokens + 1):
                    break  # first come, first served: no overtaking the head of the queue
                self.waiting.pop(0)
                self.blocks.allocate(
                    request.kv, request.token_ids, request.num_tokens + 1, reuse=not request.wants_prompt_logprobs
                )
                self.running.append(request)
                n = min(request.num_uncomputed, budget)
                batch.prefills.append((request, n))
                budget -= n
            if self.drafts_wanted is not None and batch.decodes and not batch.prefills:
                self._reserve_lookahead(batch, self.drafts_wanted(batch.decodes), budget)
            return batch

    def finish(self, request: Request) -> None:
        """A request ended (or failed): free its blocks at once."""
        with self._mutex:
            self._drop(request)

    def drain(self) -> list[Request]:
        """Remove every request, freeing all memory (after a failed step); returns them to be told."""
        with self._mutex:
            requests = self.running + self.waiting
            for request in requests:
                self._drop(request)
            return requests

    def _schedule_decodes(self, batch: ScheduledBatch, budget: int) -> bool:
        """Give decoding sequences, up to `budget` of them in admission order, room for their next token,
        preempting from the back; True if any was preempted."""
        preempted = False
        for request in list(self.running):
            if len(batch.decodes) == budget:
                break
            if request not in self.running or request.num_uncomputed != 1:  # preempted above, or still prefilling
                continue
            while not self.blocks.ensure_room(request.kv, request.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                batch.decodes.append(request)
        return preempted

    def _reserve_lookahead(self, batch: ScheduledBatch, wanted: list[int], budget: int) -> None:
        """Room for each decode's drafts, up to its `wanted`, what it may still generate, the budget and the free
        blocks."""
        used = 0
        for request, k in zip(batch.decodes, wanted):
            want = min(k, request.max_new_tokens - len(request.output_ids) - 1, budget - used)
            if want > 0:
                self.blocks.ensure_room(request.kv, request.num_tokens + want)  # as far as free blocks go
                want = min(want, len(request.kv.blocks) * self.blocks.block_size - request.num_tokens)
            batch.lookahead.append(max(want, 0))
            used += batch.lookahead[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.kv)
        self.preemptions += 1
        self._enqueue(request)

    def _reap_cancelled(self) -> None:
        for request in [r for r in self.running + self.waiting if r.cancelled]:
            self._drop(request)

    def _drop(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
            self.blocks.free(request.kv)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: (r.priority, r.request_id))
