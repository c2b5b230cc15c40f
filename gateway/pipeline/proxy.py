"""The request path of ``/v1/chat/completions`` and ``/v1/completions``, top to bottom:

    auth → read + validate body → route → limits → cache (hit: replay) → upstream (+ fallback)
         → response (JSON, or an SSE relay; stored in the cache when complete) → usage record → metering

Routing runs before the limits so the budget reservation is priced for the tier(s) the request can
actually reach, and before the cache because the cache key is the post-routing upstream request.
Each step is a call into a small module: :mod:`gateway.auth.keys`, :mod:`gateway.pipeline.request`,
:mod:`gateway.pipeline.routing`, :mod:`gateway.pipeline.upstream_body`, :mod:`gateway.upstream.pool`,
:mod:`gateway.openai.sse`, :mod:`gateway.ledger.record`; limits, cache and metering through
:class:`gateway.pipeline.accounting.Accounting`.
Failures are :class:`gateway.errors.GatewayError` subclasses, turned into
OpenAI-shaped errors by the app's handlers; after a streamed 200 they become an in-stream error event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.auth.keys import KeyInfo, KeyStore
from gateway.config import Settings, TierConfig
from gateway.errors import BodyTooLarge, GatewayError, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from gateway.ledger.record import UsageRecord, emit
from gateway.openai import sse
from gateway.openai.chunks import StreamAssembler, replay
from gateway.pipeline import abstention, upstream_body
from gateway.pipeline import request as schemas
from gateway.pipeline.routing import RouteDecision, Routing
from gateway.thinking import forcing as budget
from gateway.upstream.pool import UpstreamConnectTimeout, UpstreamPool

if TYPE_CHECKING:
    from gateway.pipeline.accounting import Accounting
    from gateway.state.cache import Ticket

log = logging.getLogger("thinkgate.proxy")

PATHS = {"chat": "/chat/completions", "completions": "/completions"}
VALIDATORS = {"chat": schemas.validate_chat, "completions": schemas.validate_completion}
TIER_HEADER = "x-thinkgate-tier"
CACHE_HEADER = "x-thinkgate-cache"
SIMILARITY_HEADER = "x-thinkgate-cache-similarity"
CLIENT_CLOSED = 499  # nginx's convention for "client closed the request"

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


def _reasoning_of(part: dict[str, Any] | None) -> str | None:
    if not part:
        return None
    return part.get("reasoning") or part.get("reasoning_content")


def needs_reasoning_count(usage: dict[str, Any] | None) -> bool:
    """True when ``usage`` lacks a positive ``completion_tokens_details.reasoning_tokens``.

    A 0 next to non-empty reasoning text is treated as missing: some vLLM reasoning parsers report 0.
    """
    details = (usage or {}).get("completion_tokens_details") or {}
    return not details.get("reasoning_tokens")


def estimate_tokens(text: str) -> int:
    """Rough token count when no tokenizer answers: ~4 characters per token (OpenAI's rule of thumb)."""
    return max(1, (len(text) + 3) // 4) if text else 0


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

    async def handle(self, request: Request, endpoint: str) -> Response:
        """Serve one ``chat`` or ``completions`` request; raises GatewayError before any byte is sent."""
        key = await self.keys.authenticate(request.headers.get("authorization"))
        body = schemas.parse_json_object(await read_body(request, self.max_body))
        VALIDATORS[endpoint](body)
        return await self.serve(key, body, request.headers, endpoint)

    async def serve(self, key: KeyInfo, body: dict[str, Any], headers: Mapping[str, str], endpoint: str,
                    label: str | None = None, route: RouteDecision | None = None) -> Response:
        """Serve a validated ``chat`` or ``completions`` ``body`` for ``key`` (``headers``: the request's).

        Other APIs translated onto chat (``/v1/responses``, ``/v1/messages``) call this with ``label``, the
        usage event's ``endpoint`` (it also scopes their cache entries), and may pass the ``route`` they
        decided themselves. Raises GatewayError before any byte is sent."""
        route = route or self.routing.decide(body, headers.get(TIER_HEADER))
        record = UsageRecord(
            key_id=key.id,
            tags=key.tags,
            endpoint=label or endpoint,
            requested_model=body.get("model"),
            stream=body.get("stream") is True,
        )
        self._stamp(record, route)
        acct = self.accounting
        if acct is None:
            return await self._serve(route, body, endpoint, record, None)
        # limits: reserve before the upstream call (429 budget_exceeded / rate_limit_exceeded, Retry-After)
        await acct.admit(key, body, record, [route.tier, *self.routing.fallbacks(route.tier)])
        ticket: Ticket | None = None
        try:
            # cache: key = tenant scope + the post-routing upstream request
            up_body = upstream_body.build(body, route.tier, endpoint)
            ticket = await acct.cache_begin(key, record, route.tier, up_body, headers)
            if ticket.status == "hit":
                return self._replay_hit(ticket, route, record, body)
            return await self._serve(route, body, endpoint, record, ticket)
        except BaseException as exc:
            # Normally the record is already metered (errors included); this settles anything else.
            with anyio.CancelScope(shield=True):
                if ticket is not None:
                    await acct.cache_finish(ticket, None, record, route.tier)
                cancelled = isinstance(exc, asyncio.CancelledError | anyio.get_cancelled_exc_class())
                acct.abandon(record, route.tier, CLIENT_CLOSED if cancelled else 500,
                             "client_disconnected" if cancelled else "internal_error")
            raise

    async def _serve(self, route: RouteDecision, body: dict[str, Any], endpoint: str, record: UsageRecord,
                     ticket: Ticket | None) -> Response:
        """Call the upstream and answer (JSON or SSE relay); a complete answer is offered to the cache."""
        try:
            route, resp = await self._call_upstream(route, body, endpoint, record)
        except GatewayError as exc:
            await self._cache_finish(ticket, None, record, route.tier)
            self._finish(record, route.tier, getattr(exc, "status_code", exc.status), exc.code)
            raise
        self._stamp(record, route)
        # the cascade: each tier that lists escalation conditions is checked in turn, up the tier order
        while route.tier.escalate_on and (nxt := self._next_tier(route.tier)) is not None:
            before = route
            route, resp, record = await self._maybe_escalate(route, resp, body, endpoint, record, nxt)
            if route is before:
                break
        cache_ticket = ticket if route.reason not in ("fallback", "escalated") else None  # routed tier only
        if ticket is not None and cache_ticket is None:
            await self._cache_finish(ticket, None, record, route.tier)
        headers = {**route_headers(route, record), CACHE_HEADER: ticket.status if ticket else "bypass"}
        if record.stream:
            wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            relay = self._relay(resp, route.tier, record, wants_usage, cache_ticket)
            return sse.RelayResponse(relay, headers)
        return await self._complete(resp, route, record, cache_ticket, headers)

    def _replay_hit(self, ticket: Ticket, route: RouteDecision, record: UsageRecord,
                    body: dict[str, Any]) -> Response:
        """Serve a cached answer (JSON, or replayed as SSE): metered as a hit (cost 0, saved = its price)."""
        assert ticket.entry is not None
        cached = ticket.entry.body
        route = RouteDecision(route.tier, "cache", route.difficulty)
        self._stamp(record, route)
        record.cached = True
        record.set_usage(cached.get("usage"))
        record.usage_source = "cache"
        record.mark_first_byte()
        headers = {**route_headers(route, record), CACHE_HEADER: "hit"}
        if ticket.similarity is not None:  # a similar question's answer (gateway/state/semantic_cache.py)
            record.cache_request_id = ticket.source_request_id
            record.cache_similarity = ticket.similarity
            headers[CACHE_HEADER] = "semantic-hit"
            headers[SIMILARITY_HEADER] = f"{ticket.similarity:.4f}"
        self._finish(record, route.tier, 200)
        if not record.stream:
            return Response(orjson.dumps(cached), media_type="application/json", headers=headers)
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        frames = replay(cached, wants_usage, self.settings.cache.replay_chunk_chars)
        return sse.RelayResponse(_iterate(frames), headers)

    async def _cache_finish(self, ticket: Ticket | None, answer: dict[str, Any] | None, record: UsageRecord,
                            tier: TierConfig) -> None:
        if ticket is not None and self.accounting is not None:
            await self.accounting.cache_finish(ticket, answer, record, tier)

    def _next_tier(self, tier: TierConfig) -> TierConfig | None:
        """The tier after ``tier`` in the configured order (cheapest first), or None for the last one."""
        names = [t.name for t in self.settings.tiers]
        i = names.index(tier.name)
        return self.settings.tiers[i + 1] if i + 1 < len(names) else None

    async def _maybe_escalate(
        self, route: RouteDecision, resp: Any, body: dict[str, Any], endpoint: str, record: UsageRecord,
        nxt: TierConfig,
    ) -> tuple[RouteDecision, Any, UsageRecord]:
        """Retry on ``nxt`` when the tier's answer is empty, was cut inside its thought, abstains or is unsure
        (``tier.escalate_on``; :mod:`gateway.pipeline.abstention`). Both calls are metered: the first attempt
        as its own usage record (``error_code: escalated_<why>``), the retry with route reason ``escalated``.
        Streams are read up to the first answer token to decide (:func:`gateway.thinking.forcing.peek_stream`),
        or to their end when the tier checks the answer's content (``abstain``/``low_confidence``)."""
        tier = route.tier
        if record.stream:
            whole = bool({"abstain", "low_confidence"} & set(tier.escalate_on))
            resp, summary = await budget.peek_stream(resp, endpoint, whole=whole)
        else:
            try:
                summary = orjson.loads(resp.content)
            except orjson.JSONDecodeError:
                return route, resp, record
        why = None
        if isinstance(summary, dict):
            why = budget.escalation_reason(tier, summary, endpoint) or abstention.cascade_reason(
                tier.escalate_on, tier.abstain_phrases, tier.min_answer_logprob, summary, endpoint)
        if why is None:
            return route, resp, record
        await resp.aclose()
        log.info("tier %s gave %s; escalating to %s", route.tier.name, why, nxt.name)
        record.mark_first_byte()
        record.set_usage(summary.get("usage") if isinstance(summary.get("usage"), dict) else None)
        self._finish(record, route.tier, 200, f"escalated_{why}")
        retry = RouteDecision(nxt, "escalated", route.difficulty)
        again = UsageRecord(key_id=record.key_id, tags=record.tags, endpoint=record.endpoint,
                            requested_model=record.requested_model, stream=record.stream)
        self._stamp(again, retry)
        try:
            routed, resp = await self._call_upstream(retry, body, endpoint, again)
        except GatewayError as exc:
            self._finish(again, nxt, getattr(exc, "status_code", exc.status), exc.code)
            raise
        if routed.reason == "fallback":
            routed = RouteDecision(routed.tier, "escalated", route.difficulty)
        self._stamp(again, routed)
        return routed, resp, again

    async def _call_upstream(
        self, route: RouteDecision, body: dict[str, Any], endpoint: str, record: UsageRecord
    ) -> tuple[RouteDecision, httpx.Response]:
        """Open the upstream call on the routed tier, falling back to later tiers when it is down."""
        candidates = [route.tier, *self.routing.fallbacks(route.tier)]
        last: GatewayError | None = None
        for i, tier in enumerate(candidates):
            built = upstream_body.build(body, tier, endpoint)
            try:
                if tier.budget_mode == "forced":
                    resp: Any = await budget.open_forced(self.upstreams, tier, endpoint, built)
                else:
                    resp = await self.upstreams.open(tier, PATHS[endpoint], orjson.dumps(built), stream=record.stream)
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

    async def _complete(self, resp: httpx.Response, route: RouteDecision, record: UsageRecord,
                        ticket: Ticket | None, headers: dict[str, str]) -> Response:
        """Non-streamed answer: fill the reasoning count if missing, record usage, return the JSON."""
        content = resp.content
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            await self._cache_finish(ticket, None, record, route.tier)
            self._finish(record, route.tier, 502, "upstream_error")
            raise UpstreamError(f"upstream of tier {route.tier.name!r} sent an invalid JSON answer")
        usage = data.get("usage")
        reasoning = [r for c in data.get("choices") or () if (r := _reasoning_of(c.get("message")))]
        if reasoning and isinstance(usage, dict) and needs_reasoning_count(usage):
            await self._fill_reasoning(usage, route.tier, reasoning)
            content = orjson.dumps(data)
        record.mark_first_byte()
        record.set_usage(usage if isinstance(usage, dict) else None)
        complete = bool(data.get("choices")) and all(c.get("finish_reason") for c in data["choices"])
        await self._cache_finish(ticket, data if complete and isinstance(usage, dict) else None, record, route.tier)
        self._finish(record, route.tier, 200)
        return Response(content, media_type="application/json", headers=headers)

    async def _relay(
        self, resp: httpx.Response, tier: TierConfig, record: UsageRecord, wants_usage: bool,
        ticket: Ticket | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """Relay the upstream SSE stream; hold back the usage chunk (fill, forward only if asked).

        Upstream failures after the 200 become one in-stream error event (no ``[DONE]``). A client
        disconnect cancels this generator: the upstream response is closed, which cancels the request.
        With a cache ``ticket`` the stream is also assembled and stored once it completed successfully.
        """
        tally = sse.StreamTally()
        status: int | None = None
        code: str | None = None
        assembler = StreamAssembler() if ticket is not None and ticket.decision.store else None
        try:
            async for batch in sse.data_batches(resp):
                if assembler is not None:
                    assembler.feed_payloads(batch)
                out = tally.feed(batch)
                if tally.saw_text:
                    record.mark_first_byte()
                if out:
                    yield out
                if tally.done or tally.upstream_error:
                    break
            if tally.upstream_error:
                status, code = 502, "upstream_error"
                return
            if not tally.done:
                raise httpx.RemoteProtocolError("upstream stream ended without [DONE]")
            if tally.usage_chunk is not None:
                usage = tally.usage_chunk["usage"]
                texts = tally.reasoning_texts()
                if texts and needs_reasoning_count(usage):
                    await self._fill_reasoning(usage, tier, texts)
                record.set_usage(usage)
                if assembler is not None:
                    assembler.usage = usage  # with the filled reasoning count
                if wants_usage:
                    yield sse.event(orjson.dumps(tally.usage_chunk))
            elif tally.last_usage is not None:
                record.set_usage(tally.last_usage)
            else:
                self._count(record, tally)
            yield sse.DONE
            status = 200
        except httpx.TimeoutException:
            status, code = 504, "upstream_timeout"
            yield sse.error_event(UpstreamTimeout(f"upstream of tier {tier.name!r} stalled mid-stream"))
        except httpx.HTTPError as exc:
            status, code = 502, "upstream_stream_broken"
            yield sse.error_event(
                UpstreamError(f"upstream of tier {tier.name!r} broke the stream: {exc}", code=code)
            )
        finally:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
                if status is None:
                    status, code = CLIENT_CLOSED, "client_disconnected"
                if status != 200:
                    record.partial = True
                    if tally.usage_chunk is not None:
                        record.set_usage(tally.usage_chunk["usage"])
                    elif tally.last_usage is not None:
                        record.set_usage(tally.last_usage)
                    else:
                        self._count(record, tally)
                complete = status == 200 and assembler is not None and assembler.complete
                await self._cache_finish(ticket, assembler.result() if complete and assembler else None, record,
                                         tier)
                self._finish(record, tier, status, code)

    async def _fill_reasoning(self, usage: dict[str, Any], tier: TierConfig, texts: list[str]) -> None:
        """Set ``usage.completion_tokens_details.reasoning_tokens`` from the reasoning texts (one per
        choice): exact counts from the upstream's ``/tokenize``, else a ~4 chars/token estimate."""
        counts = await asyncio.gather(*(self.upstreams.count_tokens(tier, t) for t in texts))
        total = sum(c if c is not None else estimate_tokens(t) for c, t in zip(counts, texts, strict=True))
        details = usage.get("completion_tokens_details")
        if not isinstance(details, dict):
            details = {}
            usage["completion_tokens_details"] = details
        details["reasoning_tokens"] = total

    @staticmethod
    def _count(record: UsageRecord, tally: sse.StreamTally) -> None:
        # No upstream usage (client gone, stream broken): vLLM sends about one token per delta.
        record.completion_tokens = tally.reasoning_deltas + tally.text_deltas
        record.reasoning_tokens = tally.reasoning_deltas
        record.usage_source = "counted"

    @staticmethod
    def _stamp(record: UsageRecord, route: RouteDecision) -> None:
        record.tier = route.tier.name
        record.upstream_model = route.tier.model
        record.route_reason = route.reason
        record.difficulty = route.difficulty

    def _finish(self, record: UsageRecord, tier: TierConfig, status: int, code: str | None = None) -> None:
        record.error_code = code
        record.finish(tier, status)
        for sink in self.usage_sinks:
            try:
                sink(record)
            except Exception:
                log.exception("usage sink %r failed", sink)


async def _iterate(frames: Iterable[bytes]) -> AsyncGenerator[bytes, None]:
    for frame in frames:
        yield frame
