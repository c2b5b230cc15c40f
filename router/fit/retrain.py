"""Retraining from routing outcomes: labels from the gateway's outcome stream, a fit, a calibration and the
old-vs-new comparison on a held-out slice of the outcomes. Pure (NumPy / scikit-learn); the gateway's CLI reads
the stream and calls :func:`retrain`.

Labels (an outcome is a dict with the fields of ``gateway.ledger.outcome.Outcome``, ``text`` required — the
gateway keeps it under ``routing.outcomes.retain_text``). The label is "the cheaper tier sufficed" (0) or not (1),
whatever graded the answer — ``feedback`` (a client's grade, ``POST /v1/feedback``), ``shadow`` (the next tier
asked too, a judge compared; judge ``verifier`` = a check against the reference answer) or ``escalation`` (the
cascade found the cheap answer empty, cut or abstaining).

Two routed tiers (``cheap`` → ``top``; ``tiers`` given as the top tier's name alone, or as two names — a tier
outside them counts as the cheap one):

- answered on a lower tier and ``sufficed`` → 0 (the cheap tier was enough: an easy request);
- answered on a lower tier and not ``sufficed`` → 1 (the cheap tier was not enough);
- answered on the top tier → no label, graded right or wrong: the cheap tier was never tried, so the grade says
  nothing about the boundary (a top answer graded wrong does not make the request "easy").

``k`` ≥ 2 routed tiers ``tiers[0]`` (cheapest) … ``tiers[k-1]`` (top), boundary ``b`` = 1 … k−1 between
``tiers[b-1]`` and ``tiers[b]`` (the router's cut ``thresholds[b-1]``). Assumed *monotone*: a more expensive tier
is at least as good. An outcome answered on ``tiers[i]``, i < k−1 (:func:`boundary_labels`):

- ``sufficed`` → 0 at every boundary b > i (every tier from ``tiers[i]`` up is enough);
- not ``sufficed`` → 1 at every boundary b ≤ i+1 (no tier up to ``tiers[i]`` is enough);
- answered on the top tier, or on a tier outside ``tiers`` (its place in the order is unknown) → no label.

With two tiers this is the rule above (one boundary). One outcome's labels are all equal: its *pooled* label
(:func:`label_of`) is that value. Several outcomes of one routing window (same ``window_digest``): per boundary the
mean of its labels, rounded (ties → 1; None where no outcome spoke to that boundary), and the pooled label the mean
of all of them, rounded (ties → 1) — the label the single difficulty score is fitted on.

Held-out slice: outcomes whose digest hashes (SHA-256 of ``thinkgate-outcomes-v1/<digest>``) into the
``heldout_frac`` share; never fitted on. Old vs new: ROC AUC of the router score against the labels on that
slice (rank quality, threshold-free), and the share of held-out requests served well at the calibrated
thresholds (label 1 sent to the top tier, or label 0). The new router is refused (:class:`RetrainRefused`)
when its AUC is below the old one's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from router.fit.calibrate import fraction_at_or_above, thresholds_for_fractions
from router.fit.evaluate import auc_score
from router.fit.fitter import fit_router
from router.fit.labels import LabelledItem
from router.model import ModelConfig, TrainedRouter
from router.policy import embed_cuts

HIST_BINS = 20


class RetrainRefused(ValueError):
    """The retrained router is worse than the one in service on the held-out outcomes (or cannot be judged);
    ``report`` is the comparison when one was made."""

    def __init__(self, message: str, report: RetrainReport | None = None) -> None:
        super().__init__(message)
        self.report = report


def is_heldout_digest(digest: str, frac: float) -> bool:
    """Whether the outcome group ``digest`` belongs to the fixed held-out slice (``frac`` of all digests)."""
    h = hashlib.sha256(f"thinkgate-outcomes-v1/{digest}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < frac


Tiers = str | Sequence[str]  # the top tier's name (two tiers), or the routed tiers cheapest first


def tier_order(tiers: Tiers) -> list[str]:
    """The routed tiers cheapest first; a name alone is the top tier of two (``""`` stands for the cheap one)."""
    return ["", tiers] if isinstance(tiers, str) else list(tiers)


def boundary_labels(outcome: dict[str, Any], tiers: Tiers) -> list[int | None]:
    """The label one outcome gives at each boundary b = 1 … k−1 (index b−1; module docstring): 1 = a tier above
    ``tiers[b-1]`` was needed, 0 = ``tiers[b-1]`` was enough, None = no evidence about that boundary."""
    order = tier_order(tiers)
    k = len(order)
    out: list[int | None] = [None] * (k - 1)
    sufficed, tier = outcome.get("sufficed"), outcome.get("tier")
    if sufficed is None or tier is None or tier == order[-1]:  # the top tier: nothing learnt about a boundary
        return out
    if tier in order[:-1]:
        i = order.index(tier)
    elif k == 2:  # two tiers: every tier but the top is the cheap side (as before k tiers were learnt)
        i = 0
    else:
        return out
    for b in range(i + 1, k) if sufficed else range(1, i + 2):
        out[b - 1] = 0 if sufficed else 1
    return out


def label_of(outcome: dict[str, Any], tiers: Tiers) -> int | None:
    """The pooled label (1 = a tier above the one that answered was needed) one outcome gives, or None (see the
    module docstring); ``tiers``: the top tier's name (two tiers) or the routed tiers cheapest first."""
    labels = [x for x in boundary_labels(outcome, tiers) if x is not None]
    return labels[0] if labels else None


def label_counts(outcomes: Iterable[dict[str, Any]], tiers: Tiers) -> dict[str, dict[str, int]]:
    """Per outcome ``source``: how many outcomes gave label 0 (``cheap_sufficed``), 1 (``cheap_failed``) or none
    (``dropped``: a top-tier answer, no grade, or no routing-window text to learn from)."""
    out: dict[str, dict[str, int]] = {}
    for o in outcomes:
        c = out.setdefault(str(o.get("source")), {"cheap_sufficed": 0, "cheap_failed": 0, "dropped": 0})
        label = label_of(o, tiers) if isinstance(o.get("text"), str) else None
        c["dropped" if label is None else ("cheap_failed" if label else "cheap_sufficed")] += 1
    return out


def _rounded_mean(labels: Sequence[int]) -> int | None:
    return int(float(np.mean(labels)) >= 0.5) if labels else None  # ties → 1: the cautious side


def is_comparison(outcome: dict[str, Any]) -> bool:
    """True for a shadow outcome judged by comparing the two tiers' answers (judge ``agreement``, ``normalised``
    or ``tier:<name>``): its ``sufficed`` says the answers agree, not that the cheap one is right. A ``verifier``
    shadow checks the cheap answer against a reference: a grade, like feedback."""
    return outcome.get("source") == "shadow" and outcome.get("judge") != "verifier"


def items_from_outcomes(outcomes: Iterable[dict[str, Any]], tiers: Tiers) -> list[LabelledItem]:
    """One labelled item per routing window with a text and at least one label (see the module docstring);
    ``label`` = the pooled label, ``group`` = the window digest, ``source`` = ``outcomes``; ``meta``: ``n`` (labelled
    outcomes), ``by_source`` (their count per source), ``compared`` (how many of them are answer comparisons,
    :func:`is_comparison`) and ``by_boundary`` (k−1 labels, None = no evidence)."""
    k = len(tier_order(tiers))
    groups: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        text, per_b = o.get("text"), boundary_labels(o, tiers)
        if not isinstance(text, str) or all(x is None for x in per_b):
            continue
        digest = o.get("window_digest") or hashlib.sha256(text.encode()).hexdigest()[:16]
        g = groups.setdefault(digest, {"text": text, "n": 0, "b": [[] for _ in range(k - 1)], "sources": {}})
        g["n"] += 1
        for b, x in enumerate(per_b):
            if x is not None:
                g["b"][b].append(x)
        src = str(o.get("source"))
        g["sources"][src] = g["sources"].get(src, 0) + 1
        g["compared"] = g.get("compared", 0) + int(is_comparison(o))
    items = []
    for digest, g in sorted(groups.items()):
        pooled = _rounded_mean([x for labels in g["b"] for x in labels])
        items.append(LabelledItem(id=digest, text=g["text"], label=int(pooled or 0), source="outcomes",
                                  group=digest, meta={"n": g["n"], "by_source": g["sources"],
                                                      "compared": g.get("compared", 0),
                                                      "by_boundary": [_rounded_mean(x) for x in g["b"]]}))
    return items


def score_histogram(scores: Sequence[float] | np.ndarray, bins: int = HIST_BINS) -> dict[str, Any]:
    """A score histogram for the router file's metadata (the drift alarm's reference): ``{"edges": [bins + 1
    floats over [0, 1]], "counts": [bins ints], "n"}``."""
    s = np.clip(np.asarray(scores, dtype=np.float64), 0.0, 1.0)
    counts, edges = np.histogram(s, bins=bins, range=(0.0, 1.0))
    return {"edges": [round(float(e), 6) for e in edges], "counts": [int(c) for c in counts], "n": int(s.size)}


@dataclass
class SliceReport:
    """A router on the held-out outcomes: ROC AUC, the top-tier share and the share served well at its cuts."""

    auc: float
    long_share: float
    served_well: float


@dataclass
class RetrainReport:
    """What :func:`retrain` did: item counts, the calibrated long share, old and new on the held-out slice."""

    n_items: int
    n_fit: int
    n_heldout: int
    long_share: float
    old: SliceReport
    new: SliceReport
    accepted: bool
    reason: str = ""
    label_counts: dict[str, int] = field(default_factory=dict)


def evaluate_slice(scores: np.ndarray, labels: np.ndarray, threshold: float) -> SliceReport:
    """ROC AUC, share sent up and share served well (label 1 sent up, or label 0) at ``threshold``."""
    up = scores >= threshold
    served = np.where(labels == 1, up, True)
    return SliceReport(auc=auc_score(labels, scores), long_share=float(np.mean(up)) if up.size else float("nan"),
                       served_well=float(np.mean(served)) if served.size else float("nan"))


def cuts_of(router: TrainedRouter, k: int) -> list[float]:
    """The ``k`` − 1 cuts ``router`` serves for ``k`` routed tiers, as the gateway serves them
    (:func:`router.policy.embed_cuts`: a file with fewer cuts serves them at the top boundaries, 0.0 below); its top
    cut (0.5 without one) at every boundary when it has more."""
    if 1 <= len(router.thresholds) <= k - 1:
        return embed_cuts(router.thresholds, k)
    return [float(router.thresholds[-1]) if router.thresholds else 0.5] * (k - 1)


def calibrate_to_shares(scores: np.ndarray, shares: Sequence[float]) -> list[float]:
    """Ascending cuts such that about ``shares[b]`` of ``scores`` are at or above cut b (one cut per share, each
    with :func:`thresholds_for_fractions`; equal shares give equal cuts)."""
    cuts = [thresholds_for_fractions(scores, [min(1.0, max(0.0, f))])[0] for f in shares]
    for b in range(1, len(cuts)):  # a later boundary's cut is never below an earlier one's
        cuts[b] = max(cuts[b], cuts[b - 1])
    return cuts


def retrain(old: TrainedRouter, outcome_items: Sequence[LabelledItem], base_items: Sequence[LabelledItem] = (),
            *, long_share: float | None = None, heldout_frac: float = 0.2, cfg: ModelConfig | None = None,
            min_heldout: int = 10, n_tiers: int = 2) -> tuple[TrainedRouter, RetrainReport]:
    """Fit a router on the non-held-out ``outcome_items`` plus ``base_items`` (offline labels; the pooled label),
    calibrate its ``n_tiers`` − 1 thresholds so that each sends the share of the training texts to the tiers above
    it that the ``old`` router sends there (the top cut: ``long_share`` when given), compare with ``old`` on the
    held-out slice. Returns the new router (metadata: ``version``, ``retrained_from``, ``retrain`` report,
    ``score_histogram``) and the report; raises :class:`RetrainRefused` when the new router is worse (lower AUC)
    or the slice cannot judge (fewer than ``min_heldout`` items or a single class), ValueError when there is too
    little to fit."""
    import datetime as _dt

    held = [it for it in outcome_items if is_heldout_digest(it.group or it.id, heldout_frac)]
    train = [it for it in outcome_items if not is_heldout_digest(it.group or it.id, heldout_frac)] + list(base_items)
    labels = np.array([it.label for it in held], dtype=np.int64)
    if len(held) < min_heldout or len(set(labels.tolist())) < 2:
        raise RetrainRefused(f"the held-out slice has {len(held)} outcomes ({int(labels.sum())} needing the top "
                             f"tier): at least {min_heldout} with both labels are needed to judge a new router")
    new, _ = fit_router(train, cfg or ModelConfig(min_df=1), val_frac=0.0, platt_frac=0.15)
    train_texts = [it.text for it in train]
    old_train = np.array([old.score(t) for t in train_texts])
    old_cuts = cuts_of(old, n_tiers)
    shares = [fraction_at_or_above(old_train, c) for c in old_cuts]
    if long_share is not None:
        shares[-1] = long_share
    for i in range(len(shares) - 2, -1, -1):  # at least as many above a lower cut as above a higher one
        shares[i] = max(shares[i], shares[i + 1])
    share = shares[-1]
    new_train = new.predict_proba(train_texts)
    new.thresholds = calibrate_to_shares(new_train, shares)
    held_texts = [it.text for it in held]
    old_s = np.array([old.score(t) for t in held_texts])
    new_s = new.predict_proba(held_texts)
    rep_old = evaluate_slice(old_s, labels, old_cuts[-1])
    rep_new = evaluate_slice(new_s, labels, new.thresholds[-1])
    accepted = not (rep_new.auc < rep_old.auc)
    reason = "" if accepted else (f"the new router ranks the held-out outcomes worse (AUC {rep_new.auc:.3f} < "
                                  f"{rep_old.auc:.3f} of the router in service)")
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    report = RetrainReport(len(outcome_items), len(train), len(held), share, rep_old, rep_new, accepted, reason,
                           {"outcomes_fit": len(train) - len(base_items), "base": len(base_items),
                            "heldout": len(held)})
    new.metadata.update({
        "version": f"retrain-{now}",
        "retrained_from": old.metadata.get("version") or old.metadata.get("created_utc"),
        "retrain": {"n_fit": len(train), "n_heldout": len(held), "heldout_frac": heldout_frac,
                    "long_share": round(share, 4),
                    "old": vars(rep_old), "new": vars(rep_new)},
        "score_histogram": score_histogram(new_train),
    })
    if n_tiers > 2:  # the share each cut was calibrated to, lowest boundary first
        new.metadata["retrain"]["shares_above"] = [round(f, 4) for f in shares]
    if not accepted:
        raise RetrainRefused(reason, report)
    return new, report
