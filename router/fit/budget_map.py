"""Calibrate a router score → thinking budget map for a dial model, with the quality floor's guarantee.

A dial model (``budget_mode: prompted``) can serve any thinking budget, so ``model: auto`` may pick a budget rather
than a tier. The map is a monotone step function of the router score: ``K`` score bins (cut at the fit split's
score quantiles), each given one budget from a candidate list, never less for a higher score
(:class:`router.policy.BudgetMap`). Every such map is one operating point λ; the served map is chosen by
Learn-then-Test exactly as the tier thresholds are (:func:`router.fit.risk.certify`): the testing order from a fit
split, the fixed-sequence test on a disjoint calibration split, the cheapest rejected map served. The floor is
"accuracy ≥ ``floor`` × the accuracy of the tier's own setting" (the last candidate, usually unlimited), held on
unseen traffic from the same distribution with probability ≥ 1 − δ; nothing rejected → the tier's own setting
everywhere (the honest answer with little data).

Input per question ``i`` and candidate budget ``b``: correctness and thinking tokens of the model's answer at that
budget (``training/tiny/dial_map.py`` generates them), and the router's score of the question.
Pure NumPy (offline).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations_with_replacement
from typing import Any

import numpy as np

from router.fit.risk import DELTA, FLOOR, Certified, certify, point_estimate, slack_uniforms
from router.policy import BudgetMap


@dataclass
class BudgetMapFit:
    """The served map (``map``; all bins at the tier's own setting when nothing could be certified) and the
    evidence: calibration accuracy ratio and token share against the tier's own setting, sizes, δ and floor."""

    map: BudgetMap
    certified: bool
    accuracy_ratio: float
    token_share: float
    n_fit: int
    n_calibration: int
    candidates: int
    delta: float
    floor: float
    pvalue: float | None

    def to_serving(self) -> dict[str, Any]:
        """The ``metadata.serving.budgets`` block (:mod:`router.policy`)."""
        return {**self.map.to_dict(), "guarantee": {
            "floor": self.floor, "delta": self.delta, "confidence": round(1 - self.delta, 6),
            "certified": self.certified, "n_fit": self.n_fit, "n_calibration": self.n_calibration,
            "candidates": self.candidates, "pvalue": None if self.pvalue is None else round(self.pvalue, 6),
            "calibration_accuracy_ratio": round(self.accuracy_ratio, 4),
            "calibration_token_share": round(self.token_share, 4)}}


def split_keys(keys: Sequence[object], salt: str = "thinkgate-budget-map") -> np.ndarray:
    """True for the calibration half (SHA-256 of the salted key), False for the fit half. Deterministic."""
    return np.array([hashlib.sha256(f"{salt}/{k}".encode()).digest()[0] & 1 == 1 for k in keys], dtype=bool)


def candidate_maps(n_budgets: int, n_bins: int) -> np.ndarray:
    """Every non-decreasing assignment of budget indices to bins: (C(n_budgets + n_bins − 1, n_bins), n_bins)."""
    return np.array(list(combinations_with_replacement(range(n_budgets), n_bins)), dtype=np.int64)


def fit_budget_map(
    tier: str,
    keys: Sequence[object],
    scores: np.ndarray,
    budgets: Sequence[int | None],
    correct: np.ndarray,
    tokens: np.ndarray,
    *,
    n_bins: int = 4,
    floor: float = FLOOR,
    delta: float = DELTA,
    guarantee: bool = True,
) -> BudgetMapFit:
    """The certified map. ``scores``: (n,) router scores in [0, 1]; ``budgets``: the m candidates, ascending, None
    (unlimited) only last — the last is the tier's own setting, the floor's reference; ``correct``: bool (m, n);
    ``tokens``: (m, n) thinking tokens. ``guarantee=False`` removes the bound (for tests and comparison only):
    the cheapest map whose calibration accuracy merely meets the floor. Raises ValueError on mismatched shapes or
    fewer than 2 questions per half."""
    s = np.asarray(scores, dtype=np.float64)
    c = np.asarray(correct, dtype=bool)
    t = np.asarray(tokens, dtype=np.float64)
    m, n = c.shape
    if t.shape != (m, n) or s.shape != (n,) or len(budgets) != m or len(keys) != n:
        raise ValueError(f"shapes disagree: scores {s.shape}, correct {c.shape}, tokens {t.shape}, "
                         f"{len(budgets)} budgets, {len(keys)} keys")
    BudgetMap(tier, tuple(), (budgets[-1],))  # validates the reference; the candidates are validated per map
    cal = split_keys(keys)
    if cal.sum() < 2 or (~cal).sum() < 2:
        raise ValueError("need at least two questions in each of the fit and calibration halves")
    qs = np.quantile(s[~cal], [k / n_bins for k in range(1, n_bins)])
    cuts = np.unique(qs)
    maps = candidate_maps(m, len(cuts) + 1)
    bins = np.searchsorted(cuts, s, side="right")
    chosen = maps[:, bins]  # (J, n): the budget index each map gives each question
    cols = np.arange(n)
    all_correct = c[chosen, cols]
    all_tokens = t[chosen, cols]
    u = slack_uniforms(keys)
    top = c[m - 1]
    fit, calib = ~cal, cal
    if not guarantee:
        j = point_estimate(all_correct[:, calib], all_tokens[:, calib].sum(axis=1), top[calib], floor)
        res = Certified(None if j is None else int(j), None, 1.0, 1.0, int(calib.sum()), 0, 0, delta, floor)
    else:
        res = certify(all_correct[:, fit], all_tokens[:, fit].sum(axis=1), top[fit], u[fit],
                      all_correct[:, calib], all_tokens[:, calib].sum(axis=1), top[calib],
                      float(t[m - 1, calib].sum()), u[calib], delta=delta, floor=floor)
    if res.index is None:
        served = BudgetMap(tier, tuple(), (budgets[-1],))
    else:
        picks = [budgets[int(j)] for j in maps[res.index]]
        served = _merge(tier, [float(x) for x in cuts], picks)
    return BudgetMapFit(served, res.index is not None, res.accuracy_ratio, res.token_share, int(fit.sum()),
                        int(calib.sum()), len(maps), delta, floor, res.pvalue)


def _merge(tier: str, cuts: list[float], picks: list[int | None]) -> BudgetMap:
    """Drop the cuts between two bins that got the same budget (same map, fewer steps)."""
    keep_cuts: list[float] = []
    keep: list[int | None] = [picks[0]]
    for cut, b in zip(cuts, picks[1:], strict=True):
        if b != keep[-1]:
            keep_cuts.append(cut)
            keep.append(b)
    return BudgetMap(tier, tuple(keep_cuts), tuple(keep))
