"""``create_app(settings) -> Gateway`` (FastAPI, :mod:`gateway.api.asgi`): build the gateway's services and attach
the HTTP surface (``gateway/api/``).

Routes, one module each: ``POST /v1/chat/completions`` and ``/v1/completions`` (:mod:`gateway.api.completions`),
``/v1/responses`` (:mod:`gateway.api.responses`), ``/v1/messages`` (:mod:`gateway.api.messages`),
``GET /v1/models`` and ``POST /admin/router/reload`` (:mod:`gateway.api.models`), ``GET /v1/usage`` and
``/metrics`` (:mod:`gateway.api.usage`), ``GET /health`` and ``/ready`` (:mod:`gateway.api.ops`),
``GET /dashboard`` (:mod:`gateway.api.dashboard`). Errors are mapped by
:func:`gateway.api.errors.install_handlers`. ``app.state.routing`` is the :class:`gateway.pipeline.routing.Routing`
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

from fastapi import FastAPI

from gateway.api import completions as completions_api
from gateway.api import dashboard as dashboard_api
from gateway.api import embeddings as embeddings_api
from gateway.api import feedback as feedback_api
from gateway.api import messages as messages_api
from gateway.api import models as models_api
from gateway.api import ops as ops_api
from gateway.api import responses as responses_api
from gateway.api import usage as usage_api
from gateway.api.asgi import Gateway
from gateway.api.errors import install_handlers
from gateway.auth.keys import KeyStore
from gateway.config import Settings
from gateway.control import retrain_trigger
from gateway.control.drift import DriftMonitor
from gateway.control.outcomes import OutcomeStore, outcome_spool_path
from gateway.control.shadow import Shadow
from gateway.control.target import TargetController
from gateway.ledger.event import ROUTER_DECIDED
from gateway.ledger.record import UsageRecord
from gateway.observability.telemetry import Telemetry
from gateway.pipeline import upstream_body
from gateway.pipeline.accounting import Accounting
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.routing import Routing
from gateway.state.redis import known_nodes
from gateway.upstream.pool import UpstreamPool

_heap_frozen = False


def freeze_startup_heap(thresholds: tuple[int, int, int] | None = None) -> None:
    """Take everything allocated up to now out of the cyclic garbage collector's scans, once per process.

    Serving imports its libraries and builds the app: ~90k long-lived objects (~340k while the router still
    pulled in scikit-learn/SciPy/pandas) that every full (generation 2) collection used to traverse — then
    0.2–0.3 s with the event loop stopped on an idle 2-core box, 0.7–1.8 s under CPU contention, every few
    seconds at high concurrency (bench/RESULTS.md, "ThinkGate vs LiteLLM"). Frozen objects are still freed by
    reference counting; only cycles among them are never collected, which startup state does not produce in
    any amount that matters. ``thresholds``: then ``gc.set_threshold`` (``server.gc_thresholds``; None: unchanged).
    """
    global _heap_frozen
    if thresholds is not None:
        gc.set_threshold(*thresholds)
    if _heap_frozen:
        return
    _heap_frozen = True
    gc.collect()
    gc.freeze()


def _attach_controller(settings: Settings, routing: Routing, proxy: Proxy,
                       accounting: Accounting) -> TargetController | None:
    """The cost-target controller when ``routing.target`` sets a target: it sees every routed score (through
    ``routing``), the cost of every ``predicted`` request (a usage sink) and feeds the Prometheus gauges."""
    routed = settings.routing.routed_tiers
    if not settings.routing.target.enabled:
        # the cut points in force are still worth a gauge (the HELP line had no samples without the controller)
        accounting.metrics.thresholds_view = lambda: {routed[i + 1]: t for i, t in enumerate(routing.thresholds)
                                                      if i + 1 < len(routed)}
        return None
    ctrl = TargetController(settings.routing, accounting.handle, accounting.breaker, routing.base_thresholds)
    routing.attach_controller(ctrl)
    index = {name: i for i, name in enumerate(routed)}

    def cost_sink(record: UsageRecord) -> None:
        # every request the router decided, explored and spot-checked ones included: they are real spend
        if record.route_reason in ROUTER_DECIDED and record.tier in index and not record.cached:
            ctrl.record_cost(index[record.tier], record.cost_micro_usd)

    proxy.usage_sinks.append(cost_sink)

    def view() -> tuple[dict[str, float], float | None, dict[str, float]]:
        st = ctrl.state
        shares = {routed[i]: v for i, v in st.tier_shares.items()}
        cuts = {routed[i + 1]: t for i, t in enumerate(routing.thresholds)}
        return shares, st.target, cuts

    accounting.metrics.routing_view = view
    return ctrl


def router_version(routing: Routing) -> str | None:
    """The router file's version: its metadata ``version``, else its ``created_utc`` (None: no router file)."""
    svc = routing.service
    router = svc.router if svc is not None else None
    if router is None:
        return None
    meta = router.metadata
    return str(meta.get("version") or meta.get("created_utc") or "") or None


def _outcome_store(settings: Settings, routing: Routing, proxy: Proxy, accounting: Accounting) -> OutcomeStore | None:
    """The outcome stream (``routing.outcomes``): a usage sink (request index, escalations) and the feedback API."""
    if not settings.routing.outcomes.enabled:
        return None
    store = OutcomeStore(settings.routing.outcomes, accounting.handle, accounting.breaker,
                         outcome_spool_path(settings), router_version=lambda: router_version(routing))
    proxy.usage_sinks.append(store.sink)
    return store


def _drift_monitor(settings: Settings, routing: Routing, accounting: Accounting) -> DriftMonitor | None:
    """The drift alarm (``routing.drift``): sees every routed score, publishes the PSI gauges and alerts."""
    if not settings.routing.drift.enabled:
        return None

    def meta() -> tuple[str, dict[str, Any] | None]:
        svc = routing.service
        router = svc.router if svc is not None else None
        if router is None:
            return routing.scorer.name, None
        hist = router.metadata.get("score_histogram")
        return router_version(routing) or routing.scorer.name, hist if isinstance(hist, dict) else None

    monitor = DriftMonitor(settings.routing.drift, accounting.handle, accounting.breaker, accounting.alerts, meta,
                           lambda: routing.thresholds, len(settings.routing.routed_tiers),
                           on_update=accounting.metrics.drift)
    routing.observers.append(monitor.record)
    return monitor


def create_app(settings: Settings) -> Gateway:
    """Build the gateway app for ``settings``. Upstream clients are closed on shutdown."""
    upstreams = UpstreamPool(settings.tiers)
    routing = Routing(settings)
    accounting = Accounting(settings)
    accounting.metrics.registry.register(upstreams.balancer.collector())  # thinkgate_upstream_* series
    keys = KeyStore(settings.auth, redis_store=accounting.keystore)
    telemetry = Telemetry.from_config(settings.telemetry)  # None unless telemetry.otlp_endpoint is set
    proxy = Proxy(settings, keys, routing, upstreams, accounting=accounting, telemetry=telemetry)
    controller = _attach_controller(settings, routing, proxy, accounting)
    outcomes = _outcome_store(settings, routing, proxy, accounting)
    if outcomes is not None and settings.routing.shadow.fraction > 0:
        proxy.shadow = Shadow(settings, upstreams, accounting.handle, accounting.breaker, outcomes,
                              proxy.usage_sinks, build_body=upstream_body.build, admit=accounting.admit,
                              write_ahead=accounting.write_ahead)
    drift = _drift_monitor(settings, routing, accounting)
    retrain = retrain_trigger.attach(settings, routing, accounting.handle, accounting.breaker, outcomes)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await accounting.start()
        upstreams.start()  # the pools' active health checks
        if outcomes is not None:
            await outcomes.start()
        if retrain is not None:
            await retrain.start()  # the promoted router before the first request, not a tick later
        freeze_startup_heap(settings.server.gc_thresholds)
        # hot reload of the router file: checked every routing.reload_interval_s (mtime, size, inode)
        watcher = asyncio.create_task(routing.service.watch()) if routing.service is not None else None
        steer = asyncio.create_task(controller.run()) if controller is not None else None
        drifting = asyncio.create_task(drift.run()) if drift is not None else None
        learning = asyncio.create_task(retrain.run()) if retrain is not None else None
        yield
        for task in (watcher, steer, drifting, learning):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if controller is not None:
            await controller.close()
        if retrain is not None:
            retrain.close()  # the fit process, if one was started
        if proxy.shadow is not None:
            await proxy.shadow.close()
        if outcomes is not None:
            await outcomes.close()
        await upstreams.aclose()
        await accounting.close()
        if proxy.telemetry is not None:
            await asyncio.to_thread(proxy.telemetry.shutdown)  # exports the spans still queued

    # no /openapi.json (it was the one page besides the probes answered without a key), no slash redirects (their
    # Location is built from the Host header the client sent; the generation endpoints serve a trailing slash)
    app = Gateway(title="ThinkGate", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False, body_timeout_s=settings.server.request_body_timeout_s)
    app.state.settings = settings
    app.state.routing = routing
    app.state.proxy = proxy
    app.state.accounting = accounting
    app.state.outcomes = outcomes
    app.state.drift = drift
    app.state.retrain = retrain
    install_handlers(app)
    usage_api.install(app, settings, keys, accounting)
    responses_api.attach(app, proxy, accounting.conversations)
    messages_api.attach(app, proxy)
    embeddings_api.attach(app, proxy)

    completions_api.attach(app, proxy)
    if outcomes is not None:
        feedback_api.attach(app, keys, outcomes)
    models_api.attach(app, settings, proxy, routing, created)
    ops_api.attach(app, settings, upstreams, lambda: accounting.budgets.synced,
                   lambda: known_nodes(accounting.handle), lambda: accounting.budgets.refresh(force=True))
    dashboard_api.attach(app, settings, keys, accounting, routing)
    if settings.server.cors_allow_origins:
        allow_cors(app, settings.server.cors_allow_origins)
    return app


#: the gateway's response headers a browser script may read under CORS
EXPOSED_HEADERS = ["x-request-id", "x-thinkgate-tier", "x-thinkgate-route-reason", "x-thinkgate-difficulty",
                   "x-thinkgate-cache", "x-thinkgate-cache-similarity", "x-thinkgate-thinking-budget",
                   "x-thinkgate-escalation", "x-thinkgate-session", "x-thinkgate-downgraded-from",
                   "x-thinkgate-budget-level", "x-thinkgate-token-count", "retry-after", "retry-after-ms",
                   "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
                   "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
                   "x-should-retry",
                   *(f"anthropic-ratelimit-{u}-{f}" for u in ("requests", "tokens") for f in ("limit", "remaining",
                                                                                             "reset"))]


def allow_cors(app: Gateway, origins: list[str]) -> None:
    """Answer CORS (preflight and headers) for ``origins`` on every path: Starlette's ``CORSMiddleware``, with
    every route through the middleware stack (the direct dispatch of the generation endpoints would skip it)."""
    from starlette.middleware.cors import CORSMiddleware

    app.hot.clear()  # the routes stay in the router: served through the stack, CORS included
    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
                       expose_headers=EXPOSED_HEADERS, allow_credentials=False, max_age=600)
