"""A smoke sweep through Hydra's parallel launchers: joblib (worker processes), submitit's local executor (what runs
each job on SLURM with hydra/launcher=submitit_slurm) and Ray (each job a Ray task, on a cluster of a head and two
workers started on loopback for the test) each write one ok result.json per job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ray_cluster import RAY_ENV, local_ray_cluster
from test_bench_smoke import bench

# two of the sweep's three jobs: enough for a launcher to run jobs apart, each writing its own result
SWEEP = ("-m", "sweep=kv_memory", "size=smoke", "cache=paged,paged_int8")


def assert_one_ok_result_per_job(results_root: Path) -> None:
    results = [json.loads(p.read_text()) for p in sorted(results_root.rglob("result.json"))]
    assert sorted(r["choices"]["cache"] for r in results) == ["paged", "paged_int8"]
    for r in results:
        assert r["status"] == "ok", r["error"]
        memory = [row for row in r["rows"] if "held_mb" in row]  # the int8 job's agreement rows beside them
        assert r["sweep"] == "kv_memory" and memory and all(row["held_mb"] > 0 for row in memory)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])  # the launchers extra, which make setup installs
def test_a_smoke_sweep_through_the_launcher_writes_one_ok_result_per_job(launcher, tmp_path: Path):
    run = bench(*SWEEP, f"hydra/launcher={launcher}", f"results_root={tmp_path}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert_one_ok_result_per_job(tmp_path)


@pytest.mark.slow
def test_a_smoke_sweep_on_a_ray_cluster_writes_one_ok_result_per_job(tmp_path: Path, monkeypatch):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="the replicas extra: pip install -e '.[replicas]'")
    for name, value in RAY_ENV.items():
        monkeypatch.setenv(name, value)
    with local_ray_cluster(workers=2) as address:
        # the head offers its one CPU too: the two jobs (a CPU each) run on two of the three nodes at once
        run = bench(
            *SWEEP, "hydra/launcher=ray", f"hydra.launcher.ray.init.address={address}", f"results_root={tmp_path}"
        )
    assert run.returncode == 0, run.stderr[-2000:]
    assert_one_ok_result_per_job(tmp_path)
