"""result.json: what every bench job writes (the resolved config, the environment, the rows or why not)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULT_FILE = "result.json"


def write_result(directory: Path, result: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RESULT_FILE
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path


def unavailable_result(study: str, sweep: str | None, overrides: list[str], reason: str) -> dict[str, Any]:
    """The record of a job that could not even be composed here: no config, no rows, the reason."""
    from inferlab.bench.env import environment

    return {
        "study": study,
        "sweep": sweep,
        "status": "unavailable",
        "error": reason,
        "seconds": 0.0,
        "overrides": list(overrides),
        "choices": {},
        "config": {},
        "env": environment(),
        "rows": [],
    }
