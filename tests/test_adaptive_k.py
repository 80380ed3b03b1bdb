"""Adaptive K: the draft length that maximizes expected tokens per unit of cost, and the fallback to plain decoding."""

from __future__ import annotations

import pytest

from inferlab.engine.adaptive_k import (
    BACKOFF,
    MIN_SAMPLES,
    WINDOW,
    AdaptiveK,
    Calibration,
    DraftCost,
    StepCost,
    best_k,
    draft_token_cost,
)


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


def test_a_draft_token_costs_its_drafting_and_its_row_over_the_sequences_share_of_a_step():
    step, draft = StepCost(), DraftCost()
    assert draft_token_cost(step, draft, 1) is None  # nothing timed: the drafter's bytes ratio serves
    prior = Calibration(0.008, 0.002, 0.001)
    assert draft_token_cost(step, draft, 1, prior) == pytest.approx(prior.token_cost()) == (0.002 + 0.001) / 0.010
    step = steps_of([1, 7, 8, 56])
    assert draft_token_cost(step, draft, 1, Calibration(0.004, 0.001, 0.0005)) == pytest.approx(prior.token_cost())
    for tokens in [10, 30] * MIN_SAMPLES:
        draft.observe(tokens, 0.001 * tokens)  # a millisecond per drafted token
    assert draft.per_token() == pytest.approx(0.001)
    assert draft_token_cost(step, draft, 1) == pytest.approx((0.002 + 0.001) / 0.010)
    assert draft_token_cost(step, draft, 8) == pytest.approx((0.002 + 0.001) / (0.024 / 8))


def test_a_prior_timed_in_a_burst_of_load_gives_way_to_faster_drafting():
    """Timed at load while the machine was busy, a draft token read as costing more than a step (speculation would
    not pay); one faster drafting in the loop, and the sequence's drafts cost what the loop timed."""
    step, draft = steps_of([1, 7]), DraftCost()
    prior = Calibration(0.008, 0.002, 0.012)
    assert draft_token_cost(step, draft, 1, prior) == pytest.approx(1.4)
    draft.observe(4, 0.004)
    assert draft_token_cost(step, draft, 1, prior) == pytest.approx((0.002 + 0.001) / 0.010)


@pytest.mark.parametrize("decodes, expected", [(1, 4), (8, 0)])
def test_k_given_measured_costs(decodes, expected):
    """A self draft accepted 88%, on steps of 8 ms plus 2 ms a row and a millisecond of drafting per token: one
    sequence gains from rounds of 4 (a draft token at 0.3 of its 10 ms step); at c=8 a draft token costs as much
    as the sequence's share of the step (3 ms of 24 / 8) and the sequence decodes plainly."""
    step, draft = steps_of([1, 7, 8, 56, 16, 24]), DraftCost()
    for _ in range(MIN_SAMPLES):
        draft.observe(8, 0.008)
    cost = draft_token_cost(step, draft, decodes)
    policy = AdaptiveK(max_k=6, draft_cost=0.25, acceptance=0.88)
    assert policy.next_k(cost) == expected == brute_force_k(0.88, cost, 6)
    assert AdaptiveK(max_k=6, draft_cost=0.25, acceptance=0.88).next_k() == brute_force_k(0.88, 0.25, 6) > 0
