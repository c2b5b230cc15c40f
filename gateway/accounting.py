"""The request path's one seam to the shared-state services: limits, cache, metering, alerts, metrics.

:class:`Accounting` owns the Redis client, its circuit breaker, and one of each service; the proxy calls

- :meth:`admit` before the upstream call (429 ``budget_exceeded`` / ``rate_limit_exceeded``, or 503),
- :meth:`cache_begin` / :meth:`cache_finish` around it (``gateway/cache.py``),
- :meth:`sink` with every finished :class:`~gateway.usage_record.UsageRecord` (a usage sink): it converts the
  record to a :class:`~gateway.usage.UsageEvent` (``event_id`` = the request id = the budget reservation
  id), counts it in the Prometheus metrics at once, and writes it to Redis in a background task (metering
  → settle the reservation → alerts). :meth:`flush` waits for those writes; :meth:`close` flushes, stops
  the spool replayer and closes the client.
- :meth:`abandon` for a request that ends with neither a record nor an error response (a bug, or a
  cancellation): it is metered with status 499/500 so its reservation is settled at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import httpx

from gateway.alerts import Alerts
from gateway.auth import KeyInfo
from gateway.breaker import Breaker
from gateway.cache import CacheEntry, ResponseCache, Ticket
from gateway.cache_policy import cache_key, decide, tenant_scope
from gateway.config import Settings, TierConfig
from gateway.errors import GatewayError
from gateway.keystore import RedisKeyStore
from gateway.limits import Admission, Estimate, KeyLimits, Limits, estimate
from gateway.metering import Meter
from gateway.metrics import Metrics
from gateway.redis_client import RedisHandle, connect
from gateway.spool import Spool
from gateway.usage import UsageEvent
from gateway.usage_record import UsageRecord

log = logging.getLogger("thinkgate.accounting")

KNOWN_KEYS_MAX = 100_000


def event_of(record: UsageRecord) -> UsageEvent:
    """The usage event of a finished record (same field names; ``event_id`` = ``request_id``)."""
    return UsageEvent(
        key_id=record.key_id or "anonymous",
        requested_model=str(record.requested_model or ""),
        event_id=record.request_id,
        ts=record.ts,
        tags=dict(record.tags),
        request_id=record.request_id,
        endpoint=record.endpoint,
        tier=record.tier,
        upstream_model=record.upstream_model,
        route_reason=record.route_reason,
        difficulty=record.difficulty,
        prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens,
        completion_tokens=record.completion_tokens,
        reasoning_tokens=record.reasoning_tokens,
        cached=record.cached,
        cost_micro_usd=record.cost_micro_usd,
        saved_micro_usd=record.saved_micro_usd,
        latency_ms=round(record.latency_ms, 3),
        ttft_ms=round(record.ttft_ms, 3) if record.ttft_ms is not None else None,
        status=record.status,
        error_code=record.error_code,
        stream=record.stream,
        partial=record.partial,
        usage_source=record.usage_source if record.usage_source in ("upstream", "counted", "cache") else "none",
    )


class Accounting:
    """Built by ``create_app``; ``handle`` may be given (tests), else it connects to ``settings.redis``."""

    def __init__(self, settings: Settings, handle: RedisHandle | None = None) -> None:
        self.settings = settings
        self.handle = handle or connect(settings.redis)
        self.breaker = Breaker(settings.redis.breaker_cooldown_s)
        self.spool = Spool(settings.metering.spool_path)
        self.meter = Meter(self.handle, self.breaker, self.spool, settings.metering)
        self.cache = ResponseCache(self.handle, self.breaker, settings.cache)
        self.limits = Limits(self.handle, self.breaker, settings.limits)
        self.http = httpx.AsyncClient(trust_env=False)
        self.alerts = Alerts(self.handle, self.breaker, settings.limits, self.http)
        self.keystore = RedisKeyStore(self.handle, self.breaker, settings.auth.key_cache_s,
                                      settings.auth.key_stale_s)
        self.metrics = Metrics(settings.metrics, settings.tiers)
        self._pending: set[asyncio.Task[None]] = set()
        self._open: dict[str, KeyInfo] = {}  # request id → key, admitted and not yet metered
        self._known: dict[str, KeyInfo] = {}  # key id → last KeyInfo seen (budgets for alerts)
        self._cache_result: dict[str, str] = {}  # request id → hit|miss|bypass
        self._stop = asyncio.Event()
        self._replayer: asyncio.Task[None] | None = None

    # --- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the spool replayer (call inside the serving event loop)."""
        self._stop.clear()
        self._replayer = asyncio.create_task(self.meter.run_replayer(self._stop), name="usage-spool-replayer")

    async def flush(self) -> None:
        """Wait until every metering write started so far has finished."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def close(self) -> None:
        """Flush, stop the replayer (one last replay attempt), close the clients."""
        await self.flush()
        self._stop.set()
        if self._replayer is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._replayer
        await self.meter.replay()
        await self.http.aclose()
        await self.handle.close()

    # --- limits -----------------------------------------------------------------------------------------
    async def admit(self, key: KeyInfo, body: dict[str, Any], record: UsageRecord,
                    tiers: list[TierConfig]) -> Admission:
        """Admit the request of ``record`` (``tiers``: where it may run: routed tier + fallbacks) or raise
        :class:`~gateway.errors.RateLimited` / ``LimitsUnavailable``."""
        self._remember(key)
        lim = KeyLimits.of(key)
        if lim.unlimited:  # nothing to check: no Redis, no estimate
            self._open[record.request_id] = key
            return Admission(key.id, record.request_id, "none", Estimate(0, 0))
        try:
            admission = await self.limits.admit(lim, record.request_id, estimate(body, tiers), record.ts)
        except GatewayError as exc:
            self.metrics.rejected(exc.code)
            raise
        self._open[record.request_id] = key
        return admission

    async def key_info(self, key_id: str) -> KeyInfo | None:
        """The key ``key_id`` (for its budgets): seen by this process, in the config, or in the Redis store."""
        if key_id in self._known:
            return self._known[key_id]
        for k in self.settings.auth.keys:
            if k.id == key_id:
                return KeyInfo.from_config(k)
        rec = await self.keystore.get(key_id)
        return rec.key_info() if rec is not None else None

    def _remember(self, key: KeyInfo) -> None:
        if key.id not in self._known and len(self._known) >= KNOWN_KEYS_MAX:
            self._known.clear()
        self._known[key.id] = key

    # --- cache ------------------------------------------------------------------------------------------
    async def cache_begin(self, key: KeyInfo, record: UsageRecord, tier: TierConfig,
                          upstream_body: dict[str, Any], headers: Mapping[str, str]) -> Ticket:
        """Look up the answer to ``upstream_body`` on ``tier`` for ``key``'s tenant scope (never raises for
        Redis outages; a ``bypass`` ticket when the policy or an outage says so)."""
        decision = decide(self.settings.cache, upstream_body, headers)
        if decision.lookup or decision.store:
            digest = cache_key(tenant_scope(key.id, key.cache_namespace), record.endpoint, tier.name, upstream_body)
        else:
            digest = ""  # bypass: no Redis, no hashing
        ticket = await self.cache.begin(digest, decision)
        self._cache_result[record.request_id] = ticket.status
        return ticket

    async def cache_finish(self, ticket: Ticket, body: dict[str, Any] | None, record: UsageRecord,
                           tier: TierConfig) -> None:
        """Store ``body`` (a complete, successful answer; None = nothing to store) and release the lock."""
        entry = CacheEntry(body, record.endpoint, tier.name, tier.model, record.ts) if body is not None else None
        await self.cache.finish(ticket, entry)

    # --- metering ---------------------------------------------------------------------------------------
    def sink(self, record: UsageRecord) -> None:
        """Usage sink: metrics now, Redis write (metering → local settle → alerts) in the background."""
        event = event_of(record)
        key = self._open.pop(record.request_id, None) or self._known.get(event.key_id)
        self.metrics.observe(event, self._cache_result.pop(record.request_id, "bypass"))
        task = asyncio.get_running_loop().create_task(self._write(event, key))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def abandon(self, record: UsageRecord, tier: TierConfig | None, status: int, code: str) -> None:
        """Meter a request that ends without a record (error or cancellation) if it was admitted."""
        if record.request_id not in self._open:
            return
        record.error_code = code
        record.partial = True
        record.finish(tier, status)
        self.sink(record)

    async def _write(self, event: UsageEvent, key: KeyInfo | None) -> None:
        try:
            result = await self.meter.record(event)
            self.limits.settled(event, result)
            if key is not None and result.stored == "redis" and result.day_cost_micro_usd is not None:
                await self.alerts.check(KeyLimits.of(key), key.tags, event.day, result.day_cost_micro_usd,
                                        result.month_cost_micro_usd or 0)
        except Exception:  # never lose the reason; the event itself is in Redis or the spool unless disk failed
            log.exception("usage write failed for event %s", event.event_id)

    def render_metrics(self) -> bytes:
        return self.metrics.render(self.breaker.is_open, self.spool.pending_bytes(), self.meter.spooled)
