"""A study's targets, checked against its own rows: each target is a value of the rows matching `where` (or that
value over the same value of the rows matching `where` updated by `over`: a ratio of two of its rows), at
least or at most a goal. The report then says which targets are met and by how much the others are missed, beside
the numbers that explain them, and says so again whenever the numbers change.

In conf/study/NAME.yaml, under `report:`:

    targets:
      - {name: output tok/s vs vLLM at c=8, value: output_throughput, where: {server: inferlab, concurrency: 8},
         over: {server: vllm}, at_least: 1.5}

`pick: max` takes the largest of several matching rows (say, inferlab's builds for each instruction set this CPU
runs); by default their median. `why` names values of other studies that explain a miss, each quoted beside it in
turn (a value its study does not have is left out):

      - {name: ..., why: [{study: profile, value: speedup_ceiling, where: {precision: int4, sequences: 16},
                           says: the fused step's own 16 sequences over 1}, ...]}
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd


def target_table(
    rows: pd.DataFrame, targets: list[dict[str, Any]], studies: pd.DataFrame | None = None
) -> pd.DataFrame:
    """One line per target: what it compares, the measured value, the goal, and met / missed by how much (and, for a
    miss with a `why`, those values of the rows of `studies`, every study's)."""
    lines = []
    for target in targets:
        pick = target.get("pick", "median")
        measured = _value(rows, target["where"], target["value"], pick)
        if "over" in target:
            measured /= _value(rows, {**target["where"], **target["over"]}, target["value"], pick)
        at_least = "at_least" in target
        goal = float(target["at_least"] if at_least else target["at_most"])
        verdict = _verdict(measured, goal, at_least)
        if verdict.startswith("missed") and "why" in target and studies is not None:
            verdict += "".join(_why(studies, why) for why in target["why"])
        lines.append(
            {
                "target": target["name"],
                "measured": measured,
                "goal": f"{'>=' if at_least else '<='} {goal:g}",
                "verdict": verdict,
            }
        )
    return pd.DataFrame(lines, columns=["target", "measured", "goal", "verdict"])


def _value(rows: pd.DataFrame, where: dict[str, Any], column: str, pick: str) -> float:
    """`column` of the rows where every key of `where` has its value (NaN where none does)."""
    if column not in rows or any(key not in rows for key in where):
        return math.nan
    matching = rows
    for key, wanted in where.items():
        matching = matching[matching[key] == wanted]
    values = matching[column].dropna()
    if values.empty:
        return math.nan
    return float(values.max() if pick == "max" else values.median())


def _why(studies: pd.DataFrame, why: dict[str, Any]) -> str:
    """ "; <says>: <value> (<study>)", the value of `why` in its study's rows, or "" where that study has none."""
    if "study" not in studies:
        return ""
    value = _value(studies[studies.study == why["study"]], why["where"], why["value"], "median")
    return "" if math.isnan(value) else f"; {why['says']}: {value:.3g} ({why['study']})"


def _verdict(measured: float, goal: float, at_least: bool) -> str:
    if math.isnan(measured):
        return "not measured here"
    if measured >= goal if at_least else measured <= goal:
        return "met"
    return f"missed: {measured / goal:.2f}x the goal" if goal else "missed"
