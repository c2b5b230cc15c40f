"""``create_app(settings) -> FastAPI``: the HTTP surface of the gateway (routes only).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (:mod:`gateway.pipeline.proxy`), ``GET /v1/models``
(``auto`` and every tier with its ``thinkgate`` settings), ``GET /health`` (liveness, no key) and
``GET /ready`` (every tier's upstream and Redis answer; no key, tier names only), ``POST /admin/router/reload``
(admin key: load the router file now; it is also watched and reloaded when it changes). Errors are mapped by
:func:`gateway.errors.install_handlers`. ``app.state.routing`` is the :class:`gateway.pipeline.routing.Routing`
(plug the trained router in with ``app.state.routing.set_scorer``) and ``app.state.proxy`` the
:class:`gateway.pipeline.proxy.Proxy` (``usage_sinks`` for metering).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from gateway.api import messages as messages_api
from gateway.api import responses as responses_api
from gateway.api import usage as usage_api
from gateway.auth.keys import KeyStore
from gateway.config import Settings, TierConfig
from gateway.errors import InvalidRequest, PermissionDenied, install_handlers
from gateway.pipeline.accounting import Accounting
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.routing import AUTO, Routing
from gateway.state.conversations import ConversationStore
from gateway.upstream.pool import UpstreamPool
from router.persistence import RouterFileError

READY_TIMEOUT_S = 2.0
_heap_frozen = False


def freeze_startup_heap() -> None:
    """Take everything allocated up to now out of the cyclic garbage collector's scans, once per process.

    Serving imports scikit-learn/scipy/pandas (the router) and builds the app: ~340k long-lived objects that
    every full (generation 2) collection used to traverse — 0.2–0.3 s with the event loop stopped on an idle
    2-core box, 0.7–1.8 s under CPU contention, every few seconds at high concurrency (bench/RESULTS.md,
    "Gateway overhead"). Frozen objects are still freed by reference counting; only cycles among them are
    never collected, which startup state does not produce in any amount that matters.
    """
    global _heap_frozen
    if _heap_frozen:
        return
    _heap_frozen = True
    gc.collect()
    gc.freeze()


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _tier_card(t: TierConfig, created: int) -> dict[str, Any]:
    # Prices as decimal strings: exact, as configured (USD per 1M tokens).
    return {
        "id": t.name,
        "object": "model",
        "created": created,
        "owned_by": "thinkgate",
        "thinkgate": {
            "upstream_model": t.model,
            "thinking_budget": t.thinking_budget,
            "budget_mode": t.budget_mode,
            "enable_thinking": t.enable_thinking,
            "max_tokens": t.max_tokens,
            "prices": {
                "input_usd_per_mtok": str(t.prices.input_usd_per_mtok),
                "cached_input_usd_per_mtok": str(t.prices.cached_input_usd_per_mtok),
                "output_usd_per_mtok": str(t.prices.output_usd_per_mtok),
            },
        },
    }


async def _redis_ok(url: str, timeout_s: float) -> bool:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(await client.ping())
    except (aioredis.RedisError, OSError):
        return False
    finally:
        await client.aclose()


def create_app(settings: Settings) -> FastAPI:
    """Build the gateway app for ``settings``. Upstream clients are closed on shutdown."""
    upstreams = UpstreamPool(settings.tiers)
    routing = Routing(settings)
    accounting = Accounting(settings)
    keys = KeyStore(settings.auth, redis_store=accounting.keystore)
    proxy = Proxy(settings, keys, routing, upstreams, accounting=accounting)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await accounting.start()
        freeze_startup_heap()
        # hot reload of the router file: checked every routing.reload_interval_s (mtime, size, inode)
        watcher = asyncio.create_task(routing.service.watch()) if routing.service is not None else None
        yield
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await upstreams.aclose()
        await accounting.close()

    app = FastAPI(title="ThinkGate", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.routing = routing
    app.state.proxy = proxy
    app.state.accounting = accounting
    install_handlers(app)
    usage_api.install(app, keys, accounting)
    responses_api.attach(app, proxy, ConversationStore(accounting.handle, accounting.breaker,
                                                       settings.responses.store_ttl_s))
    messages_api.attach(app, proxy)

    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, "chat")

    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "completions")

    # Plain Starlette routes on the hot path: the body is parsed and validated by the proxy itself, so
    # FastAPI's per-request dependency and response-model machinery would be pure overhead.
    app.router.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.router.add_route("/v1/completions", completions, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        await proxy.keys.authenticate(request.headers.get("authorization"))
        auto = {
            "id": AUTO,
            "object": "model",
            "created": created,
            "owned_by": "thinkgate",
            "thinkgate": {
                "router": routing.scorer.name,
                "router_status": routing.service.info() if routing.service is not None else None,
                "routed_tiers": settings.routing.routed_tiers,
                "thresholds": routing.thresholds,
                "effort_tiers": settings.routing.effort_tiers,
            },
        }
        return _json({"object": "list", "data": [auto, *(_tier_card(t, created) for t in settings.tiers)]})

    @app.post("/admin/router/reload")
    async def reload_router(request: Request) -> Response:
        key = await proxy.keys.authenticate(request.headers.get("authorization"))
        if not key.is_admin:
            raise PermissionDenied("reloading the router needs the admin key")
        svc = routing.service
        if svc is None:
            raise InvalidRequest("no router file is configured (routing.router_path is null)")
        try:
            await asyncio.to_thread(svc.reload)
        except RouterFileError as exc:  # the router in service (if any) is kept
            err = {"message": str(exc), "type": "invalid_request_error", "code": "router_reload_failed"}
            return _json({"error": err, "router": svc.info()}, 422)
        return _json({"status": "reloaded", "router": svc.info()})

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        tiers = settings.tiers
        checks = await asyncio.gather(
            _redis_ok(settings.redis.url, min(READY_TIMEOUT_S, settings.redis.socket_timeout_s * 4)),
            *(upstreams.ready(t, READY_TIMEOUT_S) for t in tiers),
        )
        upstream_ok = {t.name: ok for t, ok in zip(tiers, checks[1:], strict=True)}
        ok = checks[0] and all(upstream_ok.values())
        return _json(
            {"status": "ready" if ok else "not_ready", "redis": checks[0], "upstreams": upstream_ok},
            200 if ok else 503,
        )

    return app
