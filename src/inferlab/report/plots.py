"""Charts for the report's sections, drawn from the CSV's rows with matplotlib (PNG, no display needed).

Each study's `report.chart` (conf/study/NAME.yaml) says what to draw, so a new study gets a chart by config:

    kind: bar | barh | line   # bar/barh: x is a category axis; line: x is numeric, ticks at the measured values
    x: precision              # the column along the axis
    series: engine            # one bar or line per value (a column, or a list of columns joined)
    order: {engine: [inferlab, llama.cpp]}   # first values in this order (us beside the peer)
    names: {p50_ttft_ms: P50}                # readable names for values and for y columns
    facet: temperature        # one row of panels per value (a column or a list of columns)
    top: 8                    # barh: the largest N categories only
    panels:                   # one axis per quantity, side by side; `y` a column, or same-unit columns as series
      - {y: decode_tok_s, ylabel: decode tokens/s, logy: false, scale: 1.0, series: null}  # series: not here
      - {y: ppl, where: {task: rolling}}  # where: only the rows whose column has that value

A panel's keys may also sit at the top level for a one-panel chart. Columns the CSV lacks are skipped.
The caption names the hardware (with its instruction set), torch threads and commit the numbers came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import pandas as pd  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402

PANEL_KEYS = ("y", "ylabel", "logy", "scale", "series", "where")


def chart(frame: pd.DataFrame, spec: dict[str, Any], title: str, path: Path) -> Path:
    """Draw `spec` (see the module docstring) from `frame`'s rows into `path`."""
    panels = [p for p in _panels(spec) if _columns(frame, p["y"])]
    facets = _groups(frame, _present(frame, spec.get("facet")), spec)
    if not panels:
        raise ValueError(f"{title}: none of the chart's columns are in the results")
    cells = [(facet, rows, panel) for facet, rows in facets for panel in panels]
    columns = len(panels) if len(panels) > 1 else min(2, len(cells))  # facets of one panel: two per row
    height = (len(cells) + columns - 1) // columns
    width = 6.0 if spec.get("kind") == "barh" else 4.6
    fig, axes = plt.subplots(height, columns, figsize=(width * columns, 3.4 * height + 0.6), squeeze=False)
    draw = {"bar": _bars, "barh": _barh}.get(spec.get("kind", "line"), _lines)
    for i, ax in enumerate(axes.flat):
        if i >= len(cells):
            ax.set_visible(False)
            continue
        facet, rows, panel = cells[i]
        for column, value in (panel.get("where") or {}).items():  # a panel of only the rows where column == value
            rows = rows[rows[column].astype(str) == str(value)]
        draw(ax, rows, spec, panel)
        if facet:
            ax.set_title(facet, fontsize=9)
        ax.grid(True, axis="x" if spec.get("kind") == "barh" else "y", alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.text(0.5, 0.01, caption(frame), ha="center", va="bottom", fontsize=7, color="0.35")
    # the suptitle's line kept clear of the top row's titles (tight_layout leaves it out on tall figures)
    fig.tight_layout(rect=(0, 0.04, 1, 1 - 0.2 / fig.get_figheight()))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def caption(frame: pd.DataFrame) -> str:
    """Where the numbers were measured: CPU and its instruction set (and GPU), torch threads, commit."""

    def values(column: str) -> str:
        found = frame[column].dropna().astype(str).unique() if column in frame else []
        return ", ".join(v.removesuffix(".0") for v in sorted(found))

    cpu = values("cpu_model") + (f" ({values('cpu_isa')})" if values("cpu_isa") else "")
    parts = [
        cpu,
        values("gpu"),
        values("torch_threads") and f"{values('torch_threads')} torch threads",
        values("git_commit") and f"commit {values('git_commit')}",
    ]
    return "Measured on " + " · ".join(p for p in parts if p)


def _panels(spec: dict[str, Any]) -> list[dict[str, Any]]:
    if "panels" in spec:
        return [dict(p) for p in spec["panels"]]
    return [{k: spec[k] for k in PANEL_KEYS if k in spec}]


def _columns(frame: pd.DataFrame, names: Any) -> list[str]:
    names = names if isinstance(names, list) else [names]
    return [n for n in names if n in frame and frame[n].notna().any()]


def _present(frame: pd.DataFrame, names: Any) -> list[str]:
    return _columns(frame, names) if names else []


def _label(value: Any, spec: dict[str, Any]) -> str:
    """A value as a reader wants it: 4 not 4.0, a configured name where there is one."""
    names = spec.get("names") or {}
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value)
    return str(
        names.get(text, names.get(value, text)) if not isinstance(value, bool) else names.get(text.lower(), text)
    )


def _key(frame: pd.DataFrame, columns: list[str], spec: dict[str, Any]) -> pd.Series:
    """One label per row: the values of `columns` that it has, joined ("inferlab avx512", "llama.cpp")."""
    labels = frame[columns].apply(lambda row: " ".join(_label(v, spec) for v in row if not pd.isna(v)), axis=1)
    return labels.astype(str)


def _groups(frame: pd.DataFrame, columns: list[str], spec: dict[str, Any]) -> list[tuple[str, pd.DataFrame]]:
    """One (panel title, rows) per combination of the facet columns' values."""
    if not columns:
        return [("", frame)]
    groups = {}
    for values, rows in frame.groupby(columns, sort=False):
        groups[values if isinstance(values, tuple) else (values,)] = rows
    keys = sorted(
        groups,
        key=lambda values: [
            _ordered(list(frame[c].dropna().unique()), c, spec).index(v) for c, v in zip(columns, values)
        ],
    )
    return [(", ".join(f"{c}={_label(v, spec)}" for c, v in zip(columns, values)), groups[values]) for values in keys]


def _ordered(values: list[Any], column: str, spec: dict[str, Any]) -> list[Any]:
    """Values sorted (numbers as numbers); those starting with a name in `order[column]` first, in that order."""
    first = [str(v) for v in (spec.get("order") or {}).get(column, [])]

    def rank(value: Any) -> tuple[int, bool, Any]:
        hits = [i for i, name in enumerate(first) if str(value) == name or str(value).startswith(name + " ")]
        return (
            hits[0] if hits else len(first),
            isinstance(value, str),
            value if not isinstance(value, str) else str(value),
        )

    return sorted(values, key=rank)


def _table(rows: pd.DataFrame, spec: dict[str, Any], panel: dict[str, Any]) -> tuple[pd.DataFrame, str | None]:
    """x down, series across, the median of each cell, scaled; and the legend's title."""
    ys, x = _columns(rows, panel["y"]), spec["x"]
    series = _present(rows, panel.get("series", spec.get("series"))) if len(ys) == 1 else []
    rows = rows[rows[x].notna()]
    if series:
        rows = rows[list(dict.fromkeys([x, *series, ys[0]]))]  # the columns drawn only: the frame has hundreds
        table = rows.assign(_series=_key(rows, series, spec)).pivot_table(
            index=x, columns="_series", values=ys[0], aggfunc="median"
        )
        table = table.reindex(columns=_ordered(list(table.columns), series[0], spec))
    else:
        table = rows.groupby(x)[ys].median()
        table.columns = [_label(c, spec) for c in ys]
    table = table.reindex(_ordered(list(table.index), x, spec)) * float(panel.get("scale", 1.0))
    return table, " ".join(series) or None


def _legend(ax: Any, table: pd.DataFrame, title: str | None) -> None:
    if table.shape[1] > 1:
        ax.legend(title=title, fontsize=8, title_fontsize=8, frameon=False)


def _bars(ax: Any, rows: pd.DataFrame, spec: dict[str, Any], panel: dict[str, Any]) -> None:
    table, title = _table(rows, spec, panel)
    n = max(table.shape[1], 1)
    width = 0.8 / n
    positions = range(len(table.index))
    for i, column in enumerate(table.columns):
        ax.bar([p - 0.4 + width * (i + 0.5) for p in positions], table[column].to_numpy(), width, label=str(column))
    labels = [_label(v, spec) for v in table.index]
    # long labels (model names) at the default size run into each other under four or more groups
    small = len(labels) >= 4 and max(map(len, labels)) > 10
    ax.set_xticks(list(positions), labels, fontsize=8 if small else None)
    if not panel.get("logy") and table.shape[1] > 1:
        # room for the legend above the bars: a line for each series and one for its title
        ax.set_ylim(top=float(table.max().max()) * (1.2 + 0.1 * (table.shape[1] + 1)))
    ax.set_xlabel(spec.get("xlabel", spec["x"]))
    ax.set_ylabel(panel.get("ylabel", panel["y"]))
    if panel.get("logy"):
        _log_axis(ax.yaxis, ax.set_yscale)
    _legend(ax, table, title)


def _barh(ax: Any, rows: pd.DataFrame, spec: dict[str, Any], panel: dict[str, Any]) -> None:
    table, _ = _table(rows, spec, panel)
    table = table.loc[table.sum(axis=1).sort_values(ascending=False).index[: int(spec.get("top", len(table)))]]
    table = table.iloc[::-1]  # the largest at the top
    ax.barh([_label(v, spec) for v in table.index], table.iloc[:, 0].to_numpy(), color="C0")
    ax.set_xlabel(panel.get("ylabel", panel["y"]))
    ax.tick_params(axis="y", labelsize=7)


def _lines(ax: Any, rows: pd.DataFrame, spec: dict[str, Any], panel: dict[str, Any]) -> None:
    table, title = _table(rows, spec, panel)
    for column in table.columns:
        line = table[column].dropna()
        ax.plot(line.index.to_numpy(dtype=float), line.to_numpy(), marker="o", label=str(column))
    ticks = [float(v) for v in table.index]
    if spec.get("logx"):
        ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))  # the measured values, not powers of ten
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _label(float(v), spec)))
    ax.set_xlabel(spec.get("xlabel", spec["x"]))
    ax.set_ylabel(panel.get("ylabel", panel["y"]))
    if panel.get("logy"):
        _log_axis(ax.yaxis, ax.set_yscale)
    _legend(ax, table, title)


def _log_axis(axis: Any, set_scale: Any) -> None:
    """A log axis labelled in plain numbers (1, 2, 3, 5, 10, 20 ...) rather than only 10^0 and 10^1."""
    set_scale("log")
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.1e}"[0] in "235" else ""))
