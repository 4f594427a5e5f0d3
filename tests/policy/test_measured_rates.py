"""MeasuredRates (spec/acceptance.py): each ladder arm's acceptance as its own rounds measured
it, and the tokens per round those rounds committed, against numpy over the same rounds."""

from __future__ import annotations

import math
import random

import numpy as np

from dspark_launch.spec.acceptance import MeasuredRates


def rounds_of(seed: int, n: int, cap: int) -> list[tuple[int, int]]:
    """(verified, accepted) per round: `cap` drafts mostly, fewer now and then (a request
    near its max_tokens), none in some (a cost model's choice)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        verified = rng.choice([cap] * 6 + [0, max(cap - 2, 0)])
        accepted = 0
        while accepted < verified and rng.random() < 0.7 - 0.05 * accepted:
            accepted += 1
        out.append((verified, accepted))
    return out


def test_expectation_is_the_mean_of_the_rounds_tokens():
    measured = MeasuredRates(8)
    rounds = rounds_of(0, 300, 6)
    for verified, accepted in rounds:
        measured.observe("arm", verified, accepted)
    tokens = np.array([1 + a for _, a in rounds], dtype=np.float64)
    assert math.isclose(measured.expectation("arm"), math.log(tokens.mean()), rel_tol=1e-12)
    # and the conditional rates are still accepted / reached, position by position
    reached = [sum(1 for v, a in rounds if v > k and a >= k) for k in range(6)]
    accepted = [sum(1 for v, a in rounds if v > k and a > k) for k in range(6)]
    expected = [a / r for a, r in zip(accepted, reached)]
    assert np.allclose(measured.rates("arm", 1)[:6], expected)


def test_counts_age_with_the_steps_that_observed_them_only():
    """An arm the ladder tries once in a while keeps its rounds while others play."""
    measured, decay = MeasuredRates(4, decay=0.9), 0.9
    for step in range(40):
        if step % 10 == 0:  # a try: one step of the tried arm
            measured.observe("tried", 4, step // 10)
            measured.tick()
        measured.observe("current", 4, 2)
        measured.tick()
    # "tried" aged by its own four steps only: round i by the 4 - i ticks from its own
    weights = np.array([decay ** (4 - i) for i in range(4)])
    tokens = np.array([1 + i for i in range(4)], dtype=np.float64)
    mean = (weights * tokens).sum() / weights.sum()
    assert math.isclose(measured.expectation("tried"), math.log(mean), rel_tol=1e-12)
    # "current" played 40 steps of 3 tokens: exactly 3
    assert math.isclose(measured.expectation("current"), math.log(3.0))


def test_plain_rounds_of_a_drafting_arm_count_one_token_each():
    measured = MeasuredRates(4)
    measured.observe("arm", 3, 3)  # 4 tokens
    for _ in range(3):  # requests at their last token: no draft verified
        measured.observe("arm", 0, 0)
    assert math.isclose(measured.expectation("arm"), math.log((4 + 3) / 4))
    assert measured.rates("arm", 1) == [1.0, 1.0, 1.0]
    assert measured.expectation("never played") is None
