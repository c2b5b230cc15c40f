"""``GET /health`` (liveness, no key) and ``GET /ready`` (readiness, no key, tier names only).

``/ready`` answers 503 only for what makes this process unable to serve: no tier's upstream answering (one
tier's upstream down is ``degraded``, 200: upstreams are shared by every replica, and the other tiers and
fallback still answer), or Redis unreachable when ``limits.on_redis_down`` is ``fail_closed`` (the operator chose
refusing over serving unchecked: every request under a budget or rate limit is refused meanwhile). With
``fail_open`` (the default) a Redis outage leaves the process serving — admission on local counters, usage spooled
and replayed, keys seen in the last ``auth.key_stale_s`` still accepted — so ``/ready`` stays 200 and says
``"status": "degraded"``. Redis is shared by every replica: failing readiness on it would take every pod out of
the Service (or every server out of a load balancer's backend) at once and turn the fail-open the operator chose
into a full outage (Kubernetes' advice: readiness should not fail on a dependency that all pods share).

One exception: a process that has **never** reached Redis since it started (it began during the outage) and has
no keys of its own config (every key lives in the Redis store, ``thinkgate keys create``; a development key made
per process does not count: no client of a fleet holds it) is ``not_ready`` under
``fail_open`` too: every request it got would be a 503 (``key_store_unavailable``). Keeping it out of the Service
lets a rolling update stall on the old, warm pods instead of replacing them. With keys in its config it can serve
those, so it is ready (``degraded``) — without the budgets set with ``thinkgate budgets set``, which it has not
read (the config's apply). A fleet restarted whole during an outage with Redis-only keys cannot serve, and
reports so. ``server.ready_requires_redis_sync`` overrides the rule: ``true`` when clients use keys of the store
and the config's keys are only for operations, ``false`` to stay ready whatever the keys.

Body: ``{"status": "ready" | "degraded" | "not_ready", "redis": bool, "redis_synced": bool, "upstreams": {tier:
bool}}`` (``redis_synced``: the budget definitions were read from Redis since start — read by the probe itself,
and every ``limits.budget_refresh_s`` in the background, once Redis answers again; no request needed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.responses import Response

from gateway.api.common import json_response as _json
from gateway.config import RedisConfig, Settings
from gateway.state.redis import ping as redis_ping
from gateway.upstream.pool import UpstreamPool

READY_TIMEOUT_S = 2.0


async def _redis_ok(cfg: RedisConfig, timeout_s: float, known: list[tuple[str, int]]) -> bool:
    # Through the gateway's own client factory, so every URL form answers (one server, Cluster, Sentinel); a
    # Cluster through the nodes the running client found too, so a dead seed is not a dead cluster
    return await redis_ping(cfg.model_copy(update={"socket_timeout_s": timeout_s}), known)


def attach(app: FastAPI, settings: Settings, upstreams: UpstreamPool, synced: Callable[[], bool],
           known: Callable[[], list[tuple[str, int]]] = list,
           sync: Callable[[], Awaitable[None]] | None = None) -> None:
    """Add the liveness and readiness probes to ``app``. ``synced``: whether this process has read its state from
    Redis since it started (``BudgetLevels.synced``); ``known``: the Cluster nodes the running client has found;
    ``sync``: reads that state now (``BudgetLevels.refresh``), awaited by a probe that finds Redis answering and
    the process not synced yet — so ``redis_synced`` turns true with the first probe after an outage, not with
    the first admitted request (or the background read, ``Accounting._sync_budgets``)."""

    # GET and HEAD: Kubernetes probes GET; load balancers and uptime checkers often HEAD (405 failed them)
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return _json({"status": "ok"})

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready() -> Response:
        tiers = settings.tiers
        checks = await asyncio.gather(
            _redis_ok(settings.redis, min(READY_TIMEOUT_S, settings.redis.socket_timeout_s * 4), known()),
            *(upstreams.ready(t, READY_TIMEOUT_S) for t in tiers),
        )
        redis_ok = bool(checks[0])
        upstream_ok = {t.name: ok for t, ok in zip(tiers, checks[1:], strict=True)}
        if redis_ok and sync is not None and not synced():
            await sync()  # through the breaker: bounded by the socket timeout; a failure leaves it unsynced
        warm = synced()
        # a replica that never reached Redis serves only the keys of its own config: with none (every key in the
        # Redis store) it can answer nobody, so it is not ready; with some it serves those, degraded
        need = settings.server.ready_requires_redis_sync
        if need is None:
            need = settings.auth.require_key and (settings.auth.dev_key_only or not settings.auth.keys)
        # an upstream is shared by every replica, as Redis is: one tier's upstream down fails no replica's
        # readiness (that emptied the Service while the other tiers, and fallback, still answered); none answering
        # does — this replica can serve nothing
        generating = [ok for t, ok in zip(tiers, checks[1:], strict=True) if not t.embeddings] or [False]
        serves = any(generating) and (  # an embeddings tier alone answers no chat or completion
            redis_ok or (settings.limits.on_redis_down == "fail_open" and (warm or not need)))
        whole = redis_ok and all(upstream_ok.values())
        status = ("ready" if whole else "degraded") if serves else "not_ready"
        return _json({"status": status, "redis": redis_ok, "redis_synced": warm, "upstreams": upstream_ok},
                     200 if serves else 503)
