"""Pick the tier of a request: forced by header or model name, mapped from ``reasoning_effort``, or routed.

Precedence (first match wins):

1. header ``X-ThinkGate-Tier: <tier>``      → reason ``forced``
2. ``model: "<tier>"``                      → reason ``forced``
3. ``model: "auto"`` + ``reasoning_effort`` → ``routing.effort_tiers[effort]``, reason ``effort``
4. ``model: "auto"``                        → router score s ∈ [0, 1] over the routing window, then the first
   ``routed_tiers[i]`` with ``s < thresholds[i]`` (else the last routed tier), reason ``predicted``

``reasoning_effort`` with a forced tier keeps the forced tier (the explicit choice wins) and is passed on (to a tier
that does not think, ``enable_thinking: false``, only ``none``: ``gateway/pipeline/upstream_body.py``). Whatever
the model it is checked (:meth:`Routing.check_effort`, else 400 ``invalid_value``): under ``auto`` it must be one
of the efforts ``routing.effort_tiers`` maps (by default OpenAI's seven, ``none`` to ``max``), on a forced tier one
of those or of OpenAI's seven — a forced tier once sent any string on, so a typo was answered by the upstream (or
silently ignored) where ``auto`` refused it.
The scorer is the trained router file at ``routing.router_path`` (:class:`router.serving.RouterService`,
hot-reloaded; its calibrated thresholds apply unless ``routing.thresholds`` is set). When that file is
missing or fails to load: ``on_router_error: refuse_start`` → :class:`router.serving.RouterUnavailable`
at construction; ``default_tier`` → every ``auto`` request goes to ``routing.default_tier`` with reason
``fallback`` and no difficulty (see docs/router.md). ``router_path: null`` means "no learned router":
:class:`router.base.LengthBaselineRouter` (a length baseline) scores instead. A scorer can also be plugged
in with :meth:`Routing.set_scorer`. When the scorer raises, ``routing.default_tier`` is used (reason
``predicted``, difficulty None) and a warning is logged.

**The router file is the policy.** A file written by ``thinkgate router fit --traces`` carries what ``auto`` serves
(``metadata.serving``, :mod:`router.policy`): its thresholds (the certified operating point) and, when it serves
the cascade, the escalation conditions and abstention phrases. A ``predicted`` route then gets its tier with that
cascade (:meth:`Routing.auto_tier`), and so does each tier it escalates to (:meth:`Routing.next_tier`), so a
gateway configured with nothing but ``routing.router_path`` (and its tiers) serves exactly the file's policy.
Explicit settings override the file: ``routing.thresholds`` replaces its thresholds, and a tier whose
``escalate_on`` (or ``abstain_phrases``) is set in the config keeps its own (``escalate_on: []`` = never
escalate). Forced routes (``model: <tier>``, the header) never get the file's cascade.

**Routing to a budget.** A dial model's router file may carry a score → thinking budget map for one tier
(``metadata.serving.budgets``, :class:`router.policy.BudgetMap`, calibrated by ``thinkgate train dial-router``).
A ``predicted`` route that lands on that tier, when the tier is ``budget_mode: prompted``, is served with the
map's budget for its score as the tier's ``thinking_budget`` (None: unlimited); the response says it in
``x-thinkgate-thinking-budget``. A request's own smaller ``thinking_token_budget`` still wins
(:func:`gateway.thinking.dial.requested_budget`); forced routes keep the configured budget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.config import Settings, TierConfig
from gateway.config.routing import OPENAI_REASONING_EFFORTS
from gateway.control.target import TargetController
from gateway.errors import InvalidRequest, UnknownModel
from gateway.ledger.event import RouteReason
from router.base import LengthBaselineRouter, Router
from router.features import clip_text
from router.policy import BudgetMap, budget_map_of, cascade_of
from router.serving import RouterService
from router.window import routing_window

log = logging.getLogger("thinkgate.routing")

AUTO = "auto"


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where a request goes: the tier, why (:data:`~gateway.ledger.event.RouteReason`) and the router score;
    ``allowed``: the tier names the key may use (None = all; fallback and escalation stay inside them);
    ``downgraded_from``: the tier asked for when the key's policy downgraded the request; ``window``: the text the
    router scored."""

    tier: TierConfig
    reason: RouteReason
    difficulty: float | None = None
    allowed: frozenset[str] | None = None
    downgraded_from: str | None = None
    #: the routing window the router scored (``predicted`` routes only; outcomes keep its digest)
    window: str | None = None
    #: the request's own ``thinking_token_budget`` (tokens; None: it asked none) — what a ``prompted`` tier asks
    #: the model for when below the tier's (``x-thinkgate-thinking-budget``)
    asked_budget: int | None = None


def default_thresholds(n_tiers: int) -> list[float]:
    """Evenly spaced cut points for ``n_tiers`` routed tiers: [0.5] for two, [1/3, 2/3] for three."""
    return [i / n_tiers for i in range(1, n_tiers)]


class Routing:
    """Turns a request into a :class:`RouteDecision`. Thread-compatible; swap the scorer at run time."""

    def __init__(self, settings: Settings, scorer: Router | None = None) -> None:
        self._tiers = {t.name: t for t in settings.tiers}
        self._order = [t.name for t in settings.tiers]
        self.cfg = settings.routing
        #: the trained router file's handle (None with ``router_path: null`` or a plugged-in scorer)
        self.service: RouterService | None = None
        if scorer is None and self.cfg.router_path is not None:
            scorer = self.service = RouterService.from_config(self.cfg)  # raises RouterUnavailable (refuse_start)
        self._scorer: Router = scorer or LengthBaselineRouter()
        self._thresholds = list(self.cfg.thresholds or default_thresholds(len(self.cfg.routed_tiers)))
        #: the cost-target controller (``routing.target``; None = the calibrated thresholds apply)
        self.controller: TargetController | None = None
        #: called with (score, the tier index the router chose) of every routed decision (the drift alarm)
        self.observers: list[Callable[[float, int], None]] = []
        #: routed tier index -> the index served: exploration (``routing.retrain.explore``; a changed index is
        #: served with route reason ``explore``)
        self.explore: Callable[[int], int] | None = None
        #: () -> whether this decision below the top tier goes to the top tier instead: the control arm of the
        #: realised floor (``routing.retrain.spot_check``; route reason ``spot_check``)
        self.spot_check: Callable[[], bool] | None = None
        #: the router file's cascade applied to the tiers and its budget map (per loaded router: rebuilt after a
        #: reload)
        self._auto: tuple[object, dict[str, TierConfig], BudgetMap | None] | None = None
        #: (tier name, budget) -> the tier as served with the loaded map's budget (a few distinct budgets; emptied
        #: when another router file is loaded)
        self._budgeted: dict[tuple[str, int | None], TierConfig] = {}

    @property
    def scorer(self) -> Router:
        return self._scorer

    def _service_in_use(self) -> RouterService | None:
        return self.service if self.service is not None and self._scorer is self.service else None

    def set_scorer(self, scorer: Router, thresholds: list[float] | None = None) -> None:
        """Plug in a router (e.g. the trained one, or a reloaded file). ``thresholds`` override the config's
        when given (a router file's calibrated cut points); they must be ascending, len(routed_tiers) - 1."""
        if thresholds is not None:
            if len(thresholds) != len(self.cfg.routed_tiers) - 1 or thresholds != sorted(thresholds):
                raise ValueError("thresholds must be ascending with len(routed_tiers) - 1 values")
            if self.cfg.thresholds is None:
                self._thresholds = list(thresholds)
        self._scorer = scorer

    def attach_controller(self, controller: TargetController) -> None:
        """Let ``controller`` move the top cut point (it sees every routed score); see routing_target.py."""
        self.controller = controller

    @property
    def base_thresholds(self) -> list[float]:
        """The calibrated (router file) or configured cut points, before the cost-target controller."""
        svc = self._service_in_use()
        if svc is not None and svc.available:
            return svc.thresholds  # read per call: a reloaded file brings its own cut points
        return list(self._thresholds)

    @property
    def thresholds(self) -> list[float]:
        """The cut points in force: :attr:`base_thresholds`, the top one moved by the controller when on."""
        base = self.base_thresholds
        return base if self.controller is None else self.controller.thresholds(base)

    def _auto_tiers(self) -> dict[str, TierConfig]:
        """Tier name → the tier as ``auto`` serves it: with the router file's cascade where the file serves one
        and the tier's config does not set its own (module doc). Cached per loaded router."""
        return self._auto_policy()[0]

    def _auto_policy(self) -> tuple[dict[str, TierConfig], BudgetMap | None]:
        """(:meth:`_auto_tiers`, the file's budget map when it applies to a ``prompted`` routed tier)."""
        svc = self._service_in_use()
        router = svc.router if svc is not None and svc.available else None
        if router is None:
            return self._tiers, None
        cached = self._auto
        if cached is not None and cached[0] is router:
            return cached[1], cached[2]
        bmap = budget_map_of(router.metadata)
        if bmap is not None and (bmap.tier not in self.cfg.routed_tiers
                                 or self._tiers[bmap.tier].budget_mode != "prompted"):
            log.warning("router file's budget map is for tier %r, which is not a routed prompted tier: ignored",
                        bmap.tier)
            bmap = None
        self._budgeted.clear()
        cascade = cascade_of(router.metadata)
        out = dict(self._tiers)
        if cascade is not None:
            routed = self.cfg.routed_tiers
            # escalation models by tier name (the ladder's settings) when any name matches, else by position in
            # the file's ``tiers`` (cheapest first) when the counts match
            models = cascade.models or {}
            order = [str(x) for x in router.metadata.get("tiers") or () if str(x) in models]
            by_name = any(n in models for n in routed[:-1])
            by_position = [models[x] for x in order] if not by_name and len(order) == len(routed) - 1 else []
            for i, name in enumerate(routed[:-1]):  # the top routed tier has nowhere to escalate to
                t = self._tiers[name]
                update: dict[str, Any] = {}
                model = models.get(name) or (by_position[i] if by_position else None)
                if "escalate_on" not in t.model_fields_set:
                    update["escalate_on"] = [c for c in cascade.escalate_on if c != "low_confidence"
                                             and (c != "learned" or model is not None)]
                    if model is not None and "escalation_model" not in t.model_fields_set:
                        update["escalation_model"] = model
                if "abstain_phrases" not in t.model_fields_set and cascade.phrases is not None:
                    update["abstain_phrases"] = list(cascade.phrases)
                if update:
                    out[name] = t.model_copy(update=update)
        self._auto = (router, out, bmap)
        return out, bmap

    def _with_budget(self, tier: TierConfig, score: float, bmap: BudgetMap | None) -> TierConfig:
        """``tier`` with the budget map's thinking budget for ``score`` (unchanged off the map's tier)."""
        if bmap is None or tier.name != bmap.tier:
            return tier
        budget = bmap.budget(score)
        key = (tier.name, budget)
        out = self._budgeted.get(key)
        if out is None:
            out = self._budgeted[key] = tier.model_copy(update={"thinking_budget": budget})
        return out

    def auto_tier(self, name: str) -> TierConfig:
        """Tier ``name`` as a ``predicted`` route serves it (with the router file's cascade, module doc)."""
        return self._auto_tiers()[name]

    def next_tier(self, tier: TierConfig) -> TierConfig | None:
        """The chat tier after ``tier`` in configuration order (None for the last; embedding tiers skipped). A
        tier that came from :meth:`auto_tier` is followed by the next one as ``auto`` serves it, so the file's
        cascade continues up the ladder; a configured tier by the configured one."""
        i = self._order.index(tier.name)
        nxt = next((n for n in self._order[i + 1:] if not self._tiers[n].embeddings), None)
        if nxt is None:
            return None
        if tier is not self._tiers.get(tier.name):
            return self._auto_tiers()[nxt]
        return self._tiers[nxt]

    def fallbacks(self, tier: TierConfig, allowed: frozenset[str] | None = None) -> list[TierConfig]:
        """Tiers after ``tier`` in configuration order (cheapest → most capable), when fallback is enabled;
        only those in ``allowed`` when given (a key's allowed tiers).

        Only later tiers: falling back to a cheaper tier would silently lower answer quality; and only tiers of
        the same kind (an ``embeddings: true`` tier is never a chat tier's fallback, nor the other way round).
        """
        if not self.cfg.fallback:
            return []
        i = self._order.index(tier.name)
        return [self._tiers[n] for n in self._order[i + 1 :] if (allowed is None or n in allowed)
                and self._tiers[n].embeddings == tier.embeddings]  # a chat request never lands on an embedding tier

    def check_effort(self, body: dict[str, Any], forced: bool) -> str | None:
        """The request's ``reasoning_effort`` (None when not given), checked whatever the model: under ``auto`` one
        of ``routing.effort_tiers``'s keys (the efforts it can route); on a named (``forced``) tier also any of
        OpenAI's values (:data:`~gateway.config.routing.OPENAI_REASONING_EFFORTS`, passed on as sent — an operator's
        narrowed map must not refuse what the tier's model reads). Else InvalidRequest (400 ``invalid_value``,
        ``param: reasoning_effort``)."""
        effort = body.get("reasoning_effort")
        if effort is None:
            return None
        allowed = set(self.cfg.effort_tiers) | (set(OPENAI_REASONING_EFFORTS) if forced else set())
        if not isinstance(effort, str) or effort not in allowed:
            raise InvalidRequest(f"reasoning_effort {effort!r} is not one of {sorted(allowed)}",
                                 param="reasoning_effort", code="invalid_value")
        return effort

    def decide(self, body: dict[str, Any], forced_header: str | None, window_text: str | None = None) -> RouteDecision:
        """Route one request body. Raises UnknownModel (404) for an unknown model/header tier and
        InvalidRequest (400) for an unknown ``reasoning_effort`` (:meth:`check_effort`, forced tiers included)."""
        effort = self.check_effort(body, forced=bool(forced_header) or body.get("model") != AUTO)
        asked = body.get("thinking_token_budget")  # kept on the decision for x-thinkgate-thinking-budget
        if not isinstance(asked, int) or isinstance(asked, bool) or asked < 0:
            asked = None
        if forced_header:
            t = self._tiers.get(forced_header.strip())
            if t is None:
                raise UnknownModel(
                    f"X-ThinkGate-Tier: unknown tier {forced_header!r} (tiers: {self._order})", param="model"
                )
            return RouteDecision(t, "forced", asked_budget=asked)
        model = body.get("model")
        if model != AUTO:
            t = self._tiers.get(model)  # type: ignore[arg-type]
            if t is None:
                raise UnknownModel(
                    f"model {model!r} does not exist; use 'auto' or one of {self._order}", param="model"
                )
            return RouteDecision(t, "forced", asked_budget=asked)
        if effort is not None:
            return RouteDecision(self._tiers[self.cfg.effort_tiers[effort]], "effort", asked_budget=asked)
        svc = self._service_in_use()
        if svc is not None and not svc.available:  # no usable router file: on_router_error = default_tier
            return RouteDecision(self._tiers[self.cfg.default_tier], "fallback", None, asked_budget=asked)
        text = window_text if window_text is not None else self._window_of(body)
        try:
            score = float(self._scorer.score(text))
        except Exception:
            log.warning("router %s failed; using default tier %s", self._scorer.name, self.cfg.default_tier,
                        exc_info=True)
            return RouteDecision(self._tiers[self.cfg.default_tier], "predicted", None, asked_budget=asked)
        score = min(1.0, max(0.0, score))
        routed = self.cfg.routed_tiers
        cuts = self.thresholds
        i = next((i for i, cut in enumerate(cuts) if score < cut), len(routed) - 1)
        reason: RouteReason = "predicted"
        chosen = i  # the router's own choice, before exploration or a spot check moves the request
        if self.explore is not None:
            j = self.explore(i)
            if j != i:
                i, reason = j, "explore"
        if reason == "predicted" and self.spot_check is not None and i < len(routed) - 1 and self.spot_check():
            i, reason = len(routed) - 1, "spot_check"
        if self.controller is not None:
            self.controller.record(score, i)
        for observe in self.observers:
            observe(score, chosen)
        tiers, bmap = self._auto_policy()
        return RouteDecision(self._with_budget(tiers[routed[i]], score, bmap), reason, score, window=text,
                             asked_budget=asked)

    def _window_of(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if isinstance(messages, list):
            return routing_window(messages)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return clip_text(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            return clip_text(str(prompt[-1]))
        return ""
