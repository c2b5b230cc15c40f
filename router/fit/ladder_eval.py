"""Offline evaluation of routing policies on a ladder of recorded settings: accuracy, tokens, the curve over
thresholds and ``savings_at_98``. Pure NumPy functions (no gateway, no files), shared with the gateway bench.

Conventions (every function):

* ``correct``: bool (n, k) — setting j (cheapest first) answered question i right; ``tokens``: float (n, k) —
  its completion tokens (thinking + answer); ``scores``: float (n,) — the router's score (higher = needs a
  more expensive setting); a **choice** is an int (n,) array of setting indices.
* Threshold rule (the gateway's): with ascending thresholds ``t``, a score ``s`` goes to setting
  ``#{t_j <= s}``.
* ``token_share`` = tokens(policy) / tokens(always-top) (sums over the questions); accuracy = fraction right.
* A **curve** is a list of ``[token_share, accuracy]`` pairs sorted by token_share: the operating points a
  policy reaches by moving its thresholds (every distinct score for two settings; pairs of cuts, reduced to
  the Pareto frontier, for three or more).
* ``savings_at_98(curve, top_acc)`` = 1 − token_share at the cheapest point with accuracy ≥ 0.98 · top_acc
  (0.0 if no point qualifies) — the issue's metric; always-top is on every threshold curve, so it is ≥ 0.

The cascade (:func:`cascade_choice`) sends a question routed below the top to its tier first and escalates to
the next one while the recorded answer abstains (:func:`abstains`): it reads answer *text*, never grading.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from router.abstention import abstains  # the serving rule: one function for fit, evaluation and the gateway

Curve = list[list[float]]

QUALITY_TARGET = 0.98

def _check(correct: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c = np.asarray(correct, dtype=np.float64)
    t = np.asarray(tokens, dtype=np.float64)
    if c.ndim != 2 or c.shape != t.shape or c.shape[1] < 2 or c.shape[0] == 0:
        raise ValueError(f"correct and tokens must be the same (n>0, k>=2) shape, got {c.shape} and {t.shape}")
    return c, t


def top_totals(correct: np.ndarray, tokens: np.ndarray) -> tuple[float, float]:
    """(accuracy, total tokens) of always-top."""
    c, t = _check(correct, tokens)
    return float(c[:, -1].mean()), float(t[:, -1].sum())


def choice_accuracy_tokens(choice: np.ndarray, correct: np.ndarray, tokens: np.ndarray) -> tuple[float, float]:
    """(accuracy, total completion tokens) of sending question i to setting ``choice[i]``."""
    c, t = _check(correct, tokens)
    ch = np.asarray(choice, dtype=np.int64)
    rows = np.arange(c.shape[0])
    return float(c[rows, ch].mean()), float(t[rows, ch].sum())


def route(scores: np.ndarray, thresholds: Sequence[float]) -> np.ndarray:
    """Setting index per score: number of ``thresholds`` ≤ score (int64, (n,))."""
    s = np.asarray(scores, dtype=np.float64)
    return np.sum(s[:, None] >= np.asarray(list(thresholds), dtype=np.float64)[None, :], axis=1).astype(np.int64)


def pareto(points: np.ndarray) -> Curve:
    """Points (m, 2) of (token_share, accuracy) → the frontier: sorted by share, accuracy strictly rising."""
    p = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    order = np.lexsort((-p[:, 1], p[:, 0]))
    out: Curve = []
    best = -np.inf
    for x, y in p[order]:
        if y > best + 1e-15:
            out.append([float(x), float(y)])
            best = y
    return out


def _cut_positions(s_sorted: np.ndarray) -> np.ndarray:
    # positions m (0..n) where the items [0, m) of the ascending scores can be cut from the rest
    n = s_sorted.shape[0]
    inner = np.flatnonzero(s_sorted[1:] != s_sorted[:-1]) + 1
    return np.r_[0, inner, n]


def threshold_curve(
    scores: np.ndarray, correct: np.ndarray, tokens: np.ndarray, *, grid: int = 200
) -> Curve:
    """Every operating point of a one-score threshold policy (see the module docstring).

    Two settings: one point per distinct score (ties go together) — the full curve. Three settings: all pairs
    of cut positions among ≤ ``grid`` quantile positions, reduced to the Pareto frontier. More than three:
    consecutive settings are merged pairwise is not attempted; raises ValueError.
    """
    c, t = _check(correct, tokens)
    s = np.asarray(scores, dtype=np.float64).ravel()
    n, k = c.shape
    if s.shape[0] != n:
        raise ValueError("scores and outcomes differ in length")
    top_tok = t[:, -1].sum()
    if top_tok <= 0:
        raise ValueError("always-top used no tokens")
    order = np.argsort(s, kind="stable")
    cs, ts = c[order], t[order]
    cuts = _cut_positions(s[order])
    # prefix sums: P[j][m] = sum of setting j over the m lowest-scored items
    pc = np.vstack([np.zeros((1, k)), np.cumsum(cs, axis=0)])
    pt = np.vstack([np.zeros((1, k)), np.cumsum(ts, axis=0)])
    if k == 2:
        a = cuts  # items below a → cheap, rest → top
        acc = (pc[a, 0] + pc[n, 1] - pc[a, 1]) / n
        tok = (pt[a, 0] + pt[n, 1] - pt[a, 1]) / top_tok
        return pareto(np.c_[tok, acc])
    if k == 3:
        if cuts.shape[0] > grid:
            cuts = np.unique(cuts[np.linspace(0, cuts.shape[0] - 1, grid).round().astype(int)])
        a, b = np.meshgrid(cuts, cuts, indexing="ij")
        ok = a <= b
        a, b = a[ok], b[ok]
        acc = (pc[a, 0] + pc[b, 1] - pc[a, 1] + pc[n, 2] - pc[b, 2]) / n
        tok = (pt[a, 0] + pt[b, 1] - pt[a, 1] + pt[n, 2] - pt[b, 2]) / top_tok
        return pareto(np.c_[tok, acc])
    raise ValueError("threshold_curve supports 2 or 3 settings")


def savings_at_98(curve: Curve, top_accuracy: float, target: float = QUALITY_TARGET) -> float:
    """1 − token_share at the cheapest point of ``curve`` with accuracy ≥ ``target`` · ``top_accuracy``; 0.0
    when none qualifies. (A float tolerance of 1e-12 on the accuracy comparison.)"""
    need = target * top_accuracy - 1e-12
    shares = [x for x, y in curve if y >= need]
    return float(1.0 - min(shares)) if shares else 0.0


def random_curve(correct: np.ndarray, tokens: np.ndarray, n_points: int = 101) -> Curve:
    """Expected curve of random routing over every tier mix (a grid of ``n_points`` per axis; for two
    settings the straight line between always-cheap and always-top)."""
    c, t = _check(correct, tokens)
    acc = c.mean(axis=0)
    share = t.sum(axis=0) / t[:, -1].sum()
    k = c.shape[1]
    w = np.linspace(0.0, 1.0, n_points)
    if k == 2:
        mixes = np.c_[1 - w, w]
    else:
        grids = np.meshgrid(*([w] * (k - 1)), indexing="ij")
        rest = np.stack([g.ravel() for g in grids], axis=1)
        rest = rest[rest.sum(axis=1) <= 1 + 1e-12]
        mixes = np.c_[1 - rest.sum(axis=1), rest]
    return pareto(np.c_[mixes @ share, mixes @ acc])


def random_at_mix(correct: np.ndarray, tokens: np.ndarray, mix: Sequence[float]) -> tuple[float, float]:
    """Expected (accuracy, total tokens) of routing a ``mix[j]`` share at random to setting j."""
    c, t = _check(correct, tokens)
    m = np.asarray(list(mix), dtype=np.float64)
    return float(m @ c.mean(axis=0)), float(m @ t.sum(axis=0))


def oracle_choice(correct: np.ndarray) -> np.ndarray:
    """The cheapest correct setting per question, 0 when none is correct (the labels)."""
    c = np.asarray(correct, dtype=bool)
    return np.where(c.any(axis=1), np.argmax(c, axis=1), 0).astype(np.int64)


def abstain_matrix(responses: Sequence[Sequence[str]], phrases: Sequence[str] | None = None) -> np.ndarray:
    """Bool (n, k): :func:`abstains` of each recorded answer (``phrases``: default the serving list)."""
    return np.array([[abstains(r, phrases) for r in row] for row in responses], dtype=bool)


def cascade_outcome(
    choice: np.ndarray, correct: np.ndarray, tokens: np.ndarray, abstain: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Route-then-cascade per question: start at ``choice[i]``, escalate one setting while the answer
    abstains and a higher setting exists. Returns (final setting (n,), correct (n,) float, tokens (n,) — the
    sum over every setting called)."""
    c, t = _check(correct, tokens)
    ab = np.asarray(abstain, dtype=bool)
    n, k = c.shape
    cur = np.asarray(choice, dtype=np.int64).copy()
    rows = np.arange(n)
    spent = t[rows, cur].copy()
    for _ in range(k - 1):
        go = (cur < k - 1) & ab[rows, cur]
        if not go.any():
            break
        cur = np.where(go, cur + 1, cur)
        spent = spent + np.where(go, t[rows, cur], 0.0)
    return cur, c[rows, cur], spent


def cascade_curve(
    scores: np.ndarray, correct: np.ndarray, tokens: np.ndarray, abstain: np.ndarray, *, grid: int = 200
) -> Curve:
    """Operating points of router + cascade over the router's thresholds (two or three settings; for three,
    pairs of cuts among ≤ ``grid`` quantile positions). Token shares can exceed 1 (both calls are paid)."""
    c, t = _check(correct, tokens)
    s = np.asarray(scores, dtype=np.float64).ravel()
    n, k = c.shape
    # cascade from each possible start setting: per-question correct and tokens
    starts = [cascade_outcome(np.full(n, j), c, t, abstain) for j in range(k)]
    cc = np.stack([x[1] for x in starts], axis=1)
    ct = np.stack([x[2] for x in starts], axis=1)
    return threshold_curve(s, cc, ct, grid=grid)


def policy_summary(choice: np.ndarray, correct: np.ndarray, tokens: np.ndarray,
                   reasoning_tokens: np.ndarray | None = None, spent: np.ndarray | None = None,
                   final_correct: np.ndarray | None = None) -> dict[str, Any]:
    """JSON-able numbers of one served policy: accuracy, completion/reasoning tokens (totals), token share,
    share per setting index. ``spent``/``final_correct`` override tokens/accuracy (the cascade)."""
    c, t = _check(correct, tokens)
    ch = np.asarray(choice, dtype=np.int64)
    rows = np.arange(c.shape[0])
    acc = float(np.mean(c[rows, ch] if final_correct is None else final_correct))
    tok = float(np.sum(t[rows, ch] if spent is None else spent))
    out: dict[str, Any] = {
        "accuracy": round(acc, 4),
        "completion_tokens": round(tok, 1),
        "token_share": round(tok / t[:, -1].sum(), 4),
        "tiers": [round(float(np.mean(ch == j)), 4) for j in range(c.shape[1])],
    }
    if reasoning_tokens is not None and spent is None:
        r = np.asarray(reasoning_tokens, dtype=np.float64)[rows, ch]
        out["reasoning_tokens"] = None if np.isnan(r).all() else round(float(np.nansum(r)), 1)
    return out


def evaluate_ladder(
    settings: Sequence[str],
    correct: np.ndarray,
    tokens: np.ndarray,
    router_scores: np.ndarray,
    router_thresholds: Sequence[float],
    length_scores: np.ndarray,
    *,
    abstain: np.ndarray | None = None,
    cascade_thresholds: Sequence[float] | None = None,
    reasoning_tokens: np.ndarray | None = None,
    target: float = QUALITY_TARGET,
) -> dict[str, Any]:
    """Every policy on one ladder's questions (the offline twin of ``thinkgate bench traces``' JSON).

    Policies: ``always:<setting>``; ``router`` (``router_scores`` at ``router_thresholds``); ``random`` (expected,
    at the router's tier mix); ``length`` (``length_scores`` at the same tier mix as the router: the quantile
    cuts that give its shares); ``oracle`` (cheapest correct setting); with ``abstain`` also ``cascade``
    (cheapest first, escalate abstentions) and ``router+cascade`` (at ``cascade_thresholds``, default the
    router's). Curves for router, length, random (and the cascades); ``savings_at_98`` per curve, and for the
    oracle its single point. Returns ``{"n_questions", "settings", "policies", "curves", "savings_at_98"}``.
    """
    c, t = _check(correct, tokens)
    n, k = c.shape
    top_acc, top_tok = top_totals(c, t)
    pol: dict[str, Any] = {}
    for j, s in enumerate(settings):
        pol[f"always:{s}"] = policy_summary(np.full(n, j), c, t, reasoning_tokens)
    ch = route(router_scores, router_thresholds)
    pol["router"] = policy_summary(ch, c, t, reasoning_tokens)
    mix = [float(np.mean(ch == j)) for j in range(k)]
    ra, rt = random_at_mix(c, t, mix)
    pol["random"] = {"accuracy": round(ra, 4), "completion_tokens": round(rt, 1), "token_share": round(rt / top_tok, 4),
                     "tiers": [round(m, 4) for m in mix], "expected": True}
    ls = np.asarray(length_scores, dtype=np.float64)
    cum = np.cumsum(mix)[:-1]
    lcuts = [float(np.quantile(ls, q)) if 0 < q < 1 else (np.inf if q >= 1 else -np.inf) for q in cum]
    pol["length"] = policy_summary(route(ls, lcuts), c, t, reasoning_tokens)
    oc = oracle_choice(c)
    pol["oracle"] = policy_summary(oc, c, t, reasoning_tokens)
    curves: dict[str, Curve] = {
        "router": threshold_curve(router_scores, c, t),
        "length": threshold_curve(ls, c, t),
        "random": random_curve(c, t, 1001 if k == 2 else 101),
    }
    sav = {name: savings_at_98(cv, top_acc, target) for name, cv in curves.items()}
    oacc, otok = choice_accuracy_tokens(oc, c, t)
    sav["oracle"] = float(1 - otok / top_tok) if oacc >= target * top_acc - 1e-12 else 0.0
    if abstain is not None:
        ab = np.asarray(abstain, dtype=bool)
        f, fc, sp = cascade_outcome(np.zeros(n, dtype=np.int64), c, t, ab)
        pol["cascade"] = policy_summary(f, c, t, spent=sp, final_correct=fc)
        cch = route(router_scores, cascade_thresholds if cascade_thresholds is not None else router_thresholds)
        f, fc, sp = cascade_outcome(cch, c, t, ab)
        pol["router+cascade"] = policy_summary(f, c, t, spent=sp, final_correct=fc)
        curves["router+cascade"] = cascade_curve(router_scores, c, t, ab)
        curves["length+cascade"] = cascade_curve(ls, c, t, ab)
        sav["router+cascade"] = savings_at_98(curves["router+cascade"], top_acc, target)
        sav["length+cascade"] = savings_at_98(curves["length+cascade"], top_acc, target)
        sav["cascade"] = float(1 - pol["cascade"]["token_share"]) if pol["cascade"]["accuracy"] >= \
            target * top_acc - 1e-12 else 0.0
    for name in ("router", "router+cascade"):
        if name in pol:
            ok = pol[name]["accuracy"] >= target * top_acc - 1e-12
            pol[name]["meets_target"] = bool(ok)
            pol[name]["savings_at_calibrated"] = round(1 - pol[name]["token_share"], 4)
    return {"n_questions": n, "settings": list(settings), "always_top_accuracy": round(top_acc, 4),
            "policies": pol, "curves": {k_: [[round(x, 5), round(y, 5)] for x, y in v] for k_, v in curves.items()},
            "savings_at_98": {k_: round(v, 4) for k_, v in sav.items()}}
