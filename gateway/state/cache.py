"""The exact response cache in Redis, with single-flight and fail-open behaviour.

Use per request (keys and policy come from ``gateway/state/cache_policy.py``)::

    ticket = await cache.begin(digest, decision)      # hit | miss (maybe leader) | bypass
    try:
        if ticket.status == "hit": replay ticket.entry
        else: call upstream; entry = CacheEntry(...) if the response completed successfully
    finally:
        await cache.finish(ticket, entry)             # stores (size/TTL checked) and releases the lock

**Single-flight.** On a miss the first request takes ``cache:lock:{digest}`` (``SET NX PX``, the wait bound)
and calls the upstream (lookup and lock are one script, ``BEGIN_LUA``: one round trip); identical requests
arriving meanwhile poll for the entry (10 → 100 ms backoff) until it appears (a hit), the lock disappears
without an entry (the leader failed or the answer was not storable: they call the upstream themselves), or
``cache.single_flight_wait_s`` passes (same). A streamed follower gets the whole answer replayed when the
leader finishes.

**Fail open.** Every Redis call goes through the shared :class:`~gateway.state.breaker.Breaker` with the short
socket timeout; when Redis is unreachable the request is served uncached (``bypass``) and, while the breaker
is open, without touching the network at all. A store-and-unlock queued off the request path (:meth:`finish_later`)
that meets an outage is kept (bounded: ``UNSENT_MAX`` calls, ``UNSENT_MAX_BYTES`` of answers) and sent with the
next batch once Redis answers (a direct :meth:`finish`'s too — Redis Cluster's path — by the retry every breaker
cooldown): the answer lands with the rest of its TTL and the lock is released, where it used to
stay until its TTL (``single_flight_wait_s``) and every identical request after the outage waited that long before
calling the upstream itself. Only complete, successful responses are stored (the caller
decides; see ``StreamAssembler.complete``); entries above ``cache.max_entry_bytes`` are skipped. Storing
the entry and releasing the lock are one script too (``FINISH_LUA``), so a miss costs the request path two
Redis round trips, a hit one. On a single Redis the lookup runs inside the request's admission call instead
(``LOOKUP_LUA`` pasted into ``gateway/state/limits.py`` ``HOT_LUA``; :meth:`ResponseCache.prepare` /
:meth:`ResponseCache.resume`): no round trip of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from redis.exceptions import NoScriptError

from gateway.config import CacheConfig
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.cache_policy import CacheDecision
from gateway.state.keys import RedisKeys
from gateway.state.redis import FastScript, RedisHandle, as_bytes, raise_error_reply

log = logging.getLogger("thinkgate.cache")

#: ``cache_lookup(entry, lock, token, wait_ms)``: the stored answer, else the single-flight lock. Returns {1, entry}
#: (stored answer), {2} (lock taken: the caller leads), {0} (another request leads), {3} (no answer; ``token`` ''
#: = no single-flight, no lock taken). Pasted into ``BEGIN_LUA`` and into the one-call hot path of a single Redis
#: (``gateway/state/limits.py`` ``HOT_LUA``: admission, write-ahead record and this lookup in one script).
LOOKUP_LUA = """
local function cache_lookup(entry, lock, token, wait_ms)
  local v = redis.call('GET', entry)
  if v then return {1, v} end
  if token == '' then return {3} end
  if redis.call('SET', lock, token, 'NX', 'PX', wait_ms) then return {2} end
  return {0}
end
"""
# KEYS: 1 entry, 2 lock; ARGV: 1 lock token ('' = none), 2 lock TTL ms. Returns what ``cache_lookup`` returns.
BEGIN_LUA = LOOKUP_LUA + "return cache_lookup(KEYS[1], KEYS[2], ARGV[1], ARGV[2])\n"
# KEYS: 1 entry, 2 lock; ARGV: 1 entry bytes ('' = store nothing), 2 entry TTL s, 3 lock token ('' = none).
# Stores the entry, then deletes the lock only if it still holds our token (it may have expired and been
# taken by another request meanwhile).
FINISH_LUA = """
if ARGV[1] ~= '' then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end
if ARGV[3] ~= '' and redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1
"""
POLL_START_S = 0.01
POLL_MAX_S = 0.1
#: bounds of the store-and-unlock calls kept through a Redis outage (``ResponseCache._keep_unsent``)
UNSENT_MAX = 4096
UNSENT_MAX_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class _Unsent:
    """A ``FINISH_LUA`` call (``keys``, ``args`` = [entry bytes, the answer's TTL s as decided, lock token]) not
    written yet, with the latest time its lock can still be held and when the call was made (monotonic s)."""

    lock_expiry: float
    made: float
    keys: list[str]
    args: list[Any]

    @property
    def data(self) -> bytes:
        return bytes(self.args[0])

    @property
    def ttl_s(self) -> int:
        return int(self.args[1])

    @property
    def token(self) -> str:
        return str(self.args[2])

    def call(self, now: float) -> tuple[list[str], list[Any]]:
        """The script's keys and arguments at ``now``: the answer stored for the rest of its TTL (never less than
        1 s; :meth:`ResponseCache._due_unsent` drops an answer whose TTL ran out)."""
        if not self.data:
            return self.keys, self.args
        return self.keys, [self.data, max(1, int(self.ttl_s - (now - self.made))), self.token]


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A stored answer: the complete non-stream ``body`` (with ``usage``), where it came from, when (epoch s)."""

    body: dict[str, Any]
    endpoint: str
    tier: str
    upstream_model: str
    created: float

    def to_bytes(self) -> bytes:
        return orjson.dumps({"v": 1, "body": self.body, "endpoint": self.endpoint, "tier": self.tier,
                             "upstream_model": self.upstream_model, "created": self.created})

    @classmethod
    def from_bytes(cls, raw: bytes) -> CacheEntry | None:
        """Parse a stored entry; None if it is unreadable or of another version."""
        try:
            d = orjson.loads(raw)
            if d.get("v") != 1:
                return None
            return cls(d["body"], d["endpoint"], d["tier"], d["upstream_model"], float(d["created"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None


@dataclass(slots=True)
class Ticket:
    """The outcome of :meth:`ResponseCache.begin`. ``leader``: this request holds the single-flight lock.
    ``waited_s``: time spent waiting for another request's answer. ``similarity`` and ``source_request_id``
    are set on a *semantic* hit (``gateway/semantic/cache.py``): the stored answer is another request's."""

    digest: str
    decision: CacheDecision
    status: Literal["hit", "miss", "bypass"]
    entry: CacheEntry | None = None
    lock_token: str | None = None
    waited_s: float = 0.0
    similarity: float | None = None
    source_request_id: str | None = None
    tenant: str = ""  # the cache scope's tenant tag (gateway/state/keys.py): the entry's Cluster slot

    @property
    def leader(self) -> bool:
        return self.lock_token is not None


@dataclass(frozen=True, slots=True)
class Lookup:
    """One exact-cache lookup ready for a script call (``cache_lookup``): the entry and lock keys, the lock token
    ("" = no single-flight) and the lock's TTL (ms). :meth:`ResponseCache.resume` turns the reply into a ticket."""

    digest: str
    decision: CacheDecision
    tenant: str
    entry_key: str
    lock_key: str
    token: str
    wait_ms: int


class ResponseCache:
    """Redis-backed exact cache; one per process."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, cfg: CacheConfig) -> None:
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.cfg = cfg
        self._begin = FastScript(handle, BEGIN_LUA)
        self._finish = FastScript(handle, FINISH_LUA)
        self._lane = handle.lane
        self._queued: list[tuple[list[str], list[Any]]] = []  # finish_later's calls not sent yet
        self._writer: asyncio.Task[None] | None = None
        #: finish_later's calls a Redis outage stopped, each with (its lock's latest expiry, when it was made):
        #: sent again with the next batch (module doc, "Fail open")
        self._unsent: deque[_Unsent] = deque()
        self._unsent_bytes = 0
        self._retry: asyncio.Task[None] | None = None

    def prepare(self, digest: str, decision: CacheDecision, tenant: str = "") -> Ticket | Lookup:
        """The lookup of ``digest`` under ``decision`` for a script call (:class:`Lookup`), or the ticket at once
        when the decision looks nothing up (``miss`` when it stores, else ``bypass``): no Redis."""
        if not decision.lookup:
            return Ticket(digest, decision, "miss" if decision.store else "bypass", tenant=tenant)
        token = uuid.uuid4().hex if self.cfg.single_flight_wait_s > 0 else ""
        wait_ms = max(1, int(self.cfg.single_flight_wait_s * 1000)) if token else 0
        return Lookup(digest, decision, tenant, self.keys.cache_entry(digest, tenant),
                      self.keys.cache_lock(digest, tenant), token, wait_ms)

    async def begin(self, digest: str, decision: CacheDecision, tenant: str = "") -> Ticket:
        """Look up (and/or lead) for ``digest`` under ``decision``; ``tenant``: the tenant tag of the cache
        scope (``gateway/state/keys.py`` ``tenant_tag``; "" = the shared slot). One script call
        (``BEGIN_LUA``); never raises for Redis outages."""
        lookup = self.prepare(digest, decision, tenant)
        return lookup if isinstance(lookup, Ticket) else await self.look(lookup)

    async def look(self, lookup: Lookup, on_wait: Callable[[], object] | None = None) -> Ticket:
        """Run the prepared ``lookup`` (one ``BEGIN_LUA`` call) and :meth:`resume` with its reply."""
        try:
            res = await self.breaker.call(lambda: self._begin(keys=[lookup.entry_key, lookup.lock_key],
                                                              args=[lookup.token, lookup.wait_ms]))
        except RedisDown:
            res = None
        return await self.resume(lookup, res, on_wait)

    async def resume(self, lookup: Lookup, res: list[Any] | None,
                     on_wait: Callable[[], object] | None = None) -> Ticket:
        """The ticket of ``lookup`` from ``res``, the reply of its ``cache_lookup`` (None: Redis did not answer) —
        run by :meth:`begin` or inside the admission call. A stale answer leads a refresh (one more call: the lock);
        a follower of another request's single-flight lock waits for its answer (polls; ``on_wait`` is called as the
        wait starts: the write-ahead record says so). Never raises for Redis outages."""
        digest, decision, t, token = lookup.digest, lookup.decision, lookup.tenant, lookup.token
        if res is None:
            # The script may still run (a paused server resumes): keep the token so finish() can release it.
            return Ticket(digest, decision, "bypass", lock_token=token or None, tenant=t)
        code = int(res[0])
        try:
            if not token:  # no single-flight: the answer or a miss
                entry = self._fresh(res[1], decision.max_age_s) if code == 1 else None
                return (Ticket(digest, decision, "hit", entry, tenant=t) if entry is not None
                        else Ticket(digest, decision, "miss", tenant=t))
            acquired = code == 2
            if code == 1:
                entry = self._fresh(res[1], decision.max_age_s)
                if entry is not None:
                    return Ticket(digest, decision, "hit", entry, tenant=t)
                # Too old for this request's max-age (or unreadable): lead a refresh like a miss.
                try:
                    acquired = bool(await self.breaker.call(
                        lambda: self.redis.set(lookup.lock_key, token, nx=True, px=lookup.wait_ms)))
                except RedisDown:
                    return Ticket(digest, decision, "bypass", lock_token=token, tenant=t)
            if acquired:
                return Ticket(digest, decision, "miss", lock_token=token, tenant=t)
            if on_wait is not None:
                on_wait()
            t0 = time.monotonic()
            entry = await self._wait(digest, decision.max_age_s, t0 + self.cfg.single_flight_wait_s, t)
            waited = time.monotonic() - t0
            if entry is not None:
                return Ticket(digest, decision, "hit", entry, waited_s=waited, tenant=t)
            return Ticket(digest, decision, "miss", waited_s=waited, tenant=t)
        except RedisDown:
            return Ticket(digest, decision, "bypass", tenant=t)

    def _finish_call(self, ticket: Ticket, entry: CacheEntry | None) -> tuple[list[str], list[Any]] | None:
        """The ``FINISH_LUA`` keys and arguments of :meth:`finish` (the ticket's lock token taken), or None when
        there is nothing to store or release."""
        data = b""
        if entry is not None and ticket.decision.store and ticket.status == "miss":
            data = entry.to_bytes()
            if len(data) > self.cfg.max_entry_bytes:
                data = b""
        token = ticket.lock_token or ""
        ticket.lock_token = None
        if not data and not token:
            return None
        keys = [self.keys.cache_entry(ticket.digest, ticket.tenant), self.keys.cache_lock(ticket.digest, ticket.tenant)]
        return keys, [data, ticket.decision.ttl_s, token]

    async def finish(self, ticket: Ticket, entry: CacheEntry | None) -> bool:
        """Store ``entry`` (if the decision allows and it fits) and release the lock. True when stored.

        Call it in a ``finally`` (also after errors and disconnects, with ``entry=None``) so followers stop
        waiting at once. Never raises for Redis outages.
        """
        call = self._finish_call(ticket, entry)
        if call is None:
            return False
        keys, args = call
        try:
            await self.breaker.call(lambda: self._finish(keys=keys, args=args))
        except RedisDown:
            # kept and sent once Redis answers (as :meth:`finish_later`'s are): a lock left to its TTL would make
            # every identical request after the outage wait that long (Redis Cluster takes this path: no lane)
            now = time.monotonic()
            self._keep_unsent([_Unsent(now + self.cfg.single_flight_wait_s, now, keys, args)])
            self._retry_later()
            return False
        return bool(args[0])

    @property
    def batches_finish(self) -> bool:
        """True when :meth:`finish_later` can queue (one Redis server: the calls go out on its lane)."""
        return self._lane is not None

    def finish_later(self, ticket: Ticket, entry: CacheEntry | None) -> asyncio.Task[None] | None:
        """:meth:`finish` off the request path: the call is queued and a writer sends every call queued meanwhile
        as one packed buffer (one write and one read for a batch instead of a round trip per request: a socket
        write costs ~15–60 µs of CPU on a 2-core VM, idle to loaded). Followers of the lock see the answer a
        batch later. Returns the writer task when this call started one (the caller
        tracks it, so a flush waits for it), else None. Only when :attr:`batches_finish`; never raises."""
        call = self._finish_call(ticket, entry)
        if call is None:
            return None
        self._queued.append(call)
        if self._writer is not None and not self._writer.done():
            return None
        self._writer = asyncio.get_running_loop().create_task(self._write_queued())
        return self._writer

    async def _write_queued(self) -> None:
        while self._queued:
            now = time.monotonic()
            fresh = [_Unsent(now + self.cfg.single_flight_wait_s, now, k, a) for k, a in self._queued]
            self._queued = []
            if self.breaker.is_open:  # refused without trying: keep them, without re-walking what is kept
                self._keep_unsent(fresh)
                self._retry_later()
                continue
            await self._send([*self._due_unsent(now), *fresh])

    async def _send(self, batch: list[_Unsent]) -> None:
        """One packed batch; on an outage the calls are kept and a retry is scheduled. Never raises."""
        if not batch:
            return
        try:
            await self.breaker.call(functools.partial(self._send_batch, [u.call(time.monotonic()) for u in batch]))
        except RedisDown as exc:  # kept for later. Debug, as finish() is silent: the breaker already logged the
            # outage, and a batch per loop pass would flood
            self._keep_unsent(batch)
            self._retry_later()
            log.debug("cache: %d stores/unlocks not written yet (redis down: %s)", len(batch), exc)
        except Exception:
            log.exception("cache: %d stores/unlocks failed", len(batch))

    def _retry_later(self) -> None:
        """Send the kept calls once Redis answers, with or without new traffic (a quiet gateway's lock would
        otherwise wait out its TTL): one task, every breaker cooldown, until none is left."""
        if self._retry is None or self._retry.done():
            self._retry = asyncio.get_running_loop().create_task(self._retry_unsent())

    async def _retry_unsent(self) -> None:
        while self._unsent:
            await asyncio.sleep(max(self.breaker.cooldown_s, 0.05))
            if self.breaker.is_open or (self._writer is not None and not self._writer.done()):
                continue  # still down, or the writer is out and takes the kept calls with its next batch
            await self._send(self._due_unsent(time.monotonic()))

    def _due_unsent(self, now: float) -> list[_Unsent]:
        """The kept calls still worth sending: a call whose lock is past its latest expiry keeps only its store
        (another request may hold the lock now — the script checks the token anyway), and whose answer's TTL
        has run out only its unlock; a call left with neither is dropped."""
        out: list[_Unsent] = []
        while self._unsent:
            u = self._unsent.popleft()
            self._unsent_bytes -= len(u.data)
            if now > u.lock_expiry and u.token:
                u = _Unsent(u.lock_expiry, u.made, u.keys, [u.data, u.ttl_s, ""])
            if u.data and u.ttl_s - (now - u.made) < 1:
                u = _Unsent(u.lock_expiry, u.made, u.keys, [b"", u.ttl_s, u.token])
            if u.data or u.token:
                out.append(u)
        return out

    def _keep_unsent(self, calls: list[_Unsent]) -> None:
        """Keep ``calls`` for a later batch, bounded: beyond ``UNSENT_MAX`` calls the oldest go, beyond
        ``UNSENT_MAX_BYTES`` of answers a call keeps only its unlock (a follower then calls the upstream itself
        instead of waiting out the lock)."""
        for u in calls:
            if u.data and self._unsent_bytes + len(u.data) > UNSENT_MAX_BYTES:
                if not u.token:
                    continue
                u = _Unsent(u.lock_expiry, u.made, u.keys, [b"", u.ttl_s, u.token])
            self._unsent.append(u)
            self._unsent_bytes += len(u.data)
        while len(self._unsent) > UNSENT_MAX:
            self._unsent_bytes -= len(self._unsent.popleft().data)

    async def close(self) -> None:
        """Stop retrying kept calls (the gateway is stopping; their locks expire with their TTL)."""
        if self._retry is not None and not self._retry.done():
            self._retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retry

    async def _send_batch(self, batch: list[tuple[list[str], list[Any]]]) -> None:
        replies = None
        if self._lane is not None:
            # with the metering writer's batch of the same loop pass: one exchange
            replies = await self._lane.exchange(b"".join(self._finish.packed(k, a) for k, a in batch), len(batch),
                                                coalesce="background")
        if replies is None or any(isinstance(r, NoScriptError) for r in replies):
            # no lane (Redis Cluster: each call goes to its slot's node), the lane is busy, or the script cache was
            # flushed: one call at a time (FastScript loads it)
            for keys, args in batch:
                await self._finish(keys=keys, args=args)
            return
        raise_error_reply(replies)

    @staticmethod
    def _fresh(raw: bytes | str | None, max_age_s: int | None) -> CacheEntry | None:
        if raw is None:
            return None
        entry = CacheEntry.from_bytes(as_bytes(raw))
        if entry is None or (max_age_s is not None and time.time() - entry.created > max_age_s):
            return None
        return entry

    async def _wait(self, digest: str, max_age_s: int | None, deadline: float, tenant: str) -> CacheEntry | None:
        key, lock = self.keys.cache_entry(digest, tenant), self.keys.cache_lock(digest, tenant)
        delay = POLL_START_S

        async def poll() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.get(key)
                pipe.exists(lock)
                return await pipe.execute()

        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 1.5, POLL_MAX_S)
            raw, locked = await self.breaker.call(poll)
            entry = self._fresh(raw, max_age_s)
            if entry is not None:
                return entry
            if not locked:
                return None
