"""The conditions the contention study measures under: a quiet machine, CPU-bound neighbors, a CPU quota.

`condition(name)` enters one for a `with` block and gives a `Placement`: what it applied (`mechanism`, for the
table) and how to start a command inside it (`wrap(argv)`). A measured process is started inside the condition,
never moved in later: OpenMP sizes its team, and an engine its thread policy, from the CPUs a process has when it
starts.

- quiet: nothing.
- neighbor: one busy-loop process per core of this process's affinity but one, unpinned (a neighbor the scheduler
  places where it likes, as another tenant's would be), started before the block and always killed after it.
- quota: a CFS quota of half the cores: a cgroup made for the block (v2's cpu.max where the cpu controller is
  delegated to this process's cgroup's children, else v1's cpu.cfs_quota_us), which each wrapped command joins before
  it runs, removed after; where no cgroup can be made (no permission, no cpu controller), an affinity mask of half the
  cores stands in for it, and `mechanism` says which one was applied.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from pathlib import Path

QUIET, NEIGHBOR, QUOTA = "quiet", "neighbor", "quota"
CONDITIONS = (QUIET, NEIGHBOR, QUOTA)
BUSY_LOOP = "while True: pass"
PERIOD_US = 100_000  # the CFS period the quota is set in (the kernel's default)
_serial = count()  # this process's cgroups, each named apart

# Run as `python -S -c ENTER PROCS CPUS ARGV...`: join the cgroup whose procs file is PROCS and/or pin to CPUS (comma
# separated), then become ARGV (same pid), so the command starts inside the condition. Without site: ~20 ms.
ENTER = """\
import os, sys
procs, cpus, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
if procs:
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
if cpus:
    os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
os.execvp(argv[0], argv)
"""


@dataclass(frozen=True)
class Placement:
    """Where a condition's commands run: in a cgroup (its procs file), on a set of CPUs, or as they are."""

    condition: str
    mechanism: str  # what was applied, for the table
    procs: Path | None = None
    cpus: tuple[int, ...] = ()

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` as a command that starts inside this placement."""
        if self.procs is None and not self.cpus:
            return list(argv)
        cpus = ",".join(str(c) for c in self.cpus)
        return [sys.executable, "-S", "-c", ENTER, str(self.procs or ""), cpus, *argv]


def cores() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0))


@contextmanager
def condition(name: str) -> Iterator[Placement]:
    """Enter condition `name` (one of CONDITIONS) for the block."""
    cpus = cores()
    if name == QUIET:
        yield Placement(QUIET, "none")
    elif name == NEIGHBOR:
        with neighbors(len(cpus) - 1) as started:
            plural = "" if len(started) == 1 else "es"
            yield Placement(NEIGHBOR, f"{len(started)} busy-loop process{plural} beside {len(cpus)} cores")
    elif name == QUOTA:
        with cpu_quota(len(cpus) / 2, cpus) as placement:
            yield placement
    else:
        raise ValueError(f"unknown condition {name!r}; known: {', '.join(CONDITIONS)}")


@contextmanager
def neighbors(n: int) -> Iterator[list[subprocess.Popen]]:
    """`n` CPU-bound processes for the block, each in a session of its own, killed (and reaped) however it ends."""
    started: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            started.append(
                subprocess.Popen(
                    [sys.executable, "-S", "-c", BUSY_LOOP],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        yield started
    finally:
        for process in started:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextmanager
def cpu_quota(cpus: float, allowed: list[int]) -> Iterator[Placement]:
    """A quota of `cpus` CPUs for the commands the block wraps: a cgroup, else an affinity mask of that many."""
    group = CpuCgroup.create(cpus)
    if group is None:
        pinned = tuple(allowed[: max(1, math.floor(cpus))])
        mechanism = f"affinity to {len(pinned)} of {len(allowed)} cores (no cgroup could be made)"
        yield Placement(QUOTA, mechanism, cpus=pinned)
        return
    try:
        yield Placement(QUOTA, group.mechanism, procs=group.path / "cgroup.procs")
    finally:
        group.remove()


@dataclass
class CpuCgroup:
    """A child cgroup of this process's own, with a CPU quota."""

    path: Path
    mechanism: str

    @classmethod
    def create(cls, cpus: float) -> CpuCgroup | None:
        """A new cgroup limited to `cpus` CPUs: cgroup v2's where it has the cpu controller, else v1's; None where
        neither can be made here."""
        quota_us = round(cpus * PERIOD_US)
        name = f"inferlab-quota-{os.getpid()}-{next(_serial)}"
        v2, v1 = own_cgroups()
        if v2 is not None and "cpu" in read(v2 / "cgroup.subtree_control").split():
            cpu_max = f"{quota_us} {PERIOD_US}"
            group = cls.make(v2 / name, {"cpu.max": cpu_max}, f"cgroup v2 cpu.max {cpu_max}")
            if group is not None:
                return group
        if v1 is not None:
            settings = {"cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": str(quota_us)}
            return cls.make(v1 / name, settings, f"cgroup v1 cpu.cfs_quota_us {quota_us} per {PERIOD_US} us")
        return None

    @classmethod
    def make(cls, path: Path, settings: dict[str, str], mechanism: str) -> CpuCgroup | None:
        try:
            path.mkdir()
        except OSError:
            return None
        group = cls(path, mechanism)
        try:
            for file, value in settings.items():
                (path / file).write_text(value)
        except OSError:
            group.remove()
            return None
        return group

    def remove(self) -> None:
        """Remove the cgroup; a process still in it (one that outlived its command) goes back to the parent first."""
        for pid in read(self.path / "cgroup.procs").split():
            try:
                (self.path.parent / "cgroup.procs").write_text(pid)
            except OSError:  # it exited meanwhile
                pass
        self.path.rmdir()


def own_cgroups() -> tuple[Path | None, Path | None]:
    """The directories of this process's cgroup in the v2 hierarchy and in v1's cpu hierarchy (None where not mounted),
    from /proc/self/cgroup's paths below each hierarchy's mount (a container may mount a subtree: mountinfo's root)."""
    v2_path = cpu_path = None
    for line in read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        if not controllers:
            v2_path = path
        elif "cpu" in controllers.split(","):
            cpu_path = path
    v2 = v1 = None
    for line in read(Path("/proc/self/mountinfo")).splitlines():
        fields = line.split()
        root, mount = fields[3], Path(fields[4])
        fstype, options = fields[-3], fields[-1].split(",")
        if fstype == "cgroup2" and v2_path is not None:
            v2 = below(mount, root, v2_path)
        elif fstype == "cgroup" and "cpu" in options and cpu_path is not None:
            v1 = below(mount, root, cpu_path)
    return v2, v1


def below(mount: Path, root: str, path: str) -> Path | None:
    """The directory of cgroup `path` in a hierarchy mounted at `mount` from its `root`; None where not visible."""
    relative = os.path.relpath(path, root)
    if relative.startswith(".."):
        return None
    directory = (mount / relative).resolve()
    return directory if directory.is_dir() else None


def read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
