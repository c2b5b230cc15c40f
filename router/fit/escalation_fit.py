"""Answer-aware escalation, fitted and certified jointly with the router threshold on cross-fitted scores.

**The escalation model** (:func:`fit_escalation`): per tier below the top, a logistic regression (scikit-learn,
offline only) on :func:`router.escalation.answer_features` of that tier's recorded answers, target "this answer is
wrong" (grading is read only here, as the label). Stored as a plain dict (:func:`router.escalation.model_probability`
scores it at serving time). Out-of-fold probabilities by the same question folds as the router
(:func:`router.fit.ladder_fit.fold_ids`).

**The served policy** for a point (s, r): the share ``s`` of questions with the highest router score goes straight
to the top tier; every other question starts at the cheapest tier, and the answer of tier j is escalated to tier
j + 1 when it abstains (:func:`router.abstention.abstains`) or its P(wrong) ≥ ``t_j``, the (1 − r)-quantile of
those out-of-fold probabilities (abstaining answers counted as 1.0): about a share ``r`` of tier j's answers go up.

**The family, declared before any held-out number was seen** (:data:`JOINT_SEQUENCE`; its shape — start at r = 0.5,
steps of 0.1, two router shares — was picked after an exploratory look at cross-fitted p-values on the
non-held-out questions of these ladders, one more reason δ is nominal): a fixed sequence of
(s, r), from the median escalation rate to aggressive, the router share interleaved. Why it starts at r = 0.5 and
not at the conservative end: a point that changes few answers can never be certified (with ≈ 400 questions and
the 2% slack, fewer than four changed-or-flagged answers give p > 0.06 even with no loss), so a
conservative→aggressive sequence would end at its first point. Each point is tested at level δ by the exact
binomial test of :mod:`router.fit.risk` on **all** non-held-out questions, with cross-fitted (5-fold out-of-fold)
router and escalation scores; the sequence stops at the first point not rejected; the cheapest rejected point is
served, none → always top. Caveat (stored in the file): cross-fitting reuses labels across folds and the
thresholds are quantiles of the same scores, so δ is the nominal level of an approximation. The split-sample
family (``--cal-frac > 0``, ``serving.split_family``) is no exact guarantee either: its calibration half is scored
by the same cross-fitted fold models, trained on folds holding other calibration questions
(:mod:`router.fit.ladder_fit`, steps 5–6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from router.abstention import abstains
from router.escalation import FEATURES, answer_features
from router.fit.risk import DELTA, FLOOR, floor_counts, floor_pvalue, slack_uniforms
from router.fit.traces import LadderData

#: (router-to-top share s, escalation rate r), in the order tested (module doc); declared 2026-12-02 01:05 UTC
JOINT_SEQUENCE: tuple[tuple[float, float], ...] = (
    (0.0, 0.5), (0.25, 0.5), (0.0, 0.4), (0.25, 0.4), (0.0, 0.3), (0.25, 0.3), (0.0, 0.2), (0.25, 0.2),
    (0.0, 0.1), (0.25, 0.1),
)
#: logistic regression strength (standardised features)
LOGIT_C = 1.0


def tier_features(data: LadderData, tier: int, scores: np.ndarray, phrases: Sequence[str] | None = None
                  ) -> np.ndarray:
    """Float (n, len(FEATURES)): :func:`answer_features` of each question's recorded answer at ``tier``, with
    the router score ``scores[i]`` (what the gateway sees at serving time: answer, thought, usage, question)."""
    thoughts = data.thoughts or [[""] * data.correct.shape[1] for _ in range(data.n)]
    rows = []
    for i in range(data.n):
        rt = float(data.reasoning_tokens[i, tier])
        rows.append(answer_features(data.responses[i][tier], thoughts[i][tier],
                                    completion_tokens=float(data.tokens[i, tier]),
                                    reasoning_tokens=None if np.isnan(rt) else rt, finish_reason="stop",
                                    question=data.questions[i], score=float(scores[i]), phrases=phrases))
    return np.asarray(rows, dtype=np.float64).reshape(data.n, len(FEATURES))


def _logit(X: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    from sklearn.linear_model import LogisticRegression

    mu = X.mean(axis=0)
    sd = X.std(axis=0)
    sd[sd == 0] = 1.0
    if y.all() or not y.any():  # one class: a constant model
        p = float(np.clip(y.mean(), 1e-3, 1 - 1e-3))
        return {"features": list(FEATURES), "mean": mu.tolist(), "scale": sd.tolist(),
                "coef": [0.0] * X.shape[1], "intercept": float(np.log(p / (1 - p)))}
    m = LogisticRegression(C=LOGIT_C, max_iter=2000).fit((X - mu) / sd, y)
    return {"features": list(FEATURES), "mean": [float(v) for v in mu], "scale": [float(v) for v in sd],
            "coef": [float(v) for v in m.coef_.ravel()], "intercept": float(m.intercept_[0])}


def _proba(model: dict[str, Any], X: np.ndarray) -> np.ndarray:
    z = ((X - np.asarray(model["mean"])) / np.asarray(model["scale"])) @ np.asarray(model["coef"]) + model["intercept"]
    return 1.0 / (1.0 + np.exp(-z))


def fit_escalation(X: np.ndarray, wrong: np.ndarray, folds: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
    """(the model on all rows, out-of-fold P(wrong) (n,)). ``X`` (n, d) from :func:`tier_features`, ``wrong``
    bool (n,), ``folds`` int (n,) fold ids."""
    y = np.asarray(wrong, dtype=bool)
    oof = np.zeros(len(y))
    for j in np.unique(folds):
        tr, te = folds != j, folds == j
        if tr.sum() == 0:
            continue
        oof[te] = _proba(_logit(X[tr], y[tr]), X[te])
    return _logit(X, y), oof


@dataclass
class JointPoint:
    """One (s, r) point on given data: thresholds, outcomes and its test."""

    s: float
    r: float
    router_cut: float
    escalation_cuts: list[float]
    correct: np.ndarray
    tokens: float
    pvalue: float
    lost: int
    m: int


def joint_outcome(scores: np.ndarray, probs: np.ndarray, data: LadderData, router_cut: float,
                  escalation_cuts: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(final tier (n,), correct bool (n,), tokens (n,) — every call paid) of the policy: score ≥ ``router_cut``
    → top; else start at 0 and escalate tier j while ``probs[:, j]`` ≥ ``escalation_cuts[j]`` (``probs``: (n,
    k − 1) P(wrong), abstentions already 1.0)."""
    n, k = data.correct.shape
    rows = np.arange(n)
    direct = np.asarray(scores) >= router_cut
    cur = np.where(direct, k - 1, 0)
    spent = data.tokens[rows, cur].copy()
    for j in range(k - 1):
        go = (cur == j) & (probs[:, j] >= escalation_cuts[j])
        cur = np.where(go, j + 1, cur)
        spent = spent + np.where(go, data.tokens[rows, np.minimum(j + 1, k - 1)], 0.0)
    return cur, data.correct[rows, cur], spent


def joint_points(scores: np.ndarray, probs: np.ndarray, data: LadderData, u: np.ndarray,
                 floor: float = FLOOR, sequence: Sequence[tuple[float, float]] = JOINT_SEQUENCE) -> list[JointPoint]:
    """Every point of ``sequence`` on ``data`` (thresholds from these scores' quantiles), with its p-value."""
    top = data.correct[:, -1]
    out = []
    for s, r in sequence:
        cut = float(np.quantile(scores, 1 - s)) if s > 0 else float(np.nextafter(1.0, 2.0))
        rest = np.asarray(scores) < cut
        cuts = [float(np.quantile(probs[rest, j], 1 - r)) if rest.any() else 1.0 for j in range(probs.shape[1])]
        _, c, spent = joint_outcome(scores, probs, data, cut, cuts)
        lost, m = floor_counts(top, c, u, floor)
        out.append(JointPoint(s, r, cut, cuts, c, float(spent.sum()), floor_pvalue(top, c, u, floor), lost, m))
    return out


def certify_joint(points: Sequence[JointPoint], delta: float = DELTA, top_tokens: float | None = None
                  ) -> tuple[int | None, int]:
    """Fixed-sequence test over ``points`` in their order: (index of the cheapest rejected point or None,
    number rejected). None too when that point spends ``top_tokens`` (always-top's) or more: it keeps the floor
    at a cost, and always-top does for less (a statistician's review found sequences where it would be served)."""
    rejected = []
    for i, p in enumerate(points):
        if p.pvalue > delta:
            break
        rejected.append(i)
    if not rejected:
        return None, 0
    best = min(rejected, key=lambda i: (points[i].tokens, -points[i].correct.mean()))
    if top_tokens is not None and points[best].tokens >= top_tokens:
        return None, len(rejected)
    return best, len(rejected)


def escalation_probs(data: LadderData, scores: np.ndarray, folds: np.ndarray, phrases: Sequence[str] | None
                     ) -> tuple[list[dict[str, Any]], np.ndarray]:
    """Per tier below the top: the fitted model and out-of-fold P(wrong) with abstentions set to 1.0
    (models list, probs (n, k − 1))."""
    k = data.correct.shape[1]
    models, cols = [], []
    for j in range(k - 1):
        X = tier_features(data, j, scores, phrases)
        model, oof = fit_escalation(X, ~data.correct[:, j], folds)
        ab = np.array([abstains(r[j], phrases) for r in data.responses])
        cols.append(np.where(ab, 1.0, oof))
        models.append(model)
    return models, np.stack(cols, axis=1)


def fit_joint(data: LadderData, scores: np.ndarray, folds: np.ndarray, phrases: Sequence[str] | None,
              delta: float = DELTA, floor: float = FLOOR) -> dict[str, Any]:
    """Fit the escalation models and certify the joint family on ``data`` (all non-held-out questions; ``scores``
    the router's out-of-fold scores). Returns a JSON-able dict: ``certified`` (bool), ``router_cut``,
    ``escalation_cuts``, ``models`` (per tier below the top), the evidence, and every tested point."""
    models, probs = escalation_probs(data, scores, folds, phrases)
    u = slack_uniforms(data.keys)
    pts = joint_points(scores, probs, data, u, floor)
    top_acc = float(data.correct[:, -1].mean())
    top_tok = float(data.tokens[:, -1].sum())
    best, nrej = certify_joint(pts, delta, top_tok)
    from sklearn.metrics import roc_auc_score

    aucs = []
    for j in range(probs.shape[1]):
        w = ~data.correct[:, j]
        aucs.append(round(float(roc_auc_score(w, probs[:, j])), 4) if 0 < w.sum() < len(w) else None)
    tested = [{"s": p.s, "r": p.r, "pvalue": round(p.pvalue, 6), "lost": p.lost, "m": p.m,
               "accuracy_ratio": round(float(p.correct.mean()) / top_acc, 4) if top_acc else None,
               "token_share": round(p.tokens / top_tok, 4)} for p in pts[:nrej + 1]]
    out: dict[str, Any] = {"certified": best is not None, "n_calibration": data.n, "delta": delta, "floor": floor,
                           "rejected": nrej, "tested": tested, "oof_auc_wrong": aucs, "models": models}
    if best is not None:
        p = pts[best]
        out.update({"s": p.s, "r": p.r, "router_cut": min(1.0, p.router_cut), "escalation_cuts": p.escalation_cuts,
                    "pvalue": round(p.pvalue, 6),
                    "calibration_accuracy_ratio": round(float(p.correct.mean()) / top_acc, 4) if top_acc else None,
                    "calibration_token_share": round(p.tokens / top_tok, 4)})
    return out
