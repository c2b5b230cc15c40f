"""``GET /v1/usage`` and ``GET /metrics``.

``GET /v1/usage`` (any key; a key sees only itself, the admin key — and on embedded defaults the development key,
as on the dashboard — sees every key):

- no query → a summary from the counters: ``{"object": "usage.summary", "key_id", "day", "month",
  "counters": {"day": {...}, "month": {...}, "total": {...}}, "limits": {...}, "budgets": [...]}`` — counters
  are integers (tokens, micro-USD); budgets and what remains of them as exact USD strings. ``budgets`` has one
  entry per budget level that applies to the key (its own, each budgeted tag of it, global) and period:
  ``{"level": "key" | "tag:team=a" | "global", "period": "day" | "month", "budget_usd", "spent_usd",
  "reserved_usd" (requests in flight), "remaining_usd"}`` (remaining = budget − spent − reserved, ≥ 0; ``limits``'
  ``remaining_usd_day`` / ``_month`` are the key level's).
  The admin key without ``key_id`` gets ``{"object": "list", "data": [summary per key]}``.
- ``group_by`` (``key,tier,model,day,tag,tag:NAME``) and/or ``since`` / ``until`` → rows
  (``gateway/ledger/export.py``): ``{"object": "list", "group_by": [...], "data": [...]}``. ``since`` defaults to the
  start of the current UTC month. Grouped rows come from the per-key, per-day usage cubes the metering script
  keeps (:meth:`gateway.state.metering.Meter.grouped`: a month costs a few dozen hash reads, not a scan of the
  month's events), with the stream read only for sub-day edges of the period and days the cubes cannot answer;
  the rows are the scan's, to the micro-USD. Each stretch read from the stream is read by its stream-id range, and
  ``since`` is raised to the oldest retained day. A non-admin key's query that would need more than
  ``KEY_MAX_SCAN_S`` (two days) of the stream read, or a read that cannot stop at its end, is refused: 400
  ``usage_scan_too_large`` (give ``since``/``until`` as UTC days). Raw events (no ``group_by``) come from the
  stream by id range (from ``since``; up to ``until`` when given), at most ``limit`` (1 … ``MAX_RAW_EVENTS``, default
  1000) — the first ``limit`` events of the period in stream order, sorted by ``ts``; ``has_more`` (every list answer
  has it; always false for grouped rows) is true when the period holds more: narrow ``since``/``until``, or use
  ``group_by`` for totals. A non-admin key's raw read may span at most ``KEY_MAX_SCAN_S`` (400
  ``usage_scan_too_large`` beyond: it filters everyone's stream by key).
- ``key_id`` selects a key (admin only for other keys: 403 otherwise).
- A parameter that does not parse — ``since``/``until`` (see ``gateway/ledger/export.py``), ``group_by``, a
  ``limit`` outside 1 … ``MAX_RAW_EVENTS`` — or ``since`` not before ``until`` (an empty period, which
  ``thinkgate usage export`` refuses too) is a 400 ``invalid_request_error`` naming it in ``param``.

``GET /metrics``: Prometheus exposition, for the operator (``metrics.access``, default ``admin``: the admin key or
``metrics.scrape_key_sha256``'s key — any other key 403, none 401; scrape with ``authorization`` in the scrape
config). Its series carry the upstream replicas' URLs (internal hosts and ports), the tiers' upstream models and,
with ``metrics.key_id_label``, every key's id and spend: nothing a tenant's key should read.
While Redis is unreachable ``/v1/usage`` answers 503 (``usage_unavailable``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import time
from datetime import UTC, datetime
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.common import json_response as _json
from gateway.auth.keys import KeyInfo, KeyStore, bearer_secret, dev_key_only_admin
from gateway.config import Settings
from gateway.errors import InvalidRequest, NotFound, PermissionDenied, UsageUnavailable
from gateway.ledger.aggregate import ScanTooLarge
from gateway.ledger.event import micro_to_usd
from gateway.ledger.export import ExportError, build, month_start, parse_group_by, parse_time
from gateway.observability.metrics import CONTENT_TYPE
from gateway.pipeline.accounting import Accounting
from gateway.state.breaker import RedisDown
from gateway.state.limits import KeyLimits
from gateway.state.reservations import open_total

MAX_RAW_EVENTS = 10_000
#: How much of the event stream a non-admin key's grouped query may have read (seconds of stream time): the two
#: sub-day edges of any period fit; days the usage cubes cannot answer beyond that are the admin's to read.
KEY_MAX_SCAN_S = 2 * 86400.0




async def summary(acct: Accounting, key_id: str, key: KeyInfo | None, now: float) -> dict[str, Any]:
    """Counters of ``key_id`` for today, this month and all time, with its budgets (when known)."""
    dt = datetime.fromtimestamp(now, UTC)
    day, month = dt.strftime("%Y-%m-%d"), dt.strftime("%Y-%m")
    counters = {
        "day": await acct.meter.key_counters(key_id, day=day),
        "month": await acct.meter.key_counters(key_id, month=month),
        "total": await acct.meter.key_counters(key_id),
    }
    limits: dict[str, Any] = {}
    budgets = await levels_view(acct, key, day, now) if key is not None else []
    if key is not None:
        lim = KeyLimits.of(key)
        # what remains is the key level's entry of ``budgets`` (budget − spent − reserved): the same figure — it read
        # budget − spent here, more than admission would let the key spend while requests are in flight
        own = {b["period"]: b["remaining_usd"] for b in budgets if b["level"] == "key"}
        for period, budget in (("day", lim.budget_day_micro), ("month", lim.budget_month_micro)):
            limits[f"budget_usd_{period}"] = str(micro_to_usd(budget)) if budget is not None else None
            limits[f"remaining_usd_{period}"] = own.get(period) if budget is not None else None
        limits["rpm"], limits["tpm"] = lim.rpm, lim.tpm
    return {"object": "usage.summary", "key_id": key_id, "day": day, "month": month, "counters": counters,
            "limits": limits, "budgets": budgets}


async def levels_view(acct: Accounting, key: KeyInfo, day: str, now: float) -> list[dict[str, Any]]:
    """Every budget level of ``key`` and period with its budget, spend, reservations and what remains (USD)."""
    await acct.budgets.refresh()
    r, k = acct.handle.client, acct.meter.keys
    out: list[dict[str, Any]] = []
    for level in [KeyLimits.of(key).level, *acct.budgets.above_key(key.tags)]:
        if not level.budgeted:
            continue
        fields = await acct.breaker.call(functools.partial(r.hgetall, k.level_reservations(level.kind, level.name)))
        reserved = open_total(fields, int(now * 1000))
        for period, budget, counter in (("day", level.day_micro, k.level_day(level.kind, level.name, day)),
                                        ("month", level.month_micro, k.level_month(level.kind, level.name, day[:7]))):
            if budget is None:
                continue
            spent = int(await acct.breaker.call(functools.partial(r.hget, counter, "cost_micro_usd")) or 0)
            out.append({"level": "key" if level.kind == "key" else level.id, "period": period,
                        "budget_usd": str(micro_to_usd(budget)), "spent_usd": str(micro_to_usd(spent)),
                        "reserved_usd": str(micro_to_usd(reserved)),
                        "remaining_usd": str(micro_to_usd(max(0, budget - spent - reserved)))})
    return out


async def _may_scrape(settings: Settings, keys: KeyStore, authorization: str | None) -> None:
    """Return when ``authorization`` may read ``/metrics`` under ``metrics.access``; raise AuthError (401: no key,
    an unknown one) or PermissionDenied (403: a key that is not the operator's)."""
    cfg = settings.metrics
    if cfg.access == "open":
        return
    secret = bearer_secret(authorization)
    if secret is not None and cfg.scrape_key_sha256 and hmac.compare_digest(
            hashlib.sha256(secret.encode()).digest(), bytes.fromhex(cfg.scrape_key_sha256)):
        return
    key = await keys.authenticate(authorization)
    if cfg.access == "any_key" or key.is_admin or dev_key_only_admin(settings.auth, key.id):
        return
    raise PermissionDenied("/metrics is for the operator: send the admin key or the scrape key "
                           "(metrics.scrape_key_sha256); metrics.access: any_key opens it to every key")


async def _grouped(acct: Accounting, key: KeyInfo, group_by: list[str], since: float, until: float | None,
                   target: str | None, now: float) -> list[dict[str, Any]]:
    """Grouped rows (:meth:`gateway.state.metering.Meter.grouped`); a non-admin key's query is refused (400
    ``usage_scan_too_large``) when it would need more than ``KEY_MAX_SCAN_S`` of the event stream read."""
    # a key's own query may not make the gateway read much of everyone's stream (its sub-day edges fit)
    cap = None if key.is_admin else KEY_MAX_SCAN_S
    try:
        return (await acct.meter.grouped(group_by, since, until, target, now, cap)).rows
    except ScanTooLarge as exc:
        raise InvalidRequest(str(exc), param="since", code="usage_scan_too_large") from None


async def _raw(acct: Accounting, key: KeyInfo, since: float, until: float | None, target: str | None, limit: int,
               now: float) -> tuple[list[dict[str, Any]], bool]:
    """``(rows, has_more)``: raw event rows of ``[since, until)`` (of ``target``, or every key), the first ``limit``
    (1 … ``MAX_RAW_EVENTS``) in stream order, sorted by ``ts``; ``has_more`` when the period holds more. A non-admin
    key's read may span at most ``KEY_MAX_SCAN_S`` (400 ``usage_scan_too_large``)."""
    span = (now if until is None else until) - since
    if not key.is_admin and span > KEY_MAX_SCAN_S:
        # every raw read filters everyone's stream by key: a key with few events asking for a month made the
        # gateway read the month (seconds of CPU per call at 150,000 events)
        raise InvalidRequest(
            f"raw events (no group_by) of {span / 3600:.1f} h: a key may read at most {KEY_MAX_SCAN_S / 3600:.0f} h "
            "of events per query — give since/until at most that far apart, use group_by (answered from the daily "
            "usage cubes), or ask the admin", param="since", code="usage_scan_too_large")
    events = []
    async for event in acct.meter.events(since, until):
        if target is None or event.key_id == target:
            events.append(event)
            # one past the limit: whether the answer is the whole period (a cut list summed as a bill undercounts)
            if len(events) > limit:
                break
    rows, _ = build(events[:limit], [])
    return rows, len(events) > limit


def _query(q: Any) -> tuple[list[str], float | None, float | None, int]:
    """``(group_by, since, until, limit)`` of the query string ``q``; raises InvalidRequest (400, ``param`` naming
    the parameter) for one that does not parse, a ``limit`` outside 1 … ``MAX_RAW_EVENTS`` and an empty period."""
    parsed: dict[str, Any] = {}
    for name, parse in (("group_by", parse_group_by), ("since", parse_time), ("until", parse_time)):
        try:
            parsed[name] = parse(q.get(name))
        except ExportError as exc:
            raise InvalidRequest(str(exc), param=name, code="invalid_value") from None
    text = q.get("limit", "1000")
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_RAW_EVENTS:
        # 0 or a negative count answered one event, above the cap the cap's worth: neither what was asked
        raise InvalidRequest(f"limit must be an integer from 1 to {MAX_RAW_EVENTS}, not {text!r}", param="limit",
                             code="invalid_value")
    since, until = parsed["since"], parsed["until"]
    if since is not None and until is not None and since >= until:
        raise InvalidRequest("since must be before until (the period would be empty)", param="until",
                             code="invalid_value")
    return parsed["group_by"], since, until, limit


def install(app: Starlette, settings: Settings, keys: KeyStore, acct: Accounting) -> None:
    """Add ``GET /v1/usage`` and ``GET /metrics`` to ``app``."""

    async def usage(request: Request) -> Response:
        key = await keys.authenticate(request.headers.get("authorization"))
        if not key.is_admin and dev_key_only_admin(settings.auth, key.id):
            # the development key of embedded defaults is the operator's, as on the dashboard and /metrics: the
            # dashboard showed every key's spend to it while this answered 403 for the same figures
            key = dataclasses.replace(key, is_admin=True)
        q = request.query_params
        target = q.get("key_id") or None
        if target is not None and target != key.id and not key.is_admin:
            raise PermissionDenied("a key may only read its own usage (the admin key reads all)")
        if not key.is_admin:
            target = key.id
        group_by, since, until, limit = _query(q)
        now = time.time()
        try:
            if not group_by and since is None and until is None:
                if target is not None:
                    info = await acct.key_info(target)
                    view = await summary(acct, target, info, now)
                    if info is None and q.get("key_id") and not view["counters"]["total"].get("requests"):
                        # a typo'd id read as "no usage" (zeros, 200): say there is no such key
                        raise NotFound(f"no key {target!r} (in the config or the key store) and no usage "
                                       "recorded for it", param="key_id", code="key_not_found")
                    return _json(view)
                ids = await acct.meter.key_ids()
                return _json({"object": "list", "data": [await summary(acct, i, await acct.key_info(i), now)
                                                         for i in ids]})
            if since is None:
                since = month_start(now)
            if group_by:  # whole days from the per-day cubes, the stream only for what they cannot answer
                rows: list[dict[str, Any]] = await _grouped(acct, key, group_by, since, until, target, now)
                more = False
            else:
                rows, more = await _raw(acct, key, since, until, target, limit, now)
        except RedisDown:
            raise UsageUnavailable("usage store unreachable; retry later", headers={"retry-after": "5"}) from None
        return _json({"object": "list", "group_by": group_by, "since": since, "until": until, "data": rows,
                      "has_more": more})

    async def metrics(request: Request) -> Response:
        await _may_scrape(settings, keys, request.headers.get("authorization"))
        return Response(acct.render_metrics(), media_type=CONTENT_TYPE)

    app.router.add_route("/v1/usage", usage, methods=["GET"])
    app.router.add_route("/metrics", metrics, methods=["GET"])
