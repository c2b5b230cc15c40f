"""Retraining from routing outcomes: labels from the gateway's outcome stream, a fit, a calibration and the
old-vs-new comparison on a held-out slice of the outcomes. Pure (NumPy / scikit-learn); the gateway's CLI reads
the stream and calls :func:`retrain`.

Labels (two routed tiers, ``cheap`` → ``top``; an outcome is a dict with the fields of
``gateway.ledger.outcome.Outcome``, ``text`` required — the gateway keeps it under
``routing.outcomes.retain_text``):

The label is "the cheaper tier sufficed" (0) or not (1), whatever graded the answer — ``feedback`` (a client's
grade, ``POST /v1/feedback``), ``shadow`` (the next tier asked too, a judge compared; judge ``verifier`` = a check
against the reference answer) or ``escalation`` (the cascade found the cheap answer empty, cut or abstaining):

- answered on a lower tier and ``sufficed`` → 0 (the cheap tier was enough: an easy request);
- answered on a lower tier and not ``sufficed`` → 1 (the cheap tier was not enough);
- answered on the top tier → no label, graded right or wrong: the cheap tier was never tried, so the grade says
  nothing about the boundary (a top answer graded wrong does not make the request "easy").

Several outcomes of one routing window (same ``window_digest``): the mean label, rounded (ties → 1).
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


def label_of(outcome: dict[str, Any], top_tier: str) -> int | None:
    """The label (1 = needs the top tier) one outcome gives, or None (see the module docstring)."""
    sufficed = outcome.get("sufficed")
    tier = outcome.get("tier")
    if sufficed is None or tier is None:
        return None
    if tier == top_tier:  # the cheap tier was not tried: nothing learnt about the boundary
        return None
    return 0 if sufficed else 1


def label_counts(outcomes: Iterable[dict[str, Any]], top_tier: str) -> dict[str, dict[str, int]]:
    """Per outcome ``source``: how many outcomes gave label 0 (``cheap_sufficed``), 1 (``cheap_failed``) or none
    (``dropped``: a top-tier answer, no grade, or no routing-window text to learn from)."""
    out: dict[str, dict[str, int]] = {}
    for o in outcomes:
        c = out.setdefault(str(o.get("source")), {"cheap_sufficed": 0, "cheap_failed": 0, "dropped": 0})
        label = label_of(o, top_tier) if isinstance(o.get("text"), str) else None
        c["dropped" if label is None else ("cheap_failed" if label else "cheap_sufficed")] += 1
    return out


def items_from_outcomes(outcomes: Iterable[dict[str, Any]], top_tier: str) -> list[LabelledItem]:
    """One labelled item per routing window with a text and at least one label (see the module docstring);
    ``group`` = the window digest, ``source`` = ``outcomes``; ``meta`` counts the evidence by source."""
    groups: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        text, label = o.get("text"), label_of(o, top_tier)
        if not isinstance(text, str) or label is None:
            continue
        digest = o.get("window_digest") or hashlib.sha256(text.encode()).hexdigest()[:16]
        g = groups.setdefault(digest, {"text": text, "labels": [], "sources": {}})
        g["labels"].append(label)
        src = str(o.get("source"))
        g["sources"][src] = g["sources"].get(src, 0) + 1
    items = []
    for digest, g in sorted(groups.items()):
        mean = float(np.mean(g["labels"]))
        items.append(LabelledItem(id=digest, text=g["text"], label=int(mean >= 0.5), source="outcomes", group=digest,
                                  meta={"n": len(g["labels"]), "by_source": g["sources"]}))
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


def retrain(old: TrainedRouter, outcome_items: Sequence[LabelledItem], base_items: Sequence[LabelledItem] = (),
            *, long_share: float | None = None, heldout_frac: float = 0.2, cfg: ModelConfig | None = None,
            min_heldout: int = 10) -> tuple[TrainedRouter, RetrainReport]:
    """Fit a router on the non-held-out ``outcome_items`` plus ``base_items`` (offline labels), calibrate its
    threshold so that ``long_share`` of the training texts go to the top tier (default: the share the ``old``
    router sends there on them), compare with ``old`` on the held-out slice. Returns the new router (metadata:
    ``version``, ``retrained_from``, ``retrain`` report, ``score_histogram``) and the report; raises
    :class:`RetrainRefused` when the new router is worse (lower AUC) or the slice cannot judge (fewer than
    ``min_heldout`` items or a single class), ValueError when there is too little to fit."""
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
    old_cut = old.thresholds[-1] if old.thresholds else 0.5
    share = long_share if long_share is not None else fraction_at_or_above(old_train, old_cut)
    new_train = new.predict_proba(train_texts)
    new.thresholds = thresholds_for_fractions(new_train, [min(1.0, max(0.0, share))])
    held_texts = [it.text for it in held]
    old_s = np.array([old.score(t) for t in held_texts])
    new_s = new.predict_proba(held_texts)
    rep_old = evaluate_slice(old_s, labels, old_cut)
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
    if not accepted:
        raise RetrainRefused(reason, report)
    return new, report
