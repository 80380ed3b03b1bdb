"""The harness's progress bars draw on a terminal and stay silent in a log or a pipe."""

from __future__ import annotations

import io

import pytest

from inferlab.bench.progress import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream,shown", [(io.StringIO(), False), (Terminal(), True)])
def test_bars_only_on_a_terminal(stream, shown, monkeypatch):
    monkeypatch.setattr("sys.stderr", stream)
    assert list(progress(range(3), "steps")) == [0, 1, 2]
    assert ("steps" in stream.getvalue()) == shown
    with progress(desc="off", total=2, enabled=False) as bar:
        bar.update(2)
    assert "off" not in stream.getvalue()
