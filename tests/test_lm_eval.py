"""lm-eval's `local-completions` model against a real inferlab-serve on local-file tasks (the lm_eval study at
size=smoke): its log-likelihoods agree with the project's own evaluation of the same text and weights."""

from __future__ import annotations

import importlib.util

import pytest
from test_bench_smoke import one_ok_result

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("lm_eval") is None,
        reason="lm-eval is not installed: pip install -e '.[eval]' (make setup does)",
    ),
]


def test_lm_eval_agrees_with_the_projects_own_perplexity(tmp_path):
    result = one_ok_result(tmp_path, "-m", "sweep=lm_eval", "size=smoke", "precision=fp32")
    rows = {row["task"]: row for row in result["rows"]}
    assert set(rows) == {"rolling", "next_line"}
    # The same windows and tokens on both sides, so equal up to float rounding: each token's log-probability is
    # fp32 of ~10 nats (an ulp ~1e-6) computed by other kernels in another order (the server's batched windows,
    # the study's own forwards), and the perplexities' ratio is exp of the mean difference, so a few ulps per
    # token stay under 1e-5 relative. Windows one token apart (other context for some tokens) move even the tiny
    # random model's by 0.2 %.
    for row in rows.values():
        assert abs(row["diff_pct"]) < 1e-3 and row["lm_eval_ppl"] > 1 and row["tokens"] > 0
    assert rows["rolling"]["tokens"] > rows["rolling"]["window"]  # several windows per document
    assert rows["rolling"]["own_ppl_own_windows"] > 1
