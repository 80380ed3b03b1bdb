"""Charts for the report's sections, drawn from the CSV's rows with matplotlib (PNG, no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import pandas as pd  # noqa: E402


def chart(frame: pd.DataFrame, spec: dict[str, Any], title: str, path: Path) -> Path:
    """A line or bar chart of `spec.y` (one column or several) against `spec.x`, one series per `spec.series`."""
    ys = spec["y"] if isinstance(spec["y"], list) else [spec["y"]]
    series = spec.get("series")
    fig, ax = plt.subplots(figsize=(7, 4))
    if spec.get("kind", "line") == "bar":
        table = frame.pivot_table(index=spec["x"], columns=series, values=ys[0], aggfunc="median") if series \
            else frame.groupby(spec["x"])[ys].median()
        table.plot.bar(ax=ax, rot=0)
    else:
        groups = frame.groupby(series) if series else [(None, frame)]
        for name, group in groups:
            group = group.sort_values(spec["x"])
            for y in ys:
                label = " ".join(str(p) for p in (name, y if len(ys) > 1 else None) if p is not None) or y
                ax.plot(group[spec["x"]], group[y], marker="o", label=label)
        ax.legend()
    ax.set_xscale("log" if spec.get("logx") else "linear")
    ax.set_yscale("log" if spec.get("logy") else "linear")
    ax.set_xlabel(spec.get("xlabel", spec["x"]))
    ax.set_ylabel(spec.get("ylabel", ys[0]))
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
