"""Thresholds with a guarantee: Learn-then-Test (Angelopoulos, Bates, Candès, Jordan, Lei, arXiv 2110.01052) for
the quality floor "accuracy ≥ ``floor`` × always-top accuracy" on unseen traffic from the same distribution.

**The hypothesis per operating point λ** (a set of thresholds, with or without the cascade). Per question the
pair (top right?, λ right?) falls in one of four cells with population shares p11, p10 (λ lost it), p01 (λ
gained it), p00. The floor holds iff ``p11 + p01 ≥ floor · (p11 + p10)``, i.e. ``floor · p10 ≤ p01 + (1 − floor)
· p11``. H0(λ): the floor is broken. The test is exact and binomial: each question of the ``top right, λ right``
cell is flagged with probability ``1 − floor`` (a fixed uniform per question, ``u``), so the flagged share is
exactly ``(1 − floor) · p11`` in the population; among the m questions that are lost, gained or flagged, the
number lost is Binomial(m, q) given m, and the floor holds iff ``q ≤ q0 = 1 / (1 + floor)``. The p-value is
``P(Binomial(m, q0) ≤ #lost)`` (1 when m = 0): super-uniform under H0 conditionally on m, hence unconditionally.
This is the binomial upper confidence bound on the (relative) accuracy loss: rejecting at level δ means the
Clopper-Pearson upper bound of q is below q0.

**Fixed-sequence testing** over the candidate points in an order fixed before the calibration split is looked
at (here: from a separate fit split, conservative to aggressive, :func:`test_order`): test each at level δ, stop at
the first that is not rejected; every rejected point keeps the floor simultaneously with probability ≥ 1 − δ
(family-wise error ≤ δ), and the cheapest of them is served. Nothing rejected → "do not route" (always top):
with little calibration data that is the honest answer.

Pure NumPy + ``scipy.special`` (offline code; the gateway only reads the result from the router file).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

FLOOR = 0.98
DELTA = 0.1


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) ≤ k), exact (regularised incomplete beta); 1.0 for k ≥ n, 0.0 for k < 0."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    from scipy.special import betainc

    return float(betainc(n - k, k + 1, 1.0 - p))


def slack_uniforms(keys: Sequence[object], salt: str = "thinkgate-ltt-slack") -> np.ndarray:
    """A fixed uniform in [0, 1) per question (SHA-256 of the salted key): which ``top right, λ right``
    questions carry the ``1 − floor`` slack (module doc). Deterministic: the same file for the same data."""
    out = np.empty(len(keys))
    for i, k in enumerate(keys):
        h = hashlib.sha256(f"{salt}/{k}".encode()).digest()
        out[i] = int.from_bytes(h[:8], "big") / 2.0**64
    return out


def floor_counts(top_correct: np.ndarray, correct: np.ndarray, u: np.ndarray, floor: float = FLOOR
                 ) -> tuple[int, int]:
    """(#lost, m): questions top got right and the point got wrong; m = lost + gained + slack-flagged."""
    top = np.asarray(top_correct, dtype=bool)
    c = np.asarray(correct, dtype=bool)
    lost = int(np.sum(top & ~c))
    gained = int(np.sum(~top & c))
    flagged = int(np.sum(top & c & (np.asarray(u) < 1.0 - floor)))
    return lost, lost + gained + flagged


def floor_pvalue(top_correct: np.ndarray, correct: np.ndarray, u: np.ndarray, floor: float = FLOOR) -> float:
    """p-value of H0 "accuracy < ``floor`` × always-top accuracy" for one operating point (module doc).

    ``top_correct``, ``correct``: bool (n,) outcomes of always-top and of the point on the same questions;
    ``u``: uniforms (n,) from :func:`slack_uniforms`."""
    lost, m = floor_counts(top_correct, correct, u, floor)
    return binom_cdf(lost, m, 1.0 / (1.0 + floor))


def test_order(pvalues: np.ndarray, cost: np.ndarray, delta: float = DELTA) -> np.ndarray:
    """The testing order, from the fit split only: the points the fit split itself certifies (p ≤ ``delta``),
    conservative (most tokens) to aggressive; when it certifies none, the one with the smallest p-value alone.
    (Points with almost no changed answers come first in a plain conservative→aggressive order and can never be
    rejected — too little evidence — which would end the sequence at once.)"""
    p = np.asarray(pvalues, dtype=np.float64)
    c = np.asarray(cost, dtype=np.float64)
    ok = np.flatnonzero(p <= delta)
    if ok.size == 0:
        return np.lexsort((c, p))[:1]
    return ok[np.lexsort((p[ok], -c[ok]))]


def fixed_sequence(pvalues: np.ndarray, order: np.ndarray, delta: float = DELTA) -> list[int]:
    """The points rejected by fixed-sequence testing: ``order``'s prefix with p ≤ ``delta`` (FWER ≤ δ)."""
    out: list[int] = []
    for i in order:
        if pvalues[int(i)] > delta:
            break
        out.append(int(i))
    return out


@dataclass
class Certified:
    """The outcome of :func:`certify`: the chosen point (None = always top) and the evidence."""

    index: int | None
    pvalue: float | None
    accuracy_ratio: float
    token_share: float
    n: int
    tested: int
    rejected: int
    delta: float
    floor: float

    def to_dict(self) -> dict[str, Any]:
        return {"pvalue": None if self.pvalue is None else round(self.pvalue, 6),
                "calibration_accuracy_ratio": round(self.accuracy_ratio, 4),
                "calibration_token_share": round(self.token_share, 4), "n_calibration": self.n,
                "tested": self.tested, "rejected": self.rejected, "delta": self.delta, "floor": self.floor}


def certify(fit_correct: np.ndarray, fit_tokens: np.ndarray, fit_top: np.ndarray, fit_u: np.ndarray,
            cal_correct: np.ndarray, cal_tokens: np.ndarray, cal_top: np.ndarray, cal_top_tokens: float,
            cal_u: np.ndarray, *, delta: float = DELTA, floor: float = FLOOR) -> Certified:
    """Learn-then-Test over m candidate points. ``*_correct``: bool (m, n) per point and question, ``*_tokens``:
    (m,) total tokens per point, ``*_top``: bool (n,) always-top outcomes, ``*_u``: (n,) slack uniforms. The
    order comes from the fit split only; the test from the calibration split only. Returns the cheapest
    rejected point (calibration tokens), or index None (always top)."""
    fc = np.asarray(fit_correct, dtype=bool)
    cc = np.asarray(cal_correct, dtype=bool)
    p_fit = np.array([floor_pvalue(fit_top, fc[j], fit_u, floor) for j in range(fc.shape[0])])
    order = test_order(p_fit, np.asarray(fit_tokens, dtype=np.float64), delta)
    p_cal = np.array([floor_pvalue(cal_top, cc[j], cal_u, floor) for j in range(cc.shape[0])])
    rejected = fixed_sequence(p_cal, order, delta)
    tested = min(len(rejected) + 1, len(order))
    n = cc.shape[1]
    top_acc = float(np.mean(cal_top)) if n else 0.0
    if not rejected:
        return Certified(None, None, 1.0, 1.0, n, tested, 0, delta, floor)
    ct = np.asarray(cal_tokens, dtype=np.float64)
    best = min(rejected, key=lambda j: (ct[j], -cc[j].mean()))
    if cal_top_tokens and ct[best] >= cal_top_tokens:  # keeps the floor at a cost: always-top does for less
        return Certified(None, None, 1.0, 1.0, n, tested, len(rejected), delta, floor)
    ratio = float(cc[best].mean() / top_acc) if top_acc > 0 else float("inf")
    return Certified(best, float(p_cal[best]), ratio, float(ct[best] / cal_top_tokens) if cal_top_tokens else 1.0,
                     n, tested, len(rejected), delta, floor)


def point_estimate(cal_correct: np.ndarray, cal_tokens: np.ndarray, cal_top: np.ndarray,
                   floor: float = FLOOR) -> int | None:
    """The bound removed (for tests and comparison only): the cheapest point whose calibration accuracy is ≥
    ``floor`` × always-top on the calibration split itself, None when none is."""
    cc = np.asarray(cal_correct, dtype=bool)
    need = floor * float(np.mean(cal_top)) - 1e-12
    ok = [j for j in range(cc.shape[0]) if cc[j].mean() >= need]
    ct = np.asarray(cal_tokens, dtype=np.float64)
    return min(ok, key=lambda j: (ct[j], -cc[j].mean())) if ok else None
