"""Adaptive K: the draft length that maximizes expected tokens per unit of cost, and the fallback to plain decoding."""

from __future__ import annotations

import pytest

from inferlab.engine.spec.adaptive_k import (
    BACKOFF,
    MAX_AGE,
    MIN_SAMPLES,
    ROUNDS,
    WINDOW,
    AdaptiveK,
    StepCost,
    StepYields,
    best_k,
    expected_tokens,
    plan_k,
)
from inferlab.engine.spec.calibration import Calibration


def brute_force_k(acceptance: float, draft_cost: float, max_k: int) -> int:
    rates = [sum(acceptance**i for i in range(k + 1)) / (1 + k * draft_cost) for k in range(max_k + 1)]
    return max(range(max_k + 1), key=lambda k: (round(rates[k], 12), -k))


@pytest.mark.parametrize("acceptance", [0.0, 0.1, 0.3, 0.5, 0.7, 0.88, 0.95, 1.0])
@pytest.mark.parametrize("draft_cost", [0.0, 0.05, 0.2, 0.45, 1.0])
def test_best_k_maximizes_tokens_per_cost(acceptance, draft_cost):
    assert best_k(acceptance, draft_cost, 6) == brute_force_k(acceptance, draft_cost, 6)


def test_long_rounds_where_the_draft_agrees_none_where_it_costs_more_than_it_brings():
    assert best_k(0.95, 0.2, 6) == 6
    assert 0 < best_k(0.6, 0.2, 6) < 6
    assert best_k(0.15, 0.2, 6) == 0  # even one draft token brings 0.15 for a cost of 0.2


def test_falls_back_then_probes_and_resumes():
    policy = AdaptiveK(max_k=4, draft_cost=0.1)
    assert policy.next_k() == 4  # the prior: the draft usually agrees
    for _ in range(20):
        policy.observe(4, 0)
    assert policy.acceptance < 0.1
    assert [policy.next_k() for _ in range(BACKOFF)] == [0] * BACKOFF  # plain decoding
    assert policy.next_k() == 1  # the probe
    for _ in range(5):
        policy.observe(1, 1)
    assert policy.next_k() > 0  # it pays again


def test_failed_probe_backs_off_again():
    policy = AdaptiveK(max_k=4, draft_cost=0.3, acceptance=0.0)
    assert [policy.next_k() for _ in range(BACKOFF)] == [0] * BACKOFF
    assert policy.next_k() == 1
    policy.observe(1, 0)
    assert [policy.next_k() for _ in range(BACKOFF)] == [0] * BACKOFF


def test_observe_counts_accepted_and_one_rejection():
    policy = AdaptiveK(max_k=4, draft_cost=0.1, acceptance=0.5)
    policy.observe(4, 4)  # four successes, nothing rejected
    assert policy.acceptance == pytest.approx(1 - 0.5 * 0.9**4)
    policy.observe(4, 1)  # one success, one failure; the two after the rejection were never judged
    high = 1 - 0.5 * 0.9**5
    assert policy.acceptance == pytest.approx(high * 0.9)


def test_step_cost_fits_seconds_per_step_and_per_row():
    cost = StepCost()
    assert cost.fit() is None and cost.fit((0.01, 0.001)) == (0.01, 0.001)
    for rows in [8, 16, 56, 24, 40] * MIN_SAMPLES:
        cost.observe(rows, 0.010 + 0.001 * rows)
    a, b = cost.fit()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.001)


def test_step_cost_without_varied_rows_charges_nothing_per_row():
    cost = StepCost()
    for _ in range(10):
        cost.observe(8, 0.02)
    assert cost.fit() == (pytest.approx(0.02), 0.0)
    a, b = cost.fit((0.006, 0.001))  # a prior splits the step's seconds as it splits its own (0.014 at 8 rows)
    assert a == pytest.approx(0.02 * 6 / 14) and b == pytest.approx(0.02 / 14)


def test_step_cost_counts_the_fastest_recent_steps():
    """A shared machine's stray slow steps (a verification of 7 rows, a plain step) move nothing: each row count's
    fastest step of the window is the fit's."""
    cost = StepCost()
    for i in range(WINDOW):
        for rows in (1, 7):
            slowdown = 3.0 if i % 4 == rows % 4 else 1.0 + 0.01 * (i % 3)
            cost.observe(rows, slowdown * (0.010 + 0.001 * rows))
    a, b = cost.fit()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.001)


def test_step_cost_follows_the_recent_steps():
    cost = StepCost()
    for rows in [1, 7] * 50:
        cost.observe(rows, 0.010)  # verification as cheap as a decode step
    for rows in [8, 56] * 50:
        cost.observe(rows, 0.002 * rows)  # then under load: every row costs
    assert cost.fit()[1] == pytest.approx(0.002, rel=0.05)


def steps_of(rows: list[int], seconds=lambda rows: 0.008 + 0.002 * rows) -> StepCost:
    step = StepCost()
    for _ in range(MIN_SAMPLES):
        for r in rows:
            step.observe(r, seconds(r))
    return step


def test_step_cost_takes_the_priors_line_until_enough_rows_are_timed():
    """A few timings of a row count, or row counts close together, do not fit a line: the prior's, at their level."""
    step = StepCost()
    for rows in [1, 7, 8, 56]:
        step.observe(rows, 2 * (0.008 + 0.002 * rows))  # a busier machine than at load
    assert step.fit((0.008, 0.002)) == (pytest.approx(0.016), pytest.approx(0.004))
    close = steps_of([5, 6], lambda rows: 0.030 - 0.002 * rows)  # noise: more rows seemingly faster
    assert close.fit((0.008, 0.002)) == (pytest.approx(0.9 * 0.008), pytest.approx(0.9 * 0.002))  # 0.018 s at 6 rows


def test_a_step_curve_follows_the_timed_row_counts_and_the_fitted_slope_past_them():
    """fp32 SmolLM2's steps as timed in the engine loop: up to 8 rows on the project's kernel, more on oneDNN's, a
    staircase a line misses (the step of 16 rows costs 12 ms more than 8, that of 9 as much)."""
    timed = {8: 0.0275, 9: 0.0365, 16: 0.0393, 24: 0.052}
    step = steps_of(list(timed), lambda rows: timed[rows])
    seconds = step.curve(step.fit((0.016, 0.001)))
    assert [seconds(r) for r in timed] == [pytest.approx(t) for t in timed.values()]
    assert seconds(20) == pytest.approx((0.0393 + 0.052) / 2)  # between timed counts: on the line between them
    _, b = step.fit()
    assert seconds(40) == pytest.approx(0.052 + 16 * b) and seconds(4) == pytest.approx(0.0275 - 4 * b)
    verifications = steps_of([32, 56], lambda rows: 0.014 if rows == 32 else 0.040)  # a fast outlier at 32 rows
    fewer = verifications.curve(verifications.fit())
    assert fewer(8) == pytest.approx(0.014 * 8 / 32)  # the slope would reach 0 s: the step's share of its rows
    assert plan_k([0.9] * 8, 6, fewer, lambda rows: 0.002 + 0.0005 * rows) == 0  # 3.5 ms a plain step: no draft pays
    untimed = StepCost()
    untimed = untimed.curve(untimed.fit((0.016, 0.001)))  # nothing timed: the prior's line
    assert untimed(8) == pytest.approx(0.024)
    busier = StepCost()
    busier.observe(8, 0.048)  # timed once, on a busier machine: the prior's line at its level
    assert busier.curve(busier.fit((0.016, 0.001)))(16) == pytest.approx(2 * 0.032)


def test_verifications_past_the_plain_steps_are_priced_as_timed_even_once():
    """fp32 SmolLM2 at c=4 on a 2-core AVX2 EPYC, as the engine loop timed it (fastest per row count, times timed):
    plain steps of 1 and 4 rows (fused, both ~28.8 ms) often, verifications of B x (K + 1) rows a few times each.
    A slope through the two plain knots alone (flat) priced the 8 rows of K = 1 at 28.8 ms; timed once or thrice,
    the row counts past them say 44-77 ms, and with a 24.9 ms draft step plain decoding wins (4 tokens in 28.8 ms
    against ~7.8 in ~75)."""
    timed = {1: (0.0289, 4), 4: (0.0288, 4), 5: (0.0429, 3), 7: (0.0445, 3), 13: (0.0768, 1), 20: (0.1043, 3)}
    step = StepCost()
    for rows, (seconds, times) in timed.items():
        for _ in range(times):
            step.observe(rows, seconds)
    seconds = step.curve(step.fit())
    assert seconds(4) == pytest.approx(0.0288) and seconds(7) == pytest.approx(0.0445)
    assert seconds(12) == pytest.approx(0.0445 + (0.0768 - 0.0445) * 5 / 6)  # between 7 and 13 rows, timed 3x and 1x
    assert seconds(16) > seconds(13) and seconds(24) >= seconds(20)
    assert plan_k([0.95] * 4, 6, seconds, lambda rows: 0.0249) == 0


def brute_force_plan(acceptances, max_k, target, draft, first_rows=None):
    decodes = len(acceptances)
    first = draft(first_rows or decodes)
    rates = [
        sum(sum(a**i for i in range(k + 1)) for a in acceptances)
        / (target(decodes * (k + 1)) + (first + (k - 1) * draft(decodes) if k else 0.0))
        for k in range(max_k + 1)
    ]
    return max(range(max_k + 1), key=lambda k: (round(rates[k], 12), -k))


@pytest.mark.parametrize("acceptances", [[0.88], [0.3], [1.0, 0.5], [0.9] * 8, [0.2, 0.95, 0.95, 0.7]])
@pytest.mark.parametrize("target", [(0.008, 0.002), (0.016, 0.001), (0.009, 0.0)])
@pytest.mark.parametrize("draft", [(0.004, 0.0004), (0.002, 0.001), (0.0, 0.0)])
@pytest.mark.parametrize("unseen", [None, 16, 200])  # rows of the first draft step (a draft model catching up)
def test_plan_k_maximizes_expected_tokens_per_second(acceptances, target, draft, unseen):
    def line(a, b):
        return lambda rows: a + b * rows

    first_rows = None if unseen is None else unseen * len(acceptances)
    assert plan_k(acceptances, 6, line(*target), line(*draft), first_rows) == brute_force_plan(
        acceptances, 6, line(*target), line(*draft), first_rows
    )


def test_a_draft_that_must_first_read_the_whole_context_does_not_start_where_its_rounds_barely_pay():
    """A draft model with its own KV feeds a request's whole context at its first drafting: an int8-like target
    (4 ms + 0.7 ms a row) with a draft of 2 ms + 0.05 ms a row gains from rounds once caught up, but not enough to
    pay 200 rows of catching up in one round; an fp32-like target (15 ms a step) does."""
    draft = lambda rows: 0.002 + 0.00005 * rows  # noqa: E731
    int8 = lambda rows: 0.004 + 0.0007 * rows  # noqa: E731
    assert plan_k([0.8], 6, int8, draft) > 0
    assert plan_k([0.8], 6, int8, draft, first_rows=200) == 0
    assert plan_k([0.8], 6, lambda rows: 0.015 + 0.0007 * rows, draft, first_rows=200) > 0


@pytest.mark.parametrize("acceptance", [0.3, 0.6, 0.88, 0.95])
def test_plan_k_for_one_sequence_is_best_k(acceptance):
    """One sequence on steps of a + b * rows: a draft token (its draft step and its verified row) costs
    (draft + b) / (a + b) one-row steps, best_k's draft_cost."""
    a, b, draft = 0.008, 0.002, 0.003
    cost = (draft + b) / (a + b)
    assert plan_k([acceptance], 6, lambda rows: a + b * rows, lambda rows: draft) == best_k(acceptance, cost, 6)


@pytest.mark.parametrize(
    "target, decodes, expected",
    [
        ((0.008, 0.002), 1, 2),  # one sequence: a draft token costs 2 ms + 4.4 ms, 0.64 of its 10 ms step
        ((0.008, 0.002), 8, 0),  # c=8: 2 ms a verified row + 0.9 ms of the 8 sequences' draft step, of a 3 ms share
        ((0.016, 0.001), 8, 2),  # a target whose step is mostly its fixed cost, c=8: 1 + 0.9 ms of a 3 ms share
    ],
)
def test_k_given_measured_costs(target, decodes, expected):
    """A self draft accepted 88%, on target steps of `target` (a, b) and draft steps of 4 ms + 0.4 ms a sequence.
    Under load the rows decide: a draft step's fixed cost is shared by the sequences drafting in it, a verified row
    is not, so the same draft pays at c=8 on a target whose step is mostly its fixed cost and not on one whose rows
    cost."""
    step = steps_of([1, 7, 8, 56, 16, 24], lambda rows: target[0] + target[1] * rows)
    draft = steps_of([1, 4, 8], lambda rows: 0.004 + 0.0004 * rows)
    target, drafting = step.curve(step.fit()), draft.curve(draft.fit())  # the loop's own timings alone
    k = plan_k([0.88] * decodes, 6, target, drafting)
    assert k == expected == brute_force_plan([0.88] * decodes, 6, target, drafting)


def test_a_calibrated_draft_token_costs_its_draft_step_and_its_verified_row():
    calibration = Calibration(a=0.008, b=0.002, draft_a=0.003, draft_b=0.001)
    assert calibration.token_cost() == pytest.approx((0.004 + 0.002) / 0.010)


def test_step_yields_judge_a_k_by_its_recent_whole_steps():
    """A (decodes, K)'s rate is its expected tokens times the median yield (tokens per second per expected token) of
    its last ROUNDS steps, once MIN_SAMPLES were timed; yields older than MAX_AGE steps of as many decodes no longer
    count."""
    timed = StepYields()
    for _ in range(MIN_SAMPLES - 1):
        timed.observe(8, 2, expected_tokens=24.0, tokens=20, seconds=0.05)
    assert timed.rate(8, 2, 24.0) is None
    timed.observe(8, 2, expected_tokens=24.0, tokens=20, seconds=0.05)
    assert timed.rate(8, 2, 24.0) == pytest.approx(400.0)  # 20 tokens in 50 ms
    assert timed.rate(8, 2, 12.0) == pytest.approx(200.0)  # acceptance fell since: half the expected tokens
    assert timed.rate(4, 2, 12.0) is None and timed.rate(8, 1, 16.0) is None
    for _ in range(ROUNDS):
        timed.observe(8, 0, expected_tokens=8.0, tokens=8, seconds=0.016)
    assert timed.rate(8, 0, 8.0) == pytest.approx(500.0)
    for _ in range(MAX_AGE):
        timed.observe(1, 0, expected_tokens=1.0, tokens=1, seconds=0.01)
    assert timed.rate(8, 2, 24.0) is not None  # steps of another count of decodes age nothing
    for _ in range(MAX_AGE - MIN_SAMPLES + 1):
        timed.observe(8, 0, expected_tokens=8.0, tokens=8, seconds=0.016)
    assert timed.rate(8, 2, 24.0) is None and timed.rate(8, 0, 8.0) is not None  # K = 2 priced afresh


def test_plan_k_goes_by_what_whole_steps_brought_where_they_were_timed():
    """bf16 SmolLM2 at c=8 on a 2-core AMX Xeon, as the engine loop timed it: the pieces price K = 1 at 27.1 ms and a
    plain step at 14.6 (K = 1 looks 1.06x as fast at acceptance 0.97), the whole steps took 32.3 and 15.8 ms. Timed
    whole, plain decoding wins; a K not timed yet is priced with the error its kind showed (drafting's 0.82 here)."""
    target = lambda rows: 0.0122 + 0.0003 * rows  # noqa: E731
    draft = lambda rows: 0.0101  # noqa: E731
    acceptances = [0.97] * 8
    assert plan_k(acceptances, 1, target, draft) == 1
    timed = StepYields()
    for _ in range(MIN_SAMPLES):
        timed.observe(8, 0, 8.0, 8, 0.0158)
        timed.observe(8, 1, expected_tokens(acceptances, 1)[1], 16, 0.0323)
    assert plan_k(acceptances, 1, target, draft, timed=timed) == 0
    assert plan_k(acceptances, 3, target, draft, timed=timed) == 0  # K = 2, 3 priced with K = 1's error: no better
    assert plan_k(acceptances[:1], 3, target, draft, timed=timed) == 3  # one sequence: nothing timed, drafting pays


def test_in_the_loop_a_k_must_bring_min_gain_over_plain_decoding():
    timed = StepYields()
    acceptances = [0.9] * 8
    for _ in range(MIN_SAMPLES):
        timed.observe(8, 0, 8.0, 8, 0.016)  # 500 tokens/s
        timed.observe(8, 1, expected_tokens(acceptances, 1)[1], 15, 0.03)  # 500 tokens/s
        timed.observe(8, 2, expected_tokens(acceptances, 2)[2], 21, 0.039)  # 538 tokens/s: 1.08x
    line = lambda rows: 0.016  # noqa: E731
    assert plan_k(acceptances, 2, line, line, timed=timed) == 2
    assert plan_k(acceptances, 2, line, line, timed=timed, min_gain=1.1) == 0
    assert plan_k(acceptances, 2, line, line, timed=timed, min_gain=1.05) == 2


def test_under_load_the_shortest_round_nearly_as_good_is_taken():
    """bf16 SmolLM2 at c=8 on a 2-core AMX Xeon: K = 1, 2 and 6 timed whole at 563, 570 and 554 tokens/s, plain 500.
    Within 10% of the best rate K = 1 is as good and holds a prompt that arrives during the round back the least;
    one sequence alone (nobody's prompt waits on its round) keeps the best."""
    timed = StepYields()
    acceptances = [0.9] * 8
    brought = {0: (8, 0.016), 1: (15.8, 0.0281), 2: (23.0, 0.0404), 6: (46.0, 0.0830)}
    for _ in range(MIN_SAMPLES):
        for k, (tokens, seconds) in brought.items():
            timed.observe(8, k, expected_tokens(acceptances, k)[k], tokens, seconds)
            timed.observe(1, k, expected_tokens(acceptances[:1], k)[k], tokens / 8, seconds / 2)
    line = lambda rows: 0.016  # noqa: E731  (K = 3-5, not timed: priced by drafting's error, below K = 2)
    assert plan_k(acceptances, 6, line, line, timed=timed, min_gain=1.05) == 2
    assert plan_k(acceptances, 6, line, line, timed=timed, min_gain=1.05, shorter_within=0.1) == 1
    assert plan_k(acceptances, 6, line, line, timed=timed, min_gain=1.05, shorter_within=0.001) == 2
    assert plan_k(acceptances[:1], 6, line, line, timed=timed, min_gain=1.05, shorter_within=0.1) == 2
