"""Where the engine loop's time goes: cumulative counters of its steps, by phase, read at any time.

One step is schedule -> pack (the flat batch's tensors) -> forward -> sample (each request's token and
events) -> hand-off (waking the event loops that got events). `forward` covers the one model call, split
into the attention the Python model runs outside its matrix products (`attention`, the flat attend's own
calls; 0 on the fused C++ step, which runs attention inside one call) and the rest. `idle` is the loop
waiting for work; `cpu` the engine thread's own CPU time inside steps, so `step - cpu` is the time it
waited for a core or the GIL (the intra-op worker threads' CPU is not counted). `first_token_s` sums each
request's time from `submit` to its first token, the engine's share of its TTFT. Rows are token rows:
`decode_rows` one per decoding sequence (plus drafts), `prompt_rows` the prompt chunks. A reader takes the
difference of two snapshots (`snapshot`) over a load and divides by the steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

PHASES = ("schedule", "pack", "forward", "attention", "sample", "handoff", "step", "cpu", "idle")


@dataclass
class StepStats:
    steps: int = 0
    fused_steps: int = 0  # steps whose forward was one C++ call
    decode_rows: int = 0
    prompt_rows: int = 0
    schedule_s: float = 0.0
    pack_s: float = 0.0
    forward_s: float = 0.0
    attention_s: float = 0.0  # part of forward_s
    sample_s: float = 0.0
    handoff_s: float = 0.0
    step_s: float = 0.0  # every phase of the step, and the lock
    cpu_s: float = 0.0  # the engine thread's CPU time within step_s
    idle_s: float = 0.0
    prompt_steps: int = 0  # steps that fed prompt chunks
    prompt_step_s: float = 0.0  # their run (forward and sampling) time
    first_tokens: int = 0  # requests that got their first token
    first_token_s: float = 0.0  # their time from reaching the engine to that token (the engine's share of TTFT)
    _idle_since: float | None = field(default=None, repr=False)  # when the wait under way began

    @contextmanager
    def idle(self) -> Iterator[None]:
        """The loop waiting for work. A wait under way counts up to each snapshot, so two snapshots taken around
        a load hold just the idle time between them (not a wait that began before the first)."""
        self._idle_since = time.perf_counter()
        try:
            yield
        finally:
            self.idle_s += time.perf_counter() - self._idle_since
            self._idle_since = None

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the body's wall time to `phase`_s."""
        start = time.perf_counter()
        try:
            yield
        finally:
            name = f"{phase}_s"
            setattr(self, name, getattr(self, name) + time.perf_counter() - start)

    @contextmanager
    def step(self) -> Iterator[None]:
        """One whole step: its wall time and the engine thread's CPU time."""
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.cpu_s += time.thread_time() - cpu
            self.step_s += time.perf_counter() - start

    @contextmanager
    def run(self, prompts: bool) -> Iterator[None]:
        """A step's run, its forward and sampling: timed into prompt_step_s for a step that fed `prompts`."""
        if not prompts:
            yield
            return
        with self.timed("prompt_step"):
            yield
        self.prompt_steps += 1

    def count(self, decode_rows: int, prompt_rows: int, fused: bool) -> None:
        self.steps += 1
        self.fused_steps += fused
        self.decode_rows += decode_rows
        self.prompt_rows += prompt_rows

    def first_token(self, seconds: float) -> None:
        self.first_tokens += 1
        self.first_token_s += seconds

    def snapshot(self) -> dict[str, float]:
        """Every counter, prefixed `engine_` (the names /v1/metrics and /metrics export)."""
        values = {name: value for name, value in asdict(self).items() if not name.startswith("_")}
        since = self._idle_since
        if since is not None:
            values["idle_s"] += time.perf_counter() - since
        return {f"engine_{name}": value for name, value in values.items()}
