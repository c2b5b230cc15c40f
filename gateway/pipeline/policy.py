"""What a key may ask of a tier: the tier's caps and the key's policy, applied after routing, before admission.

In order (the first failure answers; nothing is sent upstream):

1. **Allowed tiers** (``KeyConfig.allowed_tiers``): a request routed or forced to another tier is refused with
   403 ``tier_not_allowed`` naming the allowed tiers — or, with ``on_disallowed_tier: downgrade``, sent to the
   most capable allowed tier below the one asked for (route reason unchanged, header
   ``x-thinkgate-downgraded-from``); 403 when there is none below. Fallback and escalation never leave the
   allowed tiers.
2. **Choices**: ``n`` (and ``best_of``) above the tier's ``max_n`` → 400 naming the field.
3. **Completion cap**: ``max_tokens`` / ``max_completion_tokens`` above the tier's ``max_tokens`` is clamped to it
   (the upstream body does so), or refused (400 naming the field) for a key with ``over_cap: refuse``.
4. **Thinking range** (``TierConfig.thinking_budget_range``): a request's ``thinking_token_budget`` outside the
   budgets the tier's model follows is served at the nearest end of the range (``TierConfig.applied_budget``,
   wherever the budget is applied, so a fallback or escalation tier clamps into its own range) — or refused (400
   naming the range) for a key with ``over_cap: refuse``.
5. **Thinking cap** (``KeyConfig.max_thinking_budget``): a ``thinking_token_budget`` above it is clamped (or
   refused with ``over_cap: refuse``); without one the key's cap is sent as the request's budget, which a
   native-budget tier keeps when it is below the tier's own (``upstream_body.apply_budget``). A cap below a
   tier's ``thinking_budget_range`` is served at the range's minimum (the model would not follow less).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gateway.auth.keys import KeyInfo
from gateway.config import TierConfig
from gateway.errors import InvalidRequest, TierNotAllowed
from gateway.pipeline.routing import RouteDecision

DOWNGRADE_HEADER = "x-thinkgate-downgraded-from"


def allowed(key: KeyInfo, tiers: list[TierConfig]) -> list[TierConfig]:
    """``tiers`` filtered to those ``key`` may use (all of them when the key has no list)."""
    if key.allowed_tiers is None:
        return tiers
    return [t for t in tiers if t.name in key.allowed_tiers]


def check_tier(key: KeyInfo, route: RouteDecision, order: list[TierConfig]) -> tuple[RouteDecision, str | None]:
    """The route the key may take (``order``: every tier, cheapest first) and the tier it was downgraded from
    (None when not). Raises :class:`TierNotAllowed`."""
    if key.allowed_tiers is None or route.tier.name in key.allowed_tiers:
        return route, None
    names = [t.name for t in order]
    if key.on_disallowed_tier == "downgrade":
        below = [t for t in order[: names.index(route.tier.name)] if t.name in key.allowed_tiers]
        if below:
            return replace(route, tier=below[-1]), route.tier.name
    raise TierNotAllowed(f"key {key.id!r} may not use tier {route.tier.name!r}; allowed tiers: "
                         f"{[n for n in names if n in key.allowed_tiers]}", param="model")


def key_route(key: KeyInfo, route: RouteDecision, order: list[TierConfig]) -> RouteDecision:
    """The route as ``key`` may take it (:func:`check_tier`), carrying the key's allowed tiers (fallback and
    escalation stay inside them) and the tier it was downgraded from. Raises :class:`TierNotAllowed`."""
    route, downgraded = check_tier(key, route, order)
    allowed = frozenset(key.allowed_tiers) if key.allowed_tiers is not None else None
    return replace(route, allowed=allowed, downgraded_from=downgraded)


def outside_range(asked: Any, tier: TierConfig) -> bool:
    """Whether a request's ``thinking_token_budget`` ``asked`` would be served on ``tier`` at another budget than
    asked because it lies outside the tier's ``thinking_budget_range`` (0, thinking off, and a budget the tier's
    own smaller ``thinking_budget`` replaces anyway never do)."""
    r = tier.thinking_budget_range
    if r is None or not isinstance(asked, int) or isinstance(asked, bool) or asked <= 0:
        return False
    if tier.budget_mode == "off" or not tier.enable_thinking:
        return False
    if tier.thinking_budget is not None and asked >= tier.thinking_budget:
        return False  # the tier's own budget applies, and it lies in the range
    return not r[0] <= asked <= r[1]


def check_caps(key: KeyInfo, body: dict[str, Any], tier: TierConfig,
               budget_param: str = "thinking_token_budget") -> None:
    """Apply the tier's caps and the key's thinking cap to ``body`` in place (see the module doc);
    raises :class:`~gateway.errors.InvalidRequest` naming the field (``budget_param``: the name the client gave
    the thinking budget — ``thinking.budget_tokens`` on the Messages API)."""
    for name in ("n", "best_of"):
        v = body.get(name)
        if isinstance(v, int) and v > tier.max_n:
            raise InvalidRequest(f"'{name}' must be <= {tier.max_n} on tier {tier.name!r} (its max_n), got {v}",
                                 param=name)
    refuse = key.over_cap == "refuse"
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if refuse and isinstance(v, int) and v > tier.max_tokens:
            raise InvalidRequest(f"'{name}' must be <= {tier.max_tokens} on tier {tier.name!r} (its cap), got {v}",
                                 param=name)
    asked = body.get("thinking_token_budget")
    if refuse and outside_range(asked, tier):  # other keys are served at the nearest end of the range
        lo, hi = tier.thinking_budget_range or (0, 0)
        raise InvalidRequest(f"'{budget_param}' must be between {lo} and {hi} on tier {tier.name!r} (the thinking "
                             f"budgets its model follows: its thinking_budget_range), got {asked}",
                             param=budget_param)
    cap = key.max_thinking_budget
    if cap is None:
        return
    if isinstance(asked, int) and asked > cap:
        if refuse:
            raise InvalidRequest(f"'{budget_param}' must be <= {cap} for key {key.id!r}, got {asked}",
                                 param=budget_param)
        body["thinking_token_budget"] = cap
    elif asked is None and tier.enable_thinking and (tier.thinking_budget is None or tier.thinking_budget > cap):
        body["thinking_token_budget"] = cap
