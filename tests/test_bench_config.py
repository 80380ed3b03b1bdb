"""The harness's config tree: every group option and every study composes; every sweep is a Hydra config
whose jobs Hydra's own sweeper launches; swept values this checkout lacks become "unavailable" results."""

from __future__ import annotations

import itertools
import json

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from inferlab.api import compose
from inferlab.bench.studies import discover
from inferlab.errors import InvalidRequestError
from inferlab.paths import conf_dir, sweeps_dir

CONF_DIR, SWEEPS_DIR = conf_dir(), sweeps_dir()
GROUPS = ["model", "precision", "cache", "spec", "device", "load", "target", "study", "size"]
STUDIES = sorted(p.stem for p in (CONF_DIR / "study").glob("*.yaml"))
SWEEPS = sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))])
def test_every_group_option_composes(group, option):
    overrides = [f"{group}={option}"] + (["model.path=/tmp/x.gguf"] if option == "local" else [])
    cfg = compose("bench", overrides)
    OmegaConf.to_container(cfg, resolve=True)
    assert cfg.study.name and cfg.measure.size and cfg.load.dataset and cfg.target.kind


@pytest.mark.parametrize("study", STUDIES)
def test_every_study_has_a_config_a_module_and_a_sweep(study):
    spec = compose("bench", [f"study={study}"]).study
    assert spec.name == study and spec.title and spec.about and spec.report.table.index
    assert study in discover(), f"no module registers study {study!r}"
    assert compose("bench", [f"sweep={study}"]).study.name == study


def test_smoke_size_makes_a_tiny_model_and_few_tokens():
    cfg = compose("bench", ["size=smoke"])
    assert cfg.model.name == "tiny-random" and cfg.measure.repeats == 1 and max(cfg.measure.context_lens) <= 16
    assert compose("bench", ["size=smoke", "model=smollm2-135m"]).model.name == "smollm2-135m"  # the user wins


def launched(*overrides: str) -> list[dict]:
    """The jobs Hydra's own multirun launches for `inferlab-bench -m OVERRIDES` (in this process, each job
    only recording its study, choices and overrides instead of running)."""
    jobs = []

    def record(cfg: DictConfig) -> None:
        hydra = HydraConfig.get()
        jobs.append(
            {
                "study": cfg.study.name,
                "choices": dict(hydra.runtime.choices),
                "overrides": list(hydra.overrides.task),
                "config": cfg,
            }
        )

    GlobalHydra.instance().clear()
    try:
        hydra = Hydra.create_main_hydra2("bench", create_config_search_path(str(CONF_DIR)))
        hydra.multirun("bench", record, list(overrides), with_log_configuration=False)
    finally:
        GlobalHydra.instance().clear()
    return jobs


@pytest.mark.parametrize("sweep", SWEEPS)
def test_every_sweep_is_a_multirun_of_hydras_own_sweeper(sweep, tmp_path):
    text = (SWEEPS_DIR / f"{sweep}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        spec = hydra_compose("bench", [f"sweep={sweep}"], return_hydra_config=True)
    assert spec.hydra.mode.name == "MULTIRUN" and spec.hydra.sweeper.params
    values = [str(v).split(",") for v in spec.hydra.sweeper.params.values()]
    jobs = launched(f"sweep={sweep}", "size=smoke", f"results_root={tmp_path}")
    missing = list(tmp_path.rglob("unavailable/*/result.json"))  # swept values another branch adds
    assert len(jobs) + len(missing) == len(list(itertools.product(*values)))
    for job in jobs:
        assert job["study"] == spec.study.name and job["choices"]["sweep"] == sweep
        assert job["config"].measure.size == "smoke"
        OmegaConf.to_container(job["config"], resolve=True)


def test_user_overrides_win_over_the_sweep(tmp_path):
    jobs = launched("sweep=prefix_cache", "cache.prefix=true", "load.prompt_tokens=32", f"results_root={tmp_path}")
    (job,) = jobs
    assert job["config"].cache.prefix is True and job["config"].load.prompt_tokens == 32
    assert job["choices"]["cache"] == "paged" and job["choices"]["load"] == "shared_prefix"  # the sweep's own
    (job,) = launched("sweep=prefix_cache", "cache.prefix=false", "load=shakespeare", f"results_root={tmp_path}")
    assert job["choices"]["load"] == "shakespeare"


def test_command_line_sweeps_extend_the_sweep(tmp_path):
    jobs = launched("sweep=kv_speedup", "precision=fp32,bf16", f"results_root={tmp_path}")
    assert sorted((j["choices"]["cache"], j["choices"]["precision"]) for j in jobs) == [
        ("contiguous", "bf16"),
        ("contiguous", "fp32"),
        ("none", "bf16"),
        ("none", "fp32"),
    ]


def test_missing_sweep_values_are_recorded_not_fatal(tmp_path, monkeypatch):
    sweeps = tmp_path / "sweeps"
    sweeps.mkdir()
    (sweeps / "s.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /study: kv_memory\n"
        "hydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n"
        "      precision: fp32,int3\n      cache: contiguous,paged,ring\n"
    )
    monkeypatch.setenv("INFERLAB_SWEEPS", str(sweeps))
    jobs = launched("sweep=s", f"results_root={tmp_path}")
    assert sorted((j["choices"]["precision"], j["choices"]["cache"]) for j in jobs) == [
        ("fp32", "contiguous"),
        ("fp32", "paged"),
    ]
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.rglob("unavailable/*/result.json"))]
    assert len(records) == 4 and all(r["status"] == "unavailable" and r["study"] == "kv_memory" for r in records)
    assert all(r["sweep"] == "s" and r["env"]["cpu_model"] for r in records)
    by_job = {tuple(o for o in r["overrides"] if o.startswith(("precision", "cache"))): r["error"] for r in records}
    assert "precision/int3" in by_job[("precision=int3", "cache=paged")]
    assert "cache/ring" in by_job[("precision=fp32", "cache=ring")]


def test_a_missing_config_key_is_recorded_as_unavailable(tmp_path):
    jobs = launched("sweep=kv_memory", "cache.no_such_knob=1,2", f"results_root={tmp_path}")
    records = [json.loads(p.read_text()) for p in tmp_path.rglob("unavailable/*/result.json")]
    assert jobs == [] and len(records) == 6  # 3 caches x 2 values
    assert all("no such config key" in r["error"] for r in records)


def test_unknown_sweep_is_one_clear_error():
    with pytest.raises(InvalidRequestError, match="Could not find 'sweep/nope'"):
        compose("bench", ["sweep=nope"])


def test_spec_off_is_spec_none():
    assert compose("engine", ["spec=off"]).spec == compose("engine", ["spec=none"]).spec == compose("engine").spec
