"""Write-ahead metering: a durable record of every upstream call in flight, so a gateway that dies leaves no usage
unmetered.

Lifecycle of one record (one per usage record, i.e. per upstream call: an escalation's retry has its own):

1. :meth:`WriteAhead.begin` — before the call's first upstream byte: ``HSET wal:open {request_id} {record}`` (one
   round trip, shared by the begins of concurrent requests: a group commit; ``gateway/state/keys.py``). On a
   single Redis a request's first call writes it inside its admission script instead (``gateway/state/limits.py``
   ``HOT_LUA``: the same ``HSET``, in the same atomic step that admits it; :meth:`WriteAhead.written` then tracks
   it here), so it costs no round trip of its own; escalations and the Cluster keep :meth:`begin`. The
   record (:class:`WalRecord`) says who (key, tags), what (endpoint, models, tier), when (``ts``, the request's
   start: the usage event's day and TPM minute), the reservation's upper bound (micro-USD, tokens) and the
   owning process (``owner``). A record is taken for a call sent upstream unless it says ``waiting``.
2. :meth:`WriteAhead.waiting` — a request whose admission script wrote its record and that then waits before its
   upstream call (a single-flight follower waiting for an identical request's answer, ``gateway/state/cache.py``:
   up to ``cache.single_flight_wait_s``) marks it ``waiting``, in the background; :meth:`WriteAhead.sending`
   clears the mark before the call is sent if the wait ends in one (awaited: the record says so before the first
   byte). Only such a wait writes: the common path (no wait, or a wait that ends in a cache hit) writes nothing.
3. :meth:`WriteAhead.retarget` — a call that falls back to another tier (its routed tier refused it) names that tier
   (its model, route reason ``fallback``) before the fallback call is sent (awaited: a fallback's one extra round
   trip after a refused call; a call without a fallback writes nothing), so a call killed during its fallback is
   priced on the tier it ran on, not the one that refused it.
4. :meth:`WriteAhead.progress` — as a stream relays tokens: the tokens known so far (deltas counted, or the
   upstream's running usage when it sends one), written at most every ``metering.write_ahead_interval_s`` per
   stream, in the background.
5. The final event — the request finished and its usage event has to wait in the process's queue behind a stalled
   metering batch (out for more than ``WAL_FINAL_AFTER_S``; ``Accounting.sink``): :meth:`WriteAhead.settled` puts
   the event itself into the record, in the background. A writer idle or within a round trip sends the event with
   its next batch instead: a write of the record would land no sooner.
6. Settlement — the request's usage event: the metering script (``gateway/state/metering.py``) deletes the record
   in the same atomic step that counts the event. Exactly one settled event per request id: the event id is the
   request id and the script counts an id once.

Steps 2–5 are updates: one task writes every due record in one script call (a group commit) and collects the next
batch while it is out, so a record has at most one write in flight and its states land in order; each is written
only while its request is not settled (the script checks the day's seen-set), so a late update never reopens it.
None of them is awaited by the request but the end of a wait that goes on to the upstream (step 2) and a
fallback's tier (step 3), rare paths that pay one round trip before their call: a request that neither waits nor
falls back has no write-ahead round trip before its response's last byte.

Each process keeps a heartbeat ``wal:hb:{owner}`` (``PX metering.heartbeat_ttl_s``, refreshed every third of it).
:meth:`WriteAhead.reconcile` — at start and every ``metering.reconcile_interval_s`` — scans the open records
(every one, reading their owners' heartbeats; at most ``metering.reconcile_batch`` of dead owners a pass) and meters
those of dead owners: heartbeat absent, record not
updated for a heartbeat TTL, and seen so for a TTL by this reconciler (a live owner whose heartbeat lapsed while
Redis was away gets that long to renew it). Such a record is settled as one of three, each under the same atomic
claim — only if the record is still open and the owner's heartbeat still absent, deleting it in that step (two
replicas reconciling at once settle it once) — and each releasing the request's budget reservations at every level
and correcting its TPM window, like any usage event:

- **finished** (the record holds its final event, step 5): that event, counted as it is (its real status and
  tokens) through :meth:`Meter.settle_orphan`.
- **never sent** (``waiting``, no token, no final event): the process died while the request waited before its
  upstream call (step 2), or replayed the answer that wait brought (a cache hit). Nothing was used upstream, so it
  is not a request: :meth:`Meter.release_orphan` releases its reservations and records an *audit* event
  (``UsageEvent.audit``: ``status`` 500, ``error_code`` :data:`UNSENT_CODE`, cost 0, ``request_id`` the request's,
  ``event_id`` ``{request id}:unsent``) — in the stream, the exports and the usage cube's ``refused`` (as not
  served, with the refusals), in no counter, spend sum or request/error count; so an auditor finds every admitted
  request id in the ledger, counted or not. The request id itself is not added to the seen-set: should the owner
  turn out to be alive (its heartbeat lapsed while Redis was away) and send the call, that call's own event still
  counts once.
- **lost** (otherwise: sent, not finished): a usage event with ``partial: true``, ``status`` 500,
  ``error_code: gateway_lost`` and the tokens of its last update, priced at its tier's prices — the tier of the
  call in flight, a fallback's once it was sent (step 3) (:meth:`Meter.settle_orphan`). Its completion count is
  held to the call's admitted bound (``bound_completion``: choices × min(max_tokens, tier cap)), as a finished
  call's reported or counted one is: a record that claims more (an upstream that ignored ``max_tokens`` and
  streamed on, a running usage that misreports) is metered at the bound, ``error_code`` :data:`OVER_BOUND_CODE`
  and ``over_bound`` (the mark of a finished call held to its bound). Its prompt count is held to the call's
  admitted prompt bound (``bound_prompt``: what admission reserved for the prompt — its UTF-8 bytes plus template
  overhead, a forced-thinking tier's two phases, the largest over the tier and its fallbacks): the only source of
  a lost call's prompt count is the upstream's running usage, and one that claims more than the request could
  hold is metered at that bound, with the same code and mark.

What is left of "never sent" taken for "lost": a process killed in the short stretch between a request's admission
and its upstream call without a wait (routing the admission reply, a cache miss's bookkeeping, a semantic cache's
lookup and its embedding call — tens of milliseconds at most), or within the one background write of a wait's
start (the mark not yet in Redis) leaves a record taken for a sent call: it is settled as ``gateway_lost`` at 0
tokens, cost 0 — a request and an error too many in the counts, never money. Marking every request at its start
would close it at one more script call per request (measured 10–16% more gateway CPU; ``bench/RESULTS.md``).

Before each pass the local spools are replayed, so events a dead process on this machine spooled are counted
first (then its records are settled, not reconciled).

Replica acknowledgement (``metering.replica_acks`` = N > 0): each heartbeat also re-asserts this process's records
(:meth:`WriteAhead.reassert`): every open record it holds whose last write is older than a beat is written again, as
it is (its ``updated_ms`` kept: a re-assertion is no news of the call), through the update script (a record settled
meanwhile is not reopened); then N replicas are asked to acknowledge (``Meter.replica_acks``: a probe write and
``WAIT`` on its connection). Redis replicates asynchronously: a failover that promotes a replica which had not yet
received a record loses it, and a process killed after that left its call unbilled; re-asserted, the record is back
within a beat of the new master answering. Off (the default): no such write, no ``WAIT``.

Redis down: a begin or an update goes to its own fsync'd spool (``<usage spool>.wal.jsonl``) and is replayed
(records of requests already settled are dropped: the script checks the seen-set) before the next reconcile.
Known gaps: prompt tokens of a stream cut before its usage chunk are counted only when the upstream reports
running usage (else 0, as for a client disconnect); a request that finished is settled at its final event only
if that reached its record before the kill — one background write after it was queued, or its own event's
write, whichever lands first: killed in between, it is settled as lost, at its last progress write; a record
spooled on a machine that never restarts its gateway stays there; and a record a failover lost is back only at its
process's next beat (with ``metering.replica_acks``; never without): a process killed before that leaves its call
unbilled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, cast

import orjson
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import ResponseError

from gateway.config import MeteringConfig, Prices
from gateway.ledger.aggregate import SEEN_MARGIN_S
from gateway.ledger.event import Endpoint, RouteReason, UsageEvent, UsageSource
from gateway.ledger.pricing import cost_micro_usd
from gateway.ledger.record import UsageRecord
from gateway.openai.sse import StreamTally
from gateway.openai.usage import usage_counts, usage_limit
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.keys import RedisKeys
from gateway.state.log_throttle import LogThrottle, held_back
from gateway.state.metering import Meter, past_dedup_window
from gateway.state.redis import FastScript, RedisHandle, as_bytes
from gateway.state.spool import Spool, quarantined

log = logging.getLogger("thinkgate.metering")

SCAN_COUNT = 200  # HSCAN page size of a reconcile pass
#: ``error_code`` of the audit event that settles the record of a call never sent upstream
UNSENT_CODE = "gateway_lost_unsent"
#: ``error_code`` of a lost call (``gateway_lost``) whose record claimed more completion tokens than the call was
#: admitted to generate, or more prompt tokens than its request could hold: metered at that bound
#: (:meth:`WalRecord.event`)
OVER_BOUND_CODE = "gateway_lost_over_bound"

# Write records (updates: the waiting mark, progress, the final event; begins replayed from the spool), each unless its
# request was already settled (its usage event counted: a late update must not reopen it).
# KEYS: 1 the write-ahead hash, 1+i the seen-set of the i-th record's day; ARGV: 2i-1 its request id, 2i its JSON.
# Returns how many were written.
PUT_LUA = """
local n = 0
for i = 1, #ARGV / 2 do
  if redis.call('SISMEMBER', KEYS[1 + i], ARGV[2 * i - 1]) == 0 then
    redis.call('HSET', KEYS[1], ARGV[2 * i - 1], ARGV[2 * i])
    n = n + 1
  end
end
return n
"""


def new_owner() -> str:
    """This process's owner id: ``host:pid:random`` (a restarted process with the same pid is another owner)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def wal_spool_path(usage_spool: Path) -> Path:
    """Where write-ahead records wait for Redis: beside the usage spool, ``<stem>.wal.jsonl``."""
    return usage_spool.with_name(usage_spool.stem + ".wal.jsonl")


@dataclass(slots=True)
class WalRecord:
    """One upstream call in flight. Tokens are tokens, ``ts`` epoch s (the request start), ``updated_ms`` epoch ms
    of the last write, bounds micro-USD / tokens (0 when the call was admitted without a reservation)."""

    request_id: str
    key_id: str
    owner: str
    ts: float
    updated_ms: int
    tags: dict[str, str]
    endpoint: Endpoint = "chat"
    requested_model: str = ""
    tier: str | None = None
    upstream_model: str | None = None
    route_reason: RouteReason | None = None
    stream: bool = False
    bound_micro_usd: int = 0
    bound_tokens: int = 0
    #: the most completion tokens the call may generate (admission's ``Estimate.completion``, the usage record's
    #: ``completion_bound``: choices × min(max_tokens, tier cap) over the tier and its fallbacks); None: not known
    #: (no completion, or a record written before this field: :attr:`completion_limit` falls back on
    #: ``bound_tokens``)
    bound_completion: int | None = None
    #: the most prompt tokens the call may be billed (admission's ``Estimate.prompt``, the usage record's
    #: ``prompt_bound``: the prompt's UTF-8 bytes plus template overhead, a forced-thinking tier's two phases, over
    #: the tier and its fallbacks); None: none (a request with media parts, or a record written before this field)
    bound_prompt: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    usage_source: UsageSource = "none"
    #: True while its request waits before its upstream call (a single-flight follower; :meth:`WriteAhead.waiting`)
    #: — or, after a wait that ended in a cache hit, for good: no upstream call. False (the default, and a record
    #: written before this field existed): taken for a call sent upstream
    waiting: bool = False
    #: the request's own usage event, once the request finished while that event waited in its process's queue
    final: UsageEvent | None = None

    @property
    def day(self) -> str:
        """The request's UTC day (its usage event's, hence its seen-set's)."""
        return UsageEvent(key_id="", requested_model="", ts=self.ts).day

    @property
    def unsent(self) -> bool:
        """Never sent upstream: marked waiting, no token, no final event (see the module doc)."""
        return (self.waiting and self.final is None
                and not (self.prompt_tokens or self.completion_tokens or self.reasoning_tokens))

    @property
    def completion_limit(self) -> int | None:
        """The most completion tokens this call can be billed: :attr:`bound_completion`, else ``bound_tokens``
        (prompt + completion: never less than the completion bound) when the call was admitted with one; None:
        unbounded (admitted without a reservation)."""
        if self.bound_completion is not None:
            return self.bound_completion
        return self.bound_tokens or None

    @property
    def prompt_limit(self) -> int | None:
        """The most prompt tokens this call can be billed: :attr:`bound_prompt`; None: unbounded — a request with
        an image, audio or file part (its tokens are not its bytes), or a record written before this field (not
        ``bound_tokens``: for such a request that is no bound either, and those records were billed as written)."""
        return self.bound_prompt

    def to_json(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> WalRecord:
        data = orjson.loads(raw)
        known = {f.name for f in fields(cls)}
        rec = cls(**{k: v for k, v in data.items() if k in known})
        if isinstance(rec.final, dict):
            rec.final = UsageEvent.from_dict(rec.final)
        return rec

    def event(self, prices: Prices | None) -> UsageEvent:
        """The partial usage event of a call whose process died: the tokens of the last write, at ``prices`` (the
        tier's; None = unknown tier, cost 0), ``error_code`` ``gateway_lost``. A completion count above what the call
        could generate (:attr:`completion_limit`: an upstream that ignored ``max_tokens`` and streamed on, or a
        running usage that misreports) is metered at that bound, as a finished call's is
        (``UsageRecord.set_usage``), and the event says so: ``error_code`` :data:`OVER_BOUND_CODE` and
        ``over_bound`` (the mark a finished call held to its bound carries too). So is a prompt count above what
        the request could hold (:attr:`prompt_limit`, what admission reserved for it): the record's prompt count
        comes from the upstream's running usage alone, and one that misreports was billed as written."""
        completion, reasoning, code = self.completion_tokens, self.reasoning_tokens, "gateway_lost"
        prompt, cached = self.prompt_tokens, self.cached_tokens
        bound = self.completion_limit
        if bound is not None and completion > bound:
            completion, reasoning, code = bound, min(reasoning, bound), OVER_BOUND_CODE
        read = self.prompt_limit
        if read is not None and prompt > read:
            prompt, cached, code = read, min(cached, read), OVER_BOUND_CODE
        cost = (cost_micro_usd(prices, prompt_tokens=prompt, cached_tokens=cached,
                               completion_tokens=completion) if prices is not None else 0)
        return UsageEvent(
            key_id=self.key_id, requested_model=self.requested_model, event_id=self.request_id, ts=self.ts,
            tags=dict(self.tags), request_id=self.request_id, endpoint=self.endpoint, tier=self.tier,
            upstream_model=self.upstream_model, route_reason=self.route_reason, prompt_tokens=prompt,
            cached_tokens=cached, completion_tokens=completion, reasoning_tokens=reasoning,
            cost_micro_usd=cost, latency_ms=float(max(0, self.updated_ms - int(self.ts * 1000))), status=500,
            error_code=code, stream=self.stream, partial=True,
            usage_source="counted" if self.usage_source == "none" else self.usage_source,
            over_bound=code == OVER_BOUND_CODE)

    def unsent_event(self) -> UsageEvent:
        """The audit event of a call that was never sent upstream (:attr:`unsent`): cost 0, counted nowhere
        (``UsageEvent.audit``), ``error_code`` :data:`UNSENT_CODE`; an event id of its own (``{request id}:unsent``),
        so the request id stays free for the request's own event should its process turn out alive."""
        return UsageEvent(
            key_id=self.key_id, requested_model=self.requested_model, event_id=f"{self.request_id}:unsent", ts=self.ts,
            tags=dict(self.tags), request_id=self.request_id, endpoint=self.endpoint, tier=self.tier,
            upstream_model=self.upstream_model, route_reason=self.route_reason,
            latency_ms=float(max(0, self.updated_ms - int(self.ts * 1000))), status=500, error_code=UNSENT_CODE,
            stream=self.stream, usage_source="none", audit=True)


@dataclass(slots=True)
class _Open:
    """This process's view of one of its records: its latest state (written, or due in the next update) and when
    its tokens were last written."""

    rec: WalRecord
    written_at: float  # monotonic s
    lapses: int = 0  # WriteAhead.lapses when it was opened


class WriteAhead:
    """The write-ahead records of one process (begin / progress), its heartbeat and the reconciler of dead ones.

    ``prices``: tier name → prices (to price an orphan's tokens). One per process, built by ``Accounting``."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, meter: Meter, cfg: MeteringConfig,
                 prices: Mapping[str, Prices], owner: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.meter = meter
        self.cfg = cfg
        self.prices = dict(prices)
        self.owner = owner or new_owner()
        self.spool: Spool[WalRecord] = Spool(wal_spool_path(cfg.spool_path), decode=WalRecord.from_json)
        self._put = FastScript(handle, PUT_LUA)
        self._open: dict[str, _Open] = {}
        # records whose latest state is due in the next update (insertion order), and the one task writing them
        self._due: dict[str, WalRecord] = {}
        self._due_waiters: list[asyncio.Future[None]] = []  # released once the updates due now are written
        self._updater: asyncio.Task[None] | None = None
        self._suspects: dict[str, float] = {}  # request id → when this reconciler first saw its owner dead
        self._refused: set[str] = set()  # request ids Redis refused to settle (logged once), while they stay open
        self._tasks: set[asyncio.Task[None]] = set()
        self._begins: list[tuple[WalRecord, asyncio.Future[None]]] = []  # begins waiting for the next write
        self._begin_writer: asyncio.Task[None] | None = None
        self._conn: Connection | None = None  # the begin writer's own connection (standalone / Sentinel)
        self._clock = clock
        self.reconciled = 0  # orphans this process metered (thinkgate_write_ahead_reconciled_records_total)
        self.released = 0  # orphans never sent upstream that this process released (the same series)
        #: told each usage event this process metered for a dead process (its request's only event): the serving
        #: process's metrics count it as they count their own — else the Prometheus cost and token counters came in
        #: under the ledger after a killed process. Its errors are logged, never the record's concern.
        self.on_metered: Callable[[UsageEvent], None] | None = None
        #: heartbeats of this process that came after its key may have expired (a stall — SIGSTOP, a swap storm —
        #: or Redis away for a heartbeat TTL): while the key was absent, another replica may have claimed its records
        self.lapses = 0
        self._beat_sent = clock()  # monotonic s: when the last heartbeat that landed was sent (start: none yet)
        self.reasserted = 0  # record writes of reassert() (metering.replica_acks; for logs and tests)
        #: re-asserted records fewer than ``metering.replica_acks`` replicas acknowledged in time (for metrics)
        self.unreplicated = 0
        self._unreplicated_log = LogThrottle()

    # --- the request path -------------------------------------------------------------------------------
    def open_record(self, record: UsageRecord, bound_micro_usd: int = 0, bound_tokens: int = 0, *,
                    tier: str | None = None, upstream_model: str | None = None,
                    route_reason: RouteReason | None = None) -> WalRecord:
        """``record``'s write-ahead record as of now, not yet written anywhere (``tier``, ``upstream_model``,
        ``route_reason``: where the call goes, when ``record`` does not say it yet)."""
        return WalRecord(
            request_id=record.request_id, key_id=record.key_id or "anonymous", owner=self.owner, ts=record.ts,
            updated_ms=int(time.time() * 1000), tags=dict(record.tags), endpoint=record.endpoint,
            requested_model=str(record.requested_model or ""), tier=record.tier or tier,
            upstream_model=record.upstream_model or upstream_model, route_reason=record.route_reason or route_reason,
            stream=record.stream, bound_micro_usd=bound_micro_usd, bound_tokens=bound_tokens,
            bound_completion=record.completion_bound, bound_prompt=record.prompt_bound)

    def written(self, rec: WalRecord) -> None:
        """``rec`` is in Redis (written by another script call: the one-call hot path of a single Redis,
        ``gateway/state/limits.py``): track it here for :meth:`progress` like a begun one."""
        self._open[rec.request_id] = _Open(rec, self._clock(), self.lapses)

    async def begin(self, record: UsageRecord, bound_micro_usd: int = 0, bound_tokens: int = 0) -> None:
        """Write ``record``'s write-ahead record (before its first upstream byte): to Redis, else the spool. Never
        raises for an outage; a spool that cannot be written is logged (the request is still served)."""
        rec = self.open_record(record, bound_micro_usd, bound_tokens)
        self._open[record.request_id] = _Open(rec, self._clock(), self.lapses)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._begins.append((rec, done))
        if self._begin_writer is None:
            self._begin_writer = asyncio.get_running_loop().create_task(self._write_begins())
        await done

    async def _write_begins(self) -> None:
        """Group commit of begins: every record that arrived while the previous ``HSET`` was in flight goes in the
        next one (one field each), so concurrent requests share round trips. Each waiting request is released
        once its record is in Redis or the spool (or the write failed: logged)."""
        try:
            while self._begins:
                batch, self._begins = self._begins, []
                items: list[str | bytes] = []
                for rec, _ in batch:
                    items += [rec.request_id, rec.to_json()]
                try:
                    await self.breaker.call(functools.partial(self._hset, items))
                except RedisDown:
                    await self._spool(*(rec for rec, _ in batch))
                except Exception:
                    log.exception("write-ahead records of %d requests failed", len(batch))
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)
        finally:
            self._begin_writer = None
            for _, done in self._begins:  # cancelled (shutdown): release the waiting requests
                if not done.done():
                    done.set_result(None)

    def waiting(self, request_id: str) -> None:
        """``request_id`` starts a wait before its upstream call (a single-flight follower): mark its record
        ``waiting``, in the background (the wait itself is the time the write needs). No-op when this process has
        no record of it (Redis Cluster: a request's record is begun only right before its call)."""
        op = self._open.get(request_id)
        if op is None or op.rec.waiting:
            return
        op.rec = replace(op.rec, waiting=True, updated_ms=int(time.time() * 1000))
        self._update(op.rec)

    def is_waiting(self, request_id: str) -> bool:
        """Whether ``request_id``'s record is marked :meth:`waiting` (then :meth:`sending` must run before its call)."""
        op = self._open.get(request_id)
        return op is not None and op.rec.waiting

    async def sending(self, request_id: str) -> None:
        """The wait of ``request_id`` ended and its upstream call is about to be sent: clear the ``waiting`` mark and
        return once that is written (Redis, else the spool) — awaited, unlike the other updates, so the record says
        sent before the call's first byte: a record taken for a wait would be settled as no request at all. Only a
        request that waited and then missed pays this round trip."""
        op = self._open.get(request_id)
        if op is None or not op.rec.waiting:
            return
        op.rec = replace(op.rec, waiting=False, updated_ms=int(time.time() * 1000))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._due_waiters.append(done)
        self._update(op.rec)
        await done

    def names(self, request_id: str, tier: str, upstream_model: str, route_reason: RouteReason | None) -> bool:
        """True when this process's record of ``request_id`` names that tier, model and route reason (or it has
        none): :meth:`retarget` would write nothing."""
        op = self._open.get(request_id)
        return op is None or (op.rec.tier, op.rec.upstream_model, op.rec.route_reason) == (tier, upstream_model,
                                                                                            route_reason)

    async def retarget(self, request_id: str, tier: str, upstream_model: str, route_reason: RouteReason | None) -> None:
        """``request_id``'s call goes to another tier (a fallback, the routed tier having refused it): name that
        tier in the record — the reconciler prices a lost call at its record's tier — and return once that is
        written (Redis, else the spool), so the record names the call in flight before the call's first byte:
        a non-streamed call has no progress write, and a stream's first one comes an interval later — a kill
        meanwhile priced the call on the tier that refused it. Awaited, like :meth:`sending`; only a fallback pays
        it (one round trip after a refused call). No-op when this process has no record of ``request_id``, or it
        names that tier already."""
        op = self._open.get(request_id)
        if op is None or self.names(request_id, tier, upstream_model, route_reason):
            return
        op.rec = replace(op.rec, tier=tier, upstream_model=upstream_model, route_reason=route_reason,
                         updated_ms=int(time.time() * 1000))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._due_waiters.append(done)
        self._update(op.rec)
        await done

    def progress(self, request_id: str, completion_tokens: int, reasoning_tokens: int,
                 usage: dict[str, Any] | None = None, tier: str | None = None,
                 upstream_model: str | None = None) -> None:
        """Tokens relayed so far for ``request_id`` (``usage``: the upstream's running usage, when it sends one;
        ``tier``/``upstream_model``: where the call went — a fallback changes them after the record was begun).
        Cheap when nothing is due: a dict lookup and a clock read; a due write runs in the background."""
        op = self._open.get(request_id)
        if op is None:
            return
        now = self._clock()
        if now - op.written_at < self.cfg.write_ahead_interval_s:
            return
        rec = op.rec
        # the upstream's running usage only when the gateway would meter it (usage_counts, up to the call's bound):
        # a dead process's record is billed at it, and a count that is no count (1e12 tokens, a string, not an
        # object) must neither be billed nor raise out of the relay's hook mid-stream — the relayed count instead
        counts = usage_counts(usage, limit=usage_limit(rec.bound_tokens or None)) if usage else None
        if counts is not None:
            prompt, completion, cached, reasoning = counts
            reasoning = reasoning or min(reasoning_tokens, completion)
            source: UsageSource = "upstream"
        else:
            prompt, cached, completion, reasoning, source = rec.prompt_tokens, rec.cached_tokens, completion_tokens, \
                reasoning_tokens, "counted"
        if completion == rec.completion_tokens and prompt == rec.prompt_tokens:
            return
        op.rec = replace(rec, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
                         reasoning_tokens=reasoning, usage_source=source, updated_ms=int(time.time() * 1000),
                         tier=tier or rec.tier, upstream_model=upstream_model or rec.upstream_model)
        op.written_at = now
        self._update(op.rec)

    def tracker(self, record: UsageRecord) -> Callable[[StreamTally], None] | None:
        """A stream's progress hook, called with the relay's tally after each batch: :meth:`progress` when a write
        is due, else one clock read (the per-batch cost of write-ahead). None when ``record`` has no record here."""
        op = self._open.get(record.request_id)
        if op is None:
            return None
        clock, interval = self._clock, self.cfg.write_ahead_interval_s

        def hook(tally: StreamTally) -> None:
            if clock() - op.written_at >= interval:
                self.progress(record.request_id, tally.reasoning_deltas + tally.text_deltas, tally.reasoning_deltas,
                              tally.last_usage, record.tier, record.upstream_model)

        return hook

    def is_open(self, request_id: str) -> bool:
        """Whether this process tracks a record of ``request_id`` (begun or :meth:`written`, not yet settled)."""
        return request_id in self._open

    async def park(self, events: list[UsageEvent]) -> None:
        """Usage events Redis refused (the metering script undone; in the dead-letter spool,
        ``gateway/state/metering.py``): each goes into its request's record, which the undo left open, as its
        final event — so whichever settles the request first, the dead-letter retry or the reconciler once this
        process is gone (any restart while the key is broken), counts the real event once. The record alone held
        the tokens of its last progress write (0 for a non-streamed call): the reconciler counted that as
        ``gateway_lost`` and the real event, retried later, was dropped as a duplicate. Background, read then
        written through the update script (which skips a request settled meanwhile). Raises :class:`RedisDown`."""
        raw = await self.breaker.call(
            lambda: self.redis.hmget(self.keys.write_ahead, [e.event_id for e in events]))
        for event, r in zip(events, raw, strict=True):
            if r is not None:
                self._update(replace(WalRecord.from_json(r), final=event, updated_ms=int(time.time() * 1000)))

    def settled(self, request_id: str, final: UsageEvent | None = None) -> bool:
        """The request's usage event is on its way (it deletes the record in Redis): stop tracking it here.
        ``final``: that event, when it has to wait in the process's queue (behind a stalled metering batch): it goes
        into the record with the next update, so a process killed before the event reaches Redis leaves it there
        for the reconciler to count as it is, instead of the tokens of the last progress write (0 for a short
        stream or a non-streamed call).

        Returns whether another replica's reconciler may have metered the record already: this process's heartbeat
        may have lapsed while it was open (:meth:`lapsed`) — then only the event's write can tell whose usage event
        the ledger counted (``RecordResult.counted``)."""
        op = self._open.pop(request_id, None)
        if op is None:
            return False
        if final is not None:
            self._update(replace(op.rec, final=final, updated_ms=int(time.time() * 1000)))
        return op.lapses != self.lapses or self.lapsed()

    def lapsed(self) -> bool:
        """Whether this process's heartbeat key may be absent now: no heartbeat sent since then landed within a
        heartbeat TTL (its key lives at least that long after its send)."""
        return self._clock() - self._beat_sent >= self.cfg.heartbeat_ttl_s

    def _update(self, rec: WalRecord) -> None:
        """Write ``rec`` (a newer state of an open record) with the next update: one task writes every due record
        in one script call (a group commit, like begins) and, while that call is out, collects the next batch —
        so a record has at most one write in flight and its states land in order (a newer one never overwritten
        by an older one). A record due twice before its write is written once, in its latest state."""
        self._due[rec.request_id] = rec
        if self._updater is None:
            task = asyncio.get_running_loop().create_task(self._write_updates())
            self._updater = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _write_updates(self) -> None:
        try:
            while self._due:
                batch, self._due = list(self._due.values()), {}
                waiters, self._due_waiters = self._due_waiters, []
                try:
                    await self.breaker.call(functools.partial(self._put_many, batch))
                except RedisDown:
                    await self._spool(*batch)
                except Exception:
                    log.exception("write-ahead updates of %s failed", ", ".join(r.request_id for r in batch))
                for done in waiters:
                    if not done.done():
                        done.set_result(None)
        finally:
            self._updater = None
            waiters, self._due_waiters = self._due_waiters, []
            for done in waiters:  # cancelled (shutdown): release the waiting requests
                if not done.done():
                    done.set_result(None)

    async def _put_many(self, recs: list[WalRecord]) -> None:
        """The records ``recs`` (``PUT_LUA``: each unless its request was settled meanwhile)."""
        args: list[str | bytes] = []
        for rec in recs:
            args += [rec.request_id, rec.to_json()]
        await self._put(keys=[self.keys.write_ahead, *(self.keys.seen(rec.day) for rec in recs)], args=args)

    async def _hset(self, items: list[str | bytes]) -> None:
        """``HSET wal:open f1 v1 f2 v2 …``. Standalone and Sentinel: on a connection of its own, outside the pool —
        the begin writer is its only user, one command at a time — which halves the client's CPU per command
        (no pool checkout, no command dispatch; ``bench/RESULTS.md``). Cluster: through the client."""
        client = self.redis
        if not isinstance(client, Redis):
            await client.hset(self.keys.write_ahead, items=items)
            return
        conn = self._conn
        if conn is None:
            conn = self._conn = client.connection_pool.make_connection()
        try:  # bounded by redis.socket_timeout_s like every command
            if not conn.is_connected:  # connect() itself: a Sentinel connection asks the sentinels for the master
                await conn.connect()  # (send_packed_command would connect to the default host:port instead)
            await conn.send_packed_command(conn.pack_command("HSET", self.keys.write_ahead, *items), check_health=False)
            await conn.read_response()  # raises ResponseError for an error reply
        except BaseException:
            self._conn = None  # a failed or interrupted exchange leaves the connection in an unknown state
            with contextlib.suppress(Exception):
                await conn.disconnect()
            raise

    async def _spool(self, *recs: WalRecord) -> None:
        try:
            await self.spool.append(list(recs))
        except OSError:
            log.exception("write-ahead records of %s could not be spooled (Redis down, disk failed)",
                          ", ".join(r.request_id for r in recs))

    # --- replica acknowledgement (metering.replica_acks) ---------------------------------------------------
    @property
    def beat_s(self) -> float:
        """The period of :meth:`run`'s loop, s: a third of ``heartbeat_ttl_s`` (``reconcile_interval_s`` when that
        is shorter)."""
        return min(self.cfg.heartbeat_ttl_s / 3, self.cfg.reconcile_interval_s)

    async def reassert(self) -> int:
        """With ``metering.replica_acks`` = N > 0: write again, as they are, the records this process holds open
        whose last write is older than a beat (:attr:`beat_s`), then ask N replicas to acknowledge them
        (``Meter.replica_acks``: a probe write and ``WAIT`` on its connection, not through the breaker — on a
        Cluster to the master of the shared slot, which holds ``wal:open`` too). Fewer count in
        :attr:`unreplicated` (logged at most once a minute). Returns how many records it sent: 0 when off (no
        Redis call at all), when none is that old, or with the breaker open. Raises nothing for an outage: a
        write that meets one goes to the spool like any update (and no ``WAIT`` is asked).

        Why again at every beat: Redis replicates asynchronously, and a failover that promotes a replica which had
        not yet received a record (written by the admission script, or a begin) loses it — at any time, so once
        is not enough; while this process lives, a record lost so is back within a beat of the new master
        answering (a process killed before that still leaves its call unbilled). A record written less than a
        beat ago (admitted, or a progress write) is left to the next beat, should it still be open then: most
        calls are settled before it. Through the update task (:meth:`_update`), not beside it: a record keeps
        one write in flight and its states land in order (a re-assertion never overwrites a newer progress
        write), and the update script skips a request settled meanwhile (its day's seen-set), so a settled
        record is never reopened."""
        want = self.cfg.replica_acks
        if not want or self.breaker.is_open:
            return 0
        cutoff_ms = int((time.time() - self.beat_s) * 1000)
        old = [op.rec for op in self._open.values() if op.rec.updated_ms <= cutoff_ms]
        if not old:
            return 0
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._due_waiters.append(done)
        for rec in old:
            self._update(rec)  # one script call for all (with any update due now): the next batch
        await done
        self.reasserted += len(old)
        if self.breaker.is_open:  # the write met an outage: spooled; the next beat after it writes them again
            return len(old)
        if await self.meter.replica_acks() < want:
            self._unacknowledged(len(old))
        return len(old)

    def _unacknowledged(self, n: int) -> None:
        """``n`` re-asserted records fewer than ``metering.replica_acks`` replicas acknowledged: counted, and logged
        at most once a minute (a replica down would log every beat). Nothing more to do: the next beat writes them
        again while they are open."""
        self.unreplicated += n
        if (held := self._unreplicated_log.due()) is not None:
            log.warning("write-ahead records not acknowledged by %d Redis replica(s) within %d ms "
                        "(metering.replica_acks): %d re-asserted, %d so far; written again every %.1f s while open%s",
                        self.cfg.replica_acks, self.cfg.replica_ack_timeout_ms, n, self.unreplicated, self.beat_s,
                        held_back(held))

    # --- heartbeat and reconciliation ---------------------------------------------------------------------
    async def heartbeat(self) -> None:
        """Renew this process's heartbeat (raises :class:`RedisDown`)."""
        ttl_ms = int(self.cfg.heartbeat_ttl_s * 1000)
        sent = self._clock()
        await self.breaker.call(lambda: self.redis.set(self.keys.heartbeat(self.owner), b"1", px=ttl_ms))
        if self.lapsed():  # landed past the TTL of the last one: the key may have been absent in between
            self.lapses += 1
        self._beat_sent = sent

    async def replay(self) -> int:
        """Send spooled records to Redis (those of requests settled meanwhile are dropped); 0 when Redis is down."""
        return await self.spool.replay(self._replay_batch, "write-ahead")

    async def _replay_batch(self, recs: list[WalRecord]) -> None:
        for rec in await self._fresh(recs):
            await self.breaker.call(functools.partial(self._put_many, [rec]))

    async def _fresh(self, recs: list[WalRecord]) -> list[WalRecord]:
        """``recs`` less those past the dedup window (``past_dedup_window``), which go to the usage quarantine file
        (``Meter.quarantine``, reason ``past_dedup_window``) with one WARNING line per batch. Why: the update script
        skips the record of a request already settled by its day's seen-set, which lives ``metering.dedup_ttl_s``;
        a record spooled longer than that would be written back for a request settled long ago, and the reconciler
        would then settle it again as lost — counted twice. Whether it was settled only the stream can tell.
        Raises ``OSError`` when the quarantine cannot be written (the spool is kept)."""
        now = time.time()
        old = [r for r in recs if past_dedup_window(r, self.cfg.dedup_ttl_s, now)]
        if not old:
            return recs
        detail = (f"ts older than metering.dedup_ttl_s ({self.cfg.dedup_ttl_s} s) less {SEEN_MARGIN_S} s: the request "
                  "may have been settled and forgotten, so the record written back could bill it twice; not sent")
        quarantine = self.meter.quarantine
        if await quarantine.append([quarantined("past_dedup_window", detail, self.spool.path, orjson.loads(r.to_json()))
                                    for r in old]):
            log.warning("write-ahead records of requests %s in %s are older than metering.dedup_ttl_s (%d s) less "
                        "%d s: not sent (a settled request would be billed again), kept in %s: settle them with "
                        "thinkgate usage quarantine (bills the ones absent from the stream, once)",
                        ", ".join(r.request_id for r in old), self.spool.path, self.cfg.dedup_ttl_s, SEEN_MARGIN_S,
                        quarantine.path)
        return [r for r in recs if not past_dedup_window(r, self.cfg.dedup_ttl_s, now)]

    async def reconcile(self) -> int:
        """One bounded pass: meter the records of dead owners (see the module doc). Returns how many it counted.
        Raises :class:`RedisDown`."""
        await self.meter.replay()  # a dead process's spooled events first: then its records are settled, not lost
        await self.replay()
        candidates = await self._scan()
        if not candidates:
            self._suspects.clear()
            return 0
        owners = sorted({rec.owner for rec in candidates})
        hb_keys = [self.keys.heartbeat(o) for o in owners]
        beats = await self.breaker.call(lambda: self.redis.mget(hb_keys))
        alive = {o for o, b in zip(owners, beats, strict=True) if b is not None}
        now_ms, now = int(time.time() * 1000), self._clock()
        ttl_ms = int(self.cfg.heartbeat_ttl_s * 1000)
        seen = {rec.request_id for rec in candidates}
        for rid in [r for r in self._suspects if r not in seen]:
            del self._suspects[rid]
        self._refused &= seen
        counted = 0
        for rec in candidates:
            if rec.owner in alive or now_ms - rec.updated_ms < ttl_ms:
                self._suspects.pop(rec.request_id, None)
                continue
            first = self._suspects.setdefault(rec.request_id, now)
            if now - first < self.cfg.heartbeat_ttl_s:
                continue
            owner_hb = self.keys.heartbeat(rec.owner)
            self._suspects.pop(rec.request_id, None)
            try:
                if rec.unsent:  # no usage, no request: its reservations released, an audit event says why
                    if await self.meter.release_orphan(rec.unsent_event(), owner_hb):
                        self.released += 1
                        log.warning("released write-ahead record %s of dead process %s: never sent upstream",
                                    rec.request_id, rec.owner)
                    continue
                # it finished: its own event, which its process had no time to write; else lost, at its last update
                event = rec.final if rec.final is not None else rec.event(self.prices.get(rec.tier or ""))
                result = await self.meter.settle_orphan(event, owner_hb)
            except ResponseError as exc:
                # Redis refused it (a key of the wrong type): the script wrote nothing, the record stays for a later
                # pass; the other records go on (one such record stopped every pass at it)
                if rec.request_id not in self._refused:
                    self._refused.add(rec.request_id)
                    log.error("write-ahead record %s of dead process %s refused by Redis, left for the next pass "
                              "(fix or delete the key it names): %s", rec.request_id, rec.owner, exc)
                continue
            self._refused.discard(rec.request_id)
            if result.counted:
                counted += 1
                if self.on_metered is not None:
                    try:
                        self.on_metered(event)
                    except Exception:
                        log.exception("metrics of reconciled usage event %s failed", event.event_id)
                log.warning("metered write-ahead record %s of dead process %s as %s (%d prompt, %d completion "
                            "tokens%s)", rec.request_id, rec.owner, "finished" if rec.final is not None else "partial",
                            event.prompt_tokens, event.completion_tokens,
                            f"; its record claimed {rec.prompt_tokens} prompt and {rec.completion_tokens} completion "
                            "tokens, above its bounds" if event.error_code == OVER_BOUND_CODE else "")
        self.reconciled += counted
        return counted

    async def _scan(self) -> list[WalRecord]:
        """Up to ``reconcile_batch`` open records of other owners whose heartbeat is absent, from a scan of every open
        record (HSCAN pages of :data:`SCAN_COUNT`, the owners' heartbeats read page by page, once an owner a pass).

        Why the whole hash, filtered by owner: the pass used to stop after ``reconcile_batch`` records *scanned*, from
        the start of the hash each time — in a fleet with more calls open than that, the live replicas' records filled
        every pass and a dead process's records further on were never reached (never metered while the fleet stayed
        that busy). Reading them costs a page a round trip; settling them is what the batch bounds."""
        out: list[WalRecord] = []
        alive: dict[str, bool] = {self.owner: True}
        cursor: int = 0
        while True:
            cursor, page = await self.breaker.call(
                functools.partial(self.redis.hscan, self.keys.write_ahead, cursor, count=SCAN_COUNT))
            recs: list[WalRecord] = []
            for _rid, raw in cast(dict[bytes, bytes], page or {}).items():
                try:
                    recs.append(WalRecord.from_json(as_bytes(raw)))
                except (ValueError, TypeError):
                    log.warning("unreadable write-ahead record %r skipped", _rid)
            if new := sorted({r.owner for r in recs} - alive.keys()):
                beats = await self.breaker.call(
                    functools.partial(self.redis.mget, [self.keys.heartbeat(o) for o in new]))
                alive.update((o, b is not None) for o, b in zip(new, beats, strict=True))
            for rec in recs:
                if not alive[rec.owner] and len(out) < self.cfg.reconcile_batch:
                    out.append(rec)
            if not cursor or len(out) >= self.cfg.reconcile_batch:
                return out

    async def run(self, stop: asyncio.Event) -> None:
        """The background task: heartbeat every third of its TTL (with ``metering.replica_acks``, then
        :meth:`reassert`), reconcile at start and every ``reconcile_interval_s``, until ``stop`` is set; then drop
        the heartbeat (a clean exit leaves no orphans: its requests were settled by then)."""
        next_pass = 0.0
        while not stop.is_set():
            try:
                await self.heartbeat()
                # On the heartbeat's beat rather than a timer of its own: the heartbeat key is lost in the same
                # failover and comes back at the same beat, a beat that finds Redis down skips both, and a beat
                # (5 s by default) is short beside a failover itself (Sentinel's down-after-milliseconds, 30 s by
                # default; a Cluster's node timeout, 15 s) — a shorter one would narrow the window little, at one
                # more script call and WAIT each time
                await self.reassert()
                if self._clock() >= next_pass:
                    due, next_pass = next_pass, self._clock() + self.cfg.reconcile_interval_s
                    try:
                        await self.reconcile()
                    except RedisDown:  # a pass cut short (a timeout, a blip) is due again at the next beat,
                        next_pass = due  # not a whole interval later: a dead replica's usage waits on it
                        raise
            except RedisDown as exc:
                log.debug("write-ahead: redis down (%s)", exc)
            except Exception:
                log.exception("write-ahead reconcile pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.beat_s)

    async def close(self) -> None:
        """Wait for progress writes in flight; remove the heartbeat (best effort)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        with contextlib.suppress(RedisDown, Exception):
            await self.breaker.call(lambda: self.redis.delete(self.keys.heartbeat(self.owner)))
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.disconnect()
