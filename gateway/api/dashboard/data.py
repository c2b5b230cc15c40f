"""The dashboard's one JSON document (``GET /dashboard/data``), polled by the page every ``dashboard.poll_s``.

Two sources, so that a poll costs the same at 150,000 events of the month as at 150:

- **Sums over the period** (spend, tokens, requests, errors, cache hits, refused — in total and per day, key, tier
  and tag; cache savings; shadow spend) come from the per-key, per-day usage cubes through
  :meth:`gateway.state.metering.Meter.grouped_parts`, read once per poll and grouped with
  :func:`gateway.ledger.export.group_sums`: the same rows as ``GET /v1/usage?group_by=…`` and
  ``thinkgate usage export --group-by`` for the same period, to the micro-USD. Shadow spend is the spend of the
  shadow runner's own key ``_shadow`` (:data:`gateway.control.shadow.SHADOW_KEY`: every shadow and judge call is
  metered under it, and nothing else is), as ``thinkgate usage report``'s ``shadow_spend_micro_usd``.
- **Figures that need each event** (the always-long counterfactual and the savings against it, routing mix by
  route reason, latency percentiles, error rate per tier) come from a bounded read: the most recent
  ``dashboard.window_events`` events of the period (:meth:`gateway.state.metering.Meter.recent`, one
  ``XREVRANGE … COUNT``), never the whole stream. ``window`` says what that read covered; ``window.complete`` is
  true when it holds every event of the period (then its figures are ``thinkgate usage report``'s), and the page
  labels these figures "last N events" otherwise.

Shape (money: integer micro-USD plus exact USD strings; latency in ms; times epoch seconds)::

    {"object": "dashboard.data", "redis": "ok", "since": s, "until": s | null, "generated": s,
     "total": {group row} | null, "spend": {"day": [...], "key": [...], "tier": [...], "tag": [...]},
     "savings": {"long_tier", "spend_micro_usd", "spend_usd", "cache_saved_micro_usd", "cache_saved_usd",
                 "shadow_spend_micro_usd", "shadow_spend_usd",
                 "shadow_requests"},                                                    # the whole period (cubes)
     "window": {"limit": N, "read": stream entries read (<= N), "events": events of the period among them,
                "complete": bool, "oldest": s | null, "newest": s | null,
                "savings": {report summary over the window: always_long_micro_usd, savings_micro_usd (served
                            traffic), savings_fraction, shadow_spend_micro_usd, net_savings_micro_usd, requests, …}},
     "routing": {"routed_tiers": [...], "thresholds": [...], "calibration": {...} | null,   # over the window
                 "tiers": [{"tier", "requests", "share", "target_share" | null, "reasons": {reason: n}}]},
     "budgets": [{"level", "period", "budget_usd", "spent_usd", "reserved_usd", "remaining_usd", "key_id"?}],
     "alerts": [alert, ...], "latency": [{"tier", "events", "p50_ms", "p99_ms", "ttft_p50_ms", "errors",
                                         "error_rate"}]}                                   # over the window

While Redis is unreachable the endpoint answers 503 ``{"object": "dashboard.data", "redis": "unreachable"}``
and the page says so instead of showing numbers.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gateway.api.usage import levels_view
from gateway.config import Settings
from gateway.control.retrain_trigger import read_history
from gateway.control.shadow import SHADOW_KEY
from gateway.ledger import report as rp
from gateway.ledger.event import UsageEvent, micro_to_usd
from gateway.ledger.export import group_sums, month_start
from gateway.pipeline.accounting import Accounting
from gateway.pipeline.routing import Routing
from router.stats import percentile

SPEND_GROUPS = ("day", "key", "tier", "tag")
ALERTS_SHOWN = 50
HISTORY_SHOWN = 20


def target_shares(routed: list[str], calibration: dict[str, Any] | None) -> dict[str, float] | None:
    """Share of routed requests per routed tier that the calibration achieved (``achieved_frac_at_or_above``
    of each cut point: tier i gets f[i-1] − f[i], with f[-1] = 1 and f[n] = 0); None without it."""
    fracs = (calibration or {}).get("achieved_frac_at_or_above")
    if not isinstance(fracs, list) or len(fracs) != len(routed) - 1:
        return None
    edges = [1.0, *(float(f) for f in fracs), 0.0]
    return {t: round(edges[i] - edges[i + 1], 6) for i, t in enumerate(routed)}


def routing_view(events: list[UsageEvent], settings: Settings, routing: Routing) -> dict[str, Any]:
    """Requests per tier (by route reason) against the target share: ``routing.target``'s (the cost-target
    controller's share for the top routed tier, the rest below it) when set, else the share the router file's
    calibrated cut points achieved (``target_source``: ``routing.target`` | ``calibration`` | None).

    ``share`` is over requests the router decided (route reason ``predicted``) — the population both targets
    describe; ``reasons`` counts every request (forced, effort, cache, …) on the tier."""
    routed = list(settings.routing.routed_tiers)
    svc = routing.service
    info = svc.info() if svc is not None else None
    calibration = info.get("calibration") if info is not None else None
    # a calibration describes the file's own cut points; thresholds set in the config make it moot
    in_force = info is not None and settings.routing.thresholds is None and routing.scorer is svc
    targets = target_shares(routed, calibration) if in_force else None
    source = "calibration" if targets else None
    ctrl = routing.controller
    if ctrl is not None:  # the controller moves the top cut point: the calibration's share no longer applies
        top = ctrl.target_share()
        targets, source = None, None
        if top is not None:
            targets = {routed[-1]: top, **({routed[0]: 1 - top} if len(routed) == 2 else {})}
            source = "routing.target"
    reasons: dict[str, dict[str, int]] = {}
    predicted: dict[str, int] = {}
    for ev in events:
        if ev.audit or not rp.counts_as_request(ev) or ev.tier is None:
            continue
        reasons.setdefault(ev.tier, {})
        reasons[ev.tier][ev.route_reason or "none"] = reasons[ev.tier].get(ev.route_reason or "none", 0) + 1
        if ev.route_reason == "predicted":
            predicted[ev.tier] = predicted.get(ev.tier, 0) + 1
    n_pred = sum(predicted.values())
    tiers = []
    for t in settings.tiers:
        tiers.append({"tier": t.name, "requests": sum(reasons.get(t.name, {}).values()),
                      "predicted": predicted.get(t.name, 0),
                      "share": (predicted.get(t.name, 0) / n_pred) if n_pred and t.name in routed else None,
                      "target_share": targets.get(t.name) if targets else None,
                      "reasons": reasons.get(t.name, {})})
    return {"routed_tiers": routed, "thresholds": routing.thresholds, "router": routing.scorer.name,
            "calibration": calibration if in_force else None, "target_source": source,
            "predicted_requests": n_pred, "tiers": tiers}


def latency_view(events: list[UsageEvent], settings: Settings) -> list[dict[str, Any]]:
    """Per tier: events (refusals excluded), p50/p99 latency and p50 TTFT of status-200 events (ms),
    errors (status ≥ 500) and their share of the events."""
    by: dict[str, list[UsageEvent]] = {}
    for ev in events:
        if not ev.audit and ev.tier is not None:
            by.setdefault(ev.tier, []).append(ev)
    order = [t.name for t in settings.tiers] + sorted(set(by) - {t.name for t in settings.tiers})
    out = []
    for name in order:
        evs = by.get(name, [])
        ok = [e.latency_ms for e in evs if e.status == 200]
        ttft = [e.ttft_ms for e in evs if e.status == 200 and e.ttft_ms is not None]
        errors = sum(1 for e in evs if e.status >= 500)
        out.append({"tier": name, "events": len(evs), "p50_ms": percentile(ok, 50), "p99_ms": percentile(ok, 99),
                    "ttft_p50_ms": percentile(ttft, 50), "errors": errors,
                    "error_rate": errors / len(evs) if evs else None})
    return out


async def budgets_view(acct: Accounting, now: float) -> list[dict[str, Any]]:
    """Every budgeted level with what remains: each metered key's own budgets (``level: key``, with
    ``key_id``), then each tag and the global level once (``GET /v1/usage``'s ``budgets`` entries)."""
    day = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")
    out: list[dict[str, Any]] = []
    shared: dict[tuple[str, str], dict[str, Any]] = {}
    for key_id in await acct.meter.key_ids():
        info = await acct.key_info(key_id)
        if info is None:
            continue
        for row in await levels_view(acct, info, day, now):
            if row["level"] == "key":
                out.append({"key_id": key_id, **row})
            else:
                shared.setdefault((row["level"], row["period"]), row)
    return out + [shared[k] for k in sorted(shared)]


async def collect(acct: Accounting, settings: Settings, routing: Routing, since: float | None,
                  until: float | None, now: float) -> dict[str, Any]:
    """The dashboard document for events in [since, until) (``since`` None = this UTC month; see the module doc
    for which figures are the period's and which the window's). Raises :class:`gateway.state.breaker.RedisDown`
    when Redis is unreachable."""
    since = month_start(now) if since is None else since
    usage = await acct.meter.grouped_parts(since, until, None, now)  # the cubes, read once for every grouping
    total = group_sums(usage.parts, [])
    spend = {g: group_sums(usage.parts, [g]) for g in SPEND_GROUPS}
    shadow = sum(r["cost_micro_usd"] for r in spend["key"] if r["key"] == SHADOW_KEY)
    shadow_requests = sum(r["requests"] for r in spend["key"] if r["key"] == SHADOW_KEY)
    limit = settings.dashboard.window_events
    events, read = await acct.meter.recent(limit, since, until)
    long_tier = rp.long_tier_of(settings)
    report = rp.build(events, long_tier, settings.tier(long_tier).prices, since=since, until=until)
    spent = total[0]["cost_micro_usd"] if total else 0
    saved = total[0]["saved_micro_usd"] if total else 0
    return {
        "object": "dashboard.data", "redis": "ok", "since": since, "until": until, "generated": now,
        "total": total[0] if total else None,
        "spend": spend,
        "savings": {"long_tier": long_tier,
                    "spend_micro_usd": spent, "spend_usd": str(micro_to_usd(spent)),
                    "cache_saved_micro_usd": saved, "cache_saved_usd": str(micro_to_usd(saved)),
                    "shadow_spend_micro_usd": shadow, "shadow_spend_usd": str(micro_to_usd(shadow)),
                    # the shadow and judge calls among total.requests (the page shows them apart)
                    "shadow_requests": shadow_requests},
        # fewer entries than asked for: the read reached the start of the period, so it holds all of it
        "window": {"limit": limit, "read": read, "events": len(events), "complete": read < limit,
                   "oldest": events[0].ts if events else None, "newest": events[-1].ts if events else None,
                   "savings": report.summary()},
        "routing": routing_view(events, settings, routing),
        "budgets": await budgets_view(acct, now),
        "alerts": await acct.alerts.recent(ALERTS_SHOWN),
        # automatic retraining's audit events (promote / keep / rollback), newest first
        "router_history": list(reversed(await read_history(acct.handle, acct.breaker, HISTORY_SHOWN))),
        "latency": latency_view(events, settings),
    }
