"""How many intra-op threads one engine step uses: fewer for a step of a few token rows.

A decode step of one or two sequences is a few hundred short parallel regions; with as many torch
threads as cores, anything else that wakes (the HTTP event loop sending a token, a client on the same
machine) takes a core from one of them and every region waits for the straggler. Measured with
inferlab-serve on 2 cores at c=1: TPOT 8.5-9.4 ms on one thread vs 11-19 ms on two; at c=16 two threads
are faster (one gives 0.84x the tok/s). So steps of at most `max_rows` rows run on `threads` threads,
the others on all of them. Results do not change: the kernels split output features across threads,
never a sum.

The count is set for the calling thread only, in the OpenMP runtime torch loaded (`omp_set_num_threads`,
0.3 us); `torch.set_num_threads` would also rebuild torch's thread pools and clear oneDNN's caches
(~120 us, and the next prompt pays for the caches). Without an OpenMP runtime to call, nothing changes.
`on_own_thread` runs work such as loading on a thread that ends with it, so no OpenMP team of its own
outlives it beside the engine loop's.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")
OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")


@dataclass(frozen=True)
class StepThreads:
    threads: int = 0  # intra-op threads for a small step (device.small_step_threads); 0 = off
    max_rows: int = 0  # a step of at most this many token rows is small (device.small_step_rows)

    @contextmanager
    def step(self, rows: int) -> Iterator[None]:
        """Run the body on `threads` threads of this thread if `rows` is small, then back."""
        full = torch.get_num_threads()
        set_threads = omp_set_num_threads()
        if set_threads is None or not 0 < self.threads < full or rows > self.max_rows:
            yield
            return
        set_threads(self.threads)
        try:
            yield
        finally:
            set_threads(full)


@functools.cache
def omp_set_num_threads() -> Callable[[int], None] | None:
    """`omp_set_num_threads` of the OpenMP runtime this process loaded for torch (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if any(name in line for name in OPENMP_RUNTIMES)}
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


def on_own_thread(work: Callable[[], T]) -> T:
    """`work()` run on a thread that ends with it: its result, or its exception raised here.

    libgomp gives each thread that starts a parallel region a team of worker threads of its own, parked
    until that thread exits. A model loaded on the main thread left its team beside the engine loop's:
    more OpenMP threads than cores, and libgomp then ends every wait at a region's barrier after ~100
    spins with a futex sleep, so each of a step's ~150 parallel regions paid a wake-up. Loaded on a
    thread that ends, the team goes with it: 16 sequences of 64 tokens through the loop, SmolLM2 int4 on
    2 cores, 1.04-1.18x the tokens/s (3 interleaved pairs).
    """
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as error:
            outcome.append((False, error))

    thread = threading.Thread(target=run, name="inferlab-load", daemon=True)  # daemon: Ctrl-C while loading still exits
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
