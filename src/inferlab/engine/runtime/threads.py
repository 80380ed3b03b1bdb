"""How many intra-op threads one engine step uses: as many as the CPUs the process gets, fewer for a step of a few
token rows or while other processes keep those CPUs busy.

A step is a few hundred short parallel regions, and each region's barrier waits for the last member of the team.
When something else holds a CPU that a member needs (another process, the HTTP event loop sending a token), the
scheduler parks that member for a time slice, and every region pays for it: a team of two threads beside one
CPU-bound neighbor on two cores is slower by orders of magnitude, while one thread loses little. So the team is
fitted to the CPUs: at load to the affinity mask and the cgroup's CPU quota (runtime/cpus.py), and, where the team
size is not set by hand, every SHARE_CHECK_S in the loop to the CPUs others leave free. Steps of at
most `max_rows` rows may run on fewer still (`threads`): a lone decode gains nothing from a second thread that the
event loop competes for. Results do not change: the kernels split output features across threads, never a sum.

The count is set for the calling thread only, in the OpenMP runtime torch loaded (`omp_set_num_threads`, a
store); `torch.set_num_threads` would also rebuild torch's thread pools and clear oneDNN's caches (and the next
prompt would pay for the caches). Without an OpenMP runtime to call, nothing changes.
`on_own_thread` runs work such as loading on a thread that ends with it, so no OpenMP team of its own
outlives it beside the engine loop's.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from inferlab.engine.runtime.cpus import OthersLoad

T = TypeVar("T")
OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")
SHARE_CHECK_S = 0.25  # how often the loop looks at the CPUs others leave free (a /proc/stat read, ~50 us)


@dataclass(frozen=True)
class StepThreads:
    threads: int = 0  # intra-op threads for a small step (device.small_step_threads); 0 = off
    max_rows: int = 0  # a step of at most this many token rows is small (device.small_step_rows)
    share: tuple[int, ...] = ()  # the CPUs whose other load the team follows (device.threads unset); () = off

    def team(self) -> StepTeam:
        return StepTeam(self)


class StepTeam:
    """Each forward's team by StepThreads' policy: one per engine, shared by its loop and its direct calls (it keeps
    the CPU readings)."""

    def __init__(self, policy: StepThreads) -> None:
        self.policy = policy
        self.load = OthersLoad(policy.share) if policy.share else None
        self.fits = 0  # threads the CPUs others leave free hold (0: not measured yet)
        self.next_check = 0.0

    def threads_for(self, rows: int, full: int) -> int:
        """Intra-op threads for a step of `rows` token rows, out of the `full` team."""
        n = full
        if self.load is not None:
            now = time.monotonic()
            if now >= self.next_check:
                self.next_check = now + SHARE_CHECK_S
                others = self.load.since_last()
                if others is not None:  # a CPU half taken counts as taken: the team's barriers wait on it
                    self.fits = max(1, math.floor(len(self.policy.share) - others + 0.5))
            if self.fits:
                n = min(n, self.fits)
        if 0 < self.policy.threads and rows <= self.policy.max_rows:
            n = min(n, self.policy.threads)
        return n

    @contextmanager
    def step(self, rows: int) -> Iterator[None]:
        """Run the body on the step's team of this thread, then back to the full team."""
        full = torch.get_num_threads()
        set_threads = omp_set_num_threads()
        n = self.threads_for(rows, full)
        if set_threads is None or n >= full:
            yield
            return
        set_threads(n)
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
    # torch's own first: the C++ kernels (or another package) may load the system's libgomp beside torch's bundled
    # one, and setting that one's count leaves torch's forwards on their full team
    torch_lib = str(Path(torch.__file__).parent / "lib")
    for path in sorted(paths, key=lambda p: (not p.startswith(torch_lib), p)):
        try:
            return ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


def on_own_thread(work: Callable[[], T]) -> T:
    """`work()` run on a thread that ends with it: its result, or its exception raised here.

    libgomp gives each thread that starts a parallel region a team of worker threads of its own, parked
    until that thread exits. A model loaded on the main thread would leave its team beside the engine loop's:
    more OpenMP threads than cores, and libgomp then ends every wait at a region's barrier after ~100
    spins with a futex sleep, so each of a step's parallel regions would pay a wake-up. Loaded on a
    thread that ends, the team goes with it.
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
