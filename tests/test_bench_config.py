"""The harness's config tree: every group option and every study composes, every sweep expands into
overrides that compose, and swept values this checkout lacks become "unavailable" results."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from inferlab.api import CONF_DIR, compose
from inferlab.bench.main import SWEEPS_DIR, expand_sweep, override_key
from inferlab.bench.studies import discover
from inferlab.errors import InvalidRequestError

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
    assert yaml.safe_load((SWEEPS_DIR / f"{study}.yaml").read_text())["study"] == study


def test_smoke_size_makes_a_tiny_model_and_few_tokens():
    cfg = compose("bench", ["size=smoke"])
    assert cfg.model.name == "tiny-random" and cfg.measure.repeats == 1 and max(cfg.measure.context_lens) <= 16
    assert compose("bench", ["size=smoke", "model=smollm2-135m"]).model.name == "smollm2-135m"  # the user wins


@pytest.mark.parametrize("sweep", SWEEPS)
def test_every_sweep_expands_to_overrides_that_compose(sweep, tmp_path):
    args = expand_sweep([f"sweep={sweep}", "size=smoke", f"results_root={tmp_path}"])
    if args is None:  # everything it varies is missing here: all recorded as unavailable
        assert list(tmp_path.rglob("result.json"))
        return
    assert args[0] == "--multirun" and f"sweep={sweep}" in args
    first_values = [a.split(",")[0] for a in args if not a.startswith("-")]
    cfg = compose("bench", first_values)
    assert cfg.study.name == yaml.safe_load((SWEEPS_DIR / f"{sweep}.yaml").read_text())["study"]


def test_user_overrides_win_over_the_sweep(tmp_path):
    args = expand_sweep(["sweep=kv_speedup", "cache=contiguous", f"results_root={tmp_path}"])
    assert [a for a in args if override_key(a) == "cache"] == ["cache=contiguous"]


def test_missing_sweep_values_are_recorded_not_fatal(tmp_path, monkeypatch):
    sweeps = tmp_path / "sweeps"
    sweeps.mkdir()
    (sweeps / "s.yaml").write_text("study: kv_speedup\nparams:\n  precision: fp32,int3\n  cache.nonexistent: 1,2\n")
    monkeypatch.setattr("inferlab.bench.main.SWEEPS_DIR", sweeps)
    assert expand_sweep(["sweep=s", f"results_root={tmp_path}"]) is None  # the key is missing: nothing runs
    records = {p.parent.name: json.loads(p.read_text()) for p in tmp_path.rglob("result.json")}
    assert set(records) == {"precision=int3", "cache.nonexistent=1", "cache.nonexistent=2"}
    assert all(r["status"] == "unavailable" and r["study"] == "kv_speedup" for r in records.values())
    assert "conf/precision/int3.yaml" in records["precision=int3"]["error"]


def test_unknown_sweep_is_one_clear_error():
    with pytest.raises(InvalidRequestError, match="no sweep 'nope'"):
        expand_sweep(["sweep=nope"])
