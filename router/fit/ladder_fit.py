"""Routers learned from recorded traces: one monotone score per question, thresholds for a quality target, and
the fallback rule (ship the length or random baseline when the learned score is not better on validation).

Recipe (:func:`fit_ladder_router`), for one ladder on one or more data sets:

1. Questions of the fixed held-out split (:func:`router.fit.traces.is_heldout`) are removed first: no
   vocabulary, fit, threshold or policy choice sees them.
2. **Target** (pooled, ordinal): a number in [0, 1] per question — the mean over every model in the data set's
   folder of "its cheapest setting is wrong and its top setting right", with this ladder's own model counted
   as ``label / (k − 1)`` (``label`` = the cheapest correct setting). One ladder has ~60 positive questions
   out of ~400; the same question's outcomes on eight models are a far less noisy difficulty signal
   (``pool="none"`` uses the own label only).
3. **Features**: the Pipeline of :func:`router.model.build_pipeline` (word 1–2-gram and char 2–4-gram TF-IDF
   + hand features), vectorisers fitted on the training questions' text only.
4. **Model**: ridge regression on the target, K-fold (default 5): each fold's model scores its left-out
   fold (out-of-fold = validation scores), and the shipped coefficients are the mean of the fold models
   (a bagged linear model: same features, same scale as the validation scores). Score =
   ``sigmoid((z − μ) / σ)`` with μ, σ of the out-of-fold logits (monotone, so ranking is unchanged).
5. **Thresholds**: on the out-of-fold scores, the cheapest operating point whose accuracy is ≥ ``target``
   (0.98) × always-top accuracy (:func:`calibrate_thresholds`).
6. **Fallback**: savings_at_98 on the same validation questions of the learned score, the length ranking and
   random routing; the best one is shipped (``policy`` ``router`` | ``length`` | ``random``), all three as
   the same file type (:class:`router.model.TrainedRouter` with ``scorer`` ``pipeline``/``length``/``hash``).
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from router.fit.ladder_eval import (
    QUALITY_TARGET,
    abstain_matrix,
    cascade_curve,
    cascade_outcome,
    pareto,
    random_curve,
    savings_at_98,
    threshold_curve,
    top_totals,
)
from router.fit.traces import (
    HELDOUT_FRAC,
    HELDOUT_SALT,
    Ladder,
    LadderData,
    available_models,
    heldout_mask,
    load_ladder,
    parse_ladder,
    sufficing_labels,
)
from router.model import ModelConfig, Platt, TrainedRouter, build_pipeline, length_prior

#: Setting names ordered cheapest → most thinking (to find each model's cheapest and top setting).
SETTING_ORDER = ("no_think", "low_effort", "budget256", "medium_effort", "exd0", "budget1024", "high_effort")

#: Model of the trace routers: word 1–2-grams (the questions are short, the vocabulary small), char 2–4-grams,
#: the 20 base hand features. The question-structure set (``feature_set="qa"``: dates, ordinals, capitals,
#: comparatives, relative words, "how many") did not beat it on 5-fold validation over the nine ladders
#: (mean savings_at_98 0.240 base vs 0.230 qa; best of router/router+cascade 0.281 vs 0.289), so it is an option.
TRACE_CONFIG = ModelConfig(word_ngrams=(1, 2), char_ngrams=(2, 4), word_max_features=20_000,
                           char_max_features=15_000, min_df=2, C=1.0)
#: Ridge strength (in units of the TF-IDF + standardised hand features); 1–3 were best in 5-fold CV.
RIDGE_ALPHA = 2.0
POLICIES = ("router", "length", "random")


def model_settings(traces: str | Path, dataset: str) -> dict[str, tuple[str, ...]]:
    """Per model in ``traces/dataset``, its settings ordered by :data:`SETTING_ORDER` (unknown names last)."""
    rank = {s: i for i, s in enumerate(SETTING_ORDER)}
    return {m: tuple(sorted(ss, key=lambda s: (rank.get(s, len(rank)), s)))
            for m, ss in available_models(traces, dataset).items()}


def pooled_targets(traces: str | Path, data: LadderData, pool: str = "models") -> np.ndarray:
    """The regression target per row of ``data`` (float (n,) in [0, 1]; see the module docstring).

    ``pool="models"``: mean over the folder's models; ``"none"``: ``label / (k − 1)`` of this ladder only.
    Only outcomes (``correct``) are read — fitting labels, never features.
    """
    k = data.correct.shape[1]
    own = sufficing_labels(data.correct) / (k - 1)
    if pool == "none":
        return own.astype(np.float64)
    if pool != "models":
        raise ValueError(f"pool must be 'models' or 'none', got {pool!r}")
    total = own.astype(np.float64).copy()
    count = np.ones(data.n)
    index = {key: i for i, key in enumerate(data.keys)}
    for ds in sorted(set(data.datasets)):
        for model, settings in model_settings(traces, ds).items():
            if model == data.ladder.model or len(settings) < 2:
                continue
            other = load_ladder(traces, ds, Ladder(model, (settings[0], settings[-1])))
            need = other.correct[:, 1] & ~other.correct[:, 0]
            for j, key in enumerate(other.keys):
                i = index.get(key)
                if i is not None:
                    total[i] += float(need[j])
                    count[i] += 1
    return total / count


def length_score(text: str) -> float:
    """The length baseline's score (:func:`router.model.length_prior`; monotone in characters)."""
    return length_prior(text)


@dataclass
class Calibration:
    """Thresholds for one score on one validation set and what they achieve there."""

    thresholds: list[float]
    accuracy: float
    token_share: float
    tiers: list[float]
    top_accuracy: float
    target: float

    def to_dict(self) -> dict[str, Any]:
        return {"thresholds": [round(t, 6) for t in self.thresholds], "accuracy": round(self.accuracy, 4),
                "token_share": round(self.token_share, 4), "tiers": [round(x, 4) for x in self.tiers],
                "always_top_accuracy": round(self.top_accuracy, 4), "quality_target": self.target}


def _midpoint(lo: float, hi: float) -> float:
    return float((lo + hi) / 2.0) if hi > lo else float(hi)


def calibrate_thresholds(
    scores: np.ndarray, correct: np.ndarray, tokens: np.ndarray, target: float = QUALITY_TARGET
) -> Calibration:
    """Ascending thresholds (k − 1 of them) for the cheapest operating point of ``scores`` with accuracy ≥
    ``target`` × always-top accuracy on this set (always-top itself when nothing cheaper qualifies).

    Cut points sit at the midpoint between the neighbouring scores, so the same split is reproduced on this
    set. Two or three settings. Raises ValueError otherwise.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    c = np.asarray(correct, dtype=np.float64)
    t = np.asarray(tokens, dtype=np.float64)
    n, k = c.shape
    if k not in (2, 3):
        raise ValueError("calibrate_thresholds supports 2 or 3 settings")
    top_acc, top_tok = top_totals(c, t)
    order = np.argsort(s, kind="stable")
    ss = s[order]
    cuts = np.r_[0, np.flatnonzero(ss[1:] != ss[:-1]) + 1, n]
    pc = np.vstack([np.zeros((1, k)), np.cumsum(c[order], axis=0)])
    pt = np.vstack([np.zeros((1, k)), np.cumsum(t[order], axis=0)])
    if k == 2:
        a = cuts
        b = np.full_like(a, n)
    else:
        aa, bb = np.meshgrid(cuts, cuts, indexing="ij")
        ok = aa <= bb
        a, b = aa[ok], bb[ok]
    if k == 2:
        acc = (pc[a, 0] + pc[n, 1] - pc[a, 1]) / n
        tok = (pt[a, 0] + pt[n, 1] - pt[a, 1]) / top_tok
    else:
        acc = (pc[a, 0] + pc[b, 1] - pc[a, 1] + pc[n, 2] - pc[b, 2]) / n
        tok = (pt[a, 0] + pt[b, 1] - pt[a, 1] + pt[n, 2] - pt[b, 2]) / top_tok
    ok = acc >= target * top_acc - 1e-12
    # cheapest qualifying point; among equal cost the more accurate
    cand = np.flatnonzero(ok)
    best = int(cand[np.lexsort((-acc[cand], tok[cand]))[0]])

    def cut_value(m: int) -> float:
        if m <= 0:
            return 0.0
        if m >= n:
            return float(np.nextafter(ss[-1], np.inf))  # above every score: nothing goes up
        return _midpoint(ss[m - 1], ss[m])

    positions = [int(a[best])] if k == 2 else [int(a[best]), int(b[best])]
    th = [min(1.0, max(0.0, cut_value(m))) for m in positions]
    for i in range(1, len(th)):
        th[i] = max(th[i], th[i - 1])
    bounds = [0, *positions, n]
    tiers = [(bounds[j + 1] - bounds[j]) / n for j in range(k)]
    return Calibration(th, float(acc[best]), float(tok[best]), tiers, top_acc, target)


def random_thresholds(correct: np.ndarray, tokens: np.ndarray, target: float = QUALITY_TARGET) -> Calibration:
    """Thresholds of a uniform hash score (P(score ≥ t) = 1 − t) at the cheapest tier mix whose *expected*
    accuracy is ≥ ``target`` × always-top (a grid of 1,001 mixes per axis for two settings, 101 for three)."""
    c = np.asarray(correct, dtype=np.float64)
    t = np.asarray(tokens, dtype=np.float64)
    k = c.shape[1]
    top_acc, top_tok = top_totals(c, t)
    acc_j, share_j = c.mean(axis=0), t.sum(axis=0) / top_tok
    w = np.linspace(0.0, 1.0, 1001 if k == 2 else 101)
    if k == 2:
        mixes = np.c_[1 - w, w]
    elif k == 3:
        g1, g2 = np.meshgrid(w, w, indexing="ij")
        rest = np.c_[g1.ravel(), g2.ravel()]
        rest = rest[rest.sum(axis=1) <= 1 + 1e-12]
        mixes = np.c_[1 - rest.sum(axis=1), rest]
    else:
        raise ValueError("random_thresholds supports 2 or 3 settings")
    acc, share = mixes @ acc_j, mixes @ share_j
    ok = np.flatnonzero(acc >= target * top_acc - 1e-12)
    best = int(ok[np.lexsort((-acc[ok], share[ok]))[0]])
    m = mixes[best]
    # tier j gets scores in [t_j, t_{j+1}): t_j = 1 − (share of tiers ≥ j)
    th = [float(np.clip(1.0 - m[j:].sum(), 0.0, 1.0)) for j in range(1, k)]
    return Calibration(th, float(acc[best]), float(share[best]), [float(x) for x in m], top_acc, target)


def choose_policy(val_savings: dict[str, float]) -> str:
    """The fallback rule: the policy (``router``, ``length``, ``random``) with the highest validation
    savings_at_98; ties go to the earlier one in that order (the learned router first)."""
    return max(POLICIES, key=lambda p: (round(val_savings[p], 6), -POLICIES.index(p)))


@dataclass
class LadderFit:
    """What :func:`fit_ladder_router` produced: the shipped router, the validation comparison, the data."""

    router: TrainedRouter
    learned: TrainedRouter
    policy: str
    validation: dict[str, Any]
    train: LadderData
    val_scores: np.ndarray
    seconds: float
    notes: list[str] = field(default_factory=list)


def _fit_features(texts: Sequence[str], cfg: ModelConfig) -> tuple[Any, Any]:
    pipe = build_pipeline(cfg)
    clip = pipe.named_steps["clip"]
    X = pipe.named_steps["features"].fit_transform(clip.transform(list(texts)))
    return pipe, X.tocsr()


def _ridge(X: Any, y: np.ndarray, alpha: float) -> tuple[np.ndarray, float]:
    from sklearn.linear_model import Ridge

    m = Ridge(alpha=alpha, solver="auto").fit(X, y)
    return np.asarray(m.coef_, dtype=np.float64).ravel(), float(m.intercept_)


def fold_ids(keys: Sequence[tuple[str, str]], folds: int, seed: int) -> np.ndarray:
    """Fold index per question, from a seeded hash of (dataset, id): stable under reordering."""
    import hashlib

    out = np.empty(len(keys), dtype=np.int64)
    for i, (ds, q) in enumerate(keys):
        h = hashlib.sha256(f"thinkgate-fold/{seed}/{ds}/{q}".encode()).digest()
        out[i] = int.from_bytes(h[:8], "big") % folds
    return out


def fit_scores(
    texts: Sequence[str], y: np.ndarray, keys: Sequence[tuple[str, str]], *, cfg: ModelConfig = TRACE_CONFIG,
    alpha: float = RIDGE_ALPHA, folds: int = 5, seed: int = 0,
) -> tuple[TrainedRouter, np.ndarray]:
    """Fit the bagged ridge router (module docstring, steps 3–4). Returns (router with ``scorer="pipeline"``,
    no thresholds; out-of-fold scores in [0, 1], (n,))."""
    pipe, X = _fit_features(texts, cfg)
    f = fold_ids(keys, folds, seed)
    z_oof = np.zeros(len(texts))
    coefs, icpts = [], []
    for j in range(folds):
        tr, te = np.flatnonzero(f != j), np.flatnonzero(f == j)
        if tr.size == 0 or te.size == 0:
            continue
        w, b = _ridge(X[tr], y[tr], alpha)
        z_oof[te] = X[te] @ w + b
        coefs.append(w)
        icpts.append(b)
    if not coefs:
        raise ValueError("too few questions for the folds")
    clf = pipe.named_steps["clf"]
    clf.coef_ = np.mean(coefs, axis=0).reshape(1, -1)
    clf.intercept_ = np.array([float(np.mean(icpts))])
    clf.classes_ = np.array([0, 1])
    clf.n_features_in_ = X.shape[1]
    mu, sd = float(z_oof.mean()), float(z_oof.std()) or 1.0
    router = TrainedRouter(pipeline=pipe, platt=Platt(a=1.0 / sd, b=-mu / sd))
    from router.model import sigmoid

    return router, sigmoid((z_oof - mu) / sd)


def fit_ladder_router(
    traces: str | Path,
    datasets: Sequence[str],
    ladder: Ladder | str,
    *,
    quality_target: float = QUALITY_TARGET,
    heldout_frac: float = HELDOUT_FRAC,
    pool: str = "models",
    policy: str = "auto",
    alpha: float = RIDGE_ALPHA,
    folds: int = 5,
    seed: int = 0,
    exclude_heldout: bool = True,
    feature_set: str = "base",
) -> LadderFit:
    """Fit, calibrate and choose the shipped policy for one ladder (see the module docstring).

    ``policy``: ``auto`` (the fallback rule) or force ``router`` / ``length`` / ``random``. Returns a
    :class:`LadderFit` whose ``router`` carries thresholds and metadata (ladder, tiers, datasets, policy,
    validation comparison, held-out rule). Raises ValueError (bad ladder/policy, too few questions) and
    FileNotFoundError (missing trace file).
    """
    t0 = time.perf_counter()
    lad = parse_ladder(ladder) if isinstance(ladder, str) else ladder
    if policy not in ("auto", *POLICIES):
        raise ValueError(f"policy must be auto, router, length or random, got {policy!r}")
    data = load_ladder(traces, datasets, lad)
    keep = ~heldout_mask(data, heldout_frac) if exclude_heldout else np.ones(data.n, dtype=bool)
    train = data.subset(np.flatnonzero(keep))
    if train.n < 2 * folds:
        raise ValueError(f"only {train.n} training questions for {lad.name}; need at least {2 * folds}")
    y = pooled_targets(traces, train, pool)
    cfg = replace(TRACE_CONFIG, feature_set=feature_set)
    learned, oof = fit_scores(train.questions, y, train.keys, cfg=cfg, alpha=alpha, folds=folds, seed=seed)
    length = np.array([length_score(q) for q in train.questions])
    cal = {
        "router": calibrate_thresholds(oof, train.correct, train.tokens, quality_target),
        "length": calibrate_thresholds(length, train.correct, train.tokens, quality_target),
        "random": random_thresholds(train.correct, train.tokens, quality_target),
    }
    top_acc, _ = top_totals(train.correct, train.tokens)
    val_savings = {
        "router": savings_at_98(threshold_curve(oof, train.correct, train.tokens), top_acc, quality_target),
        "length": savings_at_98(threshold_curve(length, train.correct, train.tokens), top_acc, quality_target),
        "random": savings_at_98(random_curve(train.correct, train.tokens, 1001 if lad.settings[2:] == () else 101),
                                top_acc, quality_target),
    }
    chosen = choose_policy(val_savings) if policy == "auto" else policy
    if chosen == "router":
        shipped = TrainedRouter(pipeline=learned.pipeline, platt=learned.platt)
    else:
        shipped = TrainedRouter(pipeline=None, scorer="length" if chosen == "length" else "hash")
    shipped.thresholds = list(cal[chosen].thresholds)
    # thresholds for serving the same score with the cascade (abstaining answers escalate), calibrated on the
    # validation questions' cascade outcomes — from the recorded answer texts, never their grading
    chosen_val = {"router": oof, "length": length,
                  "random": np.array([shipped.score(q) for q in train.questions])}[chosen]
    ab = abstain_matrix(train.responses)
    starts = [cascade_outcome(np.full(train.n, j), train.correct, train.tokens, ab) for j in range(len(lad.settings))]
    cc = np.stack([x[1] for x in starts], axis=1)
    ct = np.stack([x[2] for x in starts], axis=1)
    cascade_cal = calibrate_thresholds(chosen_val, cc, ct, quality_target)
    learned.thresholds = list(cal["router"].thresholds)
    validation = {
        "method": f"{folds}-fold out-of-fold scores on the non-held-out questions",
        "n": train.n,
        "savings_at_98": {p: round(v, 4) for p, v in val_savings.items()},
        "calibrated": {p: c.to_dict() for p, c in cal.items()},
        "chosen": chosen,
        "router+cascade": {**cascade_cal.to_dict(), "savings_at_98": round(
            savings_at_98(cascade_curve(chosen_val, train.correct, train.tokens, ab), top_acc, quality_target), 4),
            "abstain_rule": "router.fit.ladder_eval.abstains"},
        "rule": "auto: the policy with the highest validation savings_at_98 (ties: router, length, random)"
        if policy == "auto" else f"forced: {policy}",
    }
    shipped.metadata = ladder_metadata(lad, list(datasets), chosen, validation, quality_target, heldout_frac,
                                       pool, alpha, folds, seed, train, exclude_heldout, cfg)
    learned.metadata = {**shipped.metadata, "policy": "router"}
    return LadderFit(shipped, learned, chosen, validation, train, oof, time.perf_counter() - t0)


def ladder_metadata(
    lad: Ladder, datasets: list[str], policy: str, validation: dict[str, Any], quality_target: float,
    heldout_frac: float, pool: str, alpha: float, folds: int, seed: int, train: LadderData, exclude_heldout: bool,
    cfg: ModelConfig = TRACE_CONFIG,
) -> dict[str, Any]:
    """The metadata of a trace router file."""
    import sklearn
    import skops

    from router.fit.jsonl import sha256_rows

    return {
        "router": {"router": "trace-ridge", "length": "length-prior", "random": "hash-random"}[policy],
        "router_version": "trace-1",
        "created_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "sklearn_version": sklearn.__version__,
        "skops_version": skops.__version__,
        "policy": policy,
        "policy_description": {
            "router": "learned: word 1-2-gram + char 2-4-gram TF-IDF + hand features -> bagged ridge on the "
                      "pooled difficulty target, score = sigmoid((z - mu) / sigma)",
            "length": "baseline: score = log1p(characters) / log1p(100000), longer prompts go up the ladder",
            "random": "baseline: score = a hash of the whitespace-normalised text, uniform in [0, 1): random "
                      "routing at the calibrated tier mix, the same answer for the same prompt",
        }[policy],
        "ladder": {"model": lad.model, "settings": list(lad.settings)},
        "tiers": list(lad.settings),
        "datasets": datasets,
        "quality_target": quality_target,
        "model_config": cfg.to_dict(),
        "ridge_alpha": alpha,
        "folds": folds,
        "seed": seed,
        "target": {"pool": pool, "definition": "mean over the folder's models of (cheapest setting wrong and top "
                   "right); this ladder's model counts label/(k-1)"},
        "heldout": {"method": "sha256", "salt": HELDOUT_SALT, "frac": heldout_frac, "excluded": exclude_heldout,
                    "function": "router.fit.traces.is_heldout(dataset, id, frac)"},
        "training_questions": train.n,
        "training_data_sha256": sha256_rows({"dataset": d, "id": q} for d, q in train.keys),
        "metrics": {"validation": validation},
        "thresholds_calibration": {"method": "cheapest operating point with accuracy >= quality_target x "
                                   "always-top on the out-of-fold validation scores",
                                   **validation["calibrated"][policy]},
        "cascade_thresholds": validation["router+cascade"]["thresholds"],
    }


def validation_pareto(scores: np.ndarray, data: LadderData) -> list[list[float]]:
    """The validation curve of ``scores`` (for plots)."""
    return pareto(np.asarray(threshold_curve(scores, data.correct, data.tokens)))
