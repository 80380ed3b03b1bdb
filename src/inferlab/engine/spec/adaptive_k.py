"""How many tokens one sequence drafts next round, from how often its drafts were accepted so far.

If each draft token is accepted with probability a, a round of k drafts emits 1 + a + ... + a^k tokens
on average (the accepted run plus the target's own token) and costs one target step of k + 1 rows (the
verification: on a CPU its rows read the weights once, like a decode step, plus each row's arithmetic) and
k draft steps: 1 + k * `draft_cost` one-row target steps, a draft token costing its draft step and its
verified row (spec/calibration.py's Calibration, timed at load; the draft's bytes over the target's before that).
Each round takes the k in 0..max_k with the most tokens per unit of cost (Leviathan et al. 2023, section 3.4). a is
a running estimate per sequence: text the draft knows well gets long rounds, text it does not gets short ones.
When even k = 1 costs more than it brings (a < the draft token's cost), the sequence decodes plainly for BACKOFF
tokens, then probes with one round of at least one draft: speculation resumes where it pays again.

In the engine loop a verification is rows of a batched step, and there rows cost: with B sequences a step's
B x (k + 1) rows take longer than its B (the lm_head and attention per row, the kernel's rows per pass, and a
kernel may switch paths past some row count), and so do the draft's rows. There one K serves every decode of a
step (plan_k): the k whose step, B x (k + 1) rows after k draft steps of B rows, brings the most expected tokens
(from each sequence's own acceptance) per second. Both the loop's decode steps and its draft steps are timed
(StepCost: the fastest timing at each row count, a line through them; the load-time Calibration until the loop
has its own), so a draft step's fixed cost is shared by the sequences drafting in it: a row-cheap draft pays with
several sequences where one sequence's draft step would not, and where rows cost more than acceptance brings, the loop
decodes plainly. A draft model with a KV cache of its own first feeds what it has not seen (the tokens of plain
steps, the whole context at a request's first drafting), so a step's first draft step counts those rows. When only
the estimates hold it back (drafts that were all accepted would pay), every decode probes with one draft after
BACKOFF plain steps, twice as many after each probe that did not resume drafting (up to MAX_BACKOFF).
Those prices are pieces; the loop also times its steps whole, from schedule to hand-off, with the tokens each
brought (StepYields), and once a K has been timed at a step's count of decodes, that timing is its rate. Once some
K > 0 was timed there, a K > 0 must bring LOOP_MIN_GAIN times plain decoding's rate, or the step decodes plainly
(and of the K's that do, the shortest round within LOOP_SHORTER_WITHIN of the best's rate is taken); before, the
prices decide (they err both ways, so a K they price as barely paying is tried and timed). Where
drafting was timed and no acceptance would pay, nothing probes; where only prices say so, the probes go on, and
their draft steps correct the prices.

The choice only ever depends on past rounds, so it keeps speculative sampling exact.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

PRIOR = 0.8  # acceptance assumed before any evidence: a draft is used because it usually agrees (in the engine loop
# only until its first rounds: later sequences start from the drafter's running estimate, Speculation.acceptance)
WEIGHT = 0.1  # each accepted or rejected draft token moves the estimate this far towards 1 or 0 (~10-token memory)
BACKOFF = 16  # plain decoding steps after speculation stopped paying, before the next probe
MAX_BACKOFF = 256  # the engine loop's plain steps between probes, doubled after each probe in vain, are at most this
WINDOW = 32  # the recent steps (and draftings) whose costs adaptive K counts
MIN_SAMPLES = 4  # timings of a row count before its fastest is a point of the fitted line
MIN_SPREAD = 3  # rows between the fewest and most rows timed before a row's cost is fitted
ROUNDS = 8  # the recent whole steps at each (decodes, K) whose yield judges that K (StepYields)
# In the engine loop a K > 0 must bring this many times plain decoding's tokens per second, as timed whole, and of
# the K's that do, the shortest round within LOOP_SHORTER_WITHIN of the best's rate is taken: under load the streams
# gain less than the steps, the more so the longer a round (a prompt arriving waits it out; rounds spread the
# requests' ends, so more steps run short of sequences). A bar much above 1 leaves the gains of short rounds unused;
# without the preference for the shortest round, long rounds' steps win on their own timing and lose on the streams'.
LOOP_MIN_GAIN = 1.05
LOOP_SHORTER_WITHIN = 0.1
MAX_AGE = 256  # steps of as many decodes after which a (decodes, K)'s yields are too old to judge it: priced afresh (a
# K timed in a slow moment, or at a request's cold start, is tried again, not shunned for good)


@dataclass
class Acceptance:
    """A sequence's running estimate of how often its draft tokens are accepted."""

    acceptance: float = PRIOR

    def observe(self, proposed: int, accepted: int) -> None:
        """A verified round: `accepted` drafts kept, then (if any was left) one rejected; later ones unseen."""
        for _ in range(accepted):
            self.acceptance += WEIGHT * (1.0 - self.acceptance)
        if accepted < proposed:
            self.acceptance -= WEIGHT * self.acceptance


@dataclass(kw_only=True)
class AdaptiveK(Acceptance):
    """One sequence's K per round, speculating alone (spec/session.py)."""

    max_k: int
    draft_cost: float  # one draft token (its draft step and its verified row), in target steps
    plain_left: int = field(default=0, init=False)  # plain steps before the next probe
    probing: bool = field(default=False, init=False)

    def next_k(self) -> int:
        """This round's K."""
        if self.plain_left:
            self.plain_left -= 1
            self.probing = not self.plain_left
            return 0
        k = best_k(self.acceptance, self.draft_cost, self.max_k)
        if k or self.probing:
            self.probing = False
            return max(k, min(1, self.max_k))
        self.plain_left = BACKOFF - 1
        self.probing = not self.plain_left
        return 0


def best_k(acceptance: float, draft_cost: float, max_k: int) -> int:
    """argmax over k in 0..max_k of expected tokens per round over its cost, 1 + k * draft_cost plain steps
    (ties: the shorter round)."""
    rates = [tokens / (1 + k * draft_cost) for k, tokens in enumerate(expected_tokens([acceptance], max_k))]
    best = 0
    for k in range(1, max_k + 1):
        if rates[k] > rates[best] * (1 + 1e-9):
            best = k
    return best


@dataclass
class StepCost:
    """A step's seconds (the target's decode steps, or the draft's steps) as a + b * rows, from the fastest of the last
    WINDOW steps at each row count (others on a shared machine only ever slow a step down: a decayed mean of them read
    a stray slow verification as a costly row, and with a few rows' spread a steep b left a near 0, a draft token
    costing more than a step, so that sequences went to plain decoding). A least-squares line through the row counts
    seen MIN_SAMPLES times once they span MIN_SPREAD rows; before that the prior's line (the load-time timing; without
    one, b = 0) scaled to the fastest step seen."""

    steps: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _points: tuple[dict[int, float], dict[int, float]] | None = field(default=None, init=False, repr=False)

    def observe(self, rows: int, seconds: float) -> None:
        self.steps.append((rows, seconds))
        self._points = None

    def points(self) -> tuple[dict[int, float], dict[int, float]]:
        """(each row count timed -> its fastest step, those timed at least MIN_SAMPLES times -> theirs), kept until
        the next step is observed: the engine loop reads them several times a step (fit, curve; the draft steps' when
        no decode drafted for many steps), each time on the loop's thread."""
        if self._points is None:
            fastest: dict[int, float] = {}
            counts: Counter[int] = Counter()
            for rows, seconds in self.steps:
                fastest[rows] = min(seconds, fastest.get(rows, math.inf))
                counts[rows] += 1
            self._points = fastest, {rows: s for rows, s in fastest.items() if counts[rows] >= MIN_SAMPLES}
        return self._points

    def fit(self, prior: tuple[float, float] | None = None) -> tuple[float, float] | None:
        """(a, b): seconds per step and per row, both >= 0; `prior` before any step (None without one)."""
        if not self.steps:
            return prior
        fastest, seen = self.points()
        if len(seen) < 2 or max(seen) - min(seen) < MIN_SPREAD:
            a, b = prior if prior is not None and sum(prior) > 0 else (1.0, 0.0)
            scale = min(seconds / (a + b * rows) for rows, seconds in fastest.items())
            return a * scale, b * scale
        n = len(seen)
        mean_r, mean_t = sum(seen) / n, sum(seen.values()) / n
        slope = sum((r - mean_r) * (t - mean_t) for r, t in seen.items()) / sum((r - mean_r) ** 2 for r in seen)
        b = min(max(0.0, slope), mean_t / mean_r)
        return mean_t - b * mean_r, b

    def curve(self, line: tuple[float, float]) -> Callable[[int], float]:
        """Seconds of a step of `rows` rows: between two row counts timed MIN_SAMPLES times (knots), on the line between
        their fastest steps, and past them on the slope of `line` (this cost's fit) from the nearest one (a kernel that
        switches paths past some row count makes a staircase, not a line); `line` itself where none is. Past the last
        knot every row count timed is a knot too, at its fastest however few times it was timed: those are a drafting
        loop's verifications, B x (K + 1) rows with B and K changing, which seldom repeat a count MIN_SAMPLES times,
        and a slope through the plain steps' knots alone (a few rows that cost alike) would price them as nearly free.
        A single timing errs only on the dear side (others on a shared machine only slow a step), against drafting.
        Below the fewest rows timed, never under that step's share of its rows (a step's fixed cost only raises it):
        once a loop has drafted for a while only its verifications are timed (tens of rows), and a slope through them
        can reach 0 s for a plain step of a few rows, which adaptive K divides by."""
        a, b = line
        fastest, seen = self.points()
        knots = sorted(seen.items())
        if knots:  # past the last knot, every row count timed is one too, at its fastest even if timed once
            knots += sorted((rows, s) for rows, s in fastest.items() if rows > knots[-1][0])

        def seconds(rows: int) -> float:
            if not knots:
                return a + b * rows
            (first, at_first), (last, at_last) = knots[0], knots[-1]
            if rows <= first:
                return max(at_first - b * (first - rows), at_first * rows / first)
            if rows >= last:
                return at_last + b * (rows - last)
            (low, at_low), (high, at_high) = next((k0, k1) for k0, k1 in zip(knots, knots[1:]) if k1[0] >= rows)
            return at_low + (at_high - at_low) * (rows - low) / (high - low)

        return seconds


@dataclass
class StepYields:
    """What the engine loop's whole steps of decodes alone brought, by (decodes, K) (K = 0: plain steps), as tokens
    per second per token the plan expected: a step's rate is its expected tokens times the median of its (decodes,
    K)'s last ROUNDS yields, once MIN_SAMPLES of them are younger than MAX_AGE steps of as many decodes (a load at
    another concurrency in between ages nothing: counted in all steps, loads that alternate concurrencies would
    re-explore their K's at every load).

    round_seconds' price adds up pieces, each the fastest timing of its kind (a verification of so many rows, a draft
    step), and leaves out what is no forward: the schedule, the draft's picks, rejection sampling, handing a
    round's tokens to the streams. Its tokens assume every round drafts its K and every token is wanted, where a
    round's drafting stops at a doubtful proposal and a request's last round ends at its max_tokens. Both err
    towards drafting, more than a plain step's price does, so a loop judged by prices alone drafts where its plain
    steps bring more tokens a second. Timed whole, each K is judged by
    what its steps did; the expected tokens still follow the sequences' acceptance, and MAX_AGE lets a K judged
    long ago be tried again."""

    yields: dict[tuple[int, int], deque[tuple[int, float]]] = field(default_factory=dict)
    steps: Counter[int] = field(default_factory=Counter)  # steps observed, by their decodes

    def observe(self, decodes: int, k: int, expected_tokens: float, tokens: int, seconds: float) -> None:
        self.steps[decodes] += 1
        rounds = self.yields.setdefault((decodes, k), deque(maxlen=ROUNDS))
        rounds.append((self.steps[decodes], tokens / expected_tokens / seconds))

    def rate(self, decodes: int, k: int, expected_tokens: float) -> float | None:
        """Tokens per second of a step of `decodes` decodes at K = k expecting `expected_tokens`; None until timed."""
        recent = self._recent(decodes, k)
        return expected_tokens * statistics.median(recent) if len(recent) >= MIN_SAMPLES else None

    def drafting_timed(self, decodes: int, max_k: int) -> bool:
        """Whether some K > 0 has a rate at `decodes` decodes."""
        return any(len(self._recent(decodes, k)) >= MIN_SAMPLES for k in range(1, max_k + 1))

    def _recent(self, decodes: int, k: int) -> list[float]:
        return [y for step, y in self.yields.get((decodes, k), ()) if self.steps[decodes] - step < MAX_AGE]


def expected_tokens(acceptances: list[float], max_k: int) -> list[float]:
    """A step's expected tokens when its decodes (one per acceptance) draft k tokens each, for k = 0..max_k:
    1 + a + ... + a^k a sequence, at its own acceptance a."""
    totals, runs = [float(len(acceptances))], [1.0] * len(acceptances)
    for _ in range(max_k):
        runs = [run * a for run, a in zip(runs, acceptances)]
        totals.append(totals[-1] + sum(runs))
    return totals


def round_seconds(
    decodes: int, k: int, target: Callable[[int], float], draft: Callable[[int], float], first_rows: int | None = None
) -> float:
    """The price of a step whose `decodes` decodes draft k tokens each: its verification of decodes x (k + 1) rows,
    `target`(rows) seconds, after k draft steps, each `draft`(rows): the first of `first_rows` rows (what the draft
    has not seen yet; default one a decode), the others of one a decode."""
    if not k:
        return target(decodes)
    first = draft(decodes if first_rows is None else first_rows)
    return target(decodes * (k + 1)) + first + (k - 1) * draft(decodes)


def plan_k(
    acceptances: list[float],
    max_k: int,
    target: Callable[[int], float],
    draft: Callable[[int], float],
    first_rows: int | None = None,
    timed: StepYields | None = None,
    min_gain: float = 1.0,
    shorter_within: float = 0.0,
) -> int:
    """The K every decode of an engine-loop step drafts: the k in 0..max_k with the most expected tokens per second
    (ties: the shorter round), a k > 0 only where it brings at least `min_gain` times plain decoding's once some
    k > 0 was timed whole (before, where it is priced to pay at all). A k's rate is
    `timed`'s where its steps were timed whole, else its expected tokens over round_seconds, scaled as the timed
    rates of its kind (plain; drafting; the other kind's while its own has none) are to their own prices: the price
    errs more for drafting rounds than for plain steps, so once one K has drafted, the others are judged by its
    error. Where several sequences decode, the smallest k > 0 whose rate is within `shorter_within` of the best k's
    is taken instead. For one sequence whose steps cost a + b * rows this is best_k."""
    decodes = len(acceptances)
    tokens = expected_tokens(acceptances, max_k)
    priced = [tokens[k] / round_seconds(decodes, k, target, draft, first_rows) for k in range(max_k + 1)]
    measured = [timed.rate(decodes, k, tokens[k]) if timed is not None else None for k in range(max_k + 1)]
    plain_error = [m / p for m, p in zip(measured[:1], priced) if m is not None]
    drafting_error = [m / p for m, p in zip(measured[1:], priced[1:]) if m is not None]
    plain_error, drafting_error = plain_error or drafting_error, drafting_error or plain_error
    rates = [
        rate if rate is not None else price * statistics.median((drafting_error if k else plain_error) or [1.0])
        for k, (rate, price) in enumerate(zip(measured, priced))
    ]
    # until some K > 0 was timed whole, one is tried wherever its price says it pays: the price errs both ways
    floor = rates[0] * (min_gain if any(rate is not None for rate in measured[1:]) else 1.0)
    best = 0
    for k in range(1, max_k + 1):
        if rates[k] > max(rates[best], floor) * (1 + 1e-9):
            best = k
    if decodes > 1 and best:  # the shortest round nearly as good: a longer one holds back the prompts arriving in it
        best = min(k for k in range(1, best + 1) if rates[k] * (1 + shorter_within) >= rates[best])
    return best
