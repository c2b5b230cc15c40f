"""Threshold calibration, RouteLLM-style (arXiv 2406.18665; ``routellm/calibrate_threshold.py`` takes the
``1 − strong_pct`` quantile of router scores on a calibration set).

Routing rule everywhere (gateway included): a score ``s`` goes to ``tiers[i]`` with ``i`` = the number of
thresholds ``t`` with ``s ≥ t``. So with two tiers, "fraction at or above the threshold" = fraction long.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from router.fit.metrics import routing_curve


def thresholds_for_fractions(scores: np.ndarray | Sequence[float], fractions: Sequence[float]) -> list[float]:
    """Thresholds such that about ``fractions[i]`` of ``scores`` are ≥ ``thresholds[i]``.

    ``fractions``: strictly decreasing values in [0, 1], one per threshold (for tiers short/long: one value,
    the target fraction sent to long; for none/short/long: [frac ≥ short, frac = long]). Returns ascending
    thresholds in [0, 1]. On distinct scores the achieved fraction is within 1/n of the target; ties can
    only be routed together. Raises ValueError on empty scores or bad fractions.
    """
    s = np.sort(np.asarray(scores, dtype=np.float64).ravel())
    n = s.shape[0]
    if n == 0:
        raise ValueError("no calibration scores")
    fr = list(fractions)
    if not fr or any(not 0 <= f <= 1 for f in fr) or any(b >= a for a, b in pairwise(fr)):
        raise ValueError(f"fractions must be strictly decreasing values in [0, 1], got {fr}")
    out = []
    for f in fr:
        k = round(f * n)  # number of items to put at or above the threshold
        if k <= 0:
            t = 1.0  # nothing is sent up (a score of exactly 1.0 still would)
        elif k >= n:
            t = 0.0
        else:
            # midpoint between the (n-k-1)-th and (n-k)-th order statistics: exactly k items are ≥ t
            lo, hi = s[n - k - 1], s[n - k]
            t = float((lo + hi) / 2.0) if hi > lo else float(hi)
        out.append(float(np.clip(t, 0.0, 1.0)))
    for i in range(1, len(out)):  # keep ascending even when ties collapse two cuts
        out[i] = max(out[i], out[i - 1])
    return out


def threshold_for_quality_loss(
    scores: np.ndarray | Sequence[float],
    short_correct: np.ndarray | Sequence[float],
    long_correct: np.ndarray | Sequence[float],
    max_loss: float,
) -> float:
    """The highest threshold (fewest long calls) whose quality on the calibration set is at least
    ``(1 − max_loss) ·`` always-long quality. ``max_loss`` is relative (0.05 = keep 95%).

    Two tiers only. Returns a threshold in [0, 1]; 0.0 (everything long) when nothing cheaper qualifies.
    """
    if not 0 <= max_loss < 1:
        raise ValueError("max_loss must be in [0, 1)")
    curve = routing_curve(scores, short_correct, long_correct)
    target = (1.0 - max_loss) * curve.q_long
    ok = np.flatnonzero(curve.quality >= target - 1e-12)
    if ok.size == 0:
        return 0.0
    t = float(curve.thresholds[int(ok[0])])
    return 1.0 if not np.isfinite(t) else float(np.clip(t, 0.0, 1.0))


def fraction_at_or_above(scores: np.ndarray | Sequence[float], threshold: float) -> float:
    """Fraction of ``scores`` ≥ ``threshold`` (what a threshold sends to the upper tier)."""
    s = np.asarray(scores, dtype=np.float64)
    return float(np.mean(s >= threshold)) if s.size else float("nan")
