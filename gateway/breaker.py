"""A circuit breaker for the shared Redis: after a failure, answer "down" at once for a cooldown.

States: *closed* (calls go through), *open* (calls fail at once with :class:`RedisDown` for ``cooldown_s``
seconds after the last failure), then *half-open*: one probe call goes through; success closes the breaker,
failure opens it again. Without it every request would pay the socket timeout while Redis is unreachable.

Counts as a failure: ``redis.ConnectionError``, ``redis.TimeoutError``, ``OSError``, ``asyncio.TimeoutError``
(and ``redis.BusyLoadingError``, a subclass of ConnectionError). Other Redis errors (a script error, a
wrong type) are bugs, not outages, and propagate unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.exceptions as rexc

T = TypeVar("T")
log = logging.getLogger("thinkgate.redis")

OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    OSError,
    asyncio.TimeoutError,
)


class RedisDown(RuntimeError):
    """Redis is unreachable (or the breaker is open); the caller falls back to its degraded mode."""


class Breaker:
    """Shared by every component that talks to one Redis; ``clock`` is injectable for tests (seconds)."""

    def __init__(self, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._opened_at: float | None = None
        self._probing = False
        self.failures = 0  # total outage errors seen (for metrics)
        self.short_circuits = 0  # calls refused while open

    @property
    def is_open(self) -> bool:
        """True while calls are refused without trying (the cooldown has not passed, or a probe is out)."""
        if self._opened_at is None:
            return False
        return self._probing or self._clock() - self._opened_at < self.cooldown_s

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

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` unless the breaker is open; raise :class:`RedisDown` on refusal or an outage error."""
        probing = False
        if self._opened_at is not None:
            if self.is_open:
                self.short_circuits += 1
                raise RedisDown("redis circuit breaker open")
            self._probing = probing = True
        try:
            result = await fn()
        except OUTAGE_ERRORS as exc:
            self.record_failure(exc)
            raise RedisDown(str(exc) or type(exc).__name__) from exc
        finally:
            if probing:
                self._probing = False
        self.record_success()
        return result
