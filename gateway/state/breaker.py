"""A circuit breaker for the shared Redis: after a failure, answer "down" at once for a cooldown.

States: *closed* (calls go through), *open* (calls fail at once with :class:`RedisDown` for ``cooldown_s``
seconds after the last failure), then *half-open*: one probe call goes through; success closes the breaker,
failure opens it again. Without it every request would pay the socket timeout while Redis is unreachable.

Counts as a failure: ``redis.ConnectionError``, ``redis.TimeoutError``, ``OSError``, ``asyncio.TimeoutError``
(and ``redis.BusyLoadingError``, a subclass of ConnectionError); on a Redis Cluster also ``CLUSTERDOWN`` /
``TRYAGAIN`` / an uncovered slot (a failover in progress) and "no node reachable" at (re)initialisation; and a
``RuntimeError`` / ``AttributeError`` raised inside redis-py's asyncio connection code — redis-py 8.1's
cluster client disconnects a node's free connections in a background task after a connection error, and a
command that picks one up meanwhile fails writing to the closed transport (uvloop: ``RuntimeError: unable to
perform operation on <TCPTransport closed=True>``; asyncio: ``'NoneType' object has no attribute
'writelines'``). Treated as the outage it is, the caller degrades (cache bypass, usage spooled) instead of
failing the request and losing its usage event. Other Redis errors (a script error, a wrong type) are bugs,
not outages, and propagate unchanged.

**A stalled event loop is not an outage.** The socket timeout runs on the event loop's clock: when the loop
itself does not run for longer than the timeout (a long garbage collection, the process starved of CPU on a
busy machine), every Redis call in flight "times out" when it resumes although Redis answered in time, and
one such stall used to open the breaker for ``cooldown_s`` (cache bypassed, every usage event spooled with
an fsync). With ``stall_s`` set, a :class:`LoopWatch` notes how late the loop runs; a *timeout* during which
the loop stalled for ``stall_s`` or more fails that call (:class:`RedisDown`, the caller degrades as usual)
without opening the breaker. It raises :class:`RedisStalled` (a :class:`RedisDown`, so every caller degrades
as before; a read that is safe to repeat may retry it once, as the key lookup does), counts it in
:attr:`Breaker.stall_timeouts` (``thinkgate_redis_stall_timeouts_total``) and logs a WARNING at most once a
minute — such a call had failed without a word: a request refused 503 ``key_store_unavailable`` with Redis
healthy, or a usage event spooled, left nothing to explain it. Connection errors always count.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.exceptions as rexc

from router.errors import ThinkGateError

T = TypeVar("T")
log = logging.getLogger("thinkgate.redis")

OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    OSError,
    asyncio.TimeoutError,
    rexc.ClusterDownError,  # CLUSTERDOWN (also MasterDownError): a failover in progress
    rexc.TryAgainError,  # TRYAGAIN: a slot being migrated or failed over
    rexc.SlotNotCoveredError,
)
_CLUSTER_UNREACHABLE = ("Redis Cluster cannot be connected", "All slots are not covered")
_REDIS_ASYNC = ("/redis/asyncio/", "\\redis\\asyncio\\")


def is_outage(exc: BaseException) -> bool:
    """True when ``exc`` means Redis is unreachable (see the module doc), not a bug in a command."""
    if isinstance(exc, OUTAGE_ERRORS):
        return True
    if isinstance(exc, rexc.RedisClusterException):  # raised by the cluster client's (re)initialisation
        return str(exc).startswith(_CLUSTER_UNREACHABLE)
    if isinstance(exc, RuntimeError | AttributeError):  # a connection torn down under a command (redis-py)
        tb = exc.__traceback__
        while tb is not None:
            if any(p in tb.tb_frame.f_code.co_filename for p in _REDIS_ASYNC):
                return True
            tb = tb.tb_next
    return False


TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (rexc.TimeoutError, asyncio.TimeoutError)


class RedisDown(ThinkGateError, RuntimeError):
    """Redis is unreachable (or the breaker is open); the caller falls back to its degraded mode."""


class RedisStalled(RedisDown):
    """A call timed out while the event loop itself stalled (the breaker stays closed): Redis most likely answered
    in time. A caller may repeat a read once; otherwise handled as :class:`RedisDown`."""


#: at most one WARNING about stall timeouts per this many seconds (a starved host has them in bursts)
STALL_LOG_EVERY_S = 60.0


class LoopWatch:
    """How late the running event loop is: a callback every ``period_s`` notes how late it ran.

    :meth:`stalled_since` answers "did the loop stop for a while since ``t0``?" (loop time), counting a
    stall still under way (the callback is overdue). Started by the first :meth:`start` inside a loop,
    restarted when another loop runs (tests); costs one timer callback per period.
    """

    def __init__(self, period_s: float = 0.05, keep: int = 64) -> None:
        self.period_s = period_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        self._stalls: deque[tuple[float, float]] = deque(maxlen=keep)  # (loop time it ended, seconds late)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        self._loop = loop
        self._stalls.clear()
        self._due = loop.time() + self.period_s
        loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        now = loop.time()
        late = now - self._due
        if late > self.period_s:
            self._stalls.append((now, late))
        self._due = now + self.period_s
        loop.call_at(self._due, self._tick)

    def stalled_since(self, t0: float) -> float:
        """The longest stall (seconds) that ended at or after loop time ``t0``, or is under way now."""
        if self._loop is None:
            return 0.0
        longest = max(0.0, self._loop.time() - self._due)
        for ended, late in reversed(self._stalls):
            if ended < t0:
                break
            longest = max(longest, late)
        return longest


class Breaker:
    """Shared by every component that talks to one Redis; ``clock`` is injectable for tests (seconds)."""

    def __init__(self, cooldown_s: float, clock: Callable[[], float] = time.monotonic,
                 stall_s: float | None = None) -> None:
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._opened_at: float | None = None
        self._probing = False
        self.failures = 0  # total outage errors seen (for metrics)
        self.short_circuits = 0  # calls refused while open
        self.stall_s = stall_s
        self.watch = LoopWatch() if stall_s is not None else None
        self.stall_timeouts = 0  # timeouts blamed on a stalled event loop (breaker left closed)
        self._stall_logged_at: float | None = None
        self._stall_logged_count = 0  # stall_timeouts when the last WARNING was written

    def retry_after(self) -> dict[str, str]:
        """The ``retry-after`` header (whole seconds, ≥ 1: the cooldown) of a 503 answered because Redis is down: a
        client retrying sooner meets the open breaker again."""
        return {"retry-after": str(max(1, math.ceil(self.cooldown_s)))}

    @property
    def is_open(self) -> bool:
        """True while calls are refused without trying (the cooldown has not passed, or a probe is out)."""
        if self._opened_at is None:
            return False
        return self._probing or self._clock() - self._opened_at < self.cooldown_s

    @property
    def closed(self) -> bool:
        """True when the last call went through (not open, not half-open waiting for its probe)."""
        return self._opened_at is None

    def record_failure(self, exc: BaseException) -> None:
        """Open (or re-open) the breaker after an outage error."""
        if self._opened_at is None:
            log.warning("redis unreachable, breaker open for %.1f s: %r", self.cooldown_s, exc)
        self.failures += 1
        self._opened_at = self._clock()

    def record_success(self) -> None:
        """Close the breaker."""
        if self._opened_at is not None:
            log.info("redis reachable again, breaker closed")
        self._opened_at = None

    def _log_stall(self, stalled_s: float, exc: BaseException) -> None:
        now = self._clock()
        if self._stall_logged_at is not None and now - self._stall_logged_at < STALL_LOG_EVERY_S:
            return
        since = self.stall_timeouts - self._stall_logged_count
        self._stall_logged_at, self._stall_logged_count = now, self.stall_timeouts
        log.warning("a Redis call timed out while this process's event loop stalled for %.2f s (a starved or "
                    "overloaded host, a long garbage collection): that call failed, the breaker stays closed; "
                    "%d such timeout(s) since the last report, %d in all "
                    "(thinkgate_redis_stall_timeouts_total): %r", stalled_s, since, self.stall_timeouts, exc)

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` unless the breaker is open; raise :class:`RedisDown` on refusal or an outage error."""
        probing = False
        if self._opened_at is not None:
            if self.is_open:
                self.short_circuits += 1
                raise RedisDown("redis circuit breaker open")
            self._probing = probing = True
        watch = self.watch
        t0 = 0.0
        if watch is not None:
            watch.start()
            t0 = asyncio.get_running_loop().time()
        try:
            result = await fn()
        except Exception as exc:
            if not is_outage(exc):
                raise
            if (watch is not None and self.stall_s is not None and isinstance(exc, TIMEOUT_ERRORS)
                    and watch.stalled_since(t0) >= self.stall_s):
                stalled = watch.stalled_since(t0)
                self.stall_timeouts += 1
                self._log_stall(stalled, exc)
                raise RedisStalled(f"timed out while the event loop stalled for {stalled:.2f} s: {exc}") from exc
            self.record_failure(exc)
            raise RedisDown(str(exc) or type(exc).__name__) from exc
        finally:
            if probing:
                self._probing = False
        self.record_success()
        return result
