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
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from gateway.auth.keys import KeyInfo, KeyStore
from gateway.config import Settings, TierConfig
from gateway.control.shadow import Shadow
from gateway.errors import BodyTooLarge, ClientClosed, GatewayError, UpstreamError, UpstreamUnavailable
from gateway.ledger.event import Endpoint, WireEndpoint
from gateway.ledger.record import UsageRecord, emit
from gateway.observability.telemetry import Telemetry, current, span
from gateway.observability.telemetry import finish as end_trace
from gateway.openai import sse
from gateway.openai.chunks import replay
from gateway.openai.usage import needs_reasoning_count, reasoning_of
from gateway.pipeline import abstention, escalation, policy, upstream_body
from gateway.pipeline import request as schemas
from gateway.pipeline.accounting import Ahead
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.relay import CLIENT_CLOSED, fill_reasoning, relay
from gateway.pipeline.routing import RouteDecision, Routing
from gateway.pipeline.sessions import SESSION_HEADER, Sessions
from gateway.thinking import dial
from gateway.thinking.forcing import open_forced
from gateway.upstream.balancer import affinity, conversation_key
from gateway.upstream.pool import ENDPOINT_PATHS, UpstreamConnectTimeout, UpstreamPool
from gateway.upstream.response import UpstreamResponse

if TYPE_CHECKING:
    from gateway.pipeline.accounting import Accounting

log = logging.getLogger("thinkgate.proxy")

VALIDATORS = {"chat": schemas.validate_chat, "completions": schemas.validate_completion}
TIER_HEADER = "x-thinkgate-tier"
CACHE_HEADER = "x-thinkgate-cache"
SIMILARITY_HEADER = "x-thinkgate-cache-similarity"
ESCALATION_HEADER = "x-thinkgate-escalation"

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
    if route.downgraded_from is not None:
        h[policy.DOWNGRADE_HEADER] = route.downgraded_from
    return h


async def disconnected(request: Request) -> None:
    """Return once the client has closed the connection (the body is already read, so the next ASGI message
    is ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
        telemetry: Telemetry | None = None,
    ) -> None:
        self.settings = settings
        self.telemetry = telemetry  # OpenTelemetry traces (gateway/observability/telemetry.py); None = off
        self.keys = keys
        self.routing = routing
        self.upstreams = upstreams
        self.usage_sinks: list[UsageSink] = usage_sinks if usage_sinks is not None else [emit]
        self.accounting = accounting
        if accounting is not None:
            self.usage_sinks.append(accounting.sink)
        self.max_body = settings.server.max_body_bytes
        #: shadow comparisons (``routing.shadow``; set by the app when on)
        self.shadow: Shadow | None = None
        self.sessions = (Sessions(settings, accounting.handle, accounting.breaker, accounting.metrics)
                         if accounting is not None and settings.routing.session_ttl_s > 0 else None)

    async def handle(self, request: Request, endpoint: WireEndpoint) -> Response:
        """Serve one ``chat`` or ``completions`` request; raises GatewayError before any byte is sent.

        A request refused before any upstream call (here: auth, body, validation; in :meth:`serve`: routing,
        key policy, limits) leaves an audit event (``Accounting.audit``) and its error carries ``x-request-id``.
        """
        trace = self.telemetry.begin(endpoint, request.headers) if self.telemetry is not None else None
        try:
            return await self._handle(request, endpoint)
        except BaseException as exc:
            if trace is not None:
                trace.fail(exc)
            raise

    async def _handle(self, request: Request, endpoint: WireEndpoint) -> Response:
        record = UsageRecord(endpoint=endpoint)
        with self.auditing(record):
            key = await self.keys.authenticate(request.headers.get("authorization"))
            record.key_id, record.tags = key.id, key.tags
            body = schemas.parse_json_object(await read_body(request, self.max_body))
            record.requested_model, record.stream = body.get("model"), body.get("stream") is True
            VALIDATORS[endpoint](body)
        return await self.serve(key, body, request.headers, endpoint, disconnect=lambda: disconnected(request))

    @contextlib.contextmanager
    def auditing(self, record: UsageRecord) -> Iterator[UsageRecord]:
        """Audit a :class:`GatewayError` raised inside the block — a request refused before any upstream call —
        with what ``record`` knows by then (key, model, tier), and re-raise it. For the steps before
        :meth:`serve`; the APIs translated onto chat use it too."""
        try:
            yield record
        except GatewayError as exc:
            self.refused(record, exc)
            raise

    def refused(self, record: UsageRecord, exc: GatewayError, route: RouteDecision | None = None) -> None:
        """Audit a request refused before any upstream call (see ``Accounting.audit``)."""
        if route is not None:
            record.tier, record.upstream_model, record.route_reason = route.tier.name, route.tier.model, route.reason
        if self.accounting is not None:
            self.accounting.audit(record, exc.status, exc.code)
        else:
            record.status, record.error_code = exc.status, exc.code
        end_trace(record)  # the request span says what was known: the model asked for, the tier when routed
        exc.headers.setdefault("x-request-id", record.request_id)

    async def serve(self, key: KeyInfo, body: dict[str, Any], headers: Mapping[str, str], endpoint: WireEndpoint,
                    label: Endpoint | None = None, route: RouteDecision | None = None,
                    session: str | None = None,
                    disconnect: Callable[[], Awaitable[None]] | None = None) -> Response:
        """Serve a validated ``chat`` or ``completions`` ``body`` for ``key`` (``headers``: the request's).

        Other APIs translated onto chat (``/v1/responses``, ``/v1/messages``) call this with ``label``, the
        usage event's ``endpoint`` (it also scopes their cache entries), and may pass the ``route`` they
        decided themselves and the ``session`` digest of the conversation (:mod:`gateway.pipeline.sessions`).
        A chat request routed by the router keeps its conversation's tier (``x-thinkgate-session: new|sticky``).
        ``disconnect`` returns when the client has gone away: a non-streamed answer is then cancelled upstream
        (:meth:`_unless_disconnected`). Raises GatewayError before any byte is sent."""
        if self.telemetry is None or current() is not None:
            return await self._serve_entry(key, body, headers, endpoint, label, route, session, disconnect)
        trace = self.telemetry.begin(label or endpoint, headers)  # entered here from another API (responses, …)
        try:
            return await self._serve_entry(key, body, headers, endpoint, label, route, session, disconnect)
        except BaseException as exc:
            trace.fail(exc)
            raise

    async def _serve_entry(self, key: KeyInfo, body: dict[str, Any], headers: Mapping[str, str],
                           endpoint: WireEndpoint, label: Endpoint | None, route: RouteDecision | None,
                           session: str | None, disconnect: Callable[[], Awaitable[None]] | None) -> Response:
        try:
            with span("route"):
                route = route or self.routing.decide(body, headers.get(TIER_HEADER))
        except GatewayError as exc:
            self.refused(UsageRecord(key_id=key.id, tags=key.tags, endpoint=label or endpoint,
                                     requested_model=body.get("model"), stream=body.get("stream") is True), exc)
            raise
        sticky = None
        if self.sessions is not None and endpoint == "chat":
            sticky = await self.sessions.stick(key.id, body, route, session)
            if sticky is not None:
                route = sticky.route
        resp = await self._serve_routed(key, body, headers, endpoint, label, route, disconnect)
        if sticky is not None and self.sessions is not None:
            resp.headers[SESSION_HEADER] = sticky.state
            if resp.headers.get("x-thinkgate-route-reason") == "escalated":
                await self.sessions.repin(sticky, resp.headers["x-thinkgate-tier"])
        return resp

    async def _serve_routed(self, key: KeyInfo, body: dict[str, Any], headers: Mapping[str, str],
                            endpoint: WireEndpoint, label: Endpoint | None, route: RouteDecision,
                            disconnect: Callable[[], Awaitable[None]] | None = None) -> Response:
        record = UsageRecord(
            key_id=key.id,
            tags=key.tags,
            endpoint=label or endpoint,
            requested_model=body.get("model"),
            stream=body.get("stream") is True,
        )
        acct = self.accounting
        try:
            # key policy and tier caps (gateway/pipeline/policy.py): allowed tiers (403 or downgrade), n ≤ max_n,
            # max_tokens, the key's thinking cap
            route, downgraded = policy.check_tier(key, route, self.settings.tiers)
            allowed = frozenset(key.allowed_tiers) if key.allowed_tiers is not None else None
            route = replace(route, allowed=allowed, downgraded_from=downgraded)
            policy.check_caps(key, body, route.tier)
            if acct is not None:
                # limits: reserve before the upstream call, at every budget level (429 budget_exceeded /
                # rate_limit_exceeded with Retry-After, or 503); on a single Redis the same script call writes the
                # write-ahead record and looks the answer up (``Ahead``; cache key = tenant scope + the
                # post-routing upstream request)
                up_body = upstream_body.build(body, route.tier, endpoint)
                with span("limits"):
                    await acct.admit(key, body, record, [route.tier, *self._fallbacks(route)],
                                     Ahead(route.tier, route.reason, up_body, headers))
        except GatewayError as exc:
            self.refused(record, exc, route)
            raise
        ex = Exchange(record, route, self.usage_sinks, acct)
        if self.shadow is not None and endpoint == "chat" and self.shadow.sampled(route, body):
            ex.on_answer = functools.partial(self._shadow_answer, body)
        if acct is None:
            return await self._serve(ex, body, endpoint)
        try:
            with span("cache"):
                ex.ticket = await acct.cache_begin(key, record, route.tier, up_body, headers)
            if ex.ticket.status == "hit":
                return await self._replay_hit(ex, body)
            if record.stream or disconnect is None:  # the SSE relay notices a disconnect itself
                return await self._serve(ex, body, endpoint)
            return await self._unless_disconnected(disconnect, self._serve(ex, body, endpoint), ex)
        except BaseException as exc:
            # Normally every exit closed the exchange (errors included); this settles anything else.
            cancelled = isinstance(exc, asyncio.CancelledError | anyio.get_cancelled_exc_class())
            with anyio.CancelScope(shield=True):
                await ex.abandon(CLIENT_CLOSED if cancelled else 500,
                                 "client_disconnected" if cancelled else "internal_error")
            raise

    async def _unless_disconnected(self, disconnect: Callable[[], Awaitable[None]], serving: Awaitable[Response],
                                   ex: Exchange) -> Response:
        """Run ``serving`` (a non-streamed answer) until done, or until the client goes away: then cancel it —
        which closes the upstream request, and vLLM aborts a request whose connection closed — meter the
        current attempt as ``partial`` with status 499, and raise :class:`ClientClosed`. A non-streamed
        upstream reports no usage before its end, so such a record has the tokens known (none) and
        ``usage_source: none``."""
        work = asyncio.ensure_future(serving)
        watch = asyncio.ensure_future(disconnect())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if work.done():
            return work.result()
        work.cancel()
        with anyio.CancelScope(shield=True):
            try:
                await work
            except (asyncio.CancelledError, Exception) as exc:  # the client is gone either way
                log.debug("cancelled request %s ended with %r", ex.record.request_id, exc)
            await ex.abandon(CLIENT_CLOSED, "client_disconnected")
        raise ClientClosed("the client closed the connection; the upstream call was cancelled")

    def _shadow_answer(self, body: dict[str, Any], ex: Exchange, answer: dict[str, Any]) -> None:
        """A sampled request's answer is complete: compare it with the next tier up once the client has it (a
        stream: now, after its last chunk; JSON: from the response's background hook)."""
        shadow = self.shadow
        job = shadow.job(body, ex.record, ex.route, answer) if shadow is not None else None
        if shadow is None or job is None:
            return
        if ex.record.stream:
            shadow.start(job)
        else:
            ex.after_response = functools.partial(shadow.start_after_response, job)

    def _fallbacks(self, route: RouteDecision) -> list[TierConfig]:
        """The tiers a call on ``route`` may fall back to: later tiers the key may use."""
        return self.routing.fallbacks(route.tier, route.allowed)

    async def _serve(self, ex: Exchange, body: dict[str, Any], endpoint: WireEndpoint) -> Response:
        """Call the upstream and answer (JSON or SSE relay); a complete answer is offered to the cache."""
        try:
            route, resp = await self._call_upstream(ex.route, body, endpoint, ex.record)
        except GatewayError as exc:
            await ex.close(exc.status, exc.code)
            raise
        ex.stamp(route)
        extra: dict[str, str] = {}
        # the cascade: each tier that lists escalation conditions is checked in turn, up the tier order
        while ex.tier.escalate_on and (nxt := self._next_tier(ex.tier)) is not None:
            before = ex.route
            resp = await self._maybe_escalate(ex, resp, body, endpoint, nxt, extra)
            if ex.route is before:
                break
        cached_status = ex.ticket.status if ex.ticket is not None else "bypass"
        if ex.route.reason in ("fallback", "escalated"):  # only the routed tier's answer is cached
            await ex.release_cache()
        headers = {**route_headers(ex.route, ex.record), CACHE_HEADER: cached_status, **extra}
        if ex.record.stream:
            wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            n = body.get("n")
            choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
            return sse.RelayResponse(relay(resp, ex, self.upstreams, wants_usage, cache=True, choices=choices),
                                     headers)
        return await self._complete(resp, ex, headers)

    async def _replay_hit(self, ex: Exchange, body: dict[str, Any]) -> Response:
        """Serve a cached answer (JSON, or replayed as SSE): metered as a hit (cost 0, saved = its price)."""
        assert ex.ticket is not None and ex.ticket.entry is not None
        cached = ex.ticket.entry.body
        ex.stamp(replace(ex.route, reason="cache"))
        record = ex.record
        record.cached = True
        record.set_usage(cached.get("usage"))
        record.usage_source = "cache"
        record.mark_first_byte()
        headers = {**route_headers(ex.route, record), CACHE_HEADER: "hit"}
        ticket = ex.ticket
        if ticket.similarity is not None:  # a similar question's answer (gateway/semantic/cache.py)
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
        """The tier after ``tier`` in the configured order (cheapest first), or None for the last one; as
        ``auto`` serves it when ``tier`` is a routed one (the router file's cascade, ``Routing.next_tier``)."""
        return self.routing.next_tier(tier)

    async def _maybe_escalate(self, ex: Exchange, resp: UpstreamResponse, body: dict[str, Any], endpoint: WireEndpoint,
                              nxt: TierConfig, headers: dict[str, str]) -> UpstreamResponse:
        """Retry on ``nxt`` when the tier's answer is empty, was cut inside its thought, abstains or is unsure
        (``tier.escalate_on``; :mod:`gateway.pipeline.abstention`). Both calls are metered: the first attempt
        as its own usage record (``error_code: escalated_<why>``), the retry with route reason ``escalated``.
        Streams are read up to the first answer token to decide (:func:`gateway.pipeline.escalation.peek_stream`),
        or to their end when the tier checks the answer's content (``abstain``/``low_confidence``).
        The retry is admitted — reserved at every budget level — before it is sent; when that is refused (or
        the key may not use ``nxt``) the first answer is returned, with ``x-thinkgate-escalation: skipped;
        tier=…; reason=…`` in ``headers``."""
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
                tier.escalate_on, tier.abstain_phrases, tier.min_answer_logprob, summary, endpoint) or \
                escalation.learned_reason(tier, summary, endpoint, ex.route.window, ex.route.difficulty)
        if why is None:
            return resp
        retry = replace(ex.route, tier=nxt, reason="escalated")
        again = UsageRecord(key_id=ex.record.key_id, tags=ex.record.tags, endpoint=ex.record.endpoint,
                            requested_model=ex.record.requested_model, stream=ex.record.stream)
        skipped = await self._admit_escalation(retry, body, again)
        if skipped is not None:
            log.info("tier %s gave %s; not escalating to %s (%s)", ex.tier.name, why, nxt.name, skipped)
            headers[ESCALATION_HEADER] = f"skipped; tier={nxt.name}; reason={skipped}"
            return resp
        await resp.aclose()
        log.info("tier %s gave %s; escalating to %s", ex.tier.name, why, nxt.name)
        ex.record.mark_first_byte()
        ex.record.set_usage(summary.get("usage") if isinstance(summary.get("usage"), dict) else None)
        await ex.next_attempt(retry, 200, f"escalated_{why}", record=again)
        try:
            routed, resp = await self._call_upstream(ex.route, body, endpoint, ex.record)
        except GatewayError as exc:
            await ex.close(exc.status, exc.code)
            raise
        ex.stamp(replace(routed, reason="escalated"))
        return resp

    async def _admit_escalation(self, retry: RouteDecision, body: dict[str, Any], again: UsageRecord) -> str | None:
        """Reserve the escalated call (``again``'s id) on ``retry.tier`` and its fallbacks; None when admitted,
        else why it may not be sent (an error code)."""
        if retry.allowed is not None and retry.tier.name not in retry.allowed:
            return "tier_not_allowed"
        if self.accounting is None:
            return None
        key = self.accounting.key_of(again.key_id)
        try:
            policy.check_caps(key, dict(body), retry.tier)
            await self.accounting.admit(key, body, again, [retry.tier, *self._fallbacks(retry)])
        except GatewayError as exc:
            return exc.code or "refused"
        return None

    async def _call_upstream(
        self, route: RouteDecision, body: dict[str, Any], endpoint: WireEndpoint, record: UsageRecord
    ) -> tuple[RouteDecision, UpstreamResponse]:
        """Open the upstream call on the routed tier, falling back to later tiers when it is down. A tier with
        several replicas prefers the conversation's replica (:func:`gateway.upstream.balancer.conversation_key`).
        The call's write-ahead record is written first (``Accounting.write_ahead``): nothing reaches an upstream
        unrecorded."""
        if self.accounting is not None:
            await self.accounting.write_ahead(record)
        candidates = [route.tier, *self._fallbacks(route)]
        last: GatewayError | None = None
        key = conversation_key(body) if any(len(t.upstream_urls) > 1 for t in candidates) else None
        for i, tier in enumerate(candidates):
            built = upstream_body.build(body, tier, endpoint)
            resp: UpstreamResponse
            try:
                with span("upstream"), affinity(key):
                    if tier.budget_mode in ("forced", "prompted"):  # prompted: forcing is the hard stop
                        resp = await open_forced(self.upstreams, dial.forcing_tier(tier, body), endpoint, built)
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
            return replace(route, tier=tier, reason="fallback"), resp
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
        after = BackgroundTask(ex.after_response) if ex.after_response is not None else None
        return Response(content, media_type="application/json", headers=headers, background=after)


async def _iterate(frames: Iterable[bytes]) -> AsyncGenerator[bytes, None]:
    for frame in frames:
        yield frame
