"""The request path's one seam to the shared-state services: limits, cache, metering, alerts, metrics.

:class:`Accounting` owns the Redis client, its circuit breaker, and one of each service; the proxy calls

- :meth:`admit` before every upstream call — the first, and an escalation's — at every budget level the key
  is under (429 ``budget_exceeded`` / ``rate_limit_exceeded``, or 503),
- :meth:`cache_begin` / :meth:`cache_finish` around it (``gateway/state/cache.py``),
- :meth:`sink` with every finished :class:`~gateway.ledger.record.UsageRecord` (a usage sink): it converts the
  record to a :class:`~gateway.ledger.event.UsageEvent` (``event_id`` = the request id = the budget reservation
  id), counts it in the Prometheus metrics at once (at its write's answer when another replica may have metered
  it, see :meth:`sink`), and queues it for one background writer task (metering
  → settle the reservation → alerts). The writer sends whatever has queued up since its last round trip as
  one pipeline (``Meter.record_many``): one event at low load, dozens at high concurrency, instead of a task
  and a round trip per event. :meth:`flush` waits until the queue is written; :meth:`close` flushes, stops
  the spool replayer and closes the client.
- :meth:`abandon` for a request that ends with neither a record nor an error response (a bug, or a
  cancellation): it is metered with status 499/500 so its reservation is settled at once.
- :meth:`audit` for a request refused before any upstream call: one audit event (cost 0, never counted as
  spend) through the same writer, and ``thinkgate_refused_requests_total{status,code}``.
- :meth:`write_ahead` before an upstream call's first byte and :meth:`stream_progress` as a stream relays tokens:
  the call's write-ahead record (``gateway/state/write_ahead.py``), settled by its usage event; a background task
  keeps this process's heartbeat and meters the records of dead processes as ``partial``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, fields
from typing import Any

import httpx
from redis.exceptions import ResponseError

from gateway.auth.keys import KeyInfo
from gateway.auth.redis_store import RedisKeyStore
from gateway.config import Settings, TierConfig
from gateway.errors import GatewayError, RateLimited
from gateway.ledger.event import RouteReason, UsageEvent
from gateway.ledger.record import UsageRecord
from gateway.observability.metrics import Metrics
from gateway.openai.sse import StreamTally
from gateway.semantic.cache import Probe, SemanticCache
from gateway.semantic.embed import Sketch, embedder_for
from gateway.semantic.policy import question as semantic_question
from gateway.state.alerts import Alerts
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.budgets import BudgetLevels, BudgetStore, Level
from gateway.state.cache import CacheEntry, Lookup, ResponseCache, Ticket
from gateway.state.cache_policy import cache_key, decide, tenant_scope
from gateway.state.conversations import ConversationStore
from gateway.state.keys import tenant_tag
from gateway.state.limits import Admission, BudgetMode, Estimate, KeyLimits, Limits, Rider, embedding_estimate, estimate
from gateway.state.metering import Leftovers, Meter, RecordResult
from gateway.state.redis import RedisHandle, connect
from gateway.state.spool import Spool
from gateway.state.write_ahead import WalRecord, WriteAhead

log = logging.getLogger("thinkgate.accounting")

KNOWN_KEYS_MAX = 100_000
WRITE_BATCH_MAX = 128  # usage events per metering pipeline
#: a metering batch out longer than this is a stall, not a round trip: events queued behind it are written into
#: their write-ahead records meanwhile (:meth:`Accounting.sink`). Below it the event's own batch leaves about as
#: soon as that write could land, so writing it twice would buy nothing (and cost ~5% CPU per request at 32
#: concurrent, bench/RESULTS.md "Write-ahead metering overhead")
WAL_FINAL_AFTER_S = 0.05
#: the longest a request waits for the usage spool to reach Redis before its admission after an outage (seconds)
REPLAY_WAIT_S = 5.0
#: a process started during an outage tries to read the budget definitions at least this far apart (seconds;
#: ``limits.budget_refresh_s`` may be 0) until it has read them once
FIRST_SYNC_MIN_S = 0.5
#: Audit events of requests with no valid key (401): at most this many per second per process, in bursts of
#: :data:`ANON_AUDIT_BURST` — anyone on the network can send them, and each one is a stream entry plus a 40-day
#: dedup entry in Redis (~810 bytes): unbounded, they were a way to fill Redis without a key. Past the bound they are
#: counted (``thinkgate_refused_requests_total``) and logged once per second, not written.
ANON_AUDIT_PER_S = 20.0
ANON_AUDIT_BURST = 100.0
#: The longest client-chosen text an audit event keeps (a 900 KB ``model`` string was stored verbatim)
AUDIT_TEXT_MAX = 256


@dataclass(frozen=True, slots=True)
class Ahead:
    """A request's first upstream call, as known at its admission: the routed ``tier`` and ``route_reason``, the
    ``upstream_body`` it will send (the exact cache's key) and the request's ``headers`` (its cache policy).
    Given to :meth:`Accounting.admit`, it lets a single Redis do the whole hot path in one script call:
    admission at every level, the write-ahead record and the exact-cache lookup (``gateway/state/limits.py``
    ``HOT_LUA``)."""

    tier: TierConfig
    route_reason: RouteReason | None
    upstream_body: dict[str, Any]
    headers: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class _Looked:
    """An exact-cache lookup prepared for a request's first admission call (``prepared``) and what became of it,
    until :meth:`Accounting.cache_begin` (or :meth:`Accounting.sink`) takes it. ``reply``: the reply of its
    ``cache_lookup`` in that call (None: not run, or Redis did not answer). ``outcome_unknown``: the call's outcome
    is unknown (its reply lost: a timeout once sent) — it may have taken the single-flight lock under this lookup's
    token, so the request's usage event releases it as if it had (a token-checked unlock: a no-op when it did not)."""

    prepared: Lookup | Ticket
    reply: list[Any] | None
    outcome_unknown: bool = False

    @property
    def may_hold_lock(self) -> bool:
        """Whether the admission call took (or may have taken) the single-flight lock under this lookup's token."""
        if not isinstance(self.prepared, Lookup):
            return False
        reply = self.reply
        return self.outcome_unknown or (reply is not None and len(reply) > 0 and int(reply[0]) == 2)  # {2}: taken


#: fields a usage event takes from its record as they are (same name, same meaning): every field the two share
#: but those :func:`event_of` converts (``tests/gateway/test_event_of.py``)
_CONVERTED = frozenset({"key_id", "requested_model", "tags", "latency_ms", "ttft_ms", "cache_similarity"})
_AS_IS = tuple(sorted({f.name for f in fields(UsageEvent)} & {f.name for f in fields(UsageRecord)} - _CONVERTED))


def event_of(record: UsageRecord) -> UsageEvent:
    """The usage event of a finished record: the shared fields as they are, ``event_id`` = ``request_id``, the
    key id ``anonymous`` when none, latencies rounded to µs and the cache similarity to 4 places."""
    return UsageEvent(
        **{name: getattr(record, name) for name in _AS_IS},
        key_id=record.key_id or "anonymous",
        requested_model=str(record.requested_model or ""),
        event_id=record.request_id,
        tags=dict(record.tags),
        latency_ms=round(record.latency_ms, 3),
        ttft_ms=round(record.ttft_ms, 3) if record.ttft_ms is not None else None,
        cache_similarity=round(record.cache_similarity, 4) if record.cache_similarity is not None else None,
    )


class Accounting:
    """Built by ``create_app``; ``handle`` may be given (tests), else it connects to ``settings.redis``."""

    def __init__(self, settings: Settings, handle: RedisHandle | None = None) -> None:
        self.settings = settings
        self.handle = handle or connect(settings.redis, writer=True)
        # A timeout during which the event loop itself stalled for half the socket timeout is the loop's
        # fault, not Redis's: it fails that call but leaves the breaker closed (gateway/state/breaker.py).
        self.breaker = Breaker(settings.redis.breaker_cooldown_s, stall_s=settings.redis.socket_timeout_s / 2)
        self.spool: Spool[UsageEvent] = Spool(settings.metering.spool_path)
        self.meter = Meter(self.handle, self.breaker, self.spool, settings.metering)
        self.cache = ResponseCache(self.handle, self.breaker, settings.cache)
        self.limits = Limits(self.handle, self.breaker, settings.limits)
        self.budgets = BudgetLevels(self.handle, self.breaker, settings.limits)
        self.http = httpx.AsyncClient(trust_env=False)
        self.alerts = Alerts(self.handle, self.breaker, settings.limits, self.http)
        self.keystore = RedisKeyStore(self.handle, self.breaker, settings.auth.key_cache_s,
                                      settings.auth.key_stale_s)
        self.metrics = Metrics(settings.metrics, settings.tiers)
        # here, not in the app, so /metrics reads its counts of conversations not stored
        self.conversations = ConversationStore(self.handle, self.breaker, settings.responses.store_ttl_s)
        sem = settings.cache.semantic
        self.semantic: SemanticCache | None = None
        if sem.enabled and settings.cache.mode != "off":
            embedder = embedder_for(sem.embedder, settings.tiers, self.http, sem.embed_timeout_s)
            self.semantic = SemanticCache(self.handle, self.breaker, sem, embedder)
        self._probes: dict[str, Probe] = {}  # request id → semantic probe, until the answer is stored or not
        # the metering writer, alert checks, cancelled admissions (a first call's: a future its reply resolves)
        self._pending: set[asyncio.Future[Any]] = set()
        # request id → resolved once the first-call admission its cancelled caller left out is settled (flush waits);
        # the ids whose admission was told before the caller's cancellation reached admit_estimate
        self._orphans: dict[str, asyncio.Future[None]] = {}
        self._orphans_told: set[str] = set()
        self._queue: list[tuple[UsageEvent, KeyInfo | None]] = []  # finished events not yet handed to Redis
        self._anon_tokens, self._anon_at, self._anon_dropped = ANON_AUDIT_BURST, time.monotonic(), 0
        self._writer: asyncio.Task[None] | None = None
        self._batch_since: float | None = None  # monotonic s: when the metering batch now out was sent (None: none)
        self._open: dict[str, KeyInfo] = {}  # request id → key, admitted and not yet metered
        self._known: dict[str, KeyInfo] = {}  # key id → last KeyInfo seen (budgets for alerts)
        self._cache_result: dict[str, str] = {}  # request id → hit|miss|bypass
        # event id → its cache outcome: events counted in the metrics at their write's answer (Accounting.sink)
        self._unobserved: dict[str, str] = {}
        # request id → the exact-cache lookup prepared for its admission call and that call's reply to it (None:
        # not run), until cache_begin takes it
        self._looked: dict[str, _Looked] = {}
        self._replaying: asyncio.Task[int] | None = None  # the spool replay admissions wait for after an outage
        self._replay_retry_at = 0.0  # monotonic s: a failed replay is not retried from the request path before
        self._stop = asyncio.Event()
        self._replayer: asyncio.Task[None] | None = None
        self._dead_retrier: asyncio.Task[None] | None = None
        # write-ahead records (metering.write_ahead): the admitted upper bound per request id until its record is
        # written, and the heartbeat/reconcile task
        self.wal: WriteAhead | None = None
        if settings.metering.write_ahead:
            self.wal = WriteAhead(self.handle, self.breaker, self.meter, settings.metering,
                                  {t.name: t.prices for t in settings.tiers})
            # a dead process's request metered here counts in this process's series, as its own would have
            self.wal.on_metered = lambda event: self.metrics.observe(event, "bypass")
        self._bounds: dict[str, Estimate] = {}
        self._wal_task: asyncio.Task[None] | None = None
        self._syncer: asyncio.Task[None] | None = None

    # --- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the spool replayer (call inside the serving event loop); say which semantic index is used."""
        self._stop.clear()
        try:
            await BudgetStore(self.handle, self.breaker).sync()
        except RedisDown:
            log.warning("budget definitions not checked at start (Redis down)")
        except ResponseError as exc:  # a listing of the wrong type, or a refused write (OOM, READONLY): serve
            # (budgets.refresh keeps its copy) and say so; Redis's reply names the command and the key
            log.error("budget definitions not checked at start: Redis refused the sync of %s and its definition "
                      "hashes (%s)", self.budgets.keys.budget_defs, exc)
        await self.budgets.refresh(force=True)  # the copy a Redis outage falls back on (``/ready`` reads synced)
        if not self.budgets.synced:  # started during an outage: read them once Redis answers, traffic or not
            self._syncer = asyncio.create_task(self._sync_budgets(), name="budget-first-sync")
        self._replayer = asyncio.create_task(self.meter.run_replayer(self._stop), name="usage-spool-replayer")
        self._dead_retrier = asyncio.create_task(self.meter.run_dead_letters(self._stop),
                                                 name="usage-dead-letter-retrier")
        if self.wal is not None:
            self._wal_task = asyncio.create_task(self.wal.run(self._stop), name="write-ahead-reconciler")
        if self.semantic is not None:
            search = await self.semantic.index.detect()
            log.info("semantic cache on (embedder %s, threshold %.2f): LSH index in Redis%s",
                     self.semantic.embedder.name, self.semantic.cfg.threshold,
                     " (the server's vector search module is present but not used)" if search else "")

    async def _sync_budgets(self) -> None:
        """Read the budget definitions every ``limits.budget_refresh_s`` (at least every :data:`FIRST_SYNC_MIN_S`)
        until a read succeeds (``BudgetLevels.synced``), then stop. A process started while Redis was down used to
        stay unsynced until it admitted a request — ``/ready`` said ``redis_synced: false`` with Redis back, and
        ``not_ready`` (503) if Redis went again before any traffic came."""
        period = max(self.settings.limits.budget_refresh_s, FIRST_SYNC_MIN_S)
        while not self.budgets.synced and not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), period)
            if self._stop.is_set():
                return
            try:
                await self.budgets.refresh(force=True)  # Redis still down: the breaker answers at once
            except Exception:  # a refused listing is logged by refresh; anything else must not end the loop
                log.exception("budget definitions not read")

    async def flush(self) -> None:
        """Wait until every usage event finished so far has been written (Redis or spool)."""
        while self._pending or self._queue:
            if self._queue and (self._writer is None or self._writer.done()):
                self._start_writer()
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def close(self) -> None:
        """Flush, stop the replayer (one last replay attempt), close the clients."""
        if self._replaying is not None and not self._replaying.done():
            self._replaying.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._replaying
        await self.flush()
        self._stop.set()
        for task in (self._replayer, self._dead_retrier, self._syncer):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._wal_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._wal_task
        await self.meter.replay()
        if self.wal is not None:
            await self.wal.close()
        await self.cache.close()
        await self.limits.close()
        await self.http.aclose()
        await self.handle.close()

    # --- limits -----------------------------------------------------------------------------------------
    async def admit(self, key: KeyInfo, body: dict[str, Any], record: UsageRecord,
                    tiers: list[TierConfig], ahead: Ahead | None = None, *,
                    budget_mode: BudgetMode | None = None) -> Admission:
        """Admit the request of ``record`` (``tiers``: where it may run: routed tier + fallbacks) or raise
        :class:`~gateway.errors.RateLimited` / ``LimitsUnavailable``. ``ahead``: the request's first upstream
        call (:class:`Ahead`): on a single Redis its write-ahead record and exact-cache lookup are done in the
        same script call (``Limits.fused``); :meth:`cache_begin` and :meth:`write_ahead` then use what it did.
        ``budget_mode``: this call's budget mode at every level (default ``limits.budget_mode``; the shadow's
        calls are ``hard``, ``gateway/control/shadow.py``)."""
        est = estimate(body, tiers)
        record.completion_bound = est.completion  # metering holds a reported completion count to it
        record.token_bound = est.tokens  # …and trusts a reported count up to it (n choices may pass 10M tokens)
        record.prompt_bound = est.prompt  # a killed call's write-ahead record is billed at most this prompt
        return await self.admit_estimate(key, est, record, ahead, budget_mode=budget_mode)

    async def admit_estimate(self, key: KeyInfo, est: Estimate, record: UsageRecord,
                             ahead: Ahead | None = None, *, budget_mode: BudgetMode | None = None) -> Admission:
        """Admit one upstream call of ``key`` bounded by ``est`` under ``record``'s id, at the key, each of its
        tags and the global level — with the budgets in Redis at this moment (the local copy only while Redis
        is down). Raises like :meth:`admit`.

        **Cancelled while admitted.** A call with no rider (every call but a request's first on a single Redis:
        an escalation's, a shadow or judge call, an embedding call) is admitted in a task of its own that a
        cancellation of the caller does not stop: the script may already be on its way to Redis (a coalesced
        exchange is sent whatever its callers do), so its outcome is awaited and, when it admitted, the call that
        will never be sent is metered as such (:meth:`abandon`: status 499, cost 0, ``cancelled``) — its
        reservations are settled at once instead of holding the budgets until ``limits.reservation_ttl_s``.
        A request's first call on a single Redis (``ahead``: one script call that also writes its write-ahead record and
        may take the exact cache's single-flight lock) keeps its one await and no task: the lane's flush that reads
        the script's reply tells it to :meth:`_first_call_orphaned` (``Rider.orphan``), which meters it the same way
        — that usage event also deletes its write-ahead record and releases the lock."""
        self._remember(key)
        lim = KeyLimits.of(key)
        if self.spool.dirty and not self.breaker.is_open and time.monotonic() >= self._replay_retry_at:
            await self._replay_before_admitting()
        await self.budgets.refresh()  # the fallback copy (Redis down) and the views; admission reads Redis
        rider, rec, lookup = None, None, None
        if ahead is not None and self.limits.fused:
            rider, rec, lookup = self._rider(key, est, record, ahead)
        admitting = self.limits.admit(lim, record.request_id, est, record.ts, self.budgets.candidates(key.tags),
                                      self.budgets.above_key(key.tags), rider, budget_mode)
        try:
            # the hot path's first call (rider) keeps its one await; the others are released if cancelled
            admission = await (admitting if rider is not None else self._released_if_cancelled(admitting, key, record))
        except GatewayError as exc:
            self.metrics.rejected(exc.code)
            if exc.outcome_unknown and ahead is not None:
                # a request's first call: refused, its audit event (Proxy.refused) takes back what the lost script
                # may have left besides its reservations and record — its RPM count (the key has a limit: the script
                # counted it, had it run) and the single-flight lock its lookup may have taken (only this process
                # knows its key and token)
                look = lookup if isinstance(lookup, Lookup) and lookup.token else None
                self.meter.left(record.request_id, Leftovers(rpm=lim.rpm is not None,
                                                             lock=look.lock_key if look is not None else "",
                                                             token=look.token if look is not None else ""))
            if isinstance(exc, RateLimited) and exc.exhausted is not None:
                self._track(self._alert_exhausted(exc.exhausted, key, record.ts))
            raise
        except asyncio.CancelledError:
            if rider is not None:  # its script's outcome is told to _first_call_orphaned: flush() waits for it
                self._await_orphan(record.request_id)
            raise
        self.budgets.learn(st.level for st in admission.levels)  # the copy a failed admission call falls back on
        self._open[record.request_id] = key
        if admission.rode and rec is not None and self.wal is not None:
            self.wal.written(rec)  # in Redis already: write_ahead() has nothing to write
        else:
            self._bounds[record.request_id] = admission.estimate  # the write-ahead record carries the upper bound
        if lookup is not None:
            # not ridden (Redis down: admitted locally): resume() makes it a bypass that still releases the lock
            # the script may have taken after all (a paused server resumes)
            self._looked[record.request_id] = _Looked(lookup, admission.lookup_reply if admission.rode else None)
        return admission

    async def _released_if_cancelled(self, admitting: Coroutine[Any, Any, Admission], key: KeyInfo,
                                     record: UsageRecord) -> Admission:
        """Await ``admitting`` (a :meth:`Limits.admit` call for ``record``) in a task a cancellation of the caller
        leaves running; if the caller is cancelled and the call is then admitted, it is metered as never sent
        (:meth:`_cancelled_admission`). The task is pending work until then (:meth:`flush` waits for it)."""
        task = asyncio.get_running_loop().create_task(admitting)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._pending.add(task)  # flush() and close() wait for its outcome
            task.add_done_callback(functools.partial(self._cancelled_admission, key, record))
            raise

    def _cancelled_admission(self, key: KeyInfo, record: UsageRecord, task: asyncio.Task[Admission]) -> None:
        """The admission of a caller that was cancelled meanwhile has ended: refused (nothing reserved) or
        admitted — then metered as the call that was never sent (status 499, cost 0, ``cancelled``), which settles
        its reservations at every level (and the local counters' copy) now."""
        self._pending.discard(task)
        if task.cancelled() or task.exception() is not None:  # refused, or undecided: nothing of it was reserved
            return
        self._open[record.request_id] = key
        self.abandon(record, None, 499, "cancelled")

    def _await_orphan(self, rid: str) -> None:
        """The caller of ``rid``'s first-call admission was cancelled: :meth:`flush` waits until its outcome is
        settled (unless it was told already: the reply came before the cancellation took effect)."""
        if rid in self._orphans_told:
            self._orphans_told.discard(rid)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._orphans[rid] = waiter
        self._pending.add(waiter)

    def _first_call_orphaned(self, key: KeyInfo, record: UsageRecord, ahead: Ahead, rec: WalRecord | None,
                             lookup: Lookup | Ticket | None, admission: Admission | None, unknown: bool) -> None:
        """What the hot-path admission of a request's first call did, its caller (the request) cancelled while the
        script was out (``Rider.orphan``; called once, from the lane's flush or the cancelled caller). Admitted: the
        call will never be sent, so it is metered as such (status 499, cost 0, ``cancelled``; the routed tier): its
        usage event settles the reservations at every level, deletes the write-ahead record — which the reconciler
        would otherwise bill as a partial call once this process is gone — and releases the single-flight lock the
        script took (:meth:`sink`). Its outcome ``unknown`` (the script may have run: a timeout): metered the same
        way — the event settles whatever is there, nothing if it never ran, and a script that runs later finds the
        request settled (``HOT``'s seen-set check) —, the lock released by its token (a no-op if it was never
        taken). Refused: nothing to settle."""
        rid = record.request_id
        waiter = self._orphans.pop(rid, None)
        if waiter is None:
            self._orphans_told.add(rid)  # told before the caller's cancellation reached admit_estimate
        try:
            if admission is not None or unknown:
                if admission is not None:
                    self.budgets.learn(st.level for st in admission.levels)
                self._open[rid] = key
                if admission is not None and rec is not None and self.wal is not None:
                    self.wal.written(rec)
                if lookup is not None:
                    # unknown: as if the lock was taken (FINISH deletes it only if it holds this lock's token)
                    self._looked[rid] = _Looked(lookup, admission.lookup_reply if admission is not None else None,
                                                outcome_unknown=admission is None)
                if record.tier is None:
                    record.tier, record.upstream_model = ahead.tier.name, ahead.tier.model
                    record.route_reason = record.route_reason or ahead.route_reason
                self.abandon(record, None, 499, "cancelled")
        finally:
            if waiter is not None:
                self._pending.discard(waiter)
                waiter.set_result(None)

    async def _replay_before_admitting(self) -> None:
        """Send the usage spool to Redis before Redis decides an admission again. The events spooled while Redis
        was down are spend the admission script cannot see: admitting on Redis's counters before they land let a
        hard budget be overspent in the seconds after an outage (until the replayer's next pass). One replay for
        every request that waits (coalesced), bounded by :data:`REPLAY_WAIT_S`; on an outage or the bound the
        request goes on (Redis down: admitted on the local counters, which count that spend)."""
        if self._replaying is None or self._replaying.done():
            self._replaying = asyncio.get_running_loop().create_task(self._replay_spool())
        try:
            await asyncio.wait_for(asyncio.shield(self._replaying), REPLAY_WAIT_S)
        except RedisDown:
            pass  # still down: admitted on the local counters, which count the spooled spend
        except Exception as exc:  # logged by the replayer's next pass too; admission decides on what it sees
            log.warning("usage spool not replayed before admission: %r", exc)

    async def _replay_spool(self) -> int:
        """The replay admissions wait for. Half-open (the breaker's cooldown passed, nothing went through yet): one
        PING first, so a Redis still down costs one probe, not a read and parse of the whole spool. A replay
        that fails with an error that is not an outage is not tried from the request path again for
        ``metering.replay_interval_s`` (the background replayer keeps trying); an outage is paced by the breaker."""
        try:
            if not self.breaker.closed:
                await self.breaker.call(self.handle.client.ping)
            n = await self.meter.replay()
            if self.spool.dirty:
                raise RedisDown("the usage spool is still not in Redis")
            return n
        except RedisDown:
            raise  # an outage (or a probe already out): the breaker paces the next try, no throttle of our own
        except Exception:
            self._replay_retry_at = time.monotonic() + self.settings.metering.replay_interval_s
            raise

    def _rider(self, key: KeyInfo, est: Estimate, record: UsageRecord,
               ahead: Ahead) -> tuple[Rider, WalRecord | None, Lookup | Ticket | None]:
        """What the admission call of a request's first upstream call also does on a single Redis: write its
        write-ahead record (when ``metering.write_ahead``) and look its answer up in the exact cache."""
        rec = None
        if self.wal is not None:
            rec = self.wal.open_record(record, est.micro_usd, est.tokens, tier=ahead.tier.name,
                                       upstream_model=ahead.tier.model, route_reason=ahead.route_reason)
        lookup = self._lookup(key, record, ahead.tier, ahead.upstream_body, ahead.headers)
        # told what the script did if the request is cancelled while it is out (no task on the normal path)
        orphan = functools.partial(self._first_call_orphaned, key, record, ahead, rec, lookup)
        return (Rider(self.wal.keys.write_ahead if self.wal is not None else "", rec.to_json() if rec else b"",
                      lookup if isinstance(lookup, Lookup) else None, orphan), rec, lookup)

    async def renew(self, record: UsageRecord) -> int:
        """Extend the reservations of a call still running (a stream) by ``limits.reservation_ttl_s``; the
        number of levels that still held it."""
        return await self.limits.renew(record.key_id or "anonymous", record.tags, record.request_id, time.time())

    def key_of(self, key_id: str | None) -> KeyInfo:
        """The key of a request admitted by this process (its last-seen KeyInfo)."""
        return self._known.get(key_id or "") or KeyInfo(id=key_id or "anonymous")

    async def admit_follow_up(self, first: UsageRecord, body: dict[str, Any], record: UsageRecord,
                              tiers: list[TierConfig]) -> Admission:
        """Admit a further upstream call made for the request of ``first`` (an escalation) as ``record``: its own
        reservation at every level, settled by ``record``'s usage event. Raises like :meth:`admit`."""
        return await self.admit(self.key_of(first.key_id), body, record, tiers)

    async def key_info(self, key_id: str) -> KeyInfo | None:
        """The key ``key_id`` (for its budgets): in the config, else as the Redis store has it now (``keys update``
        changes it in place), else — Redis down — as this process last saw it."""
        for k in self.settings.auth.keys:
            if k.id == key_id:
                return KeyInfo.of(k)
        try:
            rec = await self.keystore.get(key_id)
        except RedisDown:
            return self._known.get(key_id)
        return KeyInfo.of(rec) if rec is not None else self._known.get(key_id)

    def _remember(self, key: KeyInfo) -> None:
        if key.id not in self._known and len(self._known) >= KNOWN_KEYS_MAX:
            self._known.clear()
        self._known[key.id] = key

    # --- cache ------------------------------------------------------------------------------------------
    async def cache_begin(self, key: KeyInfo, record: UsageRecord, tier: TierConfig,
                          upstream_body: dict[str, Any], headers: Mapping[str, str]) -> Ticket:
        """Look up the answer to ``upstream_body`` on ``tier`` for ``key``'s tenant scope (never raises for
        Redis outages; a ``bypass`` ticket when the policy or an outage says so)."""
        looked = self._looked.pop(record.request_id, None)
        # a single-flight follower's wait (up to cache.single_flight_wait_s) is where a killed process leaves most
        # records of requests never sent upstream: marked so (one background write, on that path only)
        on_wait = functools.partial(self.wal.waiting, record.request_id) if self.wal is not None else None
        if looked is None:
            prepared = self._lookup(key, record, tier, upstream_body, headers)
            ticket = prepared if isinstance(prepared, Ticket) else await self.cache.look(prepared, on_wait)
        else:  # prepared for the admission call (``admit``'s ``ahead``): its reply, or Redis did not answer it
            prepared = looked.prepared
            ticket = (prepared if isinstance(prepared, Ticket)
                      else await self.cache.resume(prepared, looked.reply, on_wait))
        if self.semantic is not None and ticket.status == "miss":
            ticket = await self._semantic_begin(self.semantic, ticket, key, record, tier, upstream_body)
        self._cache_result[record.request_id] = "semantic-hit" if ticket.similarity is not None else ticket.status
        return ticket

    def _lookup(self, key: KeyInfo, record: UsageRecord, tier: TierConfig, upstream_body: dict[str, Any],
                headers: Mapping[str, str]) -> Lookup | Ticket:
        """The exact-cache lookup of ``upstream_body`` on ``tier`` for ``key``'s tenant scope, ready for a script
        call, or its ticket at once when the cache policy looks nothing up."""
        decision = decide(self.settings.cache, upstream_body, headers)
        scope = tenant_scope(key.id, key.cache_namespace)
        if decision.lookup or decision.store:
            digest = cache_key(scope, record.endpoint, tier.name, upstream_body)
        else:
            digest = ""  # bypass: no Redis, no hashing
        # the entry lives in its tenant's Cluster slot (gateway/state/keys.py)
        return self.cache.prepare(digest, decision, tenant_tag(scope))

    async def _semantic_begin(self, semantic: SemanticCache, ticket: Ticket, key: KeyInfo, record: UsageRecord,
                              tier: TierConfig, upstream_body: dict[str, Any]) -> Ticket:
        """After an exact miss: look for a similar question's answer (when the decision allows a lookup) and
        keep the probe to index this request's answer once it is stored. A semantic hit releases the
        single-flight lock this request may hold (identical requests waiting on it then look up themselves)."""
        scope = tenant_scope(key.id, key.cache_namespace)
        emb = await self._admit_embedding(semantic, key, record, scope, tier, upstream_body)
        if emb is False:
            return ticket  # the embedding call is not admitted: no semantic lookup, the request goes on
        try:
            if isinstance(emb, UsageRecord):  # recorded before it is sent, as every upstream call: a crash is billed
                await self.write_ahead(emb)
            probe = await semantic.prepare(scope, record.endpoint, tier.name, upstream_body)
        except BaseException as exc:  # cancelled in flight: metered (nothing known of it), its reservation settled now
            if isinstance(emb, UsageRecord):
                self._meter_embedding(emb, None, 499 if isinstance(exc, asyncio.CancelledError) else 500, partial=True)
            raise
        if isinstance(emb, UsageRecord):  # admitted: metered whatever the call did (settles its reservation)
            self._meter_embedding(emb, probe.sketch if probe is not None else None)
        if probe is None:
            return ticket
        if ticket.decision.lookup:
            found = await semantic.lookup(probe, ticket.decision.max_age_s)
            self.metrics.semantic(found.outcome)
            if found.outcome == "hit" and found.entry is not None:
                await self.cache.finish(ticket, None)
                return Ticket(ticket.digest, ticket.decision, "hit", found.entry, similarity=found.similarity,
                              source_request_id=found.matched_request_id, tenant=ticket.tenant)
        if ticket.decision.store:
            self._probes[record.request_id] = probe
        return ticket

    async def _admit_embedding(self, semantic: SemanticCache, key: KeyInfo, record: UsageRecord, scope: str,
                               tier: TierConfig, upstream_body: dict[str, Any]) -> UsageRecord | bool:
        """Admit the semantic cache's embedding call before it is made (a paid ``openai:<tier>`` embedder):
        its own usage record under the request's key, reserved at every level like any upstream call. Returns
        the admitted record, True when the embedder is not a paid call (or there is nothing to embed), False
        when admission refused it (the lookup is skipped, the request itself was admitted on its own)."""
        name = self.settings.cache.semantic.embedder
        if not name.startswith("openai:"):
            return True
        q = semantic_question(scope, record.endpoint, tier.name, upstream_body, semantic.embedder.name,
                              semantic.cfg.max_chars)
        if q is None:
            return True
        emb_tier = self.settings.tier(name.removeprefix("openai:"))
        emb = UsageRecord(key_id=record.key_id, tags=record.tags, endpoint="embeddings",
                          requested_model=emb_tier.model, tier=emb_tier.name, upstream_model=emb_tier.model,
                          route_reason="forced")
        try:
            await self.admit_estimate(key, embedding_estimate(q.text, emb_tier), emb)
        except GatewayError as exc:
            log.info("semantic cache lookup of %s skipped: its embedding call was not admitted (%s)",
                     record.request_id, exc.code)
            return False
        return emb

    def _meter_embedding(self, emb: UsageRecord, sketch: Sketch | None, failed: int = 502,
                         partial: bool = False) -> None:
        """The usage event of an admitted embedding call: its prompt tokens at the tier's prices — as the upstream
        reported them, else counted (``usage_source: counted``, :class:`~gateway.semantic.embed.Sketch`) —; none
        and status ``failed`` when it failed (``sketch`` None: 502, or 499/500 cut in flight with ``partial``)."""
        tier = self.settings.tier(emb.tier or "")
        emb.prompt_tokens = sketch.tokens if sketch is not None else 0
        emb.usage_source = "none" if sketch is None else "counted" if sketch.counted else "upstream"
        emb.partial = sketch is None and partial
        emb.finish(tier, 200 if sketch is not None else failed)
        self.sink(emb)

    async def cache_finish(self, ticket: Ticket, body: dict[str, Any] | None, record: UsageRecord,
                           tier: TierConfig) -> None:
        """Store ``body`` (a complete, successful answer; None = nothing to store) and release the lock; a
        stored answer is also indexed by the semantic cache. On one Redis server, with no semantic index to
        write, the call is queued and sent in a batch (``ResponseCache.finish_later``) instead of awaited."""
        entry = CacheEntry(body, record.endpoint, tier.name, tier.model, record.ts) if body is not None else None
        probe = self._probes.pop(record.request_id, None)
        if probe is None and self.cache.batches_finish:  # nothing waits on the result: off the request path
            writer = self.cache.finish_later(ticket, entry)
            if writer is not None:
                self._pending.add(writer)  # flush() and close() wait for it
                writer.add_done_callback(self._pending.discard)
            return
        stored = await self.cache.finish(ticket, entry)
        if stored and probe is not None and self.semantic is not None:
            await self.semantic.store(probe, ticket.digest, record.request_id, ticket.decision.ttl_s)

    # --- write-ahead ------------------------------------------------------------------------------------
    async def write_ahead(self, record: UsageRecord) -> None:
        """Before ``record``'s upstream call sends its first byte: its write-ahead record, with the admitted upper
        bound (Redis, else the spool; never raises for an outage). Called again before a fallback's call (the
        record stamped with the fallback tier, ``Exchange.stamp``): the write-ahead record then names that tier,
        its model and route reason before the call is sent (``WriteAhead.retarget``: one awaited write, on a
        fallback only), so a process killed during it is settled on the tier the call ran on."""
        if self.wal is None:
            return
        bound = self._bounds.pop(record.request_id, None)
        rid = record.request_id
        if bound is None and self.wal.is_open(rid):
            # written inside its admission call (a single Redis: ``admit``'s ``ahead``), or by an earlier call of this
            # request; a request that waited on another's single-flight lock marked it waiting (taken for never sent
            # after a crash): cleared first
            if self.wal.is_waiting(rid):
                await self.wal.sending(rid)
            if record.tier is not None and record.upstream_model is not None \
                    and not self.wal.names(rid, record.tier, record.upstream_model, record.route_reason):
                await self.wal.retarget(rid, record.tier, record.upstream_model, record.route_reason)
            return
        await self.wal.begin(record, bound.micro_usd if bound else 0, bound.tokens if bound else 0)

    def stream_progress(self, record: UsageRecord) -> Callable[[StreamTally], None] | None:
        """The progress hook of ``record``'s stream: call it with the relay's tally after each batch; the tokens
        relayed so far go to the write-ahead record at most every ``metering.write_ahead_interval_s``. None when
        write-ahead is off (nothing to call per batch)."""
        return self.wal.tracker(record) if self.wal is not None else None

    # --- metering ---------------------------------------------------------------------------------------
    def sink(self, record: UsageRecord) -> None:
        """Usage sink: metrics now, Redis write (metering → local settle → alerts) in the background. A request whose
        write-ahead record another replica may have metered already (this process's heartbeat lapsed while it ran:
        ``WriteAhead.settled``) is counted in the metrics at its write's answer instead, unless that says its id was
        counted already: the ledger holds the reconciler's event, which that replica's metrics counted."""
        event = event_of(record)
        self._bounds.pop(record.request_id, None)
        claimable = False
        if self.wal is not None:  # its usage event deletes the record in Redis
            # The writer stalled (a batch out past WAL_FINAL_AFTER_S): the event waits for that call, then its own —
            # a kill meanwhile would leave the record with the tokens of its last progress write (none for a short
            # call), so the event goes into the record first (one background write for all the events queued
            # meanwhile). The writer idle or within a round trip: the event leaves with the next batch, as soon as
            # that write could. Redis down: the event goes to the fsync'd spool.
            since = self._batch_since
            waits = since is not None and time.monotonic() - since > WAL_FINAL_AFTER_S and self.breaker.closed
            claimable = self.wal.settled(record.request_id, event if waits else None)
        key = self._open.pop(record.request_id, None) or self._known.get(event.key_id)
        self._probes.pop(record.request_id, None)
        looked = self._looked.pop(record.request_id, None)
        if looked is not None and looked.may_hold_lock:
            # a single-flight lock its admission call took (or may have) that no cache_begin turned into a ticket:
            # release it
            look = looked.prepared
            assert isinstance(look, Lookup)  # may_hold_lock
            self._track(self.cache.finish(Ticket(look.digest, look.decision, "miss", lock_token=look.token,
                                                 tenant=look.tenant), None))
        self._queue.append((event, key))  # first: a failing metric must never cost the usage record
        cache = self._cache_result.pop(record.request_id, "bypass")
        if claimable:
            self._unobserved[event.event_id] = cache
        else:
            self._observe(event, cache)
        if self._writer is None or self._writer.done():
            self._start_writer()

    def _observe(self, event: UsageEvent, cache: str) -> None:
        try:
            self.metrics.observe(event, cache)
        except Exception:
            log.exception("metrics of usage event %s failed", event.event_id)

    def _observe_written(self, batch: list[tuple[UsageEvent, KeyInfo | None]],
                         results: list[RecordResult] | None) -> None:
        """Count the events of ``batch`` that :meth:`sink` left to their write's answer (``results``; None: the write
        failed): each unless Redis said its id was counted already — by a reconciler that took this process for
        dead, whose process counted it then. Spooled or refused, it is still this process's to count."""
        if not self._unobserved:
            return
        for i, (event, _) in enumerate(batch):
            cache = self._unobserved.pop(event.event_id, None)
            if cache is None:
                continue
            result = results[i] if results is not None else None
            if result is not None and result.stored == "redis" and not result.counted:
                log.warning("usage event %s was metered by another replica's reconciler while this process's "
                            "heartbeat lapsed: the ledger and that replica's metrics hold its event, not this one",
                            event.event_id)
                continue
            self._observe(event, cache)

    def _start_writer(self) -> None:
        self._writer = self._track(self._write_queue())

    def _track(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    def audit(self, record: UsageRecord, status: int, code: str | None) -> None:
        """Record a request refused before any upstream call (``record``: what is known — key, tier, endpoint):
        one audit event with cost 0 (``UsageEvent.audit``) and the refusal counter by status and code. Its write
        (metering's ``AUDIT``) also settles what an admission under the request id may have left — one whose reply
        was lost may have reserved and written the write-ahead record (``gateway/state/limits.py``, "Outcome
        unknown") —, through the same writer and spool as every event: an outage delays it, never loses it."""
        record.finish(None, status)
        record.error_code = code
        if not record.key_id and not self._anon_admitted():
            self.metrics.refused(status, code)
            return
        event = event_of(record)
        event.key_id = record.key_id or ""  # unknown (401): no key id, never "anonymous"
        if event.requested_model and len(event.requested_model) > AUDIT_TEXT_MAX:
            event.requested_model = event.requested_model[:AUDIT_TEXT_MAX]
        event.audit = True
        event.cost_micro_usd = event.saved_micro_usd = 0
        event.usage_source = "none"
        self._open.pop(record.request_id, None)
        self.metrics.refused(status, code)
        self._queue.append((event, None))
        if self._writer is None or self._writer.done():
            self._start_writer()

    def _anon_admitted(self) -> bool:
        """Whether an audit event without a key may be written now (token bucket, :data:`ANON_AUDIT_PER_S`)."""
        now = time.monotonic()
        self._anon_tokens = min(ANON_AUDIT_BURST, self._anon_tokens + (now - self._anon_at) * ANON_AUDIT_PER_S)
        if self._anon_tokens >= 1.0:
            self._anon_tokens -= 1.0
            if self._anon_dropped:
                log.warning("%d audit events of requests without a valid key were not written (more than %g/s)",
                            self._anon_dropped, ANON_AUDIT_PER_S)
                self._anon_dropped = 0
            self._anon_at = now
            return True
        self._anon_at = now
        self._anon_dropped += 1
        return False

    def abandon(self, record: UsageRecord, tier: TierConfig | None, status: int, code: str) -> None:
        """Meter a request that ends without a record (error or cancellation) if it was admitted."""
        if record.request_id not in self._open:
            return
        record.error_code = code
        record.partial = True
        record.finish(tier, status)
        self.sink(record)

    async def _write_queue(self) -> None:
        """The metering writer: until the queue is empty, write what has queued up as one batch."""
        while self._queue:
            batch = self._queue[:WRITE_BATCH_MAX]
            del self._queue[:WRITE_BATCH_MAX]
            await self._write_batch(batch)

    async def _write_batch(self, batch: list[tuple[UsageEvent, KeyInfo | None]]) -> None:
        self._batch_since = time.monotonic()
        try:
            results = await self.meter.record_many([event for event, _ in batch])
        except Exception:  # a spool could not be written (disk full): Meter keeps every other failure. Events
            # not counted keep their write-ahead records open (the reconciler bills them if this process dies);
            # counted ones lost only their extra copy for too few replica acknowledgements (metering.replica_acks)
            log.exception("usage write failed for events %s", ", ".join(e.event_id for e, _ in batch))
            self._observe_written(batch, None)
            return
        finally:
            self._batch_since = None
        self._observe_written(batch, results)
        parked = [event for (event, _), result in zip(batch, results, strict=True) if result.stored == "dead_letter"]
        if parked and self.wal is not None:
            self._track(self._park(parked))
        for (event, key), result in zip(batch, results, strict=True):
            try:
                self.limits.settled(event, result)
            except Exception:
                log.exception("usage settle failed for event %s", event.event_id)
            if key is None or event.audit or result.stored != "redis" or result.day_cost_micro_usd is None:
                continue
            lim = KeyLimits.of(key)
            levels = [lv for lv in self.budgets.above_key(key.tags) if lv.id in result.levels]
            if lim.budget_day_micro or lim.budget_month_micro or levels:  # alerts only concern budgeted levels
                spend = [(lim.level, result.day_cost_micro_usd, result.month_cost_micro_usd or 0)]
                spend += [(lv, *result.levels[lv.id]) for lv in levels]
                self._track(self._alert(spend, key, event))

    async def _park(self, events: list[UsageEvent]) -> None:
        """Dead-lettered events into their write-ahead records (``WriteAhead.park``); a failure is logged (the
        events are safe in the dead-letter spool either way)."""
        assert self.wal is not None
        try:
            await self.wal.park(events)
        except Exception:
            log.exception("write-ahead: dead-lettered events %s not put into their records",
                          ", ".join(e.event_id for e in events))

    async def _alert(self, spend: list[Any], key: KeyInfo, event: UsageEvent) -> None:
        try:
            for level, day_cost, month_cost in spend:
                await self.alerts.check_level(level, key.tags, event.day, day_cost, month_cost, key.id)
        except Exception:
            log.exception("budget alert check failed for event %s", event.event_id)

    async def _alert_exhausted(self, exhausted: tuple[Level, str, int], key: KeyInfo, ts: float) -> None:
        """A request refused on spend past a budget: the level's alerts, as metering checks them after a request
        (a budget lowered below today's spend refused everything without the operator hearing of it). Each alert
        fires once per level and period (the marks), so a stream of refusals fires it once."""
        level, period, spent = exhausted
        try:
            day = time.strftime("%Y-%m-%d", time.gmtime(ts))
            await self.alerts.check_level(level, key.tags, day, spent if period == "day" else 0,
                                          spent if period == "month" else 0, key.id)
        except Exception:
            log.exception("budget alert check failed for a refused request of key %s", key.id)

    def render_metrics(self) -> bytes:
        return self.metrics.render(self.breaker.is_open,
                                   self.spool.pending_bytes() + self.meter.unacked.pending_bytes(), self.meter.spooled,
                                   self.meter.dead.pending_bytes(), self.meter.dead_lettered,
                                   self.meter.unreplicated, self.limits.refused_scripts,
                                   self.meter.quarantine.pending_bytes(), self.meter.quarantine.counts,
                                   self.wal.unreplicated if self.wal is not None else 0,
                                   self.breaker.stall_timeouts, self.conversations.not_stored,
                                   {"metered": self.wal.reconciled, "released": self.wal.released}
                                   if self.wal is not None else None)
