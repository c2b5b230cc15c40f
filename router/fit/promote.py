"""Automatic retraining: fit a candidate router on the outcome stream, compare it with the router in service on
a held-back slice under the served-floor rule (the realised floor of a promoted router: :mod:`router.fit.realised`).
Pure (NumPy / scikit-learn); the gateway's trigger (``gateway/control/retrain_trigger.py``) runs it in its fit
process.

**Labels**: :func:`router.fit.retrain.items_from_outcomes` (cheap right → 0, cheap wrong → 1, top answers →
no label; with ``k`` ≥ 3 routed tiers one label per boundary, the rule in :mod:`router.fit.retrain`).

**The served-floor estimate on outcomes.** An outcome grades the tier that answered, never both tiers, so
"accuracy ≥ ``floor`` × always-top" is estimated, under one stated assumption — *nesting*: a question the cheap
tier gets right, the top tier gets right too. Then, with ``p_top`` (the top tier's graded accuracy) and
``p_cheap`` (the cheap tier's) from the feedback outcomes, a cheap-wrong window sent to the cheap tier costs
always-top a right answer with probability ``q = (p_top − p_cheap) / (1 − p_cheap)`` — taken conservatively, at
the upper 90% Wilson bound of ``p_top`` and the lower one of ``p_cheap`` (clipped to [0, 1]; 1 when either is
unknown: the strictest reading). Both rates must describe the same questions, so they come from a randomised arm
of the router in service only (:func:`boundary_rates`; ``comparison.rates.source``): its spot checks
(``routing.retrain.spot_check``: both tiers on the questions it sends cheap, :func:`spot_check_rates`), else its
explored answers (``routing.retrain.explore``: both tiers on the questions it sends up, :func:`explore_rates`),
``spot_check_min`` graded answers in each arm; else none (``q`` = 1). All feedback pooled (:func:`rates`) is
never used here: the top tier answered the questions routed up, the cheap tier those routed down, so ``q`` reads
near 0 once a router works — and promoted routers that sent everything cheap. On ``n`` labelled windows a policy
that sends ``k`` label-1 windows to the cheap tier loses ``q·k`` of always-top's ``p_top·n`` right answers::

    accuracy_ratio ≈ 1 − q·k / (p_top·n)        (the point estimate, reported)
    ratio_low       = 1 − q·k⁺ / (p_top·n)      holds_floor: ratio_low ≥ floor
    cheap_share     = share of the n windows sent to the cheap tier   (the savings tie-break)

where ``k⁺ = m · wilson(k/m, m)`` bounds the lost count: ``m`` windows sent cheap, the label-1 rate among them at
its upper Wilson bound (at the comparison's ``z``, *Looks* below; ``m`` = 0: ``k⁺`` = 0 — a policy sending
nothing cheap loses nothing). A slice of tens
of windows with 0 or 1 of them lost proves little (with the point count, ``thinkgate bench learn`` on o3-mini
ended 2 of 9 runs on promoted routers at 0.976 and 0.951 of always-top's accuracy on held-out questions). At
``q`` = 1 and ``k`` = 0 the bound is ``m·z²/(m + z²)`` (≤ ``z²`` windows).

**Comparison labels.** A shadow outcome judged by comparing the two answers (``agreement``, ``normalised``, an LLM
judge; :func:`router.fit.retrain.is_comparison`) labels 1 a *disagreement*, not a wrong cheap answer. Every window
the top tier gets right and the cheap one wrong is a disagreement (the normalised judge said "agree" on 0.1% of such
pairs in the traces: bench/RESULTS.md, "Shadow judges"), so a disagreement sent cheap loses always-top's answer with
probability ``P(top right, cheap wrong) / P(disagree) = q · P(cheap wrong) / P(disagree)`` — on the traces
0.17–0.20 where ``q`` read 0.12–0.17. A window labelled by comparisons only (:func:`compared_only`) therefore costs
``q_compared`` (:attr:`Rates.q_compared`): under nesting ``P(top right, cheap wrong) = p_top − p_cheap``, so
``(p_top⁺ − p_cheap⁻) / p_disagree⁻`` with the disagreement rate of the comparisons on the same arm as ``q``'s rates
(the router's own cheap answers with spot checks, its explored answers otherwise: :func:`comparison_verdicts`) at its
lower bound; never below ``q``, 1 while that arm has no comparisons; a window with any grade (feedback, verifier,
escalation) costs ``q``. The lost count is then a sum of per-window losses in [0, w] (w the larger of the two),
bounded as above after scaling by w. (Counted at ``q``, comparison labels under-read the loss by ``(1 − p_cheap) /
p_disagree``: latent while ``q``'s bound was loose, a broken floor for a deployment whose thousands of grades
tighten it.)

**Looks.** Automatic retraining compares every ``every_outcomes`` outcomes, and each comparison is one more chance
that a small slice or a randomised arm of thirty-odd grades reads lucky (``bench learn`` on o3-mini, at 90% per
comparison: the explored arm read the cheap tier right on 49% and the top on 27% of the same kind of question
after ~20 comparisons, ``q`` = 0, and a router sending everything cheap was promoted — 0.707 of always-top's
accuracy on the held-out questions). So the error is spent over the deployment's comparisons
(:func:`look_z`: ``delta`` = 0.1 in all, the ``i``-th at ``0.1 / (i (i + 1))``, half to each bound): both bounds
above use that ``z`` — 1.96 at the first comparison, 3.3 at the tenth. With ``q`` = 1 and nothing lost, a
candidate sending windows cheap then needs ~200 held-back windows at the first look; a router that sends
everything up holds at once (nothing sent cheap, nothing lost).

**Candidate**: fitted on the non-held-out windows (:func:`router.fit.retrain.is_heldout_digest`), its threshold
the highest cut (most cheap answers) whose estimate holds the floor on 5-fold out-of-fold scores of those
windows (none → the candidate routes everything up and is never better). **Better** (:func:`better`): on the
held-back windows the candidate holds the floor and either the router in service does not, or the candidate
sends a larger share to the cheap tier.

**k ≥ 3 routed tiers** (one score, cuts ``c_1 ≤ … ≤ c_{k-1}``; boundary ``b`` between ``tiers[b-1]`` and
``tiers[b]``). Each boundary is the two-tier problem above on the windows labelled there (``by_boundary``), with
its own rates — the explored answers on ``tiers[b-1]`` against the router's own on ``tiers[b]``
(:func:`explore_rates`; the spot checks compare the top tier with every tier below it, so they are read with two
tiers only). Under nesting the answers lost at the boundaries add up (a window sent to ``tiers[j]`` loses at
every boundary above ``j`` it was labelled 1), so each boundary gets an equal share of the budget:
``floor_b = 1 − (1 − floor)/(k − 1)``
(:func:`boundary_floor`; ``floor`` itself with two tiers), and the composed estimate is::

    accuracy_ratio ≈ 1 − Σ_b (1 − accuracy_ratio_b)     holds_floor: every boundary holds floor_b (⇒ ratio_low ≥ floor)
    cheap_share     = mean over the windows of (tiers below the top it is sent to) / (k − 1)

The candidate's score is fitted on the pooled label; each cut ``c_b`` is the highest (most windows below it) that
holds ``floor_b`` on the out-of-fold scores of the windows that speak to ``b`` (:func:`boundary_view`: those
labelled there, and those without evidence there that the cut sends below it, as lost; no labelled window: 0.0,
nothing crosses it downwards), then the cuts are made monotone by lowering a cut to the one above it (more windows
up: a boundary's estimate only improves). **Better** is the rule above on the composed estimates: the candidate
must hold every boundary on the held-back windows' estimate.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from router.fit.labels import LabelledItem
from router.fit.retrain import Tiers, cuts_of, is_heldout_digest, items_from_outcomes, score_histogram, tier_order
from router.model import ModelConfig, TrainedRouter
from router.persistence import save_router

FOLDS = 5
Z90 = 1.2816
DELTA = 0.1  # the error a deployment's automatic promotions spend in all (look_z)
SPOT_CHECK = "spot_check"  # route reason: a cheap decision the top tier served (``routing.retrain.spot_check``)
EXPLORE = "explore"  # route reason: a decision served one tier down at random (``routing.retrain.explore``)
PREDICTED = "predicted"  # route reason: the router's own decision, served as decided
#: The route reasons of the answers a router version served by its own decision: as decided, spot-checked, or
#: escalated by the cascade it serves. Not explored ones (a randomised arm), nor forced, effort, fallback, cache or
#: shadow answers: the client, the upstream's failure, the cache or the gateway chose those tiers, and their grades
#: say nothing of the router's floor. None: an outcome recorded without a route reason (written before outcomes
#: carried one, or by a tool), counted as the router's as it always was.
ROUTER_ANSWERS: frozenset[str | None] = frozenset({PREDICTED, SPOT_CHECK, "escalated", None})
#: The first attempts whose escalation is still the router's answer: its own decision (or an outcome written
#: before outcomes carried ``escalated_from``). A forced or explored tier the cascade escalated is not.
ROUTER_ESCALATIONS: frozenset[str | None] = frozenset({PREDICTED, None})


def is_router_answer(outcome: dict[str, Any]) -> bool:
    """Whether ``outcome`` grades an answer its router version chose (:data:`ROUTER_ANSWERS`; an escalated answer
    only when the escalated attempt was the router's own, :data:`ROUTER_ESCALATIONS`)."""
    reason = outcome.get("route_reason")
    if reason == "escalated":
        return outcome.get("escalated_from") in ROUTER_ESCALATIONS
    return reason in ROUTER_ANSWERS


@dataclass
class Rates:
    """Graded accuracies from feedback outcomes: ``p_top``, ``p_cheap`` (None: no grade) and the counts.
    ``source``: ``spot_check`` (:func:`spot_check_rates`: both tiers on the questions the router sends cheap),
    ``explore`` (:func:`explore_rates`: both tiers on the questions it sends up), ``none`` (no randomised arm yet:
    no rates, ``q`` = 1) or ``feedback`` (:func:`rates`: all graded answers — top answers on the questions routed
    up, cheap ones on those routed down; the realised floor's nesting fallback, never the promotion's)."""

    p_top: float | None
    p_cheap: float | None
    n_top: int
    n_cheap: int
    source: str = "feedback"
    #: the one-sided normal quantile of the bounds (:data:`Z90`; a promotion's look sets it: :func:`look_z`)
    z: float = Z90
    #: the share of answer comparisons that disagree, on the arm's cheap answers (:func:`comparison_verdicts`)
    p_disagree: float | None = None
    n_compared: int = 0

    @property
    def q(self) -> float:
        """P(top right | cheap wrong) under nesting (module doc), conservative: the upper Wilson bound (``z``) of
        ``p_top`` against the lower one of ``p_cheap`` (few grades → a large q → a cautious router); 1.0 when a
        rate is unknown."""
        bounds = self._bounds()
        if bounds is None or bounds[1] >= 1.0:
            return 1.0
        top, cheap = bounds
        return float(min(1.0, max(0.0, (top - cheap) / (1.0 - cheap))))

    def _bounds(self) -> tuple[float, float] | None:
        """(``p_top`` at its upper Wilson bound, ``p_cheap`` at its lower one), at ``z``; None when a rate is
        unknown."""
        if self.p_top is None or self.p_cheap is None:
            return None
        return (wilson(self.p_top, self.n_top, upper=True, z=self.z),
                wilson(self.p_cheap, self.n_cheap, upper=False, z=self.z))

    @property
    def q_compared(self) -> float:
        """P(top right, cheap wrong | the two answers disagree) — the loss behind a window labelled 1 by an answer
        comparison only (module doc, *Comparison labels*): under nesting ``(p_top − p_cheap) / p_disagree``, with
        ``p_top`` at its upper Wilson bound and ``p_cheap``, ``p_disagree`` at their lower ones (``z``); never below
        ``q``, at most 1; 1.0 when a rate is unknown (the strictest reading)."""
        q, bounds = self.q, self._bounds()
        if self.p_disagree is None or bounds is None or q >= 1.0:
            return 1.0
        d = wilson(self.p_disagree, self.n_compared, upper=False, z=self.z)
        if d <= 0.0:
            return 1.0
        top, cheap = bounds
        return float(min(1.0, max(q, (top - cheap) / d)))


def wilson(p: float, n: int, upper: bool, z: float = Z90) -> float:
    """The one-sided Wilson score bound (``z`` = 1.2816: 90%) of a proportion ``p`` observed on ``n``."""
    if n <= 0:
        return 1.0 if upper else 0.0
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return float(min(1.0, max(0.0, (centre + (half if upper else -half)) / (1 + z * z / n))))


def look_z(look: int | None, delta: float = DELTA) -> float:
    """The bounds' normal quantile at a deployment's ``look``-th promotion comparison (1, 2, …): every look is
    another chance to promote a router on a lucky slice, so the error ``delta`` is spent over all of them —
    ``delta_i = delta / (i (i + 1))`` (Σ = ``delta``), split between the two bounds a comparison reads (``q``'s
    rates and the lost count), each at ``1 − delta_i / 2``. Look 1: z 1.96; look 10: 3.32; look 100: 4.42. None
    (a comparison outside a deployment's sequence: a direct call): :data:`Z90`."""
    if look is None:
        return Z90
    i = max(1, int(look))
    return float(NormalDist().inv_cdf(1.0 - delta / (i * (i + 1)) / 2.0))


def rates(outcomes: Sequence[dict[str, Any]], top_tier: str, exclude: set[str] | None = None) -> Rates:
    """Graded accuracy per side from ``feedback`` outcomes (``sufficed`` = graded right); ``exclude``: request
    ids to leave out."""
    top = [bool(o["sufficed"]) for o in outcomes if o.get("source") == "feedback" and o.get("sufficed") is not None
           and o.get("tier") == top_tier and o.get("request_id") not in (exclude or set())]
    cheap = [bool(o["sufficed"]) for o in outcomes if o.get("source") == "feedback"
             and o.get("sufficed") is not None and o.get("tier") not in (None, top_tier)
             and o.get("request_id") not in (exclude or set())]
    return Rates(float(np.mean(top)) if top else None, float(np.mean(cheap)) if cheap else None, len(top), len(cheap))


def boundary_floor(floor: float, k: int) -> float:
    """Each boundary's share of the floor with ``k`` routed tiers (module doc): ``1 − (1 − floor)/(k − 1)``."""
    return floor if k <= 2 else 1.0 - (1.0 - floor) / (k - 1)


def graded_of(outcomes: Sequence[dict[str, Any]], version: str) -> list[dict[str, Any]]:
    """The ``feedback`` outcomes with a grade (``sufficed`` set) on answers router ``version`` served."""
    return [o for o in outcomes if o.get("source") == "feedback" and o.get("router_version") == version
            and o.get("sufficed") is not None]


def version_arms(outcomes: Sequence[dict[str, Any]], version: str, top_tier: str
                 ) -> tuple[list[bool], list[bool], list[bool]]:
    """The graded feedback on router ``version``'s own answers (route reason in :data:`ROUTER_ANSWERS`: explored,
    forced, effort, fallback and cached ones left out), as three lists of "graded right": (its cheap answers, its
    spot checks — top answers to questions it sent cheap —, its top answers)."""
    mine = [o for o in graded_of(outcomes, version) if is_router_answer(o)]
    checked = [bool(o["sufficed"]) for o in mine if o.get("route_reason") == SPOT_CHECK]
    cheap = [bool(o["sufficed"]) for o in mine if o.get("route_reason") != SPOT_CHECK and o.get("tier") != top_tier]
    top = [bool(o["sufficed"]) for o in mine if o.get("route_reason") != SPOT_CHECK and o.get("tier") == top_tier]
    return cheap, checked, top


def spot_check_rates(outcomes: Sequence[dict[str, Any]], version: str | None, top_tier: str,
                     minimum: int) -> Rates | None:
    """Both tiers' graded accuracy on the same questions — the ones router ``version`` sends cheap: its spot
    checks (the top tier's answers, route reason ``spot_check``) against its own cheap answers (explored ones left
    out). Where ``q`` from all feedback (:func:`rates`) compares the top tier on the hard questions with the cheap
    tier on the easy ones, and so reads near 0 once a router works, this ``q`` is nesting within one population.
    None with fewer than ``minimum`` graded spot checks (or no graded cheap answer) of ``version``."""
    if version is None:
        return None
    cheap, checked, _ = version_arms(outcomes, version, top_tier)
    if len(checked) < minimum or not cheap:
        return None
    return Rates(float(np.mean(checked)), float(np.mean(cheap)), len(checked), len(cheap), source=SPOT_CHECK)


@dataclass
class FloorEstimate:
    """A policy on labelled windows (module doc): estimated accuracy ratio (point), floor held (read at
    ``ratio_low``), cheap share, n, and ``ratio_low``: the ratio with the count of label-1 windows sent cheap at
    its upper bound (``k⁺`` at the rates' ``z``, module doc; 1.0 on no windows)."""

    accuracy_ratio: float
    holds_floor: bool
    cheap_share: float
    n: int
    ratio_low: float = 1.0


def estimate(up: np.ndarray, labels: np.ndarray, r: Rates, floor: float,
             compared: np.ndarray | None = None) -> FloorEstimate:
    """The served-floor estimate of a policy sending ``up`` (bool (n,)) to the top tier on windows with
    ``labels`` (int (n,), 1 = the cheap tier was not enough). ``compared`` (bool (n,), default none): the windows
    whose label comes from answer comparisons only — a label 1 there costs ``r.q_compared``, elsewhere ``r.q``."""
    n = int(labels.size)
    if n == 0:
        return FloorEstimate(1.0, True, 0.0, 0)
    lost = (labels == 1) & ~up
    loss_p = np.full(n, r.q) if compared is None else np.where(compared, r.q_compared, r.q)
    k_w = float(np.sum(loss_p[lost]))  # the expected answers lost: q per graded-wrong window sent cheap
    p_top = r.p_top if r.p_top else 1.0
    ratio = 1.0 - k_w / (p_top * n)
    # holds_floor reads the lost count at m × the upper Wilson bound of its rate among the m windows sent cheap,
    # not its point count: with few windows a point count of 0 or 1 let candidates through that broke the floor on
    # new questions (bench learn, o3-mini: 2 of 9 runs at 0.976 and 0.951 of always-top). Bounding the rate among
    # the cheap ones (not over all n) keeps a policy that sends nothing cheap at exactly no loss. With two loss
    # probabilities the count is scaled by the larger one (each window's loss in [0, w]) before the bound.
    m = int(np.sum(~up))
    w = float(np.max(loss_p[~up])) if m else 0.0
    k_up = w * m * wilson(k_w / (w * m), m, upper=True, z=r.z) if m and w > 0 else 0.0
    ratio_low = 1.0 - k_up / (p_top * n)
    return FloorEstimate(round(ratio, 6), bool(ratio_low >= floor - 1e-12), round(float(np.mean(~up)), 6), n,
                         round(ratio_low, 6))


def served_scores(router: TrainedRouter, texts: Sequence[str]) -> np.ndarray:
    """The scores the gateway serves with ``router`` (its fast path: learned, length or hash scorer)."""
    return np.array([router.score(t) for t in texts], dtype=np.float64)


def _fold(digest: str) -> int:
    return int.from_bytes(hashlib.sha256(f"thinkgate-promote-fold/{digest}".encode()).digest()[:4], "big") % FOLDS


def _fit(items: Sequence[LabelledItem]) -> TrainedRouter:
    from router.fit.fitter import fit_router

    router, _ = fit_router(list(items), ModelConfig(min_df=1), val_frac=0.0, platt_frac=0.15)
    return router


def oof_scores(items: Sequence[LabelledItem]) -> np.ndarray:
    """5-fold out-of-fold scores (folds by window digest); a fold whose training part has one class scores 0.5."""
    folds = np.array([_fold(it.group or it.id) for it in items])
    out = np.full(len(items), 0.5)
    for f in range(FOLDS):
        test = np.flatnonzero(folds == f)
        train = [items[i] for i in np.flatnonzero(folds != f)]
        if test.size == 0 or len({it.label for it in train}) < 2 or len(train) < 8:
            continue
        try:
            m = _fit(train)
        except ValueError:
            continue
        out[test] = m.predict_proba([items[i].text for i in test])
    return out


@dataclass
class Comparison:
    """What :func:`fit_candidate` found: counts, rates, both routers' estimates on the held-back slice."""

    n_outcomes: int
    n_items: int
    n_fit: int
    n_heldout: int
    rates: dict[str, Any]
    old: dict[str, Any] | None
    new: dict[str, Any] | None
    better: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def better(old: FloorEstimate, new: FloorEstimate) -> bool:
    """The promotion rule (module doc): the candidate holds the floor, and the router in service does not or
    sends a smaller share to the cheap tier."""
    return new.holds_floor and (not old.holds_floor or new.cheap_share > old.cheap_share)


def explore_rates(outcomes: Sequence[dict[str, Any]], version: str | None, lower: str, upper: str,
                  minimum: int) -> Rates | None:
    """Both tiers' graded accuracy on the same questions — the ones router ``version`` sends to ``upper``: its
    explored answers (served one tier down, on ``lower``, at random: route reason ``explore``) against its own
    answers on ``upper`` (route reason ``predicted``). Exploration splits those decisions at random, so the two arms
    are one population and ``q`` is nesting within it (as with spot checks, on the questions sent up rather than
    down). ``lower`` ``""``: any tier but ``upper`` (two tiers named by their top alone). None with fewer than
    ``minimum`` graded answers in either arm."""
    down, up = explore_arms(outcomes, version, lower, upper)
    if len(down) < minimum or len(up) < minimum:
        return None
    return Rates(float(np.mean(up)), float(np.mean(down)), len(up), len(down), source=EXPLORE)


def explore_arms(outcomes: Sequence[dict[str, Any]], version: str | None, lower: str, upper: str
                 ) -> tuple[list[bool], list[bool]]:
    """The two arms of :func:`explore_rates` as "graded right" lists: (explored answers on ``lower``, the router's
    own on ``upper``); both empty without a version."""
    if version is None:
        return [], []
    mine = graded_of(outcomes, version)
    down = [bool(o["sufficed"]) for o in mine if o.get("route_reason") == EXPLORE
            and (o.get("tier") == lower if lower else o.get("tier") not in (None, upper))]
    up = [bool(o["sufficed"]) for o in mine if o.get("route_reason") == PREDICTED and o.get("tier") == upper]
    return down, up


def boundary_rates(outcomes: Sequence[dict[str, Any]], order: Sequence[str], version: str | None,
                   spot_check_min: int, z: float = Z90) -> list[Rates]:
    """The rates behind each boundary's ``q`` (module doc), lowest boundary first, from a randomised arm of router
    ``version`` only: with two tiers its spot checks once it has ``spot_check_min`` of them graded, else its
    explored answers against its own on the tier above (:func:`explore_rates`, ``spot_check_min`` in each arm);
    neither → no rates (``q`` = 1, the strictest reading). Never :func:`rates` over all feedback: there the top tier
    answered the questions routed up and the cheap tier those routed down, so the cheap tier can read *better*
    than the top one and ``q`` 0 — every candidate then "holds the floor" sending everything cheap (seen in
    ``thinkgate bench learn`` on o3-mini: promoted at p_top 0.34 < p_cheap 0.55, 0.707 of always-top's accuracy
    on the held-out questions)."""
    out = []
    for b in range(1, len(order)):
        lower, upper = order[b - 1], order[b]
        spot = spot_check_rates(outcomes, version, upper, spot_check_min) if len(order) == 2 else None
        found = spot or explore_rates(outcomes, version, lower, upper, spot_check_min)
        if found is None:  # no rates yet; the explored arms' counts say how far they are from the minimum
            down, up = explore_arms(outcomes, version, lower, upper)
            found = Rates(None, None, len(up), len(down), source="none")
        verdicts = [] if found.source == "none" else comparison_verdicts(
            outcomes, version, "" if len(order) == 2 else lower, upper,
            PREDICTED if found.source == SPOT_CHECK else EXPLORE)
        out.append(replace(found, z=z, p_disagree=float(np.mean([not v for v in verdicts])) if verdicts else None,
                           n_compared=len(verdicts)))
    return out


def comparison_verdicts(outcomes: Sequence[dict[str, Any]], version: str | None, lower: str, upper: str,
                        reason: str) -> list[bool]:
    """The answer comparisons (shadow outcomes judged by comparing the answers,
    :func:`router.fit.retrain.is_comparison`; ``sufficed`` = they agree) of router ``version``'s cheap answers
    with route reason ``reason`` on ``lower`` (``""``: any tier but ``upper``) — the arm behind ``q``'s
    ``p_cheap``: its own cheap decisions (``predicted``) with spot checks, its explored answers (``explore``)
    otherwise. Behind :attr:`Rates.q_compared`."""
    from router.fit.retrain import is_comparison

    if version is None:
        return []
    return [bool(o["sufficed"]) for o in outcomes
            if is_comparison(o) and o.get("router_version") == version and o.get("route_reason") == reason
            and o.get("sufficed") is not None
            and (o.get("tier") == lower if lower else o.get("tier") not in (None, upper))]


def labels_at(items: Sequence[LabelledItem], b: int) -> tuple[np.ndarray, np.ndarray]:
    """(bool (n,): the items labelled at boundary ``b`` (1-based), int (n,): their label there, 0 elsewhere).
    An item without ``meta["by_boundary"]`` carries its pooled label at every boundary."""
    lab = [(it.meta.get("by_boundary") or [it.label] * b)[b - 1] for it in items]
    return (np.array([x is not None for x in lab], dtype=bool),
            np.array([0 if x is None else int(x) for x in lab], dtype=np.int64))


def compared_only(items: Sequence[LabelledItem]) -> np.ndarray:
    """bool (n,): the items whose every labelled outcome is an answer comparison (``meta["compared"]`` =
    ``meta["n"]``, :func:`router.fit.retrain.is_comparison`); items without those counts: False."""
    return np.array([int(it.meta.get("compared", 0)) >= int(it.meta.get("n", 0)) > 0 for it in items], dtype=bool)


def boundary_view(scores: np.ndarray, items: Sequence[LabelledItem], b: int, cut: float
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(up bool (m,), labels int (m,), compared bool (m,): :func:`compared_only`) of the windows that speak to
    boundary ``b`` at ``cut``: those labelled there,
    and — the strict reading — those with no evidence there that the cut sends below it, as label 1. With three
    tiers a window only ever answered on ``short`` (sufficed: 0 at short|long) says nothing about ``none``; sent
    to ``none`` by a low score it would otherwise cost nothing in the estimate (a new user's trial: a candidate
    sent such questions to ``none`` at an estimated 1.0, and all 18 of the next were graded wrong)."""
    mask, y = labels_at(items, b)
    unknown = ~mask & (scores < cut)
    use = mask | unknown
    return scores[use] >= cut, np.where(unknown, 1, y)[use], (compared_only(items) & ~unknown)[use]


def strict_cut(scores: np.ndarray, items: Sequence[LabelledItem], b: int, r: Rates, floor: float) -> float:
    """The highest cut (most windows below it, to the cheaper tier) whose estimate at boundary ``b`` holds
    ``floor`` on :func:`boundary_view` (0.0 = every window up when none does)."""
    cands = np.unique(np.concatenate([scores, [1.0 + 1e-9]]))
    for cut in cands[::-1]:  # from "everything cheap" down to "everything up"
        up, y, compared = boundary_view(scores, items, b, float(cut))
        if estimate(up, y, r, floor, compared).holds_floor:
            return float(min(1.0, cut))
    return 0.0


def fit_cuts(scores: np.ndarray, items: Sequence[LabelledItem], rs: Sequence[Rates], floor: float) -> list[float]:
    """One cut per boundary (``len(rs)`` of them, ascending, in score units [0, 1]): :func:`strict_cut` at the
    boundary's floor (none labelled there: 0.0), then each lowered to the one above it (module doc). ``scores``:
    float (n,) out-of-fold scores of ``items``; ``rs``: one :class:`Rates` per boundary, lowest first."""
    fb = boundary_floor(floor, len(rs) + 1)
    cuts = []
    for b, r in enumerate(rs, start=1):
        mask, _ = labels_at(items, b)
        cuts.append(strict_cut(scores, items, b, r, fb) if mask.any() else 0.0)
    for b in range(len(cuts) - 2, -1, -1):  # lowering a cut sends more windows up: its estimate only improves
        cuts[b] = min(cuts[b], cuts[b + 1])
    return cuts


def policy_estimate(scores: np.ndarray, items: Sequence[LabelledItem], cuts: Sequence[float], rs: Sequence[Rates],
                    floor: float) -> tuple[FloorEstimate, list[FloorEstimate]]:
    """The served-floor estimate of the cuts ``cuts`` on windows with ``scores`` (float (n,)): (composed, one per
    boundary) — module doc; with two tiers the composed one is the boundary's."""
    fb = boundary_floor(floor, len(cuts) + 1)
    per = []
    for b, (cut, r) in enumerate(zip(cuts, rs, strict=True), start=1):
        up, y, compared = boundary_view(scores, items, b, cut)
        per.append(estimate(up, y, r, fb, compared))
    if len(per) == 1:
        return per[0], per
    below_top = np.sum(scores[:, None] < np.asarray(cuts)[None, :], axis=1)  # boundaries not crossed
    ratio = 1.0 - sum(1.0 - e.accuracy_ratio for e in per)
    low = 1.0 - sum(1.0 - e.ratio_low for e in per)
    cheap = float(np.mean(below_top / len(cuts))) if scores.size else 0.0
    return FloorEstimate(round(ratio, 6), all(e.holds_floor for e in per), round(cheap, 6), int(scores.size),
                         round(low, 6)), per


def _report(overall: FloorEstimate, per: Sequence[FloorEstimate], order: Sequence[str],
            floor: float) -> dict[str, Any]:
    """An estimate as the audit event carries it: the composed one, plus each boundary's with k ≥ 3 tiers."""
    out = asdict(overall)
    if len(per) > 1:
        fb = round(boundary_floor(floor, len(order)), 6)
        out["boundaries"] = [{"tiers": [order[b], order[b + 1]], "floor": fb, **asdict(e)} for b, e in enumerate(per)]
    return out


def _rates_report(rs: Sequence[Rates], order: Sequence[str]) -> dict[str, Any]:
    if len(rs) == 1:
        return {**asdict(rs[0]), "q": round(rs[0].q, 6), "q_compared": round(rs[0].q_compared, 6)}
    sources = {r.source for r in rs}
    return {"source": sources.pop() if len(sources) == 1 else "mixed",
            "boundaries": [{"tiers": [order[b], order[b + 1]], **asdict(r), "q": round(r.q, 6),
                            "q_compared": round(r.q_compared, 6)} for b, r in enumerate(rs)]}


def fit_candidate(old: TrainedRouter, outcomes: Sequence[dict[str, Any]], tiers: Tiers, *, floor: float = 0.98,
                  heldout_frac: float = 0.2, min_heldout: int = 10, exclude: set[str] | None = None,
                  version: str | None = None, spot_check_min: int = 30,
                  look: int | None = None) -> tuple[TrainedRouter | None, Comparison]:
    """Fit a candidate on ``outcomes`` (dicts with the fields of ``gateway.ledger.outcome.Outcome``) and compare
    it with ``old`` (module doc). ``tiers``: the top tier's name (two tiers) or the routed tiers cheapest first.
    Returns (the candidate — ``len(tiers) − 1`` thresholds —, or None when none could be fitted or judged; the
    comparison — ``better`` says whether to promote). ``exclude``: request ids whose outcomes teach no label
    (explored answers are kept: they are the cheap answers to learn from; nothing is excluded by default). The
    rates behind ``q``: :func:`boundary_rates`. ``look``: this comparison's number among the deployment's
    automatic ones (1, 2, …; the bounds' confidence grows with it, :func:`look_z`); None: 90%, outside a sequence."""
    order = tier_order(tiers)
    obs = [o for o in outcomes if o.get("request_id") not in (exclude or set())]
    items = items_from_outcomes(obs, tiers)
    prev = old.metadata.get("version") or old.metadata.get("created_utc")
    z = look_z(look)
    rs = boundary_rates(outcomes, order, prev, spot_check_min, z=z)
    rd = {**_rates_report(rs, order), "look": look, "z": round(z, 4)}
    held = [it for it in items if is_heldout_digest(it.group or it.id, heldout_frac)]
    train = [it for it in items if not is_heldout_digest(it.group or it.id, heldout_frac)]
    y_train = np.array([it.label for it in train], dtype=np.int64)

    def cmp(old_e: dict[str, Any] | None, new_e: dict[str, Any] | None, ok: bool, why: str) -> Comparison:
        judged = rd if old_e is not None and new_e is not None else {**rd, "look": None}  # no comparison spent
        return Comparison(len(outcomes), len(items), len(train), len(held), judged, old_e, new_e, ok, why)

    if len(held) < min_heldout:
        return None, cmp(None, None, False, f"{len(held)} held-back labelled windows (< {min_heldout}): too few to "
                                            "judge a new router")
    if len(set(y_train.tolist())) < 2 or len(train) < 2 * FOLDS:
        return None, cmp(None, None, False, f"{len(train)} training windows with labels {sorted(set(y_train))}: "
                                            "both labels are needed to fit")
    cuts = fit_cuts(oof_scores(train), train, rs, floor)
    try:
        new = _fit(train)
    except ValueError as exc:
        return None, cmp(None, None, False, f"fit failed: {exc}")
    new.thresholds = cuts
    texts = [it.text for it in held]
    old_e, old_per = policy_estimate(served_scores(old, texts), held, cuts_of(old, len(order)), rs, floor)
    new_e, new_per = policy_estimate(new.predict_proba(texts), held, cuts, rs, floor)
    ok = better(old_e, new_e)
    why = ("promote: holds the floor and sends more to the cheap tier" if ok and old_e.holds_floor else
           "promote: holds the floor where the router in service does not" if ok else
           "keep: the candidate does not hold the floor on the held-back slice" if not new_e.holds_floor else
           "keep: the candidate sends no larger share to the cheap tier")
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    new_d = _report(new_e, new_per, order, floor)
    comparison = cmp(_report(old_e, old_per, order, floor), new_d, ok, why)
    new.metadata.update({
        "version": version or f"auto-{now}",
        "created_utc": now,
        "retrained_from": prev,
        "serving": {"policy": "router", "scorer": "router", "thresholds": [round(c, 6) for c in cuts],
                    "cascade": None, "guarantee": None,
                    "floor_estimate": {"floor": floor, "heldback": new_d,
                                       "assumption": "nesting (router/fit/promote.py)"}},
        "auto_retrain": comparison.to_dict(),
        # every labelled window (the drift alarm ignores a histogram of fewer than its min_samples scores)
        "score_histogram": score_histogram(new.predict_proba([it.text for it in (*train, *held)])),
    })
    return new, comparison


def fit_and_save(old: TrainedRouter, outcomes: Sequence[dict[str, Any]], tiers: Tiers, out_dir: str,
                 version: str, *, floor: float = 0.98, heldout_frac: float = 0.2, min_heldout: int = 10,
                 spot_check_min: int = 30, look: int | None = None
                 ) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
    """:func:`fit_candidate`, then — only when the candidate is better — write it to
    ``out_dir/router-<version>.skops`` (atomic, :func:`router.persistence.save_router`). The job automatic
    retraining runs in a child process (``gateway/control/retrain_trigger.py``): only paths and plain dicts come
    back, so the gateway neither unpickles nor serialises a fitted model on its event loop's GIL.

    Returns (the written path or None, the comparison as a dict, ``{"pid", "seconds"}``: the process that ran the
    job and its wall time, fit and save). Raises OSError when the file cannot be written."""
    t0 = time.perf_counter()
    new, cmp = fit_candidate(old, outcomes, tiers, floor=floor, heldout_frac=heldout_frac,
                             min_heldout=min_heldout, version=version, spot_check_min=spot_check_min, look=look)
    path = None
    if new is not None and cmp.better:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        path = str(save_router(new, Path(out_dir) / f"router-{version}.skops"))
    return path, cmp.to_dict(), {"pid": os.getpid(), "seconds": round(time.perf_counter() - t0, 3)}
