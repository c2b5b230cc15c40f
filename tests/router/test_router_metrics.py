"""Routing metrics (RouteLLM arXiv 2406.18665 terms) on hand-computed cases, and threshold calibration."""

from __future__ import annotations

import math

import numpy as np
import pytest

from router.fit.calibrate import fraction_at_or_above, threshold_for_quality_loss, thresholds_for_fractions
from router.fit.metrics import apgr, cost_reduction_at, cpt, oracle_curve, random_curve, routing_curve

# 4 items: only item 0 gains from the long tier, and the router ranks it first.
SCORES = [0.9, 0.8, 0.3, 0.1]
SHORT = [0, 1, 1, 0]
LONG = [1, 1, 1, 0]


def test_curve_apgr_cpt_and_cost_reduction_by_hand() -> None:
    c = routing_curve(SCORES, SHORT, LONG)
    assert c.q_short == 0.5 and c.q_long == 0.75
    np.testing.assert_allclose(c.frac_long, [0, 0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(c.quality, [0.5, 0.75, 0.75, 0.75, 0.75])
    # PGR = [0, 1, 1, 1, 1] → trapezoid area 0.125 + 0.75
    assert apgr(c) == pytest.approx(0.875)
    # 50% of the gap = 0.625, reached halfway through the first segment
    assert cpt(c, 0.5) == pytest.approx(0.125)
    # 95% of always-long = 0.7125 → x = 0.2125 → 78.75% fewer long calls (short calls free)
    assert cost_reduction_at(c, 0.95) == pytest.approx(0.7875)
    # with short calls costing 10% of long ones: 1 - (0.7875·0.1 + 0.2125)
    assert cost_reduction_at(c, 0.95, short_cost_ratio=0.1) == pytest.approx(1 - (0.7875 * 0.1 + 0.2125))


def test_random_and_oracle_baselines() -> None:
    r = random_curve(SHORT, LONG)
    assert apgr(r) == pytest.approx(0.5)
    assert cpt(r, 0.8) == pytest.approx(0.8)
    assert cost_reduction_at(r, 0.95) == pytest.approx(1 - 0.85)
    o = oracle_curve(SHORT, LONG)
    assert apgr(o) == pytest.approx(0.875)
    # a router ranking the only useful item last is worse than random
    bad = routing_curve([0.1, 0.8, 0.3, 0.9], SHORT, LONG)
    assert apgr(bad) < 0.5


def test_ties_cannot_be_split_and_unreachable_targets_are_nan() -> None:
    c = routing_curve([0.5, 0.5, 0.5], [0, 1, 0], [1, 1, 1])
    np.testing.assert_allclose(c.frac_long, [0.0, 1.0])
    np.testing.assert_allclose(c.quality, [1 / 3, 1.0])
    never = routing_curve([0.2, 0.1], [0, 0], [0, 0])  # long never helps
    assert math.isnan(apgr(never))
    assert cost_reduction_at(routing_curve([0.2, 0.1], [1, 1], [1, 1]), 0.95) == 1.0  # short already enough


def test_calibration_hits_requested_long_fraction_within_two_points() -> None:
    rng = np.random.default_rng(0)
    scores = rng.beta(2, 5, size=1000)  # skewed like real router scores
    for target in (0.1, 0.25, 0.5, 0.8):
        (t,) = thresholds_for_fractions(scores, [target])
        assert abs(fraction_at_or_above(scores, t) - target) <= 0.02, target
    cuts = thresholds_for_fractions(scores, [0.6, 0.2])  # three tiers: ≥ short, = long
    assert cuts == sorted(cuts)
    assert abs(fraction_at_or_above(scores, cuts[0]) - 0.6) <= 0.02
    assert abs(fraction_at_or_above(scores, cuts[1]) - 0.2) <= 0.02
    assert thresholds_for_fractions(scores, [0.0]) == [1.0]
    assert thresholds_for_fractions(scores, [1.0]) == [0.0]
    with pytest.raises(ValueError):
        thresholds_for_fractions(scores, [0.2, 0.6])  # must decrease
    with pytest.raises(ValueError):
        thresholds_for_fractions([], [0.5])


def test_threshold_for_max_quality_loss() -> None:
    t = threshold_for_quality_loss(SCORES, SHORT, LONG, max_loss=0.05)
    assert t == pytest.approx(0.9)  # sending only item 0 long already reaches 100% of always-long
    s = np.asarray(SCORES)
    quality = np.mean(np.where(s >= t, LONG, SHORT))
    assert quality >= 0.95 * np.mean(LONG)
    assert threshold_for_quality_loss([0.2, 0.1], [1, 1], [1, 1], 0.0) == 1.0  # nothing needs long
