"""Progress bars for the harness: tqdm on a terminal, silent where stderr is a log or a pipe (CI, `make
report > log`), and gone once done so the next job's lines follow."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm


def progress(
    iterable: Iterable[Any] | None = None, desc: str = "", total: int | None = None, enabled: bool = True
) -> tqdm:
    return tqdm(iterable, desc=desc, total=total, leave=False, disable=None if enabled else True, dynamic_ncols=True)
