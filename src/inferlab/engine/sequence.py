"""One request's state inside the scheduler (vLLM's `Sequence`), and the events it streams out.

The scheduler moves a `Request` between waiting and running; the engine loop feeds its uncomputed
tokens, samples, and calls `accept`, which turns a token into the events the client sees.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from inferlab.engine.block_manager import BlockTable
from inferlab.engine.sampling import SamplingParams
from inferlab.engine.stop import TextStream


@dataclass
class Timings:
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float  # start of the request -> first token sampled
    total_ms: float
    tpot_ms: float  # (total - ttft) / (completion_tokens - 1)
    tokens_per_sec: float  # decode rate: 1000 / tpot_ms

    @classmethod
    def measure(cls, start: float, first: float, end: float, prompt_tokens: int, completion_tokens: int) -> "Timings":
        ttft, total = (first - start) * 1e3, (end - start) * 1e3
        tpot = (total - ttft) / (completion_tokens - 1) if completion_tokens > 1 else 0.0
        return cls(prompt_tokens, completion_tokens, ttft, total, tpot, 1e3 / tpot if tpot > 0 else 0.0)


@dataclass
class StreamEvent:
    """One generated token (`token_id` set), or the closing event (`finish_reason` and `timings` set)."""

    index: int
    text: str
    token_id: int | None = None
    ttft_ms: float | None = None  # on the first token only
    finish_reason: str | None = None
    timings: Timings | None = None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: int  # arrival order: ties in priority go first-come first-served
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # the params' value, capped by the context
    text: TextStream
    eos_ids: set[int]
    emit: Callable[[StreamEvent | BaseException], None]  # called on the engine loop's thread
    generator: torch.Generator | None = None
    priority: int = 0  # lower runs sooner
    start: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    kv: BlockTable = field(default_factory=BlockTable)
    status: Status = Status.WAITING
    cancelled: bool = False
    finish_reason: str | None = None
    first_token_time: float | None = None
    preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed: the rest of the prompt (or all of it after a preemption), else the last sample."""
        return self.num_tokens - self.kv.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token: int) -> list[StreamEvent]:
        """A sampled token -> the events to stream: the token's, and the closing one when it ends the request."""
        now = time.perf_counter()
        if not self.output_ids:
            self.first_token_time = now
        if token in self.eos_ids:
            return [self._close("stop")]
        self.output_ids.append(token)
        delta, stopped = self.text.push(token)
        n = len(self.output_ids)
        events = [StreamEvent(n - 1, delta, token, (now - self.start) * 1e3 if n == 1 else None)]
        if stopped or n >= self.max_new_tokens:
            events.append(self._close("stop" if stopped else "length"))
        return events

    def _close(self, reason: str) -> StreamEvent:
        self.finish_reason = reason
        timings = Timings.measure(self.start, self.first_token_time, time.perf_counter(), len(self.prompt_ids),
                                  len(self.output_ids))
        return StreamEvent(len(self.output_ids), self.text.flush(), finish_reason=reason, timings=timings)
