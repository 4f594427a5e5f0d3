"""Algorithm 1 (greedy admission, early stop) against a brute-force search over every length
vector, on synthetic survival probabilities and synthetic cost curves where the objective is
unimodal in the number of admitted drafts; plus monotonicity sanity checks."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dspark_launch.spec.cost_curve import CostCurve
from dspark_launch.spec.policy import best_prefix, choose_lengths, monotone


def brute_force(survival, base, seconds):
    """Every length vector; the objective's best value and the vectors that reach it."""
    best, argmax = -math.inf, []
    for lengths in itertools.product(*[range(len(row) + 1) for row in survival]):
        tau = len(survival) + sum(sum(row[:n]) for row, n in zip(survival, lengths))
        theta = tau / seconds(base + sum(lengths))
        if theta > best + 1e-12:
            best, argmax = theta, [list(lengths)]
        elif abs(theta - best) <= 1e-12:
            argmax.append(list(lengths))
    return best, argmax


def by_drafts(survival, base, seconds):
    """The objective as a function of the number of admitted drafts D (best D drafts)."""
    flat = sorted((a for row in survival for a in row), reverse=True)
    return [(len(survival) + sum(flat[:d])) / seconds(base + d) for d in range(len(flat) + 1)]


def unimodal(values):
    peak = values.index(max(values))
    rising = all(values[i] < values[i + 1] for i in range(peak))
    falling = all(values[i] > values[i + 1] for i in range(peak, len(values) - 1))
    return rising and falling


conds = st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.lists(conds, min_size=1, max_size=3), st.integers(0, 6),
       st.floats(0.0, 1.0), st.floats(0.01, 1.0), st.floats(0.0, 0.3), st.integers(2, 12))
def test_greedy_equals_brute_force_when_unimodal(rows, prefill, fixed, slope, bend, knee):
    survival = [monotone(list(itertools.accumulate(r, lambda a, b: a * b))) for r in rows]
    base = prefill + len(survival)
    # Memory-bound then compute-bound: flat-ish up to the knee, steeper after (convex).
    curve = CostCurve([1, knee, knee + 16], [fixed + 0.01, fixed + 0.01 + bend * knee,
                                             fixed + 0.01 + bend * knee + 16 * slope])
    values = by_drafts(survival, base, curve.step_seconds)
    assume(unimodal(values))
    choice = choose_lengths(survival, base, curve.step_seconds)
    best, argmax = brute_force(survival, base, curve.step_seconds)
    got = choice.expected_tokens / curve.step_seconds(choice.tokens)
    assert math.isclose(got, best, rel_tol=1e-9), (choice, best, argmax)
    assert choice.lengths in argmax
    assert choice.tokens == base + sum(choice.lengths)


def test_early_stop_can_miss_a_later_peak():
    """Jagged curve: a costly step at 2 tokens hides a cheap plateau behind it. Early stopping
    keeps the decision a stopping time and accepts this local maximum (reference §5.2)."""
    table = np.array([0.0, 1.0, 3.0, 1.05, 1.1])  # seconds at 1..4 tokens

    def seconds(n):
        return table[np.asarray(n)]

    survival = [[0.9, 0.9, 0.9]]
    assert choose_lengths(survival, 1, seconds).lengths == [0]
    assert brute_force(survival, 1, seconds)[1] == [[3]]


def test_zero_survival_verifies_nothing_and_certain_drafts_all():
    flat = CostCurve([1, 64], [1.0, 1.0]).step_seconds
    assert choose_lengths([[0.0] * 7, [0.0] * 7], 2, flat).lengths == [0, 0]
    slope = CostCurve([1, 64], [1.0, 1.5]).step_seconds
    assert choose_lengths([[1.0] * 7, [0.0] * 7], 2, slope).lengths == [7, 0]
    assert choose_lengths([], 5, slope).lengths == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6), min_size=1, max_size=4),
       st.floats(0.01, 0.5), st.floats(1.0, 1.5))
def test_monotone_in_survival_and_cost(rows, slope, factor):
    survival = [monotone(list(itertools.accumulate(r, lambda a, b: a * b))) for r in rows]
    higher = [[min(1.0, a * factor) for a in row] for row in survival]
    curve = CostCurve([1, 64], [1.0, 1.0 + 63 * slope])
    steeper = CostCurve([1, 64], [1.0, 1.0 + 63 * slope * 2])
    base = len(survival)
    n = sum(choose_lengths(survival, base, curve.step_seconds).lengths)
    assert sum(choose_lengths(higher, base, curve.step_seconds).lengths) >= n
    assert sum(choose_lengths(survival, base, steeper.step_seconds).lengths) <= n


def test_probes_back_off_while_drafting_does_not_pay():
    """A drafter that is never accepted, on a curve where a draft costs as much as a step:
    nothing is drafted but probes, and each probe that finds nothing accepted doubles the gap
    to the next (PROBE_EVERY, 2x, 4x, ... up to PROBE_EVERY_MAX): decided from past rounds
    only, so lossless like every other plan."""
    from dspark_launch.spec.policy import PROBE_EVERY, PROBE_EVERY_MAX, VerifyPolicy

    policy = VerifyPolicy("model", CostCurve([1, 64], [1.0, 64.0]),
                         CostCurve([1, 64], [1.0, 64.0]), positions=4)
    drafted = []
    for step in range(6000):
        lengths = policy.plan([0], ["greedy"], [4], 1)
        if sum(lengths):
            assert lengths == [4]  # a probe drafts what the request may
            drafted.append(step)
            policy.record(0, "greedy", lengths[0], 0)
        policy.record_step(1 + sum(lengths), 1 + sum(lengths), 1.0 + sum(lengths),
                           int(sum(lengths) > 0), 1.0)
    gaps = np.diff(drafted).tolist()
    assert drafted[0] == PROBE_EVERY - 1
    doubling = [PROBE_EVERY * 2 ** i for i in range(1, 5) if PROBE_EVERY * 2 ** i
                < PROBE_EVERY_MAX]
    assert gaps[:len(doubling)] == doubling
    assert set(gaps[len(doubling):]) == {PROBE_EVERY_MAX}


def test_best_prefix_prices_the_draft_block_the_longest_verify_needs():
    """Two requests, survival (0.9, 0.8, 0.1), a step of n tokens 1 + 0.01 n s. Drafting
    priced by rows (0.1 s x requests x longest verify: a block drafter's fitted block):
    [2, 2] gives 5.4 / 1.46 = 3.70 tok/s, [3, 3] only 5.6 / 1.68 = 3.33. Priced per request
    (0.1 s each, whatever the block), [3, 3] wins: 5.6 / 1.28 = 4.38 against 5.4 / 1.26."""
    survival = [[0.9, 0.8, 0.1]] * 2
    step = lambda n: 1.0 + 0.01 * n  # noqa: E731
    by_rows = best_prefix(survival, 2, step, lambda n, longest: 0.1 * n * longest)
    assert by_rows.lengths == [2, 2] and by_rows.expected_tokens == pytest.approx(5.4)
    per_request = best_prefix(survival, 2, step, lambda n, longest: 0.1 * n)
    assert per_request.lengths == [3, 3]
