"""One request's lifecycle on the request path: its usage record, its route and its cache ticket, closed once.

Every exit of the pipeline — a JSON answer, the end of an SSE relay, an upstream error, a client that went away,
a cache hit — ends in :meth:`Exchange.close`, which offers the answer to the cache (or releases the single-flight
lock), then finishes the usage record and hands it to the usage sinks. ``close`` is idempotent, so a later
safety net (the proxy's ``except BaseException``) can call :meth:`abandon` without double metering.
An escalation finishes the first attempt and continues with the next attempt's record (:meth:`next_attempt`); the
first is metered once the next call answered (a stream the cascade peeks in turn: once the peek read it), or served
after all when it could not (:meth:`settle_held`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio

from gateway.config import TierConfig
from gateway.errors import GatewayError, UpstreamTimeout
from gateway.ledger.record import UsageRecord
from gateway.observability import telemetry
from gateway.upstream.pool import longest_opening

if TYPE_CHECKING:
    from gateway.pipeline.accounting import Accounting
    from gateway.pipeline.routing import RouteDecision
    from gateway.state.cache import Ticket
    from gateway.state.limits import RateState

log = logging.getLogger("thinkgate.proxy")

UsageSink = Callable[[UsageRecord], None]


class Exchange:
    """The state of one request between admission and its usage event.

    ``record`` is the usage record of the current upstream attempt; ``route`` its tier and reason; ``ticket``
    the cache ticket (None when the cache is bypassed or already released).
    """

    __slots__ = ("_closed", "_held", "accounting", "after_response", "on_answer", "rate", "record", "renewer", "route",
                 "sinks", "started", "ticket")

    def __init__(self, record: UsageRecord, route: RouteDecision, sinks: list[UsageSink],
                 accounting: Accounting) -> None:
        self.record = record
        self.sinks = sinks
        self.accounting = accounting
        self.ticket: Ticket | None = None
        self._closed = False
        #: an escalation's previous attempt, finished and not yet metered, and its route (:meth:`next_attempt`)
        self._held: tuple[UsageRecord, RouteDecision] | None = None
        #: called with a complete, successful answer when the exchange closes (the shadow comparisons)
        self.on_answer: Callable[[Exchange, dict[str, Any]], None] | None = None
        #: run after a JSON response's last byte was sent (set by ``on_answer``; Starlette's background hook)
        self.after_response: Callable[[], Awaitable[None]] | None = None
        self.route = route
        #: the key's RPM/TPM windows after the latest admission of this request (an escalation's, when one ran)
        self.rate: RateState | None = None
        #: the renewal of a long non-streamed call's reservations, once its timer started it
        self.renewer: asyncio.Task[None] | None = None
        #: ``time.monotonic()`` when the request's first upstream call was about to be sent (set then by
        #: ``Proxy._answer``; its admission until then): a stream's ``limits.max_stream_s`` counts from here
        #: (:meth:`stream_deadline`)
        self.started = time.monotonic()
        self.stamp(route)

    @property
    def tier(self) -> TierConfig:
        """The tier of the current attempt."""
        return self.route.tier

    def stream_deadline(self) -> float:
        """``time.monotonic()`` at which the request's stream reaches ``limits.max_stream_s`` and is cut.

        Counted from the request's first upstream call (:attr:`started`), not from the first byte relayed: what ran
        before the relay — a tier's stream held back by the escalation peek (a whole thought, or answer), an
        escalation's calls, a forced stream's opening — is the same request's time on the upstreams, under
        reservations that are as old, and the client waited through it. Per request, not per attempt: a cascade
        of three tiers is one stream, bounded once."""
        return self.started + self.accounting.settings.limits.max_stream_s

    @contextlib.asynccontextmanager
    async def opening_bound(self) -> AsyncIterator[None]:
        """The context the current attempt's upstream call opens in (``Proxy._call``). A stream's opening counts
        against ``limits.max_stream_s`` as the rest of it does (an escalation's call opens with what the first answer
        left of the bound): the call is cancelled when :meth:`stream_deadline` passes — timed only when the tier's own
        timeouts could end the opening past it (:func:`~gateway.upstream.pool.longest_opening`; a stream's first call
        rarely: no timer on the usual path), never for a non-streamed call.

        Raises :class:`~gateway.errors.UpstreamTimeout` (504 ``stream_max_duration``; the record marked partial) when
        the bound closed the call — no response head yet, or a forced stream's thought phase not answered. The caller
        meters it as the failed call it was (nothing billed: no 200 came, as for a head that timed out). Before
        anything reached the client: an escalation's call so fails and ``Proxy._answer`` serves the answer the
        exchange holds (note ``failed; tier=…; reason=stream_max_duration``); a request's first call is the client's
        504. (One context for the timer and its failure: one stop on the request's way, bench/request_walk.py.)"""
        left = self.stream_deadline() - time.monotonic() if self.record.stream else math.inf
        if left > longest_opening(self.tier):
            yield
            return
        with anyio.move_on_after(left) as scope:
            yield
        if scope.cancelled_caught:
            self.record.partial = True
            raise UpstreamTimeout(f"upstream of tier {self.tier.name!r} had not answered when the stream reached "
                                  "limits.max_stream_s", code="stream_max_duration")

    @property
    def closed(self) -> bool:
        """True once the usage record was finished and sent to the sinks."""
        return self._closed

    def stamp(self, route: RouteDecision) -> None:
        """Make ``route`` the current one and write it into the record (tier, model, reason, difficulty)."""
        self.route = route
        r = self.record
        r.tier = route.tier.name
        r.upstream_model = route.tier.model
        r.route_reason = route.reason
        r.difficulty = route.difficulty
        r.routing_window = route.window

    async def release_cache(self, answer: dict[str, Any] | None = None) -> None:
        """Store ``answer`` (a complete, successful response; None stores nothing) and release the ticket's
        single-flight lock. Idempotent; shielded from cancellation so a lock is never left behind."""
        ticket, self.ticket = self.ticket, None
        if ticket is not None:
            with anyio.CancelScope(shield=True):
                await self.accounting.cache_finish(ticket, answer, self.record, self.tier)

    async def close(self, status: int, code: str | None = None, answer: dict[str, Any] | None = None) -> None:
        """End the request: cache (``answer`` or release), then the usage record with HTTP ``status`` and
        error ``code``. Only the first call has an effect."""
        if self._closed:
            return
        await self.release_cache(answer)
        self._meter(status, code)
        if answer is not None and status == 200 and self.on_answer is not None:
            self.on_answer(self, answer)

    async def next_attempt(self, route: RouteDecision, status: int, code: str, record: UsageRecord) -> None:
        """Finish the current attempt (``status``, ``code`` — e.g. ``escalated_empty_answer``) and continue on
        ``route`` with ``record`` (the next attempt's, already admitted under its id); the cache ticket stays
        with the exchange. The finished attempt is held, not metered yet: :meth:`settle_held` meters it once the
        next call answered (or the request ends any other way), or serves it after all when the next call failed
        before answering. An attempt held before (the previous step of a cascade) is metered as escalated first:
        the current call, which escalates in turn, answered."""
        self.settle_held()
        held = self.record
        held.error_code = code
        held.escalated_to = route.tier.name
        held.finish(self.tier, status)
        self._held = (held, self.route)
        record.escalated_from = held.escalated_from or held.route_reason
        self.record = record
        self._closed = False
        self.stamp(route)

    def settle_held(self, failed: BaseException | None = None) -> str | None:
        """Settle the attempt :meth:`next_attempt` held once the next call is out of the way. ``failed``: what the
        next call raised, if it did. When it is a gateway error that closed the exchange (the next call failed
        before it answered, and was metered as the failed call it was), the held attempt's answer is the request's
        after all: it becomes the current attempt again, unmetered and open, as if it had not been escalated (its
        error code cleared; the answer's way closes it) — returns why it was escalated (``<why>`` of its
        ``escalated_<why>``). Otherwise (the next call answered, or the request ends another way: the client gone,
        an error before the call) the held attempt is metered as it was finished there, escalated — returns None.
        No-op (None) when none is held, and after the first call."""
        held, self._held = self._held, None
        if held is None:
            return None
        if isinstance(failed, GatewayError) and self._closed:
            self.record, route = held
            why = (self.record.error_code or "").removeprefix("escalated_")
            self.record.error_code = self.record.escalated_to = None
            self._closed = False
            self.stamp(route)
            return why
        self._send(held[0])
        return None

    async def abandon(self, status: int, code: str) -> None:
        """The safety net for an exit no step closed (an unexpected error, a cancellation): release the cache
        and meter the record as ``partial`` — unless it was already closed."""
        if self._closed:
            await self.release_cache()
            return
        self.record.partial = True
        await self.close(status, code)

    def _meter(self, status: int, code: str | None) -> None:
        self._closed = True
        self.record.error_code = code
        self.record.finish(self.tier, status)
        self._send(self.record)

    def _send(self, record: UsageRecord) -> None:
        """Hand a finished record to the usage sinks; end the request span with it — unless an attempt is held
        (an escalation's call that failed, whose held answer may still be served): then it is an event on it."""
        with telemetry.span("metering"):
            for sink in self.sinks:
                try:
                    sink(record)
                except Exception:
                    log.exception("usage sink %r failed", sink)
        if self._held is None:
            telemetry.finish(record)
        else:
            telemetry.event("thinkgate.escalation_failed", record)
