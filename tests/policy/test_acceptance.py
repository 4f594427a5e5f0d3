"""Acceptance estimates: STS recovers known per-position temperatures on synthetic blocks and
lowers ECE; calibration.json loading and its errors; measured per-position rates with shrinkage;
the online confidence correction."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_launch.errors import ConfigError
from dspark_launch.spec.acceptance import (
    AcceptanceTracker,
    ConfidenceCorrection,
    apply_temperatures,
    expected_calibration_error,
    fit_sts,
    load_calibration,
    survival,
)


def synthetic_blocks(n: int, true_t: list[float], seed: int = 0):
    """Raw confidences, and acceptance drawn from the TRUE conditional probabilities
    sigmoid(logit(c)/t_k), drafts accepted left to right until the first failure."""
    g = torch.Generator().manual_seed(seed)
    k = len(true_t)
    conf = torch.sigmoid(torch.randn(n, k, generator=g) * 1.5 + 1.5)  # over-confident-ish
    p = apply_temperatures(conf, true_t)
    ok = torch.rand(n, k, generator=g) < p
    accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return conf, accepted


def test_sts_recovers_temperatures_and_lowers_ece():
    true_t = [2.0, 1.0, 3.0, 0.5]
    conf, accepted = synthetic_blocks(20000, true_t)
    temps = fit_sts(conf, accepted)
    for got, want in zip(temps, true_t):
        assert got == pytest.approx(want, rel=0.2)
    raw = survival(conf)
    cal = survival(apply_temperatures(conf, temps))
    for k in range(len(true_t)):
        outcome = (accepted > k).float()
        before = expected_calibration_error(raw[:, k], outcome)
        after = expected_calibration_error(cal[:, k], outcome)
        assert after < 0.02
        if true_t[k] != 1.0 or k > 0:
            assert after < before


def test_ece_closed_form():
    pred = torch.tensor([0.05, 0.05, 0.95, 0.95])
    outcome = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # bin 0: |0.05 - 0.5| * 2/4, bin 9: |0.95 - 1| * 2/4
    assert expected_calibration_error(pred, outcome) == pytest.approx(0.45 * 0.5 + 0.05 * 0.5)


def test_apply_temperatures_orders_and_repeats_last():
    c = torch.tensor([[0.9, 0.9, 0.9]])
    out = apply_temperatures(c, [1.0, 2.0])
    assert out[0, 0] == pytest.approx(0.9)
    assert out[0, 1] == pytest.approx(float(torch.sigmoid(torch.logit(torch.tensor(0.9)) / 2)))
    assert out[0, 2] == pytest.approx(out[0, 1])
    assert torch.equal(apply_temperatures(c, None), c)


def test_load_calibration(tmp_path):
    assert load_calibration(tmp_path) is None
    assert load_calibration(None) is None
    (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": [1.5, 2]}))
    assert load_calibration(tmp_path) == [1.5, 2.0]
    (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": [1.5, -1]}))
    with pytest.raises(ConfigError, match="positive"):
        load_calibration(tmp_path)
    (tmp_path / "calibration.json").write_text("{nope")
    with pytest.raises(ConfigError, match="calibration.json"):
        load_calibration(tmp_path)


def test_tracker_learns_rates_per_request_with_shrinkage():
    t = AcceptanceTracker(positions=3, prior=0.5, prior_weight=2.0, request_weight=4.0,
                          decay=1.0)
    for _ in range(50):
        t.observe("good", "greedy", verified=3, accepted=3)
        t.observe("bad", "greedy", verified=3, accepted=0)
    g = t.global_rates("greedy")
    # Position 1: 50 of 100 reached accepted, prior 0.5 -> exactly 0.5.
    assert g[0] == pytest.approx(0.5)
    # Position 2 is reached only by "good" (50 of 50), shrunk towards g[0] with weight 2.
    assert g[1] == pytest.approx((50 + 2 * 0.5) / (50 + 2))
    good, bad = t.conditional("good", "greedy"), t.conditional("bad", "greedy")
    assert good[0] == pytest.approx((50 + 4 * g[0]) / (50 + 4))
    assert bad[0] == pytest.approx((0 + 4 * g[0]) / (50 + 4))
    assert t.conditional("young", "greedy") == g  # no rounds yet: the global rate
    assert t.global_rates("sampled") == [0.5] * 3  # classes are separate
    t.forget("good")
    assert t.conditional("good", "greedy") == g


def test_tracker_ages_so_a_dead_drafter_is_probed_again():
    t = AcceptanceTracker(positions=2, prior=0.5, prior_weight=2.0, decay=0.9)
    for _ in range(30):
        t.observe("r", "greedy", verified=1, accepted=0)
    low = t.global_rates("greedy")[0]
    assert low == pytest.approx(1 / 32)  # (0 + 2 * 0.5) / (30 + 2)
    t.observe("s", "greedy", verified=0, accepted=0)  # verifying nothing teaches nothing
    assert t.global_rates("greedy")[0] == pytest.approx(low)
    mine = t.conditional("r", "greedy")[0]
    for _ in range(10):
        t.tick()
    assert t.global_rates("greedy")[0] == pytest.approx(1 / (30 * 0.9 ** 10 + 2))
    assert t.conditional("r", "greedy")[0] > 5 * mine


def test_confidence_correction_tracks_realised_rate():
    corr = ConfidenceCorrection(positions=2, weight=8.0, decay=1.0)
    assert corr.apply("sampled", [0.9, 0.9]) == [0.9, 0.9]
    for i in range(400):
        # Predicted 0.9 at position 1, realised 0.45 (every other round).
        corr.observe("sampled", [0.9, 0.9], accepted=i % 2)
    r = corr.ratios("sampled")
    assert r[0] == pytest.approx((200 + 8) / (400 * 0.9 + 8))  # shrunk towards 1 by weight 8
    # Position 2 is reached in the 200 rounds that accepted draft 1, accepted in none; it is
    # shrunk towards position 1's ratio.
    assert r[1] == pytest.approx((0 + 8 * r[0]) / (200 * 0.9 + 8))
    assert corr.apply("sampled", [0.9, 0.9])[0] == pytest.approx(0.9 * r[0])
    assert corr.apply("greedy", [0.9]) == [0.9]
