"""The CPUs this process really gets: the affinity mask, the cgroup's CPU quota, and how busy other processes keep them.

A process may run on fewer CPUs than the machine has: a cpuset or `taskset` narrows its affinity mask, and a
Kubernetes CPU limit (a CFS quota: cgroup v2's `cpu.max`, v1's `cpu.cfs_quota_us`) lets it run only so many
CPU-seconds a period, whatever the mask says. And a CPU it may run on can be taken by another process. A team of
intra-op threads larger than what is left waits, at every barrier of a step's few hundred parallel regions, for the
member the scheduler parked: a time slice each.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")  # where cgroup v1 mounts the cpu controller, by distribution


@dataclass(frozen=True)
class CpuGrant:
    """What the operating system hands this process: the CPUs it may run on and its CPU quota."""

    cpus: tuple[int, ...]  # the affinity mask
    quota: float | None  # CPUs' worth of time per period (cgroup CPU quota); None: no quota

    @property
    def threads(self) -> int:
        """Intra-op threads that fit: one per CPU of the mask, no more than the quota's whole CPUs, at least one.
        A thread beyond the quota's whole CPUs is throttled in the middle of a parallel region, holding the others."""
        n = len(self.cpus)
        if self.quota is not None:
            n = min(n, int(self.quota + 1e-6))
        return max(1, n)

    def describe(self) -> str:
        quota = "no CPU quota" if self.quota is None else f"a CPU quota of {self.quota:g}"
        return f"{len(self.cpus)} CPUs in the affinity mask, {quota}"


def cpu_grant(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> CpuGrant:
    cpus = (
        tuple(sorted(os.sched_getaffinity(0)))
        if hasattr(os, "sched_getaffinity")
        else tuple(range(os.cpu_count() or 1))
    )
    return CpuGrant(cpus, cgroup_quota(proc_cgroup, root))


def cgroup_quota(proc_cgroup: Path, root: Path) -> float | None:
    """The tightest CPU quota on this process's cgroup and its ancestors, in CPUs (None: none, or no cgroups).
    /proc/self/cgroup names the process's cgroup per hierarchy: `0::/path` for v2, `N:cpu,cpuacct:/path` for v1."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            quotas += [q for d in ancestors(root, path) if (q := read_cpu_max(d / "cpu.max")) is not None]
        elif "cpu" in controllers.split(","):
            for mount in V1_CPU_DIRS:
                quotas += [q for d in ancestors(root / mount, path) if (q := read_cfs_quota(d)) is not None]
    return min(quotas, default=None)


def ancestors(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory and its parents' up to the mount (inside a container, the mount is often the
    container's own cgroup while /proc/self/cgroup still names the host's path: the existing ones are read)."""
    parts = [p for p in path.split("/") if p]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def read_cpu_max(path: Path) -> float | None:
    """cgroup v2's `cpu.max`: "QUOTA PERIOD" in microseconds, or "max PERIOD" for none."""
    try:
        quota, period = path.read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def read_cfs_quota(directory: Path) -> float | None:
    """cgroup v1's `cpu.cfs_quota_us` (-1: none) over `cpu.cfs_period_us`."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


class OthersLoad:
    """How many of `cpus` other processes keep busy: from one reading to the next, the busy time the kernel counts on
    those CPUs (/proc/stat; stolen time counts as busy, niced time as free) less this process's own CPU time, over
    the time between.

    The measure is what a team of threads would find: a CPU-bound neighbor on one of two cores reads ~0.67 while two
    threads of ours compete with it for both, ~1 once one thread leaves it a core of its own.
    """

    def __init__(self, cpus: tuple[int, ...], stat: Path = Path("/proc/stat")) -> None:
        self.stat, self.names = stat, {f"cpu{c}" for c in cpus}
        self.tick_s = 1 / os.sysconf("SC_CLK_TCK")
        # A niced process (a build, a batch job) yields its CPU to ours whenever our threads want it, so its time
        # counts as free; unless this process is niced itself, when the kernel counts our own time there too.
        self.skip = (3, 4) if os.getpriority(os.PRIO_PROCESS, 0) > 0 else (1, 3, 4)  # nice, idle, iowait
        self.last = self.reading()

    def reading(self) -> tuple[float, float, float] | None:
        """(wall s, busy s on the CPUs, this process's CPU s), or None where /proc/stat cannot be read."""
        try:
            lines = self.stat.read_text().splitlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            fields = line.split()
            if fields and fields[0] in self.names:
                ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
                busy += sum(t for i, t in enumerate(ticks) if i not in self.skip)
        return time.monotonic(), busy * self.tick_s, time.process_time()

    def since_last(self) -> float | None:
        """CPUs' worth of others' work since the last call (None: nothing to measure)."""
        now = self.reading()
        last, self.last = self.last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        return max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / (now[0] - last[0]))
