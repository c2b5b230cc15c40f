"""The request path of ``/v1/chat/completions`` and ``/v1/completions`` (and of the APIs translated onto chat):

    route → session → key policy → limits → cache (hit: replay) → upstream (+ fallback, + escalation)
          → an :class:`~gateway.pipeline.answer.Answer` (a chat dict, or a stream of chunks; stored in the cache
            when complete) → usage record → metering

:meth:`Proxy.serve` is that line, top to bottom. Authentication, the body, headers, status codes and SSE framing
are ``gateway/api/``'s: the caller arrives as a :class:`~gateway.pipeline.answer.Caller` and the answer leaves as
data. Routing runs before the limits so the budget reservation is priced for the tier(s) the request can
actually reach, and before the cache because the cache key is the post-routing upstream request.
Each step is a call into a small module: :mod:`gateway.pipeline.routing`, :mod:`gateway.pipeline.sessions`,
:mod:`gateway.pipeline.policy`, :mod:`gateway.pipeline.upstream_body`, :mod:`gateway.upstream.pool`,
:mod:`gateway.thinking.forcing`, :mod:`gateway.pipeline.escalation`, :mod:`gateway.pipeline.relay`; limits,
cache and metering through :class:`gateway.pipeline.accounting.Accounting`. One
:class:`gateway.pipeline.exchange.Exchange` per request carries the current attempt's usage record, the route
and the cache ticket, and every exit closes it once.
Failures are :class:`gateway.errors.GatewayError` subclasses, turned into
OpenAI-shaped errors by the app's handlers; after a streamed 200 they become an in-stream error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import orjson

from gateway.auth.keys import KeyStore
from gateway.config import Settings, TierConfig
from gateway.control.shadow import Shadow
from gateway.errors import ClientClosed, GatewayError, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from gateway.ledger.record import UsageRecord, emit
from gateway.observability.telemetry import Telemetry, span
from gateway.observability.telemetry import finish as end_trace
from gateway.openai.chunks import fresh_identity, replay_chunks
from gateway.openai.sse import Chunk, StreamTally, well_formed
from gateway.pipeline import abstention, escalation, policy, upstream_body
from gateway.pipeline.accounting import Ahead
from gateway.pipeline.answer import Answer, Caller
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.relay import (
    CLIENT_CLOSED,
    complete,
    count_answer,
    count_prompt,
    longest_wait,
    meter_closed,
    relay,
    renew,
)
from gateway.pipeline.routing import RouteDecision, Routing
from gateway.pipeline.sessions import Sessions
from gateway.thinking import dial
from gateway.thinking.forcing import ForcedCallFailed, open_forced
from gateway.upstream.balancer import conversation_affinity
from gateway.upstream.pool import ENDPOINT_PATHS, UpstreamConnectTimeout, UpstreamPool
from gateway.upstream.response import SyntheticResponse, UpstreamResponse, json_body

if TYPE_CHECKING:
    from gateway.pipeline.accounting import Accounting

log = logging.getLogger("thinkgate.proxy")

TIER_HEADER = "x-thinkgate-tier"

UsageSink = Callable[[UsageRecord], None]


class Proxy:
    """Serves the generation endpoints. Holds the key store, routing, upstream pool, accounting and usage sinks;
    ``accounting`` (limits, cache, metering) is part of every request's way."""

    def __init__(
        self,
        settings: Settings,
        keys: KeyStore,
        routing: Routing,
        upstreams: UpstreamPool,
        accounting: Accounting,
        usage_sinks: list[UsageSink] | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.settings = settings
        self.telemetry = telemetry  # OpenTelemetry traces (observability/telemetry.py; begun in api/); None: off
        self.keys = keys
        self.routing = routing
        self.upstreams = upstreams
        self.usage_sinks: list[UsageSink] = usage_sinks if usage_sinks is not None else [emit]
        self.accounting = accounting
        self.usage_sinks.append(accounting.sink)
        self.max_body = settings.server.max_body_bytes
        #: the tiers whose stream may be held back by an escalation peek before the relay renews its reservations:
        #: those that escalate, and those falling back to one that does (a key's allowed tiers aside: a timer more)
        self._peeked = frozenset(t.name for t in settings.tiers
                                 if any(f.escalate_on for f in (t, *routing.fallbacks(t))))
        #: shadow comparisons (``routing.shadow``; set by the app when on)
        self.shadow: Shadow | None = None
        self.sessions = (Sessions(settings, accounting.handle, accounting.breaker, accounting.metrics)
                         if settings.routing.session_ttl_s > 0 else None)

    # --- the way ----------------------------------------------------------------------------------------
    async def serve(self, caller: Caller, body: dict[str, Any], *, route: RouteDecision | None = None,
                    session: str | None = None,
                    disconnect: Callable[[], Awaitable[None]] | None = None) -> Answer:
        """Serve the validated ``body`` of ``caller``: route it (unless the API layer passes the ``route`` it
        decided), keep a chat conversation on its session's tier (``session``: the conversation's digest, else
        derived from the body; :mod:`gateway.pipeline.sessions`), check the key's policy, reserve its limits,
        look the answer up in the cache (a hit is replayed), else call the upstream — falling back, escalating —
        and return the :class:`Answer`. A refusal before any upstream call is audited (``Accounting.audit``) and
        raised with ``x-request-id``; any GatewayError is raised before the answer exists. ``disconnect`` returns
        when the client has gone away: a non-streamed answer is then cancelled upstream
        (:meth:`_unless_disconnected`); a stream notices it itself. A session whose turn escalated is re-pinned
        to the tier that answered."""
        acct = self.accounting
        record = caller.record()
        sticky = None
        try:
            with span("route"):
                route = route or self.routing.decide(body, caller.headers.get(TIER_HEADER))
            if self.sessions is not None and caller.endpoint == "chat":
                sticky = await self.sessions.stick(caller.key.id, body, route, session)
                route = sticky.route if sticky is not None else route
            # key policy and tier caps: allowed tiers (403 or downgrade), n ≤ max_n, max_tokens, thinking cap
            route = policy.key_route(caller.key, route, self.settings.tiers)
            policy.check_caps(caller.key, body, route.tier, budget_param="thinking.budget_tokens"
                              if caller.label == "messages" else "thinking_token_budget")
            capped = body.get("thinking_token_budget")
            if isinstance(capped, int) and capped != route.asked_budget:  # the key's cap clamped or set it
                route = replace(route, asked_budget=capped)
            # reserved at every budget level (429 with Retry-After, or 503); on a single Redis the same script
            # call writes the write-ahead record and looks the answer up (``Ahead``; cache key = tenant scope +
            # the post-routing upstream request)
            up_body = upstream_body.build(body, route.tier, caller.endpoint)
            with span("limits"):
                admitted = await acct.admit(caller.key, body, record, [route.tier, *self._fallbacks(route)],
                                            Ahead(route.tier, route.reason, up_body, caller.headers))
        except GatewayError as exc:
            self.refused(record, exc, route)
            raise
        ex = Exchange(record, route, self.usage_sinks, acct)
        ex.rate = admitted.rate
        if self.shadow is not None and caller.endpoint == "chat" and self.shadow.sampled(route, body):
            ex.on_answer = functools.partial(self._shadow_answer, body)
        try:
            with span("cache"):
                ex.ticket = await acct.cache_begin(caller.key, record, route.tier, up_body, caller.headers)
            if ex.ticket.status == "hit":
                answer = await self._replay_hit(ex, caller)
            elif caller.stream and not route.tier.escalate_on and route.tier.name not in self._peeked:
                answer = await self._answer(ex, body, caller)  # the relay renews a stream's reservations
            else:
                # a long non-streamed answer must not outlive its reservations, nor a stream an escalation peek holds
                # back (its tier's, or that of the tier it falls back to: through the whole thought, or the answer)
                # before the relay renews them: a timer starts their renewal a third of the TTL after admission (the
                # usual short call costs a timer, not a task). The client is watched meanwhile (a peeked stream's
                # too: the relay notices it after that)
                every = acct.settings.limits.reservation_ttl_s / 3
                timer = asyncio.get_running_loop().call_later(max(0.0, record.ts + every - time.time()),
                                                              self._start_renewal, ex)
                try:
                    answer = await (self._answer(ex, body, caller) if disconnect is None else
                                    self._unless_disconnected(disconnect, self._answer(ex, body, caller), ex, body))
                finally:
                    timer.cancel()
                    if ex.renewer is not None:
                        ex.renewer.cancel()
        except BaseException as exc:
            if isinstance(exc, GatewayError):  # an upstream's failure: the client can match it to its usage event
                exc.headers.setdefault("x-request-id", ex.record.request_id)
            # Normally every exit closed the exchange (errors included); this settles anything else.
            cancelled = isinstance(exc, asyncio.CancelledError | anyio.get_cancelled_exc_class())
            status, code = (CLIENT_CLOSED, "client_disconnected") if cancelled else (500, "internal_error")
            if isinstance(exc, GatewayError):  # the record says what the client got
                status, code = exc.status, exc.code or "upstream_error"
            with anyio.CancelScope(shield=True):
                await ex.abandon(status, code)
            raise
        answer.rate = ex.rate
        if sticky is not None and self.sessions is not None:
            answer.session = sticky.state
            if answer.escalated:
                await self.sessions.repin(sticky, answer.route.tier.name)
        return answer

    async def _answer(self, ex: Exchange, body: dict[str, Any], caller: Caller) -> Answer:
        """Call the upstream (falling back), escalate up the cascade while a tier's answer asks for it, and
        answer: the stream of chunks (relayed, metered at its end), or the JSON answer (metered now). Only the
        routed tier's answer is offered to the cache. An escalation whose call fails before it answers (the next
        tier down, refused, a 5xx; a stream that broke, stalled or sent an error event while peeked, the next tier
        escalating in turn, or the last tier's before its first content; one that reached ``limits.max_stream_s``
        still opening or before its first content: nothing of it reached the client; metered as that failed call,
        which releases the cache ticket) leaves the answer it would have improved — the exchange's held attempt, served
        as if not escalated, with the note ``failed; tier=…; reason=<error code>``; the held attempt is metered as
        escalated once the call answered (a peeked stream: once the peek read it), or as before when the request ends
        otherwise."""
        # a stream's limits.max_stream_s counts from its first upstream call (Exchange.stream_deadline): not from the
        # cache lookup's wait before it (a single-flight follower's, an embedding call's)
        ex.started = time.monotonic()
        resp = await self._call(ex, body, caller)
        data = None if caller.stream else await self._parsed(resp, ex)
        note = None
        # the held attempt's answer and the tier its escalation asked, while that tier's call has not answered
        held: tuple[UpstreamResponse, dict[str, Any] | None, str] | None = None
        # the cascade: each tier that lists escalation conditions is checked in turn, up the tier order
        while True:
            try:
                if held is not None:  # the escalation's call (a non-streamed answer is read whole here)
                    resp = await self._call(ex, body, caller)
                    data = None if caller.stream else await self._parsed(resp, ex)
                again = False
                # a stream is peeked here: until then the call has not answered (an escalation's stream, up to its
                # first content, whether its tier escalates or not)
                if ex.tier.escalate_on or (held is not None and caller.stream):
                    resp, note, again = await self._escalation(ex, resp, data, body, caller, asked=held is not None)
            except BaseException as exc:
                why = ex.settle_held(exc)  # the held attempt is the current one again, or metered as escalated
                if held is None or why is None or not isinstance(exc, GatewayError):
                    raise  # the client went away, something broke, or not the escalation's call: metered as before
                # the next tier could not answer (down, refused, failed or broke before answering; metered as the
                # failed call it was): the client keeps the answer it would have had without the escalation, as when
                # the budget refuses it — not a 502 for an answer billed and thrown away
                resp, data, nxt = held
                note = f"failed; tier={nxt}; reason={exc.code or 'upstream_error'}"
                # still judged too weak by its tier's escalate_on: an escalation outcome, as an escalated one is
                ex.record.escalation_not_taken = (why, nxt, note)
                log.warning("escalation to %s failed (%s); answering with tier %s", nxt, exc.code, ex.tier.name)
                break
            if not again:
                ex.settle_held()  # the escalation's call answered (if one was made): the held attempt was escalated
                break
            held = (resp, data, ex.tier.name)
        answer = Answer(ex.route, ex.record.request_id, ex.ticket.status if ex.ticket is not None else "bypass",
                        escalation=note)
        if ex.route.reason in ("fallback", "escalated") or note is not None:
            # only the routed tier's answer is cached, and not one its escalate_on judged too weak (an escalation
            # refused or failed): replayed, the same request would never escalate again
            await ex.release_cache()
        if caller.stream:
            n = body.get("n")
            choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
            answer.stream = relay(resp, ex, self.upstreams, caller.usage, choices=choices, body=body)
            answer.record = ex.record
            return answer
        assert data is not None
        changed = await complete(data, ex, self.upstreams, body, caller.endpoint)
        answer.body, answer.raw, answer.after = data, None if changed else resp.content or None, ex.after_response
        return answer

    async def _call(self, ex: Exchange, body: dict[str, Any], caller: Caller) -> UpstreamResponse:
        """Open the upstream call of the current attempt on its tier, falling back to later tiers when it is
        down (the route becomes ``fallback``, or stays ``escalated`` on an escalation's retry). A tier with
        several replicas prefers the conversation's replica (:func:`gateway.upstream.balancer.conversation_affinity`).
        The call's write-ahead record is written first (``Accounting.write_ahead``): nothing reaches an upstream
        unrecorded; a fallback names its tier there before it is sent (``Accounting.write_ahead`` again). Closes
        the exchange and raises the last error when no tier answers. A stream's opening is bounded by the time
        ``limits.max_stream_s`` leaves it (:meth:`Exchange.stream_deadline`): reached, the call is closed and fails
        with 504 ``stream_max_duration`` (:meth:`Exchange.opening_bound`)."""
        route, record = ex.route, ex.record
        await self.accounting.write_ahead(record)
        candidates = [route.tier, *self._fallbacks(route)]
        last: GatewayError | None = None
        for i, tier in enumerate(candidates):
            if i > 0:
                # the record names the call in flight before it is sent: a non-streamed answer is read whole inside
                # ``open``, and a client that hangs up meanwhile is billed this call's prompt
                # (:meth:`_unless_disconnected`) — on the tier it was sent to, at that tier's prices, not the one
                # that refused it; so does its write-ahead record (awaited: a process killed during the call is
                # settled from it), on this fallback path only
                ex.stamp(replace(route, tier=tier, reason="escalated" if route.reason == "escalated" else "fallback"))
                await self.accounting.write_ahead(record)
            built = upstream_body.build(body, tier, caller.endpoint)
            resp: UpstreamResponse | None = None
            try:
                async with ex.opening_bound():  # a stream's opening under limits.max_stream_s, or 504 there
                    with span("upstream"), conversation_affinity(body, candidates):
                        # prompted: forcing is the hard stop above the requested budget unless the upstream cuts
                        # it (hard_stop: native); with no budget there is nothing to stop, and one pass spares
                        # phase 2's second prompt
                        forced = dial.forcing_tier(tier, body)
                        if forced is not None:
                            resp = await open_forced(self.upstreams, forced, caller.endpoint, built,
                                                     functools.partial(count_prompt, self.upstreams, forced))
                        else:
                            resp = await self.upstreams.open(tier, ENDPOINT_PATHS[caller.endpoint],
                                                             orjson.dumps(built), stream=record.stream)
            except ForcedCallFailed as failed:  # a non-streamed forced call that failed once part of it ran
                record.partial = True
                if record.set_usage(failed.usage):  # what is known to have run (phase 1, phase 2 begun), billed
                    record.usage_source = failed.source
                await ex.close(failed.error.status, failed.error.code)
                raise failed.error from None
            except (UpstreamUnavailable, UpstreamConnectTimeout) as exc:
                log.warning("tier %s unavailable (%s)%s", tier.name, exc.message,
                            "; falling back" if i + 1 < len(candidates) else "")
                last = exc
                continue
            except GatewayError as exc:
                await ex.close(exc.status, exc.code)
                raise
            assert resp is not None  # or Exchange.opening_bound raised
            return resp
        assert last is not None
        ex.stamp(route)  # no tier answered (nothing ran, nothing billed): the record keeps the request's route
        await ex.close(last.status, last.code)
        raise last

    async def _parsed(self, resp: UpstreamResponse, ex: Exchange) -> dict[str, Any]:
        """The JSON answer of a non-streamed call; a body that is no JSON object closes the exchange (502) and
        raises UpstreamError."""
        try:
            data = json_body(resp)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict) or not well_formed(data):  # (a list for ``choices`` was a 500, retried by SDKs)
            await ex.close(502, "upstream_error")
            raise UpstreamError(f"upstream of tier {ex.tier.name!r} sent an invalid JSON answer")
        if "error" in data and not data.get("choices"):
            # a 200 whose body is an error document (a proxy before the engine, an engine's error after its headers):
            # the call failed — passed on as the 200 it came with, an SDK read it as an answer with no choices
            error = data["error"]
            message = error.get("message") if isinstance(error, dict) else error
            await ex.close(502, "upstream_error")
            raise UpstreamError(f"upstream of tier {ex.tier.name!r} answered 200 with an error: "
                                f"{str(message or 'no message')[:300]}")
        return data

    async def _escalation(self, ex: Exchange, resp: UpstreamResponse, data: dict[str, Any] | None,
                          body: dict[str, Any], caller: Caller,
                          asked: bool = False) -> tuple[UpstreamResponse, str | None, bool]:
        """Whether to retry on the next tier up (``Routing.next_tier``; none after the last): when the tier's
        answer is empty, was cut inside its thought, abstains or
        is unsure (``tier.escalate_on``; :mod:`gateway.pipeline.abstention`) — never when the client's own
        ``max_tokens`` cut it (:func:`gateway.pipeline.escalation.cut_by_client`). Both calls are metered: the first
        attempt as its own usage record (``error_code: escalated_<why>``, metered here), the retry — a new record
        of the caller, the exchange's current one on return — with route reason ``escalated``. Streams are read
        up to the first answer token to decide (:func:`gateway.pipeline.escalation.peek_stream`), or to their end
        when the tier checks the answer's content (``abstain``/``low_confidence``); a stream that breaks or stalls
        meanwhile, ends without ``[DONE]`` (a break), or sends an in-stream error event (``upstream_error``), is
        metered as the failed call it was (what it sent billed, partial) and its error raised — a 502/504 for the
        request's first call; an escalation's call (this tier was the one asked) leaves the client the answer the
        exchange holds (:meth:`_answer`). An
        escalation's streamed call (``asked``) whose tier does not escalate in turn (no ``escalate_on``, or none above
        it) is read only up to its first content (``peek_stream``'s ``start``) and relayed from there; failing before
        it, it is metered and raised the same way. A peek reaches the request's ``limits.max_stream_s`` too
        (:meth:`Exchange.stream_deadline`): stopped there, it escalates nothing (no time is left for another tier) and
        the relay passes on what it read and cuts the stream — unless it is an escalation's (``asked``) and read nothing
        of its content yet (no reasoning, content or tool-call delta): then the escalation failed at the bound, as one
        whose call failed before answering (:meth:`_cut_before_content`: closed, billed what it ran — its prompt and
        the deltas read, partial —, 504 ``stream_max_duration``), and the client is served the answer the exchange
        holds, with the note ``failed; tier=…; reason=stream_max_duration``. That answer was read to its end (it is
        judged weak once read: an empty one ends unanswered, an abstention is read whole) before the bound, so the relay
        passes it on whole, as it ended (its finish reason, ``[DONE]``), never cut: a stream cut with nothing in it
        was the answer paid twice and thrown away. One that read some of its content (a tier up the cascade, peeked in
        turn, cut in its thought) is relayed and cut as any. The retry is
        admitted —
        reserved at every budget level — before it is sent; when that is refused (or the key may not use
        ``nxt``) the first answer is kept, with the note ``skipped; tier=…; reason=…``. The first attempt is finished
        here and held by the exchange (:meth:`Exchange.next_attempt`, which meters as escalated an attempt it held
        before: this tier's call answered): :meth:`_answer` meters it, or serves it when the retry fails before
        answering. Returns (the response
        to answer with unless retrying, the note, whether to retry)."""
        tier = ex.tier
        nxt = self.routing.next_tier(tier) if tier.escalate_on else None
        if nxt is None and not (asked and caller.stream):
            return resp, None, False
        if caller.stream:
            resp, summary = await self._peek(ex, resp, body, caller, start=nxt is None, asked=asked)
        else:
            assert data is not None
            summary = data
        if nxt is None:  # an escalation's stream, its start read (nothing failed there): relayed from here, as it comes
            return resp, None, False
        if caller.stream and (summary["cut"] or time.monotonic() >= ex.stream_deadline()):
            # at limits.max_stream_s (the peek stopped there, undecided): the next tier would have no time left;
            # the relay passes on what was read and cuts the stream (a non-streamed answer has no such bound)
            return resp, None, False
        if escalation.cut_by_client(summary, body.get("max_completion_tokens") or body.get("max_tokens"), tier):
            return resp, None, False
        why = escalation.escalation_reason(tier, summary, caller.endpoint) or abstention.cascade_reason(
            tier.escalate_on, tier.abstain_phrases, tier.min_answer_logprob, summary, caller.endpoint) or \
            escalation.learned_reason(tier, summary, caller.endpoint, ex.route.window, ex.route.difficulty)
        if why is None:
            return resp, None, False
        retry = replace(ex.route, tier=nxt, reason="escalated")
        again = caller.record()
        # stamped before its admission: a call admitted and never sent (the client gone, meanwhile or after) is
        # metered as the escalated call it was for (here, or by Accounting when cancelled during the admission)
        again.tier, again.upstream_model, again.route_reason = nxt.name, nxt.model, "escalated"
        skipped = await self._admit_escalation(ex, retry, body, caller, again)
        if skipped is not None:
            log.info("tier %s gave %s; not escalating to %s (%s)", tier.name, why, nxt.name, skipped)
            note = f"skipped; tier={nxt.name}; reason={skipped}"
            # the answer was judged too weak all the same: an escalation outcome when it is metered (outcomes.py)
            ex.record.escalation_not_taken = (why, nxt.name, note)
            return resp, note, False
        try:
            await resp.aclose()
            log.info("tier %s gave %s; escalating to %s", tier.name, why, nxt.name)
            ex.record.mark_first_byte()
            usage = summary.get("usage")
            taken = ex.record.set_usage(usage if isinstance(usage, dict) else None)
            counted = summary.get("counted")
            if not taken and isinstance(counted, dict):  # the stream ended with no usage (or none to trust): counted
                await self._count_attempt(ex, counted, body)
            elif not taken and data is not None:  # a non-streamed answer with none: its text counted, not $0
                await count_answer(self.upstreams, ex, data, body, caller.endpoint)
            await ex.next_attempt(retry, 200, f"escalated_{why}", again)
        except BaseException as exc:
            # admitted, never sent (the client went away, or counting the first answer failed): metered as the call
            # that never ran — nothing sent, cost 0 — so its reservations are settled now, not held for
            # limits.reservation_ttl_s; the first attempt is the exchange's to close
            if ex.record is not again:
                cancelled = isinstance(exc, asyncio.CancelledError | anyio.get_cancelled_exc_class())
                self.accounting.abandon(again, nxt, CLIENT_CLOSED if cancelled else 500,
                                        "client_disconnected" if cancelled else "internal_error")
            raise
        return resp, None, True

    async def _peek(self, ex: Exchange, resp: UpstreamResponse, body: dict[str, Any], caller: Caller,
                    start: bool, asked: bool = False) -> tuple[UpstreamResponse, dict[str, Any]]:
        """:func:`gateway.pipeline.escalation.peek_stream` of the current attempt's stream (``start``: an escalation's
        call whose tier does not escalate in turn, read up to its first content only), for :meth:`_escalation`.
        A stream that fails meanwhile is metered as the failed call it was and its error raised; one the client
        left meanwhile (cancelled by :meth:`_unless_disconnected`; the peek closed the call) is billed what the
        closed stream knows it ran (a forced stream in its answer phase: :func:`~gateway.pipeline.relay.meter_closed`),
        else the deltas read, and its prompt where it is metered. An escalation's stream (``asked``) stopped at
        ``limits.max_stream_s`` before its first content fails there (:meth:`_cut_before_content`)."""
        tier = ex.tier
        whole = bool({"abstain", "low_confidence"} & set(tier.escalate_on))
        read = StreamTally()
        try:
            peeked, summary = await escalation.peek_stream(resp, tier, caller.endpoint, whole=whole, start=start,
                                                           tally=read, deadline=ex.stream_deadline(),
                                                           patience=longest_wait(tier))
        except (asyncio.CancelledError, anyio.get_cancelled_exc_class()):
            if not ex.closed and ex.record.usage_source == "none":
                # what the closed stream knows it ran (a forced one in its answer phase: its bill, phase 2's prompt
                # in it — the prompt is then not counted again), else the deltas read; shielded, as the close was
                with anyio.CancelScope(shield=True):
                    billed = await meter_closed(resp, ex.record)
                if not billed:
                    got = escalation.counted(read)
                    ex.record.set_counted(got["completion_tokens"], got["reasoning_tokens"])
            raise
        except escalation.PeekBroken as broken:  # before a byte reached the client: the deltas read are billed
            if ex.record.set_usage(broken.usage):  # (or what the upstream said had run, when it said it)
                if isinstance(resp, SyntheticResponse) and resp.counted_on_failure:
                    # a forced stream's usage before its failure is the gateway's bill (ForcedBudget._spent), not an
                    # upstream's report: metered as the relay meters it
                    ex.record.usage_source = "counted"
            elif not await meter_closed(resp, ex.record):  # a forced phase 1 failed once it reported: that report
                await self._count_attempt(ex, broken.counted, body)
            ex.record.partial = True
            exc = broken.cause  # an in-stream error event: upstream_error, as the relay meters one it passes on
            if not broken.reported and not isinstance(exc, UpstreamTimeout) and \
                    isinstance(exc, UpstreamError | httpx.HTTPError):
                broke = exc.message if isinstance(exc, GatewayError) else type(exc).__name__
                exc = UpstreamError(f"upstream of tier {tier.name!r} broke the stream: {broke}",
                                    code="upstream_stream_broken")
            if isinstance(exc, GatewayError):
                # metered as the failed call it was; an escalation's (a tier up the cascade peeked in turn):
                # the attempt the exchange holds is served instead (_answer)
                await ex.close(exc.status, exc.code)
            raise exc from None
        if asked and summary["cut"] and not read.saw_text:
            await self._cut_before_content(ex, peeked, read, body)
        return peeked, summary

    async def _cut_before_content(self, ex: Exchange, peeked: UpstreamResponse, read: StreamTally,
                                  body: dict[str, Any]) -> None:
        """An escalation's stream the peek stopped at ``limits.max_stream_s`` before its first content (a reasoning,
        content or tool-call delta): closed, metered as the failed call it was — what it ran billed as the relay bills
        a stream cut at its bound (what the closed stream knows it ran, else the upstream's running totals, else the
        deltas read and the prompt counted), partial, 504 ``stream_max_duration`` — and raised as that error, so that
        :meth:`_answer` serves the answer the exchange holds."""
        with anyio.CancelScope(shield=True):  # the upstream call is closed, as the peek closes one
            await peeked.aclose()
        rec = ex.record
        rec.partial = True
        if not await meter_closed(peeked, rec) and not rec.set_usage(read.last_usage):
            await self._count_attempt(ex, escalation.counted(read), body)
        exc = UpstreamTimeout(f"upstream of tier {ex.tier.name!r} had not begun its answer when the stream reached "
                              "limits.max_stream_s", code="stream_max_duration")
        await ex.close(exc.status, exc.code)
        raise exc

    async def _count_attempt(self, ex: Exchange, counted: dict[str, int], body: dict[str, Any]) -> None:
        """A peeked attempt that brought no usage (the stream ended without any, or it broke, stalled or sent an
        error event while it was read) is billed what it generated (the deltas read) and its prompt
        (:func:`gateway.pipeline.relay.count_prompt`) — it was metered at 0."""
        rec = ex.record
        rec.set_counted(counted["completion_tokens"], counted["reasoning_tokens"])
        rec.prompt_tokens = await count_prompt(self.upstreams, ex.tier, body)

    async def _admit_escalation(self, ex: Exchange, retry: RouteDecision, body: dict[str, Any], caller: Caller,
                                again: UsageRecord) -> str | None:
        """Reserve the escalated call (``again``'s id) on ``retry.tier`` and its fallbacks; None when admitted,
        else why it may not be sent (an error code)."""
        if retry.allowed is not None and retry.tier.name not in retry.allowed:
            return "tier_not_allowed"
        try:
            policy.check_caps(caller.key, dict(body), retry.tier)
            admitted = await self.accounting.admit(caller.key, body, again, [retry.tier, *self._fallbacks(retry)])
        except GatewayError as exc:
            return exc.code or "refused"
        ex.rate = admitted.rate or ex.rate  # the headers say what the key has left after this call too
        return None

    async def _replay_hit(self, ex: Exchange, caller: Caller) -> Answer:
        """Serve a cached answer (the dict, or replayed as chunks): metered as a hit (cost 0, saved = its price).
        The answer gets its own ``id`` and ``created`` (:func:`fresh_identity`): clients and tracing tools key
        completions by id, and two requests must not share one."""
        ticket = ex.ticket
        assert ticket is not None and ticket.entry is not None
        cached = fresh_identity(ticket.entry.body)
        ex.stamp(replace(ex.route, reason="cache"))
        record = ex.record
        record.cached = True
        record.set_usage(cached.get("usage"))
        record.usage_source = "cache"
        record.mark_first_byte()
        answer = Answer(ex.route, record.request_id, "hit")
        if ticket.similarity is not None:  # a similar question's answer (gateway/semantic/cache.py)
            record.cache_request_id = ticket.source_request_id
            record.cache_similarity = ticket.similarity
            answer.cache, answer.similarity = "semantic-hit", ticket.similarity
        await ex.close(200)
        if not record.stream:
            answer.body = cached
        else:
            chunks = replay_chunks(cached, caller.usage, self.settings.cache.replay_chunk_chars)
            answer.stream = _one_by_one(chunks)
        return answer

    async def _unless_disconnected(self, disconnect: Callable[[], Awaitable[None]], serving: Awaitable[Answer],
                                   ex: Exchange, body: dict[str, Any]) -> Answer:
        """Run ``serving`` (a non-streamed answer; a stream up to its 200, while a tier that escalates is peeked)
        until done, or until the client goes away: then cancel it — which closes the upstream request, and vLLM
        aborts a request whose connection closed — meter the current attempt as ``partial`` with status 499, and
        raise :class:`ClientClosed`. A non-streamed upstream reports no usage before its end: once the attempt was
        admitted (its call follows at once), its prompt is billed (:func:`~gateway.pipeline.relay.count_prompt`,
        ``usage_source: counted``; the upstream had it and began on it — a client that hung up each time got the
        compute for $0), its generated tokens are unknown (0); a peeked stream's are the deltas read
        (:meth:`_escalation`)."""
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
            rec = ex.record
            # no usage came (a peeked stream's deltas may have been counted): the prompt is counted too
            if not ex.closed and rec.completion_bound is not None and rec.usage_source != "upstream" \
                    and not rec.prompt_tokens:
                rec.prompt_tokens, rec.usage_source = await count_prompt(self.upstreams, ex.tier, body), "counted"
            await ex.abandon(CLIENT_CLOSED, "client_disconnected")
        raise ClientClosed("the client closed the connection; the upstream call was cancelled")

    # --- around the way ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def auditing(self, record: UsageRecord) -> Iterator[UsageRecord]:
        """Audit a :class:`GatewayError` raised inside the block — a request refused before any upstream call —
        with what ``record`` knows by then (key, model), and re-raise it. For ``gateway/api/``'s steps before
        :meth:`serve` (authentication, the body, its validation)."""
        try:
            yield record
        except GatewayError as exc:
            self.refused(record, exc)
            raise

    def refused(self, record: UsageRecord, exc: GatewayError, route: RouteDecision | None = None) -> None:
        """Audit a request refused before any upstream call (see ``Accounting.audit``)."""
        if route is not None:
            record.tier, record.upstream_model, record.route_reason = route.tier.name, route.tier.model, route.reason
        self.accounting.audit(record, exc.status, exc.code)
        end_trace(record)  # the request span says what was known: the model asked for, the tier when routed
        exc.headers.setdefault("x-request-id", record.request_id)

    def _start_renewal(self, ex: Exchange) -> None:
        ex.renewer = asyncio.ensure_future(renew(self.accounting, ex))

    def _shadow_answer(self, body: dict[str, Any], ex: Exchange, answer: dict[str, Any]) -> None:
        """A sampled request's answer is complete: compare it with the next tier up once the client has it (a
        stream: now, after its last chunk; JSON: from the answer's after-response hook)."""
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


async def _one_by_one(chunks: Iterator[Chunk]) -> AsyncGenerator[list[Chunk], None]:
    for c in chunks:
        yield [c]
