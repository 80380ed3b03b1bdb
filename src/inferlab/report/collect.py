"""result.json files -> one pandas DataFrame, one line per result row, with the job's choices beside it.

Re-running a job adds a newer result.json; only the newest result per (study, overrides) is kept, so the
report always shows the latest measurement of each configuration. The result.json files stay on the machine that
measured them; the CSV the report was built from is committed, so on another machine (a fresh clone) its rows
stand for every configuration not measured again there, and rerunning one study replaces only that study's rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd

META = (
    "study",
    "sweep",
    "status",
    "error",
    "size",
    "model",
    "precision",
    "cache",
    "spec",
    "target",
    "load",
    "device",
    "timestamp",
    "git_commit",
    "cpu_model",
    "cpu_isa",
    "gpu",
    "torch_threads",
    "job",
    "overrides",
)
IGNORED_OVERRIDES = ("results_root", "hydra.")


def load_results(root: Path) -> list[dict[str, Any]]:
    results = []
    root = Path(root)
    for path in sorted(root.rglob("result.json")):
        result = json.loads(path.read_text())
        result["job"] = str(path.parent.relative_to(root))
        results.append(result)
    return results


def latest(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    newest: dict[tuple, dict[str, Any]] = {}
    for result in sorted(results, key=lambda r: r["env"].get("timestamp", "")):
        newest[job_key(result)] = result
    return list(newest.values())


def job_key(result: dict[str, Any]) -> tuple:
    overrides = sorted(o for o in result["overrides"] if not o.lstrip("+~").startswith(IGNORED_OVERRIDES))
    return result["study"], tuple(overrides)


def to_frame(results: list[dict[str, Any]]) -> pd.DataFrame:
    lines = []
    for result in results:
        meta = _meta(result)
        lines += [{**meta, **row} for row in result["rows"]] or [meta]
    frame = pd.DataFrame(lines)
    first = [c for c in META if c in frame.columns]
    return frame[first + [c for c in frame.columns if c not in first]]


def collect(root: Path, previous: Path | None = None) -> pd.DataFrame:
    """The newest result per (study, overrides) under root, beside the rows of `previous` (the CSV an earlier collect
    wrote, where it exists) of every configuration that root holds no newer result of."""
    return carry_over(to_frame(latest(load_results(root))), previous)


def carry_over(fresh: pd.DataFrame, previous: Path | None) -> pd.DataFrame:
    """`fresh` (to_frame's rows) beside the rows of the CSV `previous` of every (study, overrides) it has no newer
    rows of."""
    if previous is None or not Path(previous).is_file():
        return fresh
    earlier = pd.read_csv(previous, converters={"overrides": str})  # no overrides: "", not NaN
    if "overrides" not in earlier:
        print(f"{previous} predates the overrides column: its rows are not carried over", file=sys.stderr)
        return fresh
    if fresh.empty:
        return earlier
    both = pd.concat([earlier, fresh], ignore_index=True)
    key = both.study + " " + both.overrides
    # the newest; of the same job, the result.json's own rows (those after the CSV's)
    rank = both.timestamp.fillna("") + (both.index >= len(earlier)).astype(int).astype(str)
    return both[rank == rank.groupby(key).transform("max")].reset_index(drop=True)


def _meta(result: dict[str, Any]) -> dict[str, Any]:
    choices, env, config = result.get("choices", {}), result.get("env", {}), result.get("config", {})
    meta = {
        "study": result["study"],
        "sweep": result.get("sweep"),
        "status": result["status"],
        "error": result.get("error"),
        "size": config.get("measure", {}).get("size"),
        **{k: choices.get(k) for k in ("model", "precision", "cache", "spec", "target", "load", "device")},
        "timestamp": env.get("timestamp"),
        "git_commit": (env.get("git_commit") or "")[:10],
        "cpu_model": env.get("cpu_model"),
        "cpu_isa": env.get("cpu_isa"),
        "gpu": env.get("gpu"),
        "torch_threads": env.get("torch_threads"),
        "job": result["job"],
        "overrides": " ".join(job_key(result)[1]),
    }
    for override in result["overrides"]:  # an unavailable value's group, e.g. precision=int8
        key, _, value = override.partition("=")
        if key in meta and meta[key] is None:
            meta[key] = value
    return meta
