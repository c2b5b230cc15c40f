"""What ``model: auto`` serves, read from a router file's metadata (``metadata.serving``, written by
``thinkgate router fit --traces``): the scorer's thresholds, the cascade rule and its phrases, the guarantee.
Stdlib only (the gateway reads it on the request path's set-up).

``metadata.serving``::

    {"policy": "router" | "router+cascade" | "router+escalation" | "length" | "length+cascade"
               | "length+escalation" | "random" | "random+cascade" | "random+escalation" | "always_top",
     "scorer": "router" | "length" | "random", "thresholds": [...],
     "cascade": null | {"escalate_on": ["empty_answer", "length_in_thought", "abstain", "learned"?],
                        "rule": "router.abstention.abstains", "phrases": [...],
                        "models"?: {TIER: {"features", "mean", "scale", "coef", "intercept", "threshold"}}},
     "guarantee": {"floor": 0.98, "delta": 0.1, "confidence": 0.9, "n_calibration": 184, ...},
     "budgets"?: {"tier": TIER, "cuts": [c1, ...], "budgets": [b0, b1, ...], "guarantee": {...}}, ...}

``budgets`` (a dial model's router, ``thinkgate train dial-router``): on a routed request that lands on ``TIER``
(a ``budget_mode: prompted`` tier) the thinking budget is ``budgets[i]`` for the first ``i`` with ``score <
cuts[i]`` (else the last; ``null`` = unlimited), a step map non-decreasing in the score.

Files without the block (older trace routers, the shipped default) serve their thresholds and no cascade.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Cascade:
    """The cascade a router file serves: escalate a routed answer on these conditions, with these phrases."""

    escalate_on: tuple[str, ...]
    phrases: tuple[str, ...] | None
    #: per tier name: the answer-aware escalation model (``router.escalation``; with ``learned`` in escalate_on)
    models: dict[str, dict[str, Any]] | None = None


@dataclass(frozen=True)
class BudgetMap:
    """Router score → thinking budget (tokens; None = unlimited) on one tier: a monotone step map.

    ``cuts``: ascending scores in [0, 1], one fewer than ``budgets``; ``budgets``: non-decreasing, None last."""

    tier: str
    cuts: tuple[float, ...]
    budgets: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if len(self.budgets) != len(self.cuts) + 1 or list(self.cuts) != sorted(self.cuts):
            raise ValueError("a budget map needs ascending cuts and one more budget than cuts")
        finite = [b for b in self.budgets if b is not None]
        if finite != sorted(finite) or any(b < 0 for b in finite) or None in self.budgets[: len(finite)]:
            raise ValueError("budgets must be non-negative, non-decreasing in the score, unlimited (None) last")

    def budget(self, score: float) -> int | None:
        """The thinking budget for a router ``score``."""
        for cut, b in zip(self.cuts, self.budgets, strict=False):
            if score < cut:
                return b
        return self.budgets[-1]

    def to_dict(self) -> dict[str, Any]:
        """The ``metadata.serving.budgets`` block without its guarantee: ``{"tier", "cuts", "budgets"}``."""
        return {"tier": self.tier, "cuts": list(self.cuts), "budgets": list(self.budgets)}


def budget_map_of(meta: dict[str, Any] | None) -> BudgetMap | None:
    """The served score → budget map (None: the file routes to tiers only). Raises ValueError on a malformed
    block (a file that promises budgets it cannot serve must not load as if it had none)."""
    s = serving(meta)
    b = s.get("budgets") if s else None
    if not isinstance(b, dict):
        return None
    try:
        return BudgetMap(str(b["tier"]), tuple(float(c) for c in b["cuts"]),
                         tuple(None if x is None else int(x) for x in b["budgets"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"metadata.serving.budgets is malformed: {exc}") from None


def serving(meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """``metadata.serving`` when present and a dict, else None."""
    s = (meta or {}).get("serving")
    return s if isinstance(s, dict) else None


def cascade_of(meta: dict[str, Any] | None) -> Cascade | None:
    """The served cascade (None: the file serves no cascade)."""
    s = serving(meta)
    c = s.get("cascade") if s else None
    if not isinstance(c, dict):
        return None
    on = tuple(str(x) for x in c.get("escalate_on") or ())
    phrases = c.get("phrases")
    models = c.get("models")
    ms = {str(k): v for k, v in models.items() if isinstance(v, dict)} if isinstance(models, dict) else None
    return Cascade(on, tuple(str(p) for p in phrases) if isinstance(phrases, list) else None, ms or None) if on \
        else None


def guarantee_sentence(meta: dict[str, Any] | None) -> str | None:
    """One sentence: what the file promises and on how much evidence (None without ``metadata.serving``)."""
    s = serving(meta)
    if not s:
        return None
    g = s.get("guarantee") or {}
    floor, delta, n = g.get("floor"), g.get("delta"), g.get("n_calibration")
    if not isinstance(floor, int | float) or not isinstance(delta, int | float):
        return None
    how = "cross-fitted " if g.get("cross_fitted") else ""
    if s.get("policy") == "always_top":
        return (f"Does not route (always the top tier): on {n} {how}calibration questions no cheaper operating "
                f"point could be shown to keep {floor:.0%} of always-top accuracy with {1 - delta:.0%} confidence "
                "— too little evidence to promise savings.")
    share = g.get("calibration_token_share")
    tail = f" (calibration: {_token_change(share)})" if isinstance(share, int | float) else ""
    approx = " (approximate: cross-fitted scores)" if g.get("cross_fitted") else ""
    return (f"Serves {s.get('policy')} and keeps >= {floor:.0%} of always-top accuracy on unseen traffic from the "
            f"same distribution with {1 - delta:.0%} confidence{approx} (Learn-then-Test on {n} {how}calibration "
            f"questions){tail}.")


def thresholds_text(cuts: Sequence[float]) -> str:
    """Router cuts with what they mean when it is not a split: ``[0.0]`` is "always top" (every score at or above
    it), cuts of 1.0 or more send no question straight to the top (scores lie in [0, 1)) — printed bare, a served
    ``[1.0]`` beside an unserved ``[0.0]`` read as if the second were a cut of its own."""
    shown = f"[{', '.join(str(round(float(c), 6)) for c in cuts)}]"
    if cuts and all(c <= 0 for c in cuts):
        return f"{shown} = always top"
    if cuts and all(c >= 1 for c in cuts):
        return f"{shown} = none straight to the top"
    return shown


def certified_text(cert: dict[str, Any] | None, on: str = "calibration questions") -> str:
    """A Learn-then-Test result (``router.fit.risk.Certified.to_dict``, or a ``guarantee`` block) in words: the
    savings and accuracy it certified on ``n_calibration`` ``on``, or that it certified nothing (the point is then
    always top and saves nothing)."""
    cert = cert or {}
    share, acc = cert.get("calibration_token_share"), cert.get("calibration_accuracy_ratio")
    n = cert.get("n_calibration")
    if cert.get("pvalue") is None or not isinstance(share, int | float) or not isinstance(acc, int | float):
        return f"nothing certified on {n} {on}: 0% savings"
    return f"certified on {n} {on}: {_token_change(share)} at {acc:.1%} of always-top accuracy"


def _token_change(share: float) -> str:
    """``share`` (tokens / always-top's) in words: "40% fewer tokens", or "25% more tokens" above 1 — a file can
    carry such a share (fitted on a ladder that was not cheapest first), and a negative "fewer" reads as savings."""
    return f"{1 - share:.0%} fewer tokens" if share <= 1 else f"{share - 1:.0%} more tokens than always-top"


def budget_map_shape(cuts: Sequence[float], budgets: Sequence[int | None], unit: str = " tokens") -> str:
    """A score → thinking budget map in words: ``"score < 0.310: 32 tokens, else unlimited"``.

    ``cuts``: ascending score cuts, one fewer than ``budgets`` (budget in tokens; None: unlimited); ``unit``:
    the suffix after a number. Raises IndexError when ``budgets`` is empty."""

    def name(b: int | None) -> str:
        return "unlimited" if b is None else f"{b}{unit}"

    steps = ", ".join(f"score < {c:.3f}: {name(b)}" for c, b in zip(cuts, budgets, strict=False))
    return f"{steps}, else {name(budgets[-1])}" if cuts else f"{name(budgets[-1])} at every score"


def budget_sentence(meta: dict[str, Any] | None) -> str | None:
    """One sentence on the file's score → thinking budget map and its evidence (None without one)."""
    try:
        bmap = budget_map_of(meta)
    except ValueError:
        return None
    if bmap is None:
        return None

    shape = budget_map_shape(bmap.cuts, bmap.budgets)
    g = ((serving(meta) or {}).get("budgets") or {}).get("guarantee") or {}
    if g.get("certified"):
        why = (f"certified to keep >= {g.get('floor', 0):.0%} of the tier's own accuracy with "
               f"{g.get('confidence', 0):.0%} confidence on {g.get('n_calibration')} calibration problems")
    elif g:
        why = (f"no cheaper map could be certified on {g.get('n_calibration')} calibration problems, so the tier's "
               "own setting")
    else:
        why = "not calibrated"
    return f"routed requests on tier {bmap.tier!r} get a thinking budget by score: {shape} ({why})"


def cold_start_summary(meta: dict[str, Any] | None) -> str | None:
    """One sentence for the gateway's start log and ``/v1/models``: which shipped default it serves and what it
    was validated on (``metadata.cold_start``, written by ``thinkgate router cold-start``; None without it)."""
    cs = (meta or {}).get("cold_start")
    if not isinstance(cs, dict):
        return None
    what = "the learned router" if cs.get("choice") == "learned" else "prompt length (policy: length)"
    sets = [str(s) for s in cs.get("validated_on") or []]
    return (f"shipped default router: serves {what}; validated on {len(sets)} real outcome sets it was not fitted "
            f"on ({', '.join(sets)}): {cs.get('reason')}")


def embed_cuts(cuts: Sequence[float], n_tiers: int) -> list[float]:
    """A router file's ``cuts`` (ascending, 1 ≤ len ≤ ``n_tiers`` − 1) on a ladder of ``n_tiers`` routed tiers:
    they serve the top boundaries, and each boundary below them gets cut 0.0 — no score is below it, so nothing
    is routed to the tiers under the file's lowest cut (exploration and retraining can still reach them). A two-tier
    file on ``[none, short, long]`` keeps serving ``short`` / ``long`` at its cut; ``none`` waits for a retrained
    router with its own cut. Raises ValueError when there are no cuts or more than the ladder has boundaries."""
    need = n_tiers - 1
    if not cuts or len(cuts) > need:
        raise ValueError(f"{len(cuts)} cut(s) for {n_tiers} routed tiers (1 to {need} can be served)")
    return [0.0] * (need - len(cuts)) + [float(c) for c in cuts]

