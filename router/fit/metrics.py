"""Routing metrics: the quality-vs-%long curve and RouteLLM's summary numbers.

Terms follow RouteLLM (Ong et al., "RouteLLM: Learning to Route LLMs with Preference Data",
arXiv 2406.18665, §4 and ``routellm/evals/evaluate.py``), with "strong/weak" = our "long/short" tier:

* the **curve**: route items whose score ≥ t to long, sweep t; x = fraction of items sent to long
  (RouteLLM's "% strong model calls", the cost axis), y = mean correctness of the chosen tier's answers.
  We evaluate it at every distinct score (not 10 quantile bins) and interpolate linearly between points,
  which is what randomising inside a tie achieves.
* **PGR** of a point = (q − q_short) / (q_long − q_short); **APGR** = area under the PGR curve over
  x ∈ [0, 1] (trapezoid). Random routing scores 0.5; the oracle scores more than 0.5.
* **CPT(p)** = the smallest x at which PGR ≥ p ("call-performance threshold"), e.g. CPT(50%).
* **cost reduction at 95% of always-long quality**: x* = smallest x with q ≥ 0.95 · q_long; reduction =
  1 − cost(x*) / cost(1) with cost(x) = (1 − x)·r + x, r = short/long cost per request. RouteLLM takes
  r = 0 (the weak model's cost ignored), which is our default; pass the real ratio to include it.

Inputs are arrays of shape (n,): ``scores`` in [0, 1]; ``short_correct``/``long_correct`` in {0, 1}
(or any per-item quality in [0, 1]). Quality units: fraction correct (not %).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Curve:
    """Quality vs fraction sent to long. ``frac_long``, ``quality``, ``thresholds``: (m,) arrays, x ascending
    from 0 to 1; ``thresholds[i]`` is the score cut that yields point i (+inf for x = 0)."""

    frac_long: np.ndarray
    quality: np.ndarray
    thresholds: np.ndarray
    q_short: float
    q_long: float

    def quality_at(self, x: float) -> float:
        """Interpolated quality at fraction ``x`` ∈ [0, 1] sent to long."""
        return float(np.interp(x, self.frac_long, self.quality))

    def pgr(self) -> np.ndarray:
        """Performance gap recovered at each point, (m,); NaN-free only if q_long ≠ q_short."""
        gap = self.q_long - self.q_short
        return (self.quality - self.q_short) / gap if gap else np.zeros_like(self.quality)


def _as_arrays(*arrays: np.ndarray | Sequence[float]) -> list[np.ndarray]:
    out = [np.asarray(a, dtype=np.float64).ravel() for a in arrays]
    n = out[0].shape[0]
    if n == 0:
        raise ValueError("empty evaluation set")
    if any(a.shape[0] != n for a in out):
        raise ValueError("scores and outcomes must have the same length")
    return out


def routing_curve(
    scores: np.ndarray | Sequence[float],
    short_correct: np.ndarray | Sequence[float],
    long_correct: np.ndarray | Sequence[float],
) -> Curve:
    """The full routing curve (one point per distinct score, plus x = 0). See the module docstring."""
    s, qs, ql = _as_arrays(scores, short_correct, long_correct)
    n = s.shape[0]
    order = np.argsort(-s, kind="stable")
    s_sorted = s[order]
    gain = np.cumsum(ql[order] - qs[order])
    # A threshold cannot split equal scores: keep only the last index of each tie group.
    ends = np.flatnonzero(np.r_[s_sorted[1:] != s_sorted[:-1], True])
    base = qs.sum()
    frac = np.r_[0.0, (ends + 1) / n]
    quality = np.r_[base, base + gain[ends]] / n
    thresholds = np.r_[np.inf, s_sorted[ends]]
    return Curve(frac, quality, thresholds, q_short=float(qs.mean()), q_long=float(ql.mean()))


def random_curve(short_correct: np.ndarray | list[float], long_correct: np.ndarray | list[float]) -> Curve:
    """Expected curve of random routing: the straight line from (0, q_short) to (1, q_long)."""
    qs, ql = _as_arrays(short_correct, long_correct)
    a, b = float(qs.mean()), float(ql.mean())
    return Curve(np.array([0.0, 1.0]), np.array([a, b]), np.array([np.inf, -np.inf]), a, b)


def oracle_curve(short_correct: np.ndarray | list[float], long_correct: np.ndarray | list[float]) -> Curve:
    """The best achievable curve: items ordered by their true gain (long − short) first."""
    qs, ql = _as_arrays(short_correct, long_correct)
    gain = ql - qs
    # distinct pseudo-scores so ties are not merged: rank by gain, stable by index
    order = np.argsort(-gain, kind="stable")
    pseudo = np.empty_like(gain)
    pseudo[order] = np.linspace(1.0, 0.0, gain.shape[0])
    return routing_curve(pseudo, qs, ql)


def apgr(curve: Curve) -> float:
    """Average performance gap recovered: ∫₀¹ PGR(x) dx (trapezoid). 0.5 = random."""
    if curve.q_long == curve.q_short:
        return float("nan")
    pgr = curve.pgr()
    x = curve.frac_long
    return float(np.sum((x[1:] - x[:-1]) * (pgr[1:] + pgr[:-1]) / 2.0))


def frac_long_for_quality(curve: Curve, target: float) -> float:
    """Smallest fraction sent to long whose (interpolated) quality reaches ``target``; NaN if never."""
    q, x = curve.quality, curve.frac_long
    if q[0] >= target:
        return 0.0
    hit = np.flatnonzero(q >= target)
    if hit.size == 0:
        return float("nan")
    i = int(hit[0])
    # linear interpolation on the segment (i-1, i)
    q0, q1, x0, x1 = q[i - 1], q[i], x[i - 1], x[i]
    return float(x0 + (target - q0) * (x1 - x0) / (q1 - q0)) if q1 != q0 else float(x1)


def cpt(curve: Curve, pgr_target: float) -> float:
    """CPT(p): smallest fraction sent to long that recovers ``pgr_target`` (e.g. 0.5) of the gap; NaN if never."""
    return frac_long_for_quality(curve, curve.q_short + pgr_target * (curve.q_long - curve.q_short))


def cost_reduction_at(curve: Curve, quality_ratio: float = 0.95, short_cost_ratio: float = 0.0) -> float:
    """1 − cost(x*)/cost(always long) at the smallest x* with quality ≥ ``quality_ratio`` · q_long.

    ``short_cost_ratio`` = cost of a short request / cost of a long one (0 = RouteLLM's convention).
    NaN if the target is never reached.
    """
    if not 0 <= short_cost_ratio <= 1:
        raise ValueError("short_cost_ratio must be in [0, 1]")
    x = frac_long_for_quality(curve, quality_ratio * curve.q_long)
    if np.isnan(x):
        return float("nan")
    return float(1.0 - ((1.0 - x) * short_cost_ratio + x))
