"""The realised floor of a router in service: from the feedback on the answers it served, is its accuracy still
≥ ``floor`` × what always-top would have scored on the same traffic? Pure Python (the gateway's retraining
trigger runs it on the outcome stream; ``gateway/control/retrain_trigger.py``).

Three estimates, all on one router version's ``feedback`` outcomes (graded answers; explored ones are not the
router's answers — only the explore estimate's ``q`` reads them), assuming the graded answers are a random sample of
the answered requests:

**spot check** (unbiased; ``routing.retrain.spot_check`` > 0). A random share ``spot_check`` of the requests the
router sends below the top tier is served by the top tier instead (route reason ``spot_check``): the control arm.
With the graded answers split in three — the router's cheap answers (``n_c``, right ``k_c``), the spot-check answers
(top answers to questions the router would have sent cheap: ``n_s``, ``k_s``) and the router's top answers
(``n_t``, ``k_t``)::

    share  = (n_c + n_s) / (n_c + n_s + n_t)        share of traffic the router sends below the top tier
    a_c    = k_c / n_c      a_s = k_s / n_s      a_t = k_t / n_t
    top    = share · a_s + (1 − share) · a_t        always-top accuracy on this traffic
    ratio  = 1 − share · (a_s − a_c) / top          served accuracy / always-top accuracy

Nothing is assumed about which questions each tier gets right: ``a_s`` is the top tier measured on the very
questions the router sends cheap. ``ratio_low`` is a conservative reading (the one-sided 90% Wilson bounds: ``a_s``
high, ``a_c`` low); the rollback rule reads the point estimate.

**nesting** (biased; the fallback without enough spot-check answers). :func:`router.fit.promote.rates` over all
feedback, under the assumption that a question the cheap tier gets right the top tier gets right too: a cheap-wrong
answer cost always-top a right one with probability ``q = (p_top − p_cheap) / (1 − p_cheap)``. It is biased
optimistic exactly when it matters: once a router sends the easy questions cheap, the cheap tier's graded accuracy
rises and the top tier's falls (it answers the hard ones), ``q`` shrinks towards 0 and a real loss reads as none
(``python -m bench.realised_floor`` measures the bias on the recorded traces).

**explore** (between the two; ``routing.retrain.explore`` > 0, without enough spot checks): the nesting formula
with ``q`` and ``p_top`` from the router's explored answers against its own top answers
(:func:`router.fit.promote.explore_rates`, ``spot_check_min`` graded answers in each arm): both tiers on the same
questions — the ones the router sends *up*, which are harder than those it sends cheap, so ``q`` is read high and
``p_top`` low: a reading that errs towards rolling back, where the pooled nesting one errs towards keeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.fit.promote import EXPLORE, SPOT_CHECK, explore_rates, is_router_answer, rates, version_arms, wilson

__all__ = ["EXPLORE", "SPOT_CHECK", "realised", "spot_check_ratio"]


def spot_check_ratio(n_c: int, k_c: int, n_s: int, k_s: int, n_t: int, k_t: int) -> tuple[float, float]:
    """(point estimate, conservative reading) of served accuracy / always-top accuracy from the three arms'
    counts (module doc). Raises ValueError when ``n_c`` or ``n_s`` is 0 (no estimate without both arms)."""
    if n_c <= 0 or n_s <= 0:
        raise ValueError("the spot-check estimate needs graded cheap answers and graded spot-check answers")
    share = (n_c + n_s) / (n_c + n_s + n_t)
    a_t = k_t / n_t if n_t else 0.0

    def ratio(a_s: float, a_c: float) -> float:
        top = share * a_s + (1.0 - share) * a_t
        if top <= 0.0:
            return 1.0  # always-top gets nothing right here: there is nothing to lose
        return 1.0 - share * (a_s - a_c) / top

    return (ratio(k_s / n_s, k_c / n_c),
            ratio(wilson(k_s / n_s, n_s, upper=True), wilson(k_c / n_c, n_c, upper=False)))


def realised(outcomes: Sequence[dict[str, Any]], version: str, top_tier: str, floor: float,
             spot_check_min: int = 30) -> dict[str, Any]:
    """The realised floor of router ``version`` (module doc) from ``outcomes`` (dicts with the fields of
    ``gateway.ledger.outcome.Outcome``); only the router's own answers count (route reason in
    :data:`~router.fit.promote.ROUTER_ANSWERS`: explored, forced, effort, fallback and cached ones are not its
    choice, nor an escalation of one of those, :func:`~router.fit.promote.is_router_answer`). The spot-check
    estimate when at least ``spot_check_min`` spot-check answers of ``version`` are graded, else the explore
    estimate when both explored arms have that many, else the nesting estimate. Ratios are dimensionless (served
    accuracy over always-top accuracy on the same traffic).

    Returns ``{"method": "spot_check" | "explore" | "nesting", "n", "n_cheap", "n_spot_check", "n_top",
    "accuracy_ratio", "ratio_low", "holds_floor"}`` (``accuracy_ratio`` and ``holds_floor`` None without graded
    answers: not measured, which is neither a held nor a broken floor; ``holds_floor`` reads the point estimate;
    the explore and nesting estimates add ``q``)."""
    cheap, checked, top = version_arms(outcomes, version, top_tier)
    n = len(cheap) + len(checked) + len(top)
    out: dict[str, Any] = {"n": n, "n_cheap": len(cheap), "n_spot_check": len(checked), "n_top": len(top)}
    if not n:
        return {**out, "method": "nesting", "accuracy_ratio": None, "ratio_low": None, "holds_floor": None}
    if len(checked) >= spot_check_min and cheap:
        point, low = spot_check_ratio(len(cheap), sum(cheap), len(checked), sum(checked), len(top), sum(top))
        return {**out, "method": "spot_check", "accuracy_ratio": round(point, 6), "ratio_low": round(low, 6),
                "holds_floor": bool(point >= floor - 1e-12)}
    explored = explore_rates(outcomes, version, "", top_tier, spot_check_min)
    r = explored or rates([o for o in outcomes if is_router_answer(o)], top_tier)
    p_top = r.p_top if r.p_top else 1.0
    cheap_wrong = len(cheap) - sum(cheap)
    # a ratio of two accuracies is ≥ 0: the formula's loss can pass 1 when p_top is read low on few answers
    ratio = max(0.0, 1.0 - r.q * cheap_wrong / (p_top * n))
    return {**out, "method": "explore" if explored else "nesting", "accuracy_ratio": round(ratio, 6),
            "ratio_low": round(ratio, 6), "holds_floor": bool(ratio >= floor - 1e-12), "q": round(r.q, 6)}
