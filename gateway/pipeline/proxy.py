"""The request path of ``/v1/chat/completions`` and ``/v1/completions``, top to bottom:

    auth → read + validate body → route → limits → cache (hit: replay) → upstream (+ fallback)
         → response (JSON, or an SSE relay; stored in the cache when complete) → usage record → metering

Routing runs before the limits so the budget reservation is priced for the tier(s) the request can
actually reach, and before the cache because the cache key is the post-routing upstream request.
Each step is a call into a small module: :mod:`gateway.auth.keys`, :mod:`gateway.pipeline.request`,
:mod:`gateway.pipeline.routing`, :mod:`gateway.pipeline.upstream_body`, :mod:`gateway.upstream.pool`,
:mod:`gateway.pipeline.relay`, :mod:`gateway.pipeline.escalation`, :mod:`gateway.ledger.record`; limits,
cache and metering through :class:`gateway.pipeline.accounting.Accounting`. One
:class:`gateway.pipeline.exchange.Exchange` per request carries the usage record, the route and the cache
ticket, and every exit closes it once.
Failures are :class:`gateway.errors.GatewayError` subclasses, turned into
OpenAI-shaped errors by the app's handlers; after a streamed 200 they become an in-stream error event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.auth.keys import KeyInfo, KeyStore
from gateway.config import Settings, TierConfig
from gateway.errors import BodyTooLarge, GatewayError, UpstreamError, UpstreamUnavailable
from gateway.ledger.event import Endpoint, WireEndpoint
from gateway.ledger.record import UsageRecord, emit
from gateway.openai import sse
from gateway.openai.chunks import replay
from gateway.openai.usage import needs_reasoning_count, reasoning_of
from gateway.pipeline import abstention, escalation, upstream_body
from gateway.pipeline import request as schemas
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.relay import CLIENT_CLOSED, fill_reasoning, relay
from gateway.pipeline.routing import RouteDecision, Routing
from gateway.pipeline.sessions import SESSION_HEADER, Sessions
from gateway.thinking.forcing import open_forced
from gateway.upstream.pool import ENDPOINT_PATHS, UpstreamConnectTimeout, UpstreamPool
from gateway.upstream.response import UpstreamResponse

if TYPE_CHECKING:
    from gateway.pipeline.accounting import Accounting

log = logging.getLogger("thinkgate.proxy")

VALIDATORS = {"chat": schemas.validate_chat, "completions": schemas.validate_completion}
TIER_HEADER = "x-thinkgate-tier"
CACHE_HEADER = "x-thinkgate-cache"
SIMILARITY_HEADER = "x-thinkgate-cache-similarity"

UsageSink = Callable[[UsageRecord], None]


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes (BodyTooLarge, 413) before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        parts.append(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def route_headers(route: RouteDecision, record: UsageRecord) -> dict[str, str]:
    """``x-thinkgate-*`` response headers; the difficulty only when the router scored the request."""
    h = {
        "x-thinkgate-tier": route.tier.name,
        "x-thinkgate-route-reason": route.reason,
        "x-request-id": record.request_id,
    }
    if route.difficulty is not None:
        h["x-thinkgate-difficulty"] = f"{route.difficulty:.4f}"
    return h


class Proxy:
    """Serves the two generation endpoints. Holds the key store, routing, upstream pool and usage sinks."""

    def __init__(
        self,
        settings: Settings,
        keys: KeyStore,
        routing: Routing,
        upstreams: UpstreamPool,
        usage_sinks: list[UsageSink] | None = None,
        accounting: Accounting | None = None,
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.routing = routing
        self.upstreams = upstreams
        self.usage_sinks: list[UsageSink] = usage_sinks if usage_sinks is not None else [emit]
        self.accounting = accounting
        if accounting is not None:
            self.usage_sinks.append(accounting.sink)
        self.max_body = settings.server.max_body_bytes
        self.sessions = (Sessions(settings, accounting.handle, accounting.breaker, accounting.metrics)
                         if accounting is not None and settings.routing.session_ttl_s > 0 else None)

    async def handle(self, request: Request, endpoint: WireEndpoint) -> Response:
        """Serve one ``chat`` or ``completions`` request; raises GatewayError before any byte is sent."""
        key = await self.keys.authenticate(request.headers.get("authorization"))
        body = schemas.parse_json_object(await read_body(request, self.max_body))
        VALIDATORS[endpoint](body)
        return await self.serve(key, body, request.headers, endpoint)

    async def serve(self, key: KeyInfo, body: dict[str, Any], headers: Mapping[str, str], endpoint: WireEndpoint,
                    label: Endpoint | None = None, route: RouteDecision | None = None,
                    session: str | None = None) -> Response:
        """Serve a validated ``chat`` or ``completions`` ``body`` for ``key`` (``headers``: the request's).

        Other APIs translated onto chat (``/v1/responses``, ``/v1/messages``) call this with ``label``, the
        usage event's ``endpoint`` (it also scopes their cache entries), and may pass the ``route`` they
        decided themselves and the ``session`` digest of the conversation (:mod:`gateway.pipeline.sessions`).
        A chat request routed by the router keeps its conversation's tier (``x-thinkgate-session: new|sticky``).
        Raises GatewayError before any byte is sent."""
        route = route or self.routing.decide(body, headers.get(TIER_HEADER))
        sticky = None
        if self.sessions is not None and endpoint == "chat":
            sticky = await self.sessions.stick(key.id, body, route, session)
            if sticky is not None:
                route = sticky.route
        resp = await self._serve_routed(key, body, headers, endpoint, label, route)
        if sticky is not None and self.sessions is not None:
            resp.headers[SESSION_HEADER] = sticky.state
            if resp.headers.get("x-thinkgate-route-reason") == "escalated":
                await self.sessions.repin(sticky, resp.headers["x-thinkgate-tier"])
        return resp

    async def _serve_routed(self, key: KeyInfo, body: dict[str, Any], headers: Mapping[str, str],
                            endpoint: WireEndpoint, label: Endpoint | None, route: RouteDecision) -> Response:
        record = UsageRecord(
            key_id=key.id,
            tags=key.tags,
            endpoint=label or endpoint,
            requested_model=body.get("model"),
            stream=body.get("stream") is True,
        )
        ex = Exchange(record, route, self.usage_sinks, self.accounting)
        acct = self.accounting
        if acct is None:
            return await self._serve(ex, body, endpoint)
        # limits: reserve before the upstream call (429 budget_exceeded / rate_limit_exceeded, Retry-After)
        await acct.admit(key, body, record, [route.tier, *self.routing.fallbacks(route.tier)])
        try:
            # cache: key = tenant scope + the post-routing upstream request
            up_body = upstream_body.build(body, route.tier, endpoint)
            ex.ticket = await acct.cache_begin(key, record, route.tier, up_body, headers)
            if ex.ticket.status == "hit":
                return await self._replay_hit(ex, body)
            return await self._serve(ex, body, endpoint)
        except BaseException as exc:
            # Normally every exit closed the exchange (errors included); this settles anything else.
            cancelled = isinstance(exc, asyncio.CancelledError | anyio.get_cancelled_exc_class())
            with anyio.CancelScope(shield=True):
                await ex.abandon(CLIENT_CLOSED if cancelled else 500,
                                 "client_disconnected" if cancelled else "internal_error")
            raise

    async def _serve(self, ex: Exchange, body: dict[str, Any], endpoint: str) -> Response:
        """Call the upstream and answer (JSON or SSE relay); a complete answer is offered to the cache."""
        try:
            route, resp = await self._call_upstream(ex.route, body, endpoint, ex.record)
        except GatewayError as exc:
            await ex.close(exc.status, exc.code)
            raise
        ex.stamp(route)
        # the cascade: each tier that lists escalation conditions is checked in turn, up the tier order
        while ex.tier.escalate_on and (nxt := self._next_tier(ex.tier)) is not None:
            before = ex.route
            resp = await self._maybe_escalate(ex, resp, body, endpoint, nxt)
            if ex.route is before:
                break
        cached_status = ex.ticket.status if ex.ticket is not None else "bypass"
        if ex.route.reason in ("fallback", "escalated"):  # only the routed tier's answer is cached
            await ex.release_cache()
        headers = {**route_headers(ex.route, ex.record), CACHE_HEADER: cached_status}
        if ex.record.stream:
            wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return sse.RelayResponse(relay(resp, ex, self.upstreams, wants_usage, cache=True), headers)
        return await self._complete(resp, ex, headers)

    async def _replay_hit(self, ex: Exchange, body: dict[str, Any]) -> Response:
        """Serve a cached answer (JSON, or replayed as SSE): metered as a hit (cost 0, saved = its price)."""
        assert ex.ticket is not None and ex.ticket.entry is not None
        cached = ex.ticket.entry.body
        ex.stamp(RouteDecision(ex.tier, "cache", ex.route.difficulty))
        record = ex.record
        record.cached = True
        record.set_usage(cached.get("usage"))
        record.usage_source = "cache"
        record.mark_first_byte()
        headers = {**route_headers(ex.route, record), CACHE_HEADER: "hit"}
        ticket = ex.ticket
        if ticket.similarity is not None:  # a similar question's answer (gateway/state/semantic_cache.py)
            record.cache_request_id = ticket.source_request_id
            record.cache_similarity = ticket.similarity
            headers[CACHE_HEADER] = "semantic-hit"
            headers[SIMILARITY_HEADER] = f"{ticket.similarity:.4f}"
        await ex.close(200)
        if not record.stream:
            return Response(orjson.dumps(cached), media_type="application/json", headers=headers)
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        frames = replay(cached, wants_usage, self.settings.cache.replay_chunk_chars)
        return sse.RelayResponse(_iterate(frames), headers)

    def _next_tier(self, tier: TierConfig) -> TierConfig | None:
        """The tier after ``tier`` in the configured order (cheapest first), or None for the last one."""
        names = [t.name for t in self.settings.tiers]
        i = names.index(tier.name)
        return self.settings.tiers[i + 1] if i + 1 < len(names) else None

    async def _maybe_escalate(self, ex: Exchange, resp: UpstreamResponse, body: dict[str, Any], endpoint: str,
                              nxt: TierConfig) -> UpstreamResponse:
        """Retry on ``nxt`` when the tier's answer is empty, was cut inside its thought, abstains or is unsure
        (``tier.escalate_on``; :mod:`gateway.pipeline.abstention`). Both calls are metered: the first attempt
        as its own usage record (``error_code: escalated_<why>``), the retry with route reason ``escalated``.
        Streams are read up to the first answer token to decide (:func:`gateway.pipeline.escalation.peek_stream`),
        or to their end when the tier checks the answer's content (``abstain``/``low_confidence``)."""
        tier = ex.tier
        if ex.record.stream:
            whole = bool({"abstain", "low_confidence"} & set(tier.escalate_on))
            resp, summary = await escalation.peek_stream(resp, tier, endpoint, whole=whole)
        else:
            try:
                summary = orjson.loads(resp.content)
            except orjson.JSONDecodeError:
                return resp
        why = None
        if isinstance(summary, dict):
            why = escalation.escalation_reason(tier, summary, endpoint) or abstention.cascade_reason(
                tier.escalate_on, tier.abstain_phrases, tier.min_answer_logprob, summary, endpoint)
        if why is None:
            return resp
        await resp.aclose()
        log.info("tier %s gave %s; escalating to %s", ex.tier.name, why, nxt.name)
        ex.record.mark_first_byte()
        ex.record.set_usage(summary.get("usage") if isinstance(summary.get("usage"), dict) else None)
        difficulty = ex.route.difficulty
        await ex.next_attempt(RouteDecision(nxt, "escalated", difficulty), 200, f"escalated_{why}")
        try:
            routed, resp = await self._call_upstream(ex.route, body, endpoint, ex.record)
        except GatewayError as exc:
            await ex.close(exc.status, exc.code)
            raise
        ex.stamp(RouteDecision(routed.tier, "escalated", difficulty))
        return resp

    async def _call_upstream(
        self, route: RouteDecision, body: dict[str, Any], endpoint: str, record: UsageRecord
    ) -> tuple[RouteDecision, UpstreamResponse]:
        """Open the upstream call on the routed tier, falling back to later tiers when it is down."""
        candidates = [route.tier, *self.routing.fallbacks(route.tier)]
        last: GatewayError | None = None
        for i, tier in enumerate(candidates):
            built = upstream_body.build(body, tier, endpoint)
            resp: UpstreamResponse
            try:
                if tier.budget_mode == "forced":
                    resp = await open_forced(self.upstreams, tier, endpoint, built)
                else:
                    resp = await self.upstreams.open(tier, ENDPOINT_PATHS[endpoint], orjson.dumps(built),
                                                     stream=record.stream)
            except (UpstreamUnavailable, UpstreamConnectTimeout) as exc:
                log.warning("tier %s unavailable (%s)%s", tier.name, exc.message,
                            "; falling back" if i + 1 < len(candidates) else "")
                last = exc
                continue
            if i == 0:
                return route, resp
            return RouteDecision(tier, "fallback", route.difficulty), resp
        assert last is not None
        raise last

    async def _complete(self, resp: UpstreamResponse, ex: Exchange, headers: dict[str, str]) -> Response:
        """Non-streamed answer: fill the reasoning count if missing, record usage, return the JSON."""
        content = resp.content
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            await ex.close(502, "upstream_error")
            raise UpstreamError(f"upstream of tier {ex.tier.name!r} sent an invalid JSON answer")
        usage = data.get("usage")
        reasoning = [r for c in data.get("choices") or () if (r := reasoning_of(c.get("message")))]
        if reasoning and isinstance(usage, dict) and needs_reasoning_count(usage):
            await fill_reasoning(self.upstreams, usage, ex.tier, reasoning)
            content = orjson.dumps(data)
        ex.record.mark_first_byte()
        ex.record.set_usage(usage if isinstance(usage, dict) else None)
        complete = bool(data.get("choices")) and all(c.get("finish_reason") for c in data["choices"])
        await ex.close(200, None, data if complete and isinstance(usage, dict) else None)
        return Response(content, media_type="application/json", headers=headers)


async def _iterate(frames: Iterable[bytes]) -> AsyncGenerator[bytes, None]:
    for frame in frames:
        yield frame
