"""Where inferlab keeps what it builds or derives once: tokenized corpora, drafts, kernels, peer models."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    """$INFERLAB_CACHE, else .cache/inferlab under the repository."""
    return Path(os.environ.get("INFERLAB_CACHE") or REPO / ".cache" / "inferlab")
