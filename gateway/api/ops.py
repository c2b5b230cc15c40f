"""``GET /health`` (liveness, no key) and ``GET /ready`` (Redis and every tier's upstream answer; no key, tier names
only; 503 when any does not)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from starlette.responses import Response

from gateway.api.common import json_response as _json
from gateway.config import RedisConfig, Settings
from gateway.state.redis import ping as redis_ping
from gateway.upstream.pool import UpstreamPool

READY_TIMEOUT_S = 2.0


async def _redis_ok(cfg: RedisConfig, timeout_s: float) -> bool:
    # Through the gateway's own client factory, so every URL form answers (one server, Cluster, Sentinel).
    return await redis_ping(cfg.model_copy(update={"socket_timeout_s": timeout_s}))


def attach(app: FastAPI, settings: Settings, upstreams: UpstreamPool) -> None:
    """Add the liveness and readiness probes to ``app``."""

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        tiers = settings.tiers
        checks = await asyncio.gather(
            _redis_ok(settings.redis, min(READY_TIMEOUT_S, settings.redis.socket_timeout_s * 4)),
            *(upstreams.ready(t, READY_TIMEOUT_S) for t in tiers),
        )
        upstream_ok = {t.name: ok for t, ok in zip(tiers, checks[1:], strict=True)}
        ok = checks[0] and all(upstream_ok.values())
        return _json(
            {"status": "ready" if ok else "not_ready", "redis": checks[0], "upstreams": upstream_ok},
            200 if ok else 503,
        )
