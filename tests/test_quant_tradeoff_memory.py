"""quant_tradeoff measures each job in a process of its own: in a multirun (Hydra's basic launcher: every job in
one process) the memory an earlier job left behind must not count in the next job's columns."""

import pytest
import torch

from inferlab.api import compose
from inferlab.bench.studies import discover
from inferlab.bench.studies.quant_tradeoff import measure, resident_mb

HELD_MB = 1024


@pytest.mark.slow
def test_a_job_measures_memory_without_what_its_process_already_holds():
    cfg = compose("bench", ["study=quant_tradeoff", "size=smoke"])
    earlier_job = torch.ones(HELD_MB * 2**20 // 4)  # what an earlier job's engine would leave in the process
    assert resident_mb() > HELD_MB
    here = measure(cfg)  # the same job in this process counts it: the bug the study's own process avoids
    # (not "> the RSS before it": loading may free what earlier tests of this process left cached)
    assert all(row["load_rss_mb"] > HELD_MB and row["rss_mb"] > HELD_MB for row in here)
    rows = discover()["quant_tradeoff"](cfg)
    assert [row["batch_size"] for row in rows] == [row["batch_size"] for row in here]
    for row in rows:
        for column in ("load_peak_rss_mb", "load_rss_mb", "rss_mb"):
            assert 0 < row[column] < HELD_MB, column  # a smoke job alone: ~600 MiB
        assert row["weight_mb"] == here[0]["weight_mb"] and row["perplexity"] == pytest.approx(here[0]["perplexity"])
    del earlier_job
