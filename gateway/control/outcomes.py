"""The outcome stream: routing outcomes (:class:`gateway.ledger.outcome.Outcome`) in Redis, spooled on outage.

Write path (:meth:`OutcomeStore.record`): one Lua call adds the outcome's id to the day's seen-set and, when it
is new, ``XADD``s it to ``p outcomes`` (field ``o`` = the JSON, ``MAXLEN ~ routing.outcomes.stream_maxlen``),
so a replayed outcome is never written twice. Redis down (or the breaker open): the outcome goes to its own
fsync'd spool file (:class:`gateway.state.spool.Spool`, the usage spool's class and rule) and
:meth:`OutcomeStore.run_replayer` sends it once Redis answers.

Request index, for ``POST /v1/feedback``: every answered request leaves ``p req:{request_id}`` (JSON: key id,
tier, route reason, router score, window digest, the version of the router serving when it was answered — its
feedback is that router's, however late it comes — and, under ``retain_text``, the window text), TTL
``routing.outcomes.request_ttl_s``. These writes are batched in the background (one pipeline every 0.2 s).
Feedback reaching the replica that answered is served from its queue, and from the batch being written, until
that write has returned — at no instant is an entry in neither place; another replica sees the request after the
write (up to 0.2 s). A write that fails (Redis down) puts its batch back in front of the queue, to be written at
a later flush: feedback reaching this replica meanwhile still finds it (its outcome is spooled). The queue is
bounded (:data:`MAX_INDEX_QUEUE`, the oldest dropped first); what a process holds when it stops is lost.
The usage sink (:meth:`OutcomeStore.sink`) also turns each escalated attempt (``error_code``
``escalated_<why>``) into an ``escalation`` outcome: the cheap tier did not suffice; ``other_tier`` the tier the
escalation asked, ``escalated_from`` (the second step of a cascade: the attempt escalated was itself an escalation's)
the route reason of the request's first attempt. So is an answer whose escalation
was asked for and not made (``UsageRecord.escalation_not_taken``: refused by the budget or the key's policy —
``x-thinkgate-escalation: skipped; …`` — or its call failed — ``failed; …``), with ``other_tier`` the tier it would
have asked and ``comment`` that note: the tier's ``escalate_on`` judged the same answer too weak, whether or not the
next tier could be reached. That answer was served, so it is indexed for feedback as well.
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import orjson
from redis.exceptions import ResponseError

from gateway.config import OUTCOMES_SEEN_TTL_S, OutcomesConfig, Settings
from gateway.ledger.outcome import Outcome, window_digest
from gateway.ledger.record import UsageRecord
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.keys import RedisKeys, key_tenant
from gateway.state.redis import RedisHandle, as_bytes, pack, raise_error_reply
from gateway.state.spool import Spool

log = logging.getLogger("thinkgate.outcomes")

# a day's seen-set: what deduplicates its outcomes (and the grades of its requests: request_ttl_s is bounded by it)
SEEN_TTL_S = OUTCOMES_SEEN_TTL_S
INDEX_FLUSH_S = 0.2
MAX_INDEX_QUEUE = 10_000

# KEYS: seen-set, stream[, grades hash]. ARGV: outcome id, JSON, seen TTL s, maxlen[, grade "1"/"0"]. Returns 1
# (written), 0 (a replay) or, for a graded outcome already there, "g" + the grade it was written with (the first
# grade stands, and the client is told which).
RECORD_LUA = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then
  if KEYS[3] then
    local g = redis.call('HGET', KEYS[3], ARGV[1])
    if g then return 'g' .. g end
  end
  return 0
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
if KEYS[3] then
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[5])
  redis.call('EXPIRE', KEYS[3], ARGV[3])
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'o', ARGV[2])
return 1
"""


def outcome_spool_path(settings: Settings) -> Path:
    """Where outcomes wait for Redis: ``routing.outcomes.spool_path``, else beside the usage spool."""
    cfg = settings.routing.outcomes
    if cfg.spool_path is not None:
        return cfg.spool_path
    usage = settings.metering.spool_path
    return usage.with_name(usage.stem + ".outcomes.jsonl")


class OutcomeStore:
    """Writes and reads outcomes and the request index. One per process; :meth:`start` inside the event loop."""

    def __init__(self, cfg: OutcomesConfig, handle: RedisHandle, breaker: Breaker, spool_path: Path,
                 router_version: Any = None) -> None:
        self.cfg = cfg
        self.redis = handle.client
        self.lane = handle.lane
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.spool: Spool[Outcome] = Spool(spool_path, decode=Outcome.from_json)
        self._script = self.redis.register_script(RECORD_LUA)
        #: () -> the router file's version string (or None), stamped into every outcome
        self.router_version = router_version or (lambda: None)
        self.spooled = 0
        # (request id, key id, entry JSON) not yet written, newest last; full, the oldest is dropped (a request is
        # graded soon after its answer, if at all)
        self._index: deque[tuple[str, str, bytes]] = deque(maxlen=MAX_INDEX_QUEUE)
        # the batch a flush is writing: still read by request() until its write returns (feedback got a 404 while
        # an entry was in neither the queue nor Redis)
        self._flushing: list[tuple[str, str, bytes]] = []
        # outcome id → grade of the feedback this process spooled and its replay has not written yet: a second grade
        # of the request meanwhile (the replica holding its index entry answers it through an outage) is answered by
        # the first, which stands once replayed — spooled too, or written to a Redis back before the replay, it was
        # told it was stored while the replay dropped it, or dropped the first instead
        self._spooled_grades: dict[str, bool] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []

    # --- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._stop.clear()
        self._loops = [asyncio.create_task(self.run_replayer(), name="outcome-spool-replayer"),
                       asyncio.create_task(self._index_loop(), name="outcome-request-index")]

    async def close(self) -> None:
        """Write what is queued, stop the loops, one last replay attempt."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._stop.set()
        for t in self._loops:  # the index loop ends after its last flush…
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.flush_index()  # …and this writes what was queued while that one was out (one at a time)
        await self.replay()

    # --- the usage sink ---------------------------------------------------------------------------------
    def sink(self, record: UsageRecord) -> None:
        """Usage sink: index answered requests for feedback; record escalations as outcomes."""
        if record.key_id is None or record.route_reason == "shadow":
            return
        code = record.error_code or ""
        if code.startswith("escalated_"):
            self._spawn(self.record(self.outcome_of(record, "escalation", sufficed=False,
                                                    judge="escalation:" + code.removeprefix("escalated_"),
                                                    other_tier=record.escalated_to,
                                                    escalated_from=record.escalated_from)))
            return
        if record.escalation_not_taken is not None:
            # judged too weak by its tier's escalate_on, served because the escalation was refused or failed: the
            # same evidence about this answer as an escalated attempt's (whatever then became of the answer served),
            # and the answer is still gradable below
            why, asked, note = record.escalation_not_taken
            self._spawn(self.record(self.outcome_of(record, "escalation", sufficed=False, judge="escalation:" + why,
                                                    other_tier=asked, comment=note,
                                                    escalated_from=record.escalated_from)))
        if record.status != 200 or record.error_code is not None:
            return
        entry: dict[str, Any] = {"key_id": record.key_id, "tier": record.tier, "route_reason": record.route_reason,
                                 "score": record.difficulty,
                                 "window_digest": window_digest(record.routing_window)
                                 if record.routing_window is not None else None,
                                 # the router that served it: feedback may come after a promotion
                                 "router_version": self.router_version(),
                                 # its day's seen-set dedups its grades, however late they come (Outcome.seen_day)
                                 "ts": record.ts}
        if record.escalated_from is not None:
            entry["escalated_from"] = record.escalated_from
        if self.cfg.retain_text and record.routing_window is not None:
            entry["text"] = record.routing_window
        self._index.append((record.request_id, record.key_id, orjson.dumps(entry)))

    def outcome_of(self, record: UsageRecord, source: Any, **kw: Any) -> Outcome:
        """An outcome about ``record``'s request (its key, tier, score, window) with ``kw`` set."""
        text = record.routing_window
        return Outcome(source=source, request_id=record.request_id, key_id=record.key_id or "anonymous",
                       tier=record.tier, route_reason=record.route_reason, score=record.difficulty,
                       window_digest=window_digest(text) if text is not None else None,
                       text=text if self.cfg.retain_text else None, router_version=self.router_version(), **kw)

    def _spawn(self, coro: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush_index(self) -> None:
        """Write the queued request-index entries (one pipeline). Until the write returns they stay readable in
        ``_flushing``; a failed write (Redis down, or an error reply) puts them back in front of the queue."""
        if not self._index or self._flushing:  # one flush at a time (close() and the loop may both call)
            return
        batch = list(self._index)
        self._flushing = batch  # visible to request() before the queue is emptied: no instant without it
        self._index.clear()
        ttl = self.cfg.request_ttl_s

        async def write() -> None:
            if self.lane is not None:  # one server: the SETs packed in one buffer (redis-py's pipeline packs
                # each command in Python: ~1% of the gateway's CPU at concurrency 32)
                packed = b"".join(pack(b"SET", self.keys.request(rid, key_tenant(key_id)), data, b"EX", ttl)
                                  for rid, key_id, data in batch)
                replies = await self.lane.exchange(packed, len(batch), coalesce="background")
                if replies is not None:
                    raise_error_reply(replies)
                    return
            async with self.redis.pipeline(transaction=False) as pipe:
                for rid, key_id, data in batch:  # each in its key's tenant slot on a Cluster (keys.py)
                    pipe.set(self.keys.request(rid, key_tenant(key_id)), data, ex=ttl)
                await pipe.execute()
        written = False
        try:
            await self.breaker.call(write)
            written = True
        except RedisDown as exc:
            log.debug("request index: %d entries kept for the next flush (redis down: %s)", len(batch), exc)
        finally:
            if not written:  # back in front of what was queued meanwhile (SET is idempotent: a partially
                # written batch written again is harmless); over the bound, the oldest go
                room = MAX_INDEX_QUEUE - len(self._index)
                if room > 0:
                    self._index.extendleft(reversed(batch[-room:]))
            self._flushing = []

    async def _index_loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), INDEX_FLUSH_S)
            try:
                await self.flush_index()
            except Exception:
                log.exception("request index write failed")

    # --- outcomes ---------------------------------------------------------------------------------------
    async def record(self, outcome: Outcome) -> str:
        """Write ``outcome`` once: ``"redis"``, ``"duplicate"`` (already there) or ``"spool"`` (Redis down).
        Raises ``OSError`` only when Redis is down and the spool cannot be written."""
        return (await self.record_graded(outcome))[0]

    async def record_graded(self, outcome: Outcome) -> tuple[str, bool | None]:
        """:meth:`record`, and the grade (``sufficed``) of the outcome now stored under its id: ``outcome``'s
        when written or spooled, the first one's for a duplicate (None when that is not known) — also while the
        first is in this process's spool, not yet replayed (``"duplicate"``: nothing written or spooled)."""
        grade = outcome.sufficed if outcome.source == "feedback" else None
        if grade is not None and (first := self._spooled_grades.get(outcome.outcome_id)) is not None:
            return "duplicate", first
        try:
            reply = await self.breaker.call(lambda: self._run(outcome))
        except RedisDown:
            if grade is not None:
                # read and set with no await between: of two grades racing through the outage, one is spooled
                if (first := self._spooled_grades.get(outcome.outcome_id)) is not None:
                    return "duplicate", first
                self._spooled_grades[outcome.outcome_id] = grade
            try:
                await self.spool.append([outcome])
            except BaseException:
                if grade is not None:
                    self._spooled_grades.pop(outcome.outcome_id, None)
                raise
            self.spooled += 1
            return "spool", outcome.sufficed
        if isinstance(reply, bytes | str) and len(reply) == 2:  # "g1" / "g0": a duplicate of a graded outcome
            return "duplicate", as_bytes(reply)[1:] == b"1"
        if int(reply):
            return "redis", outcome.sufficed
        if outcome.source == "feedback" and outcome.sufficed is not None:
            return "duplicate", await self._legacy_grade(outcome)
        return "duplicate", None

    async def _legacy_grade(self, outcome: Outcome) -> bool | None:
        """The grade of a feedback outcome seen before but without an entry in the day's grades hash: one written
        before the hash existed (commit 96eb0d2; or by a replica not yet upgraded, during a rollout), which is in
        the day's seen-set and the stream only — its duplicate answered ``sufficed: null``. Read from its stream
        entry (``sufficed``; else the client's ``value`` ≥ 0.5, the rule it was graded by) and copied into the
        grades hash, so the next duplicate is answered by the write script. None when the stream no longer holds
        it (trimmed past ``stream_maxlen``): then nothing says what it was. Raises :class:`RedisDown`."""
        # the first was found in the seen-set of this outcome's seen day, so it was made after that day's start (a
        # grade comes after its request) and its stream entry (added after it was made) is not older than that —
        # less an hour for a gateway clock ahead of Redis's (stream ids are Redis's clock): the scan stops there
        # instead of reading the whole stream
        floor_ms = (calendar.timegm(time.strptime(outcome.seen_day, "%Y-%m-%d")) - 3600) * 1000
        needle = orjson.dumps(outcome.outcome_id)
        top = "+"
        while True:
            batch = await self.breaker.call(
                lambda t=top: self.redis.xrevrange(self.keys.outcomes, max=t, min=floor_ms, count=1000)) or []  # type: ignore[misc]
            for _, fields in batch:
                raw = as_bytes((fields or {})[b"o"])
                if needle not in raw:  # most entries are other outcomes: parsed only when the id is in there
                    continue
                stored = Outcome.from_json(raw)
                if stored.outcome_id != outcome.outcome_id:
                    continue
                grade = stored.sufficed if stored.sufficed is not None else (
                    None if stored.value is None else stored.value >= 0.5)
                if grade is not None:
                    key = self.keys.outcomes_grades(outcome.seen_day)
                    await self.breaker.call(lambda k=key, g=grade: self._backfill(k, outcome.outcome_id, g))  # type: ignore[misc]
                return grade
            if len(batch) < 1000:
                return None
            last = batch[-1][0]
            top = "(" + (last.decode() if isinstance(last, bytes) else str(last))

    async def _backfill(self, key: str, outcome_id: str, grade: bool) -> None:
        # HSETNX: a grade written there meanwhile is the first's too; the TTL as the write script sets it
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hsetnx(key, outcome_id, "1" if grade else "0")
            pipe.expire(key, SEEN_TTL_S)
            await pipe.execute()

    async def _run(self, outcome: Outcome) -> Any:
        keys = [self.keys.outcomes_seen(outcome.seen_day), self.keys.outcomes]
        args: list[Any] = [outcome.outcome_id, outcome.to_json(), SEEN_TTL_S, self.cfg.stream_maxlen]
        if outcome.source == "feedback" and outcome.sufficed is not None:  # kept for a duplicate's answer
            keys.append(self.keys.outcomes_grades(outcome.seen_day))
            args.append("1" if outcome.sufficed else "0")
        return await self._script(keys=keys, args=args)

    async def _record_batch(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            await self.breaker.call(lambda o=o: self._run(o))  # type: ignore[misc]
            # in Redis now (written, or there already): a later grade is answered by the write script
            self._spooled_grades.pop(o.outcome_id, None)

    async def replay(self) -> int:
        """Send the spool to Redis; the number sent (0 when empty or Redis is down)."""
        return await self.spool.replay(self._record_batch, "outcome")

    async def run_replayer(self) -> None:
        """Replay the spool every ``replay_interval_s`` seconds until the store stops (a background task)."""
        await self.spool.run_replayer(self.replay, self._stop, self.cfg.replay_interval_s, "outcome")

    # --- reads ------------------------------------------------------------------------------------------
    async def request(self, request_id: str, key_id: str) -> dict[str, Any] | None:
        """The request-index entry of ``request_id`` made with key ``key_id`` (None: unknown, expired, or
        another key's: the entry is looked up in ``key_id``'s tenant slot). Raises :class:`RedisDown`.

        An entry still queued on this replica (answered less than one flush interval ago, or kept through an
        outage) or in the batch being written is read from there: a client grading the answer it has just
        received must not get a 404."""
        for queue in (self._index, self._flushing):  # both read before any await: an entry leaves _flushing
            for rid, kid, data in reversed(queue):  # only once its write has returned
                if rid == request_id and kid == key_id:
                    return dict(orjson.loads(data))
        raw = await self.breaker.call(lambda: self.redis.get(self.keys.request(request_id, key_tenant(key_id))))
        return None if raw is None else dict(orjson.loads(as_bytes(raw)))

    async def added(self) -> int:
        """How many outcomes were ever written to ``p outcomes`` (a count that only grows): the stream's
        ``entries-added`` (``XINFO STREAM``, Redis >= 7.0), else its length (an older Redis). 0 while there is no
        stream. Raises :class:`RedisDown`.

        Why not the length: once the stream reaches ``stream_maxlen`` every ``XADD`` trims it, so ``XLEN`` stays
        at the cap (within one stream node) however many outcomes come in — automatic retraining, which fits every
        ``every_outcomes`` new outcomes, and the realised-floor check counted by it stopped for good."""

        async def read() -> int:
            try:
                info = await self.redis.xinfo_stream(self.keys.outcomes)
            except ResponseError as exc:
                if "no such key" in str(exc).lower():
                    return 0
                raise
            added = info.get("entries-added")
            return int(added if added is not None else info.get("length") or 0)

        return await self.breaker.call(read)

    async def newest(self, limit: int, page: int = 1000) -> list[Outcome]:
        """The newest ``limit`` outcomes of the stream (fewer when it holds fewer), oldest first, read newest first
        in pages of ``page`` entries (``XREVRANGE … COUNT``). Raises RedisDown."""
        top = "+"
        newest_first: list[bytes] = []
        while len(newest_first) < limit:
            count = min(page, limit - len(newest_first))
            batch = await self.breaker.call(
                lambda t=top, c=count: self.redis.xrevrange(self.keys.outcomes, max=t, min="-", count=c)) or []  # type: ignore[misc]
            newest_first += [as_bytes((f or {})[b"o"]) for _, f in batch]
            if len(batch) < count:
                break
            last = batch[-1][0]
            top = "(" + (last.decode() if isinstance(last, bytes) else str(last))
        # parsed in a worker thread: ~1 s for 100,000 on this box, which held the event loop (bench/outcome_read_lag.py)
        return await asyncio.to_thread(lambda: [Outcome.from_json(raw) for raw in reversed(newest_first)])

    async def outcomes(self, since_ts: float | None = None, page: int = 1000) -> list[Outcome]:
        """Every outcome written at or after ``since_ts`` (epoch seconds), oldest first. Raises RedisDown."""
        start = f"{int(since_ts * 1000)}-0" if since_ts is not None else "-"
        out: list[Outcome] = []
        while True:
            batch = await self.breaker.call(
                lambda s=start: self.redis.xrange(self.keys.outcomes, min=s, max="+", count=page)) or []  # type: ignore[misc]
            out += [Outcome.from_json(as_bytes((f or {})[b"o"])) for _, f in batch]
            if len(batch) < page:
                return out
            last = batch[-1][0]
            start = "(" + (last.decode() if isinstance(last, bytes) else str(last))
