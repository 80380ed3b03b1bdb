"""The contention study's conditions: neighbors start and are always killed; a command wrapped for the quota starts
inside its cgroup (where one can be made here) or on half the cores, and the cgroup is removed afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from inferlab.bench import contention
from inferlab.bench.contention import NEIGHBOR, QUIET, QUOTA, CpuCgroup, condition, cores

# what a wrapped child reports: the CPUs it may run on and its cgroups
REPORT = "import json, os; print(json.dumps([sorted(os.sched_getaffinity(0)), open('/proc/self/cgroup').read()]))"


def started_inside(argv: list[str]) -> tuple[list[int], str]:
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    cpus, cgroups = json.loads(done.stdout)
    return cpus, cgroups


def test_quiet_runs_a_command_as_it_is():
    with condition(QUIET) as placement:
        argv = [sys.executable, "-c", REPORT]
        assert placement.wrap(argv) == argv and placement.mechanism == "none"


def test_neighbors_spin_during_the_block_and_are_killed_after_it_even_when_it_fails():
    with pytest.raises(KeyError), contention.neighbors(2) as started:
        assert len(started) == 2 and all(p.poll() is None for p in started)
        raise KeyError("the measurement failed")
    assert all(p.returncode is not None for p in started)  # killed and reaped


def test_the_neighbor_condition_starts_one_per_core_but_one():
    with condition(NEIGHBOR) as placement:
        assert placement.mechanism.startswith(f"{len(cores()) - 1} busy-loop process")


def test_without_a_cgroup_the_quota_pins_a_command_to_half_the_cores(monkeypatch):
    monkeypatch.setattr(CpuCgroup, "create", classmethod(lambda cls, cpus: None))
    with condition(QUOTA) as placement:
        cpus, _ = started_inside(placement.wrap([sys.executable, "-c", REPORT]))
    assert cpus == cores()[: max(1, len(cores()) // 2)] and placement.mechanism.startswith("affinity to")


def test_the_quota_cgroup_holds_the_command_and_is_removed_after():
    group = CpuCgroup.create(len(cores()) / 2)
    if group is None:
        pytest.skip("no cgroup with a CPU quota can be made here (no permission or no cpu controller)")
    group.remove()
    with condition(QUOTA) as placement:
        assert placement.procs is not None and placement.mechanism.startswith("cgroup v")
        directory = placement.procs.parent
        _, cgroups = started_inside(placement.wrap([sys.executable, "-c", REPORT]))
        assert f"/{directory.name}\n" in cgroups
        (quota,) = [
            int(f.read_text().split()[0]) for f in (directory / "cpu.max", directory / "cpu.cfs_quota_us") if f.exists()
        ]
        assert quota == round(len(cores()) / 2 * contention.PERIOD_US)  # v2's file, else v1's
    assert not Path(directory).exists()
