"""A smoke sweep through Hydra's parallel launchers: joblib (worker processes) and submitit's local executor
(what runs each job on SLURM with hydra/launcher=submitit_slurm) each write one ok result.json per job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench_smoke import bench


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher", ["joblib", pytest.param("submitit_local", marks=pytest.mark.full)]
)  # the launchers extra, which make setup installs
def test_a_smoke_sweep_through_the_launcher_writes_one_ok_result_per_job(launcher, tmp_path: Path):
    # two of the sweep's three jobs: enough for a launcher to run jobs apart, each writing its own result
    run = bench(
        "-m",
        "sweep=kv_memory",
        "size=smoke",
        "cache=paged,paged_int8",
        f"hydra/launcher={launcher}",
        f"results_root={tmp_path}",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.rglob("result.json"))]
    assert sorted(r["choices"]["cache"] for r in results) == ["paged", "paged_int8"]
    for r in results:
        assert r["status"] == "ok", r["error"]
        memory = [row for row in r["rows"] if "held_mb" in row]  # the int8 job's agreement rows beside them
        assert r["sweep"] == "kv_memory" and memory and all(row["held_mb"] > 0 for row in memory)
