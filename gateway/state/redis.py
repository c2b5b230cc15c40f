"""One asyncio Redis client for the gateway, built from ``redis.url`` with redis-py's own client classes.

URL forms (redis-py has no URL scheme for Cluster or Sentinel; these two are ThinkGate's):

- ``redis://[user:pass@]host:port/db``, ``rediss://…``, ``unix://…`` → ``redis.asyncio.Redis.from_url``
- ``redis+cluster://[user:pass@]host:port`` (``rediss+cluster://`` for TLS) → ``redis.asyncio.RedisCluster``
- ``redis+sentinel://[user:pass@]h1:p1[,h2:p2…]/service_name[/db]`` → ``redis.asyncio.sentinel.Sentinel``
  and ``master_for(service_name)``

Every command is bounded by ``socket_timeout_s`` (connect and read) and is never retried by the client:
the gateway decides what a failure means (fail open, spool, 503) and the :class:`~gateway.state.breaker.Breaker`
stops it from paying the timeout on every request while Redis is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast
from urllib.parse import unquote, urlparse, urlunsplit

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.config import RedisConfig
from gateway.config.redis import url_nodes

_hiredis_pack: Any
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis is a dependency
    _hiredis_pack = None

AnyRedis = Redis | RedisCluster

log = logging.getLogger("thinkgate.redis")

#: Told what became of a call its caller stopped waiting for (cancelled while it was out): its reply (a list of
#: replies from :meth:`FastLane.exchange`, the script's reply from :class:`FastScript`), None when it was never sent
#: (nothing of it ran), or the exception of an exchange that failed or was interrupted (its outcome unknown; an error
#: reply — a ``ResponseError`` — is a call Redis refused). Called once, from the task that learns it.
Orphan = Callable[[Any], None]


def as_bytes(reply: bytes | str) -> bytes:
    """A reply value of the clients built here as bytes. They use ``decode_responses=False``, so replies are
    bytes; redis-py annotates them ``bytes | str`` because its annotations also cover decoding clients."""
    return reply if isinstance(reply, bytes) else reply.encode()


def as_text(reply: bytes | str) -> str:
    """A reply value (UTF-8 bytes from the clients built here) as ``str``."""
    return reply.decode() if isinstance(reply, bytes) else reply


Arg = bytes | str | int | float
#: a group of :meth:`FastLane.exchange` calls that may share one exchange
Coalesce = Literal["request", "background"]
LANE_SIZE_MAX = 64  # connections of a FastLane (beyond them, calls go through the client's pool)


def pack(*args: Arg) -> bytes:
    """One command in the Redis protocol (RESP array of bulk strings): hiredis's C packer (a dependency), else
    :func:`_pack_py`. (redis-py's asyncio ``pack_command`` re-joins its whole buffer once per argument and encodes
    each through a generic encoder: for the hot path's script calls, 20-50 arguments, that was a fifth of the
    gateway's CPU in a profile at concurrency 32.) Never a bool: it would be sent as its text."""
    if _hiredis_pack is not None:
        return cast(bytes, _hiredis_pack(cast(Any, args)))
    return _pack_py(*args)


def _pack_py(*args: Arg) -> bytes:
    """:func:`pack` in Python, with a single join."""
    parts = [b"*%d\r\n" % len(args)]
    add = parts.append
    for a in args:  # bytes as they are; str, int, float as their text
        b = a if a.__class__ is bytes else str(a).encode()
        add(b"$%d\r\n" % len(b))
        add(b)
        add(b"\r\n")
    return b"".join(parts)


def raise_error_reply(replies: Sequence[Any]) -> None:
    """Raise the first error among a pipeline's or a lane exchange's ``replies`` (their ``ResponseError``
    instances, returned in place, :meth:`FastLane.exchange`); nothing when every command succeeded."""
    for r in replies:
        if isinstance(r, Exception):
            raise r


class FastLane:
    """Raw exchanges with one Redis server (standalone or the Sentinel master) on connections of their own,
    outside the client's pool: a packed buffer of one or more commands out, their replies in — no pool lock,
    no per-command dispatch or observability hooks. At most ``size`` connections (made by the client's pool
    with its settings: ``socket_timeout_s`` bounds every read); when all are busy a call returns None and the
    caller uses the client. A connection whose exchange failed or was interrupted is dropped (its state is
    unknown); errors are the client's (``ConnectionError``, ``TimeoutError``), so the breaker sees the same."""

    def __init__(self, client: Redis, size: int) -> None:
        self.client = client
        self.size = size
        self._idle: list[AbstractConnection] = []
        self._live = 0
        # per coalescing group: the calls joined since its flush task was made, and that task
        self._joined: dict[str, list[tuple[bytes, int, asyncio.Future[list[Any] | None], Orphan | None]]] = {}
        self._flusher: dict[str, asyncio.Task[None]] = {}
        self._flushes: set[asyncio.Task[None]] = set()

    async def exchange(self, packed: bytes, replies: int = 1, *, coalesce: Coalesce | None = None,
                       orphan: Orphan | None = None) -> list[Any] | None:
        """Send ``packed`` and read ``replies`` replies (an error reply is returned as its ``ResponseError``, the
        others as the parser gives them); None when every connection of the lane is busy.

        ``coalesce``: the exchange leaves with the other calls of its group (``"request"``: the request path's
        admission calls; ``"background"``: the metering writer, the cache's stores, the outcome index) made before
        the next pass of the event loop, as one write and one read on one connection (auto-pipelining, as ioredis
        and Lettuce do). Each caller gets its own replies and error replies; what the shared exchange raises
        (a timeout: one ``socket_timeout_s`` for the whole buffer; a lost connection) reaches every caller of it,
        and None (the lane busy) too. A caller that stops waiting leaves the others and the connection in step.
        The groups never share an exchange: an admission does not wait behind a 128-event metering batch. Why:
        a finished request's usage event and cache store were two writes and two reads, concurrent admissions one
        each. Measured (full configuration, interleaved A/B, 3,000 requests × 6 rounds, five runs on a loaded
        2-core box): gateway CPU per request −1 to −14% (mean −8%) at concurrency 32, within ±2% at 1, where the
        one extra loop pass costs about what the saved write does (bench/RESULTS.md, "Coalesced Redis exchanges").

        A kept connection that fails with a connection error (the server restarted, or Sentinel failed over and
        the old master is gone) means the other kept ones point at the same dead server: all of them, and the
        client's idle ones, are dropped, so the next calls connect afresh (through the sentinels: the new master).
        Each stale connection used to fail a request of its own and reopen the breaker, for tens of seconds after
        a failover. The failed call itself is not sent again: the server may have run it before the connection
        died (an admission twice, a cache lock waiting on itself).

        ``orphan`` (a coalesced call only): what to tell if the caller is cancelled while its call is out — the
        coalesced exchange is sent whatever its callers do, so a cancelled caller's call may still run (a request's
        first admission, which reserves and writes a write-ahead record). It is called once, with the replies the
        caller would have got (when they come, or at once if they came before the cancellation took effect), None
        if the call was never sent, or the exception of the exchange. No task and no extra future: the flush that
        reads the replies hands them over."""
        if coalesce is not None:
            return await self._coalesced(packed, replies, coalesce, orphan)
        return await self._exchange(packed, replies)

    async def _exchange(self, packed: bytes, replies: int) -> list[Any] | None:
        if self._idle:
            conn, kept = self._idle.pop(), True
        elif self._live < self.size:
            conn, kept = self.client.connection_pool.make_connection(), False
            self._live += 1
        else:
            return None
        try:
            out = await self._on(conn, packed, replies)
        except RedisConnectionError:
            await self._drop(conn)
            if kept:
                await self.close()  # the other kept connections: the same dead server
                with contextlib.suppress(Exception):
                    await self.client.connection_pool.disconnect(inuse_connections=False)  # and the client's
            raise
        except BaseException:
            await self._drop(conn)
            raise
        self._idle.append(conn)
        return out

    async def _coalesced(self, packed: bytes, replies: int, group: Coalesce,
                         orphan: Orphan | None = None) -> list[Any] | None:
        fut: asyncio.Future[list[Any] | None] = asyncio.get_running_loop().create_future()
        self._joined.setdefault(group, []).append((packed, replies, fut, orphan))
        if group not in self._flusher:  # its first step runs on the loop's next pass: the calls made before it join
            task = asyncio.get_running_loop().create_task(self._flush(group))
            self._flusher[group] = task
            self._flushes.add(task)
            task.add_done_callback(functools.partial(self._flush_done, group))
        try:
            return await fut
        except asyncio.CancelledError:
            # the replies came before the cancellation took effect (the flush set them, this task had not run
            # yet): told here; a future cancelled while pending is told by the flush (_flush, _flush_done)
            if orphan is not None and fut.done() and not fut.cancelled():
                exc = fut.exception()
                _tell(orphan, exc if exc is not None else fut.result())
            raise

    def _flush_done(self, group: Coalesce, task: asyncio.Task[None]) -> None:
        """A flush task ended. Cancelled before its first step (a loop shutting down), it never took its calls:
        they are cancelled and the group free again — else every later call would join a list nothing sends."""
        self._flushes.discard(task)
        if self._flusher.get(group) is task:
            del self._flusher[group]
            for _, _, fut, orphan in self._joined.pop(group, []):
                fut.cancel()
                if orphan is not None:
                    _tell(orphan, None)  # never sent

    async def _flush(self, group: Coalesce) -> None:
        """Send the group's joined calls as one exchange and hand each its replies (or the exchange's error, or None
        when the lane is busy). A caller that stopped waiting is skipped: the connection still reads every reply."""
        calls = self._joined.pop(group, [])
        del self._flusher[group]
        try:
            out = await self._exchange(b"".join(c[0] for c in calls), sum(c[1] for c in calls))
        except asyncio.CancelledError as exc:
            for _, _, fut, orphan in calls:
                fut.cancel()
                if orphan is not None:
                    _tell(orphan, exc)  # interrupted: sent or not, unknown
            raise
        except Exception as exc:
            for _, _, fut, orphan in calls:
                if not fut.done():
                    fut.set_exception(exc)
                elif orphan is not None and fut.cancelled():
                    _tell(orphan, exc)
            return
        i = 0
        for _, n, fut, orphan in calls:
            got = None if out is None else out[i:i + n]
            if not fut.done():
                fut.set_result(got)
            elif orphan is not None and fut.cancelled():  # its caller stopped waiting: told what it did
                _tell(orphan, got)
            i += n

    async def _on(self, conn: AbstractConnection, packed: bytes, replies: int) -> list[Any]:
        if not conn.is_connected:  # connect() itself: a Sentinel connection asks the sentinels for the master
            await conn.connect()  # (send_packed_command would connect to the default host:port instead)
        parser = getattr(conn, "_parser", None)
        if getattr(conn, "_writer", None) is None or parser is None:  # another redis-py layout: its own path
            return await _exchange_by_client(conn, packed, replies)
        # One timer for the write and every reply (redis-py arms one per write and one per reply: two
        # or more asyncio.timeout objects per call, ~4% of the gateway's CPU at concurrency 32).
        try:
            async with asyncio.timeout(conn.socket_timeout):
                await _send(conn, packed)
                return [await parser.read_response() for _ in range(replies)]
        except TimeoutError:
            raise RedisTimeoutError("Timeout reading from or writing to the socket") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error while reading from the socket: {exc}") from exc

    async def _drop(self, conn: AbstractConnection) -> None:
        """Forget a connection whose exchange failed or was interrupted (its state is unknown)."""
        self._live -= 1
        with contextlib.suppress(Exception):
            await conn.disconnect(nowait=True)

    async def close(self) -> None:
        """Close the idle connections (busy ones close when their exchange ends badly, or with the process)."""
        idle, self._idle = self._idle, []
        self._live -= len(idle)
        for conn in idle:
            with contextlib.suppress(Exception):
                await conn.disconnect()


def _tell(orphan: Orphan, outcome: Any) -> None:
    """Hand a cancelled caller's outcome to its :data:`Orphan` callback; what it raises is logged, never the flush's."""
    try:
        orphan(outcome)
    except Exception:
        log.exception("the outcome of a cancelled Redis call was not handled")


async def _send(conn: AbstractConnection, packed: bytes) -> None:
    """Write ``packed`` on ``conn`` (its ``_writer``); the caller bounds it in time. An OSError propagates."""
    writer = conn._writer
    assert writer is not None  # the caller checked (exchange)
    writer.write(packed)
    await writer.drain()


async def _exchange_by_client(conn: AbstractConnection, packed: bytes, replies: int) -> list[Any]:
    """:meth:`FastLane.exchange` through redis-py's own connection methods (a connection without the
    ``_writer`` / ``_parser`` this module reads): an error reply is returned as its ``ResponseError``."""
    await conn.send_packed_command(packed, check_health=False)
    out: list[Any] = []
    for _ in range(replies):
        try:
            out.append(await conn.read_response())
        except ResponseError as exc:  # the reply was read whole: the connection is still in step
            out.append(exc)
    return out


class FastScript:
    """A Lua script called with ``EVALSHA`` on a :class:`FastLane` (one packed buffer), loaded on ``NOSCRIPT``;
    through the client's ``register_script`` when there is no lane (Redis Cluster) or it is busy. Same replies,
    same errors as redis-py's ``Script``."""

    def __init__(self, handle: RedisHandle, script: str) -> None:
        self.client = handle.client
        self.lane = handle.lane
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()
        self._fallback = handle.client.register_script(script)

    def packed(self, keys: Sequence[Arg], args: Sequence[Arg]) -> bytes:
        """The ``EVALSHA`` command of one call (for a pipeline of several: concatenate them)."""
        return pack(b"EVALSHA", self.sha, len(keys), *keys, *args)

    async def __call__(self, keys: Sequence[Arg], args: Sequence[Arg], *, coalesce: Coalesce | None = None,
                       orphan: Orphan | None = None) -> Any:
        """Run the script; ``coalesce``: on the lane, with the other calls of this loop pass
        (:meth:`FastLane.exchange`). ``orphan`` (with ``coalesce``): if the caller is cancelled, it is told once what
        the script did (:data:`Orphan`: its reply, None when it did not run, or the exception: a ``ResponseError``
        when Redis refused it, else unknown) — the hot path keeps its one await; only a call the lane cannot take
        (all its connections busy) runs in a task, so that its outcome outlives the caller."""
        lane = self.lane
        if lane is not None:
            told = None if orphan is None else functools.partial(_first_reply, orphan)
            for attempt in range(2):
                try:
                    got = await lane.exchange(self.packed(keys, args), coalesce=coalesce, orphan=told)
                except asyncio.CancelledError:
                    if orphan is not None and coalesce is None:  # not coalesced: no one is told; it is unknown
                        _tell(orphan, asyncio.CancelledError())
                    raise
                if got is None:
                    break
                res = got[0]
                if isinstance(res, NoScriptError) and attempt == 0:  # script cache flushed (restart, SCRIPT FLUSH)
                    try:
                        await self.client.script_load(self.script)
                    except asyncio.CancelledError:
                        if orphan is not None:
                            _tell(orphan, None)  # the script did not run (NOSCRIPT) and will not be sent again
                        raise
                    continue
                if isinstance(res, Exception):
                    raise res
                return res
        calling = self._fallback(keys=cast(Any, keys), args=cast(Any, args))
        if orphan is None:
            return await calling
        task = asyncio.get_running_loop().create_task(calling)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(functools.partial(_task_outcome, orphan))
            raise


def _first_reply(orphan: Orphan, outcome: Any) -> None:
    """A lane's outcome (a list of replies) as one script call's: its one reply."""
    orphan(outcome[0] if isinstance(outcome, list) else outcome)


def _task_outcome(orphan: Orphan, task: asyncio.Task[Any]) -> None:
    """Tell ``orphan`` what ``task`` (a script call through the client) ended with."""
    if task.cancelled():
        _tell(orphan, asyncio.CancelledError())
    else:
        exc = task.exception()
        _tell(orphan, exc if exc is not None else task.result())


@dataclass(frozen=True)
class RedisHandle:
    """The client, its kind, the key prefix every ThinkGate key starts with, and (one server: standalone or
    Sentinel) a :class:`FastLane` for the request path's script calls."""

    client: AnyRedis
    kind: str  # "standalone" | "cluster" | "sentinel"
    prefix: str
    lane: FastLane | None = field(default=None, compare=False)
    #: where a key's own metering and admission keys live on a Cluster (``redis.cluster_placement``;
    #: ``gateway/state/keys.py`` ``RedisKeys.per_key_slots``)
    placement: str = "shared"

    async def close(self) -> None:
        """Close the client's connections (idempotent)."""
        if self.lane is not None:
            await self.lane.close()
        await self.client.aclose()


def cluster_prefix(prefix: str) -> str:
    """``prefix`` wrapped in a hash tag (``tg:`` → ``{tg:}``): the one slot of the shared keys (admission,
    metering); tenant keys then get ``{tg:<tenant>}`` (``gateway/state/keys.py``). A prefix that already has a
    hash tag is kept: every key then shares that one slot."""
    return prefix if "{" in prefix and "}" in prefix else "{" + prefix + "}"


def _common(cfg: RedisConfig) -> dict[str, Any]:
    return {
        "socket_timeout": cfg.socket_timeout_s,
        "socket_connect_timeout": cfg.socket_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": False,
    }


def writer_name(prefix: str) -> str:
    """The client name (``CLIENT SETNAME``) of a serving gateway's connections to a Redis Cluster under ``prefix``
    (the cluster prefix, ``{tg:}``): ``thinkgate redis migrate-placement`` finds a gateway still running by it in
    ``CLIENT LIST`` (``gateway/state/placement_migration.py`` ``live_writers``), with or without
    ``metering.write_ahead`` and however long it has been idle. A digest: any prefix makes a valid name."""
    return "thinkgate-gw-" + hashlib.sha256(prefix.encode()).hexdigest()[:16]


def connect(cfg: RedisConfig, known: Sequence[tuple[str, int]] = (), *, writer: bool = False) -> RedisHandle:
    """Build the client for ``cfg.url`` (no network I/O happens here; the first command connects). ``known``:
    Cluster nodes to try after the URL's seeds (a readiness probe passes the topology the running client found).
    ``writer``: a serving gateway's client — on a Cluster its connections are named :func:`writer_name`.

    Raises ``ValueError`` for an unsupported scheme, a port that is not a number, or a Sentinel URL without a
    service name (:func:`check_url` says the same at config load).
    """
    parsed = urlparse(cfg.url)
    scheme = parsed.scheme.lower()
    common = _common(cfg)
    if scheme in ("redis+cluster", "rediss+cluster"):
        if writer:
            common["client_name"] = writer_name(cluster_prefix(cfg.key_prefix))
        return RedisHandle(_cluster(cfg, parsed, common, known), "cluster", cluster_prefix(cfg.key_prefix),
                           placement=cfg.cluster_placement)
    lane_size = min(LANE_SIZE_MAX, cfg.max_connections)
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        master = _sentinel_master(cfg, parsed, common)
        return RedisHandle(master, "sentinel", cfg.key_prefix, FastLane(master, lane_size))
    if scheme in ("redis", "rediss", "unix"):
        client = Redis.from_url(cfg.url, max_connections=cfg.max_connections, **common)
        return RedisHandle(client, "standalone", cfg.key_prefix, FastLane(client, lane_size))
    raise ValueError(f"redis.url: unsupported scheme {parsed.scheme!r} (redis, rediss, unix, redis+cluster, "
                     "redis+sentinel)")


def known_nodes(handle: RedisHandle) -> list[tuple[str, int]]:
    """The Cluster nodes ``handle``'s client has found (host, port); [] for one server or Sentinel."""
    client = handle.client
    if not isinstance(client, RedisCluster):
        return []
    return [(n.host, int(n.port)) for n in client.get_nodes()]


async def ping(cfg: RedisConfig, known: Sequence[tuple[str, int]] = ()) -> bool:
    """True when the Redis of ``cfg.url`` answers PING within ``cfg.socket_timeout_s`` (any URL form; never raises).

    One server: PING. Sentinel: the sentinels name the master, the master answers. Cluster: every primary
    serving slots answers (a slot whose master is down and not yet failed over makes the cluster unready),
    reached through the URL's seeds and then the ``known`` nodes — the topology the running client has found, so
    a dead seed does not read as a dead cluster. A fresh client each call, so a readiness probe never reuses a
    connection the request path broke.
    """
    try:
        handle = connect(cfg, known)
    except (ValueError, RedisError, RedisClusterException, OSError):
        return False
    try:
        if isinstance(handle.client, RedisCluster):
            return bool(await handle.client.ping(target_nodes=RedisCluster.PRIMARIES))
        return bool(await handle.client.ping())
    except (RedisError, RedisClusterException, OSError):
        return False
    finally:
        with contextlib.suppress(RedisError, RedisClusterException, OSError):
            await handle.close()


def _cluster(cfg: RedisConfig, parsed: Any, common: dict[str, Any],
             known: Sequence[tuple[str, int]]) -> RedisCluster:
    """A ``RedisCluster`` started from every seed of the URL (``redis+cluster://a:7000,b:7001``; one dead seed
    then costs nothing) and the ``known`` nodes. Built from the first seed's URL, so its credentials and query
    options (``?ssl_cert_reqs=none``, ``ssl_ca_certs``…) hold for every node."""
    seeds = url_nodes(parsed, 6379)
    userinfo = parsed.netloc.rsplit("@", 1)[0] + "@" if "@" in parsed.netloc else ""
    host, port = seeds[0]
    first = urlunsplit((parsed.scheme.replace("+cluster", "", 1), f"{userinfo}{host}:{port}", parsed.path,
                        parsed.query, ""))
    others = [ClusterNode(h, p) for h, p in dict.fromkeys([*seeds[1:], *known]) if (h, p) != seeds[0]]
    extra: dict[str, Any] = {"startup_nodes": others} if others else {}
    return RedisCluster.from_url(first, max_connections=cfg.max_connections, **common, **extra)


def _sentinel_master(cfg: RedisConfig, parsed: Any, common: dict[str, Any]) -> Redis:
    nodes = url_nodes(parsed, 26379)
    path = [p for p in parsed.path.split("/") if p]
    if not path:
        raise ValueError("redis.url: a redis+sentinel:// URL needs the service name as its path")
    service, db = path[0], int(path[1]) if len(path) > 1 else 0
    auth: dict[str, Any] = {}
    if parsed.username:
        auth["username"] = unquote(parsed.username)
    if parsed.password:
        auth["password"] = unquote(parsed.password)
    sentinel = Sentinel(nodes, sentinel_kwargs={"socket_timeout": cfg.socket_timeout_s,
                                                "socket_connect_timeout": cfg.socket_timeout_s},
                        ssl=parsed.scheme.startswith("rediss"), **common, **auth)
    return sentinel.master_for(service, db=db)
