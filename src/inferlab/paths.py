"""Where inferlab finds its configs and keeps what it builds or derives once: tokenized corpora, drafts,
kernels, peer models. The same from any working directory, installed from a wheel or run from the repository.
Imports nothing heavy: the report and the load generator need these paths too."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import platformdirs
from omegaconf import OmegaConf


def conf_dir() -> Path:
    """$INFERLAB_CONF, else the Hydra config tree the package carries: inferlab/conf in a wheel; in the
    repository src/inferlab/conf, a link to the top-level conf/."""
    return Path(os.environ.get("INFERLAB_CONF") or str(resources.files("inferlab") / "conf")).resolve()


def cache_dir() -> Path:
    """$INFERLAB_CACHE, else the user's cache dir (Linux: $XDG_CACHE_HOME/inferlab or ~/.cache/inferlab)."""
    return Path(os.environ.get("INFERLAB_CACHE") or platformdirs.user_cache_dir("inferlab"))


def default_draft_dir(model_name: str) -> Path:
    """Where inferlab-train writes the draft for a model and spec=draft looks for it: in the cache dir."""
    return cache_dir() / "drafts" / model_name


def shape_file(model_name: str, file_format: str) -> Path:
    """A shape preset's GGUF file in one format (random weights, made by bench/model_files.py): in the cache dir."""
    return cache_dir() / "models" / model_name / f"{model_name}.{file_format}.gguf"


def source_tree() -> Path | None:
    """The repository when the package runs from it (src/inferlab), else None (an installed wheel)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "src" / "inferlab" / "paths.py").is_file() else None


def sweeps_dir() -> Path:
    """$INFERLAB_SWEEPS, else the repository's sweeps/ (the studies belong to the repository, not the wheel):
    the source tree's when the package runs from it, else ./sweeps."""
    if os.environ.get("INFERLAB_SWEEPS"):
        return Path(os.environ["INFERLAB_SWEEPS"])
    tree = source_tree()
    return (tree if tree is not None else Path.cwd()) / "sweeps"


# conf/ names the cache dir as ${inferlab_cache:}; registered here, where every composition finds it
OmegaConf.register_new_resolver("inferlab_cache", lambda: str(cache_dir()), replace=True)
