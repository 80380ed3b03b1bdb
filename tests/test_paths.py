"""Where inferlab finds conf/ and keeps its cache (paths.py), run from the repository."""

import shutil
import sys
from pathlib import Path

from inferlab.api import compose
from inferlab.kernels import build
from inferlab.kernels.build import kernels_build_dir
from inferlab.kernels.isa import ISAS
from inferlab.paths import cache_dir, conf_dir, source_tree, sweeps_dir

REPO = Path(__file__).resolve().parents[1]


def test_the_repository_reads_its_top_level_conf_and_sweeps(monkeypatch):
    monkeypatch.delenv("INFERLAB_CONF", raising=False)
    monkeypatch.delenv("INFERLAB_SWEEPS", raising=False)
    assert source_tree() == REPO and conf_dir() == REPO / "conf" and sweeps_dir() == REPO / "sweeps"
    monkeypatch.setenv("INFERLAB_SWEEPS", "/elsewhere/sweeps")
    assert sweeps_dir() == Path("/elsewhere/sweeps")


def test_the_cache_is_the_users_unless_inferlab_cache_says(monkeypatch, tmp_path):
    monkeypatch.delenv("INFERLAB_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert cache_dir() == tmp_path / "xdg" / "inferlab"
    monkeypatch.setenv("INFERLAB_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    assert kernels_build_dir(ISAS["avx2"]).parents[1] == tmp_path / "mine" / "kernels"
    assert compose(overrides=["model=scratch"]).model.path == str(tmp_path / "mine" / "models" / "scratch")


def test_checkouts_of_the_same_kernel_sources_share_one_build_and_others_build_apart(monkeypatch, tmp_path):
    # torch's ninja file names the sources by path: builds compile a copy kept beside them, named by its content
    monkeypatch.setenv("INFERLAB_CACHE", str(tmp_path / "cache"))
    here = kernels_build_dir(ISAS["avx2"])
    copy = tmp_path / "elsewhere" / "csrc"
    shutil.copytree(build.CSRC, copy)
    monkeypatch.setattr(build, "CSRC", copy)
    assert kernels_build_dir(ISAS["avx2"]) == here
    sources = build.copied_sources(here.parent)
    assert sources == here.parent / "csrc" and build.copied_sources(here.parent) == sources
    assert sorted(p.name for p in sources.iterdir()) == sorted(p.name for p in copy.iterdir())
    assert all((sources / p.name).read_bytes() == p.read_bytes() for p in copy.iterdir())
    assert [p.name for p in here.parent.iterdir()] == ["csrc"]  # no partial copy left behind
    (copy / "gemv.h").write_text((copy / "gemv.h").read_text() + "\n// changed\n")
    changed = kernels_build_dir(ISAS["avx2"])
    assert changed != here and changed.parent.parent == here.parent.parent
