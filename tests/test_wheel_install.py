"""`pip install .` works anywhere: the wheel, installed into a fresh venv, generates from another directory,
finding conf/ inside the package and the kernels of its own sources in $INFERLAB_CACHE."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from inferlab.kernels.build import kernels_build_dir, load_isa
from inferlab.kernels.isa import ISAS, supported_isas
from inferlab.paths import cache_dir

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv holding only the wheel; its dependencies are this environment's, reached through a path line
    (a .pth line adds a directory but runs none of the .pth files in it, so this environment's editable
    inferlab stays out)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # a copy: pip builds in the tree it is given
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("src", "conf"):  # src/inferlab/conf stays the link to conf/ it is in the repository
        shutil.copytree(REPO / name, source / name, symlinks=True, ignore=skip)
    shutil.copy2(REPO / "pyproject.toml", source)
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--wheel-dir",
        tmp / "dist",
        source,
    )
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "--quiet",
        "--no-deps",
        "--no-index",
        *(tmp / "dist").glob("inferlab-*.whl"),
    )
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def clean_env(home: Path, **extra: Path) -> dict[str, str]:
    """No path to this checkout and none of inferlab's variables, and a HOME of its own."""
    drop = ("PYTHONPATH", "INFERLAB_CONF", "INFERLAB_SWEEPS", "INFERLAB_CACHE", "XDG_CACHE_HOME")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "HOME": str(home), **{k: str(v) for k, v in extra.items()}}


def test_the_installed_package_is_the_wheel_with_conf_inside(installed, tmp_path):
    probe = (
        "import inferlab.paths as p; print(p.__file__); print(p.conf_dir()); print(p.source_tree()); "
        "print(p.cache_dir())"
    )
    python = installed / "bin" / "python"
    file, conf, tree, cache = run(python, "-c", probe, cwd=tmp_path, env=clean_env(tmp_path)).stdout.split()
    package = Path(file).parent
    assert package.is_relative_to(installed) and Path(conf) == package / "conf" and tree == "None"
    assert all(
        (package / f).is_file() for f in ("conf/generate.yaml", "conf/model/tiny-random.yaml", "kernels/csrc/gemv.h")
    )
    if sys.platform.startswith("linux"):
        assert Path(cache) == tmp_path / ".cache" / "inferlab"  # the user's cache dir by default
    env = clean_env(tmp_path, XDG_CACHE_HOME=tmp_path / "xdg", INFERLAB_CACHE=tmp_path / "mine")
    assert run(python, "-c", probe, cwd=tmp_path, env=env).stdout.split()[3] == str(tmp_path / "mine")


def test_inferlab_generate_runs_from_any_directory(installed, tmp_path):
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    elsewhere.mkdir()
    # the kernels this checkout built for what device.isa=auto picks, in a cache the run shares: the wheel's sources
    # are this checkout's, so it loads that build and compiles nothing (a file missing from the wheel would change
    # the sources' digest, and the run would compile them, and fail)
    widest = supported_isas()[-1] if supported_isas() else None
    shared = widest is not None and load_isa(widest)
    env = clean_env(tmp_path, INFERLAB_CACHE=cache)
    if shared:
        cache.mkdir()
        (cache / "kernels").symlink_to(cache_dir() / "kernels", target_is_directory=True)
        probe = (
            f"from inferlab.kernels.build import ISAS, kernels_build_dir; print(kernels_build_dir(ISAS[{widest!r}]))"
        )
        build = Path(run(installed / "bin" / "python", "-c", probe, cwd=elsewhere, env=env).stdout.strip())
        assert build == kernels_build_dir(ISAS[widest])
        (library,) = build.glob("*.so")
        built_at = library.stat().st_mtime_ns
    done = run(
        installed / "bin" / "inferlab-generate",
        "model=tiny-random",
        "prompt=Once upon a time",
        "max_new_tokens=4",
        "temperature=0",
        cwd=elsewhere,
        env=env,
    )
    assert done.stdout.strip() and "generated 4 tok" in done.stderr
    assert not list(elsewhere.iterdir()) and not (tmp_path / ".cache").exists()  # only stdout, stderr and the cache
    if shared:
        assert "building the CPU decode kernels" not in done.stderr and library.stat().st_mtime_ns == built_at
