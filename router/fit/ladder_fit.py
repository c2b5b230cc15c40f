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
5. **Split**: the non-held-out questions are split again (:func:`calibration_mask`, salted SHA-256, ``cal_frac``):
   every choice below uses the *fit* split's scores; the *calibration* split's scores are used only to certify
   thresholds. Steps 3–4 run on both splits: a calibration question's score is its out-of-fold score (a fold model
   trained on the other folds, calibration questions among them; vectorisers and score scale from all non-held-out
   questions), not the fold-mean model's the file serves — so it depends on other calibration questions' labels.
6. **Thresholds with a guarantee** (:mod:`router.fit.risk`, Learn-then-Test): candidate points from the fit split's
   score quantiles, ordered on the fit split, tested on the calibration split (the binomial test of "accuracy ≥
   ``quality_target`` × always-top", fixed sequence at level ``delta``); the cheapest certified point is served,
   none → always top ("do not route"). The test is exact only for scores independent of the questions tested:
   with the cross-fitted scores of step 5 the learned scorer's split-family guarantee is approximate (``delta``
   nominal), as the served point's is (``serving.guarantee.caveat``); the length and random scorers learn nothing
   from labels, and for them it is a clean split.
7. **Policy**: the scorer (learned / length / random) × cascade-or-not family with the most in-sample certified
   savings on the fit split. The file's ``metadata.serving`` (:mod:`router.policy`) carries the served thresholds,
   the cascade rule with its phrases (:mod:`router.abstention`), the guarantee (floor, δ, calibration size) and the
   router-alone / router+cascade thresholds.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from router.abstention import DEFAULT_PHRASES
from router.fit.escalation_fit import JOINT_SEQUENCE, fit_joint
from router.fit.ladder_eval import (
    QUALITY_TARGET,
    abstain_matrix,
    cascade_outcome,
    pareto,
    random_curve,
    route,
    savings_at_98,
    threshold_curve,
    top_totals,
)
from router.fit.risk import DELTA, Certified, certify, floor_pvalue, slack_uniforms
from router.fit.traces import (
    HELDOUT_FRAC,
    HELDOUT_SALT,
    Ladder,
    LadderData,
    available_models,
    check_cheapest_first,
    heldout_mask,
    load_ladder,
    parse_ladder,
    sufficing_labels,
)
from router.model import ModelConfig, Platt, TrainedRouter, build_pipeline, hash_score, length_prior

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
#: Share of the non-held-out questions kept apart from the fit to certify the served thresholds (router/fit/risk.py)
CAL_FRAC = 0.5
CALIB_SALT = "thinkgate-calibration-v1"
#: what the cascade of a served ``router+cascade`` policy escalates on (the gateway's ``escalate_on`` names)
CASCADE_ESCALATE_ON = ("empty_answer", "length_in_thought", "abstain")
#: quantile grid of the candidate thresholds (per axis; three tiers: every ordered pair)
GRID_2, GRID_3 = 51, 21


def calibration_mask(keys: Sequence[tuple[str, str]], frac: float = CAL_FRAC) -> np.ndarray:
    """Bool (n,): the calibration split (salted SHA-256 of (dataset, id), ~``frac``); the rest is the fit split."""
    import hashlib

    out = np.empty(len(keys), dtype=bool)
    for i, (ds, q) in enumerate(keys):
        h = hashlib.sha256(f"{CALIB_SALT}/{ds}/{q}".encode()).digest()
        out[i] = int.from_bytes(h[:8], "big") / 2.0**64 < frac
    return out


def family_name(scorer: str, cascade: bool) -> str:
    """``router`` / ``length`` / ``random``, with ``+cascade`` when the cascade is served too."""
    return f"{scorer}+cascade" if cascade else scorer


def candidate_thresholds(fit_scores: np.ndarray, k: int) -> list[list[float]]:
    """Candidate operating points from the fit split's score quantiles only (never the calibration split):
    two tiers, :data:`GRID_2` single cuts (0.0 = always top, above the maximum = always cheap); three tiers, every
    ordered pair of :data:`GRID_3` cuts."""
    s = np.asarray(fit_scores, dtype=np.float64)
    grid = GRID_2 if k == 2 else GRID_3
    qs = np.quantile(s, np.linspace(0.0, 1.0, grid))
    cuts = sorted({0.0, *[float(x) for x in qs[1:-1]], float(np.nextafter(s.max(), np.inf))})
    if k == 2:
        return [[c] for c in cuts]
    if k == 3:
        return [[a, b] for i, a in enumerate(cuts) for b in cuts[i:]]
    raise ValueError("2 or 3 settings")


def point_outcomes(scores: np.ndarray, data: LadderData, candidates: list[list[float]],
                   abstain: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(bool (m, n) correct, (m,) total tokens) of each candidate on ``data``; with ``abstain`` the cascade
    escalates abstaining answers (both calls paid)."""
    rows = np.arange(data.n)
    cs, ts = [], []
    for th in candidates:
        ch = route(scores, th)
        if abstain is None:
            cs.append(data.correct[rows, ch])
            ts.append(float(data.tokens[rows, ch].sum()))
        else:
            _, fc, sp = cascade_outcome(ch, data.correct, data.tokens, abstain)
            cs.append(fc.astype(bool))
            ts.append(float(sp.sum()))
    return np.asarray(cs, dtype=bool).reshape(len(candidates), data.n), np.asarray(ts)


def certify_family(fit_scores: np.ndarray, cal_scores: np.ndarray, fit: LadderData, cal: LadderData,
                   ab_fit: np.ndarray | None, ab_cal: np.ndarray | None, u_fit: np.ndarray, u_cal: np.ndarray,
                   delta: float, floor: float) -> tuple[list[float], Certified]:
    """Learn-then-Test for one scorer (with or without the cascade): candidates and their order from the fit
    split, the test on the calibration split. Returns (the certified thresholds, or [] for always top; evidence)."""
    cands = candidate_thresholds(fit_scores, fit.correct.shape[1])
    fc, ft = point_outcomes(fit_scores, fit, cands, ab_fit)
    cc, ct = point_outcomes(cal_scores, cal, cands, ab_cal)
    cert = certify(fc, ft, fit.correct[:, -1], u_fit, cc, ct, cal.correct[:, -1], float(cal.tokens[:, -1].sum()),
                   u_cal, delta=delta, floor=floor)
    return ([] if cert.index is None else [float(min(1.0, t)) for t in cands[cert.index]]), cert


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
    delta: float = DELTA,
    cal_frac: float = CAL_FRAC,
) -> LadderFit:
    """Fit, calibrate and choose the shipped policy for one ladder (see the module docstring).

    ``policy``: ``auto`` (the fallback rule) or force ``router`` / ``length`` / ``random``. Returns a
    :class:`LadderFit` whose ``router`` carries thresholds and metadata (ladder, tiers, datasets, policy,
    validation comparison, held-out rule). Raises ValueError (bad ladder/policy, a ladder whose mean completion
    tokens do not rise cheapest first on the fit data — :func:`router.fit.traces.check_cheapest_first` —, too
    few questions) and
    FileNotFoundError (missing trace file).
    """
    t0 = time.perf_counter()
    lad = parse_ladder(ladder) if isinstance(ladder, str) else ladder
    if policy not in ("auto", *POLICIES):
        raise ValueError(f"policy must be auto, router, length or random, got {policy!r}")
    data = load_ladder(traces, datasets, lad)
    keep = ~heldout_mask(data, heldout_frac) if exclude_heldout else np.ones(data.n, dtype=bool)
    train = data.subset(np.flatnonzero(keep))
    check_cheapest_first(train)
    if train.n < 2 * folds:
        raise ValueError(f"only {train.n} training questions for {lad.name}; need at least {2 * folds}")
    is_cal = calibration_mask(train.keys, cal_frac)
    fit_part, cal_part = train.subset(np.flatnonzero(~is_cal)), train.subset(np.flatnonzero(is_cal))
    if fit_part.n < 2 * folds or cal_part.n < 1:
        raise ValueError(f"only {fit_part.n} fit / {cal_part.n} calibration questions for {lad.name}")
    y_all = pooled_targets(traces, train, pool)
    cfg = replace(TRACE_CONFIG, feature_set=feature_set)
    # one bagged router on every non-held-out question; its out-of-fold scores serve every choice below
    # (cross-fitting: a question is always scored by fold models that did not see it)
    learned, oof_all = fit_scores(train.questions, y_all, train.keys, cfg=cfg, alpha=alpha, folds=folds, seed=seed)
    oof = oof_all[~is_cal]
    length = np.array([length_score(q) for q in fit_part.questions])
    top_acc, _ = top_totals(fit_part.correct, fit_part.tokens)
    val_savings = {
        "router": savings_at_98(threshold_curve(oof, fit_part.correct, fit_part.tokens), top_acc, quality_target),
        "length": savings_at_98(threshold_curve(length, fit_part.correct, fit_part.tokens), top_acc, quality_target),
        "random": savings_at_98(random_curve(fit_part.correct, fit_part.tokens,
                                             1001 if lad.settings[2:] == () else 101), top_acc, quality_target),
    }
    # ---- the split family (router/fit/risk.py): family chosen on the fit split, the thresholds certified by
    # Learn-then-Test on the calibration split — scored out of fold by the fold models above, which saw other
    # calibration questions' labels: approximate, not a clean split-sample guarantee (module doc, steps 5-6)
    phrases = list(DEFAULT_PHRASES)
    fit_scores_by = {"router": oof, "length": length, "random": np.array([hash_score(q) for q in fit_part.questions])}
    cal_scores_by = {"router": oof_all[is_cal],
                     "length": np.array([length_score(q) for q in cal_part.questions]),
                     "random": np.array([hash_score(q) for q in cal_part.questions])}
    ab_fit = abstain_matrix(fit_part.responses, phrases)
    ab_cal = abstain_matrix(cal_part.responses, phrases)
    u_fit, u_cal = slack_uniforms(fit_part.keys), slack_uniforms(cal_part.keys)
    families = [(sc, cas) for sc in (POLICIES if policy == "auto" else (policy,)) for cas in (True, False)]
    fit_rank: dict[str, float] = {}
    for sc, cas in families:
        cands = candidate_thresholds(fit_scores_by[sc], len(lad.settings))
        fc, ft = point_outcomes(fit_scores_by[sc], fit_part, cands, ab_fit if cas else None)
        ps = np.array([floor_pvalue(fit_part.correct[:, -1], fc[j], u_fit, quality_target) for j in range(len(cands))])
        ok = np.flatnonzero(ps <= delta)
        fit_rank[family_name(sc, cas)] = float(1 - ft[ok].min() / fit_part.tokens[:, -1].sum()) if ok.size else 0.0
    order_f = [family_name(sc, cas) for sc, cas in families]
    best_family = max(order_f, key=lambda f: (round(fit_rank[f], 6), -order_f.index(f)))
    chosen = best_family.split("+")[0]
    served_cascade = best_family.endswith("+cascade")
    certs: dict[bool, tuple[list[float], Certified]] = {}
    for cas in (False, True):
        certs[cas] = certify_family(fit_scores_by[chosen], cal_scores_by[chosen], fit_part, cal_part,
                                    ab_fit if cas else None, ab_cal if cas else None, u_fit, u_cal, delta,
                                    quality_target)
    k = len(lad.settings)
    always_top = [0.0] * (k - 1)
    served_th, served_cert = certs[served_cascade]
    if chosen == "router":
        shipped = TrainedRouter(pipeline=learned.pipeline, platt=learned.platt)
    else:
        shipped = TrainedRouter(pipeline=None, scorer="length" if chosen == "length" else "hash")
    plain_th = certs[False][0] if certs[False][1].index is not None else always_top
    cascade_th = certs[True][0] if certs[True][1].index is not None else always_top
    learned.thresholds = list(plain_th) if chosen == "router" else always_top
    # ---- the served policy: answer-aware escalation x router threshold, one family declared in advance,
    # certified on ALL non-held-out questions with cross-fitted scores (router/fit/escalation_fit.py)
    all_scores = {"router": oof_all, "length": np.array([length_score(q) for q in train.questions]),
                  "random": np.array([hash_score(q) for q in train.questions])}[chosen]
    joint = fit_joint(train, all_scores, fold_ids(train.keys, folds, seed), phrases, delta, quality_target)
    serve_policy, cascade, guarantee, shipped.thresholds = served_block(joint, chosen, lad, phrases)
    serving = {
        "policy": serve_policy,
        "scorer": chosen,
        "thresholds": [round(t, 6) for t in shipped.thresholds],
        "cascade": cascade,
        "guarantee": guarantee,
        "split_family": {"policy": family_name(chosen, served_cascade) if served_cert.index is not None
                         else "always_top", "thresholds": [round(t, 6) for t in served_th],
                         "method": "Learn-then-Test, order on the fit split, test on the calibration split",
                         **served_cert.to_dict()},
        "family_choice": {"on": "fit split", "certified_savings_in_sample": {f: round(v, 4) for f, v in
                                                                             fit_rank.items()}},
        "router_thresholds": [round(t, 6) for t in plain_th],
        "router_guarantee": certs[False][1].to_dict(),
        "cascade_thresholds": [round(t, 6) for t in cascade_th],
        "cascade_guarantee": certs[True][1].to_dict(),
    }
    validation = {
        "method": f"{folds}-fold out-of-fold scores on the fit split ({fit_part.n} of {train.n} non-held-out "
                  f"questions); thresholds certified on the other {cal_part.n} (calibration split)",
        "n": train.n,
        "savings_at_98": {p: round(v, 4) for p, v in val_savings.items()},
        "calibrated": {"router": {"thresholds": [round(t, 6) for t in plain_th], **certs[False][1].to_dict()},
                       chosen: {"thresholds": [round(t, 6) for t in plain_th], **certs[False][1].to_dict()}},
        "chosen": chosen,
        "router+cascade": {"thresholds": [round(t, 6) for t in cascade_th], **certs[True][1].to_dict(),
                           "abstain_rule": "router.abstention.abstains"},
        "rule": "auto: the scorer x cascade family with the highest in-sample certified savings on the fit split "
                "(ties: router, length, random; cascade first)" if policy == "auto" else f"forced: {policy}",
    }
    shipped.metadata = ladder_metadata(lad, list(datasets), chosen, validation, quality_target, heldout_frac,
                                       pool, alpha, folds, seed, train, exclude_heldout, cfg)
    shipped.metadata["serving"] = serving
    shipped.metadata["router_thresholds"] = serving["router_thresholds"]
    shipped.metadata["cascade_thresholds"] = serving["cascade_thresholds"]
    shipped.metadata["calibration_split"] = {"method": "sha256", "salt": CALIB_SALT, "frac": cal_frac}
    learned.metadata = {**shipped.metadata, "policy": "router"}
    return LadderFit(shipped, learned, chosen, validation, fit_part, oof, time.perf_counter() - t0)


def served_block(joint: dict[str, Any], scorer: str, lad: Ladder, phrases: list[str]
                 ) -> tuple[str, dict[str, Any] | None, dict[str, Any], list[float]]:
    """(policy name, ``cascade`` block, ``guarantee`` block, thresholds) of ``metadata.serving`` from
    :func:`router.fit.escalation_fit.fit_joint`'s result: the certified point, or always top."""
    k = len(lad.settings)
    guarantee: dict[str, Any] = {
        "floor": joint["floor"], "delta": joint["delta"], "confidence": round(1 - joint["delta"], 6),
        "n_calibration": joint["n_calibration"], "cross_fitted": True,
        "method": "Learn-then-Test: exact binomial test of the floor per point (router.fit.risk), fixed sequence "
                  "declared in advance (router.fit.escalation_fit.JOINT_SEQUENCE: router-to-top share x "
                  "escalation rate) on all non-held-out questions with 5-fold out-of-fold router and escalation "
                  "scores",
        "caveat": "cross-fitting reuses labels across folds and the cuts are quantiles of the same scores: delta "
                  "is the nominal level of an approximation (the split-sample test is split_family)",
        "sequence": [list(p) for p in JOINT_SEQUENCE], "rejected": joint["rejected"], "tested": joint["tested"],
        "oof_auc_wrong": joint["oof_auc_wrong"],
        **{key: joint[key] for key in ("pvalue", "calibration_accuracy_ratio", "calibration_token_share", "s", "r")
           if key in joint},
    }
    if not joint["certified"]:
        return "always_top", None, guarantee, [0.0] * (k - 1)
    models = {name: {**m, "threshold": round(float(c), 6)}
              for name, m, c in zip(lad.settings[:-1], joint["models"], joint["escalation_cuts"], strict=True)}
    cascade = {"escalate_on": [*CASCADE_ESCALATE_ON, "learned"], "rule": "router.abstention.abstains or "
               "router.escalation.should_escalate (per tier model)", "phrases": phrases, "models": models}
    cut = round(float(joint["router_cut"]), 6)
    return f"{family_name(scorer, False)}+escalation", cascade, guarantee, [cut] * (k - 1)


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
        "thresholds_calibration": {"method": "Learn-then-Test on the calibration split (router.fit.risk): the "
                                   "cheapest operating point certified to keep quality_target x always-top",
                                   **validation["calibrated"][policy]},
        "cascade_thresholds": validation["router+cascade"]["thresholds"],
    }


def validation_pareto(scores: np.ndarray, data: LadderData) -> list[list[float]]:
    """The validation curve of ``scores`` (for plots)."""
    return pareto(np.asarray(threshold_curve(scores, data.correct, data.tokens)))
