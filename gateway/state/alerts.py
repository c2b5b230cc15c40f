"""Soft budget alerts: when the spend of a budget level — a key, a tag (``team=a``), the global level —
crosses a configured fraction of its daily or monthly budget.

Each (level, period, fraction) fires **once per period** across all replicas: the first writer of
``alert:{key id | tag:k=v | global}:{day|month id}:{fraction}`` (``SET NX`` with a TTL past the period's
end, the value this process's token) fires; everyone else sees the key and stays quiet. A ``SET`` whose reply
was lost (a timeout: Redis may have applied it) is tried again at the next check, which then finds its own token
and fires — the alert is not lost to the mark that claimed it (:meth:`Alerts.claim`).

Firing = one structured log record on the ``thinkgate.alerts`` logger (``extra={"alert": {...}}``, message = the
JSON), an entry in the capped Redis list ``alerts:log`` (the dashboard's "alerts raised"; newest first,
:data:`LOG_MAX` kept) and, when ``limits.alert_webhook_url`` is set, delivery to that webhook
(:mod:`gateway.state.webhooks`: a Slack-compatible JSON body — ``text`` plus the alert's fields —, up to
``limits.alert_webhook_attempts`` attempts with exponential backoff from ``limits.alert_webhook_backoff_s``, each
with timeout ``limits.alert_webhook_timeout_s``; an alert that could not be delivered is appended to the dead-letter
log ``limits.alert_dead_letter_path``, JSON Lines). Alerts are checked after each metering write, from the spend it
returns (every level's, in the same reply); while Redis is down they are skipped (the next write after recovery
catches up).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import orjson

from gateway.config import LimitsConfig
from gateway.ledger.event import micro_to_usd
from gateway.state.batches import new_token
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.budgets import Level
from gateway.state.keys import RedisKeys
from gateway.state.limits import KeyLimits
from gateway.state.redis import RedisHandle
from gateway.state.webhooks import deliver

log = logging.getLogger("thinkgate.alerts")

DAY_MARK_TTL_S = 2 * 86400
MONTH_MARK_TTL_S = 32 * 86400
LOCAL_MEMO_MAX = 10_000
LOG_MAX = 200


@dataclass(frozen=True, slots=True)
class Alert:
    """One fired alert. Money as exact decimal strings (USD). ``level``: ``key``, ``tag:k=v`` or ``global``;
    ``key_id`` is the key (for a tag or global level: the key whose request crossed the mark)."""

    key_id: str
    period: str  # "day" | "month"
    period_id: str  # YYYY-MM-DD | YYYY-MM
    fraction: float
    budget_usd: str
    spent_usd: str
    tags: dict[str, str]
    type: str = "budget_alert"
    level: str = "key"

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @property
    def text(self) -> str:
        """One human line (the webhook's ``text``): who, which budget, how much of it is spent."""
        who = f"key {self.key_id}" if self.level == "key" else f"{self.level} (request of key {self.key_id})"
        return (f"ThinkGate budget alert: {who} has spent ${self.spent_usd} of its {self.period} budget "
                f"${self.budget_usd} ({self.period_id}, crossed {self.fraction:.0%})")

    def webhook_body(self) -> bytes:
        """Slack-compatible incoming-webhook JSON: ``text`` (what Slack shows) plus every alert field."""
        return orjson.dumps({"text": self.text, **asdict(self)})


class Alerts:
    """Checks spend against budgets after metering writes; one per process."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, cfg: LimitsConfig,
                 http: httpx.AsyncClient | None = None) -> None:
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.cfg = cfg
        self.http = http
        self._memo: set[tuple[str, str, float]] = set()  # already fired or seen as fired: skip Redis
        self._token = new_token().encode()  # the value of the marks this process sets
        self._deciding: set[str] = set()  # marks a task of this process is claiming now
        self.fired: list[Any] = []  # fired by this process (for tests and /metrics)

    async def check(self, lim: KeyLimits, tags: dict[str, str], day: str, spent_day: int,
                    spent_month: int) -> list[Alert]:
        """Fire every alert newly crossed by the spend (micro-USD) of ``lim.key_id`` on UTC ``day``."""
        return await self.check_level(lim.level, tags, day, spent_day, spent_month)

    async def check_level(self, level: Level, tags: dict[str, str], day: str, spent_day: int, spent_month: int,
                          key_id: str | None = None) -> list[Alert]:
        """Fire every alert newly crossed by the spend (micro-USD) of ``level`` on UTC ``day``; ``key_id``: the
        key whose request it was (defaults to the level's key)."""
        fired: list[Alert] = []
        month = day[:7]
        mark_id = level.name if level.kind == "key" else level.id
        who = key_id or (level.name if level.kind == "key" else "")
        for period, period_id, budget, spent, ttl in (
            ("day", day, level.day_micro, spent_day, DAY_MARK_TTL_S),
            ("month", month, level.month_micro, spent_month, MONTH_MARK_TTL_S),
        ):
            if budget is None or budget <= 0:
                continue
            for fraction in self.cfg.alert_fractions:
                if spent < fraction * budget:
                    break
                memo = (level.id, period_id, fraction)
                if memo in self._memo:
                    continue
                mark = self.keys.alert(mark_id, period_id, f"{fraction:g}")
                try:
                    first = await self.claim(mark, ttl)
                except RedisDown:
                    return fired
                if first is None:  # another task here is deciding it
                    continue
                if len(self._memo) >= LOCAL_MEMO_MAX:
                    self._memo.clear()
                self._memo.add(memo)
                if first:
                    alert = Alert(who, period, period_id, fraction, str(micro_to_usd(budget)),
                                  str(micro_to_usd(spent)), dict(tags),
                                  level="key" if level.kind == "key" else level.id)
                    await self._fire(alert)
                    fired.append(alert)
        return fired

    async def claim(self, mark: str, ttl_s: int) -> bool | None:
        """Whether this process fires the alert of ``mark``: True when its ``SET NX`` (value: this process's
        token, expiry ``ttl_s`` seconds) wrote the mark — now, or at an earlier call whose reply was lost (the
        mark still holds the token); False when someone else did or it has fired. Once True the mark's value
        becomes ``fired`` (so nothing here claims it again). None: another task of this process is claiming it
        now (not decided here: ask again at the next check). Raises :class:`RedisDown` (then nobody knows yet:
        call again at the next check)."""
        if mark in self._deciding:
            return None
        self._deciding.add(mark)
        try:
            ok = bool(await self.breaker.call(functools.partial(self.redis.set, mark, self._token, nx=True,
                                                                ex=ttl_s)))
            if not ok:
                ok = await self.breaker.call(functools.partial(self.redis.get, mark)) == self._token
            if ok:
                with contextlib.suppress(RedisDown):  # else a later check may fire it again: at least once
                    await self.breaker.call(functools.partial(self.redis.set, mark, b"fired", xx=True,
                                                              keepttl=True))
            return ok
        finally:
            self._deciding.discard(mark)

    async def recent(self, n: int = 50) -> list[dict[str, Any]]:
        """The ``n`` latest alerts fired by any replica (newest first), with ``fired_at`` (epoch s).
        Raises :class:`RedisDown`."""
        raw = await self.breaker.call(functools.partial(self.redis.lrange, self.keys.alerts_log, 0, n - 1))
        return [orjson.loads(r) for r in raw]

    async def fire(self, alert: Any) -> None:
        """Deliver any alert object with ``to_json``, ``webhook_body`` and dataclass fields (e.g. a drift
        alert, ``gateway/control/drift.py``) the way budget alerts are: log record, ``alerts:log``, webhook."""
        await self._fire(alert)

    async def _fire(self, alert: Any) -> None:
        self.fired.append(alert)
        payload = alert.to_json()
        log.warning("%s", payload.decode(), extra={"alert": asdict(alert)})
        entry = orjson.dumps({**asdict(alert), "fired_at": time.time()})
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.lpush(self.keys.alerts_log, entry)
            pipe.ltrim(self.keys.alerts_log, 0, LOG_MAX - 1)
            await self.breaker.call(pipe.execute)
        except RedisDown:
            pass  # the log line and the webhook still carry it
        if self.cfg.alert_webhook_url and self.http is not None:
            await deliver(self.http, self.cfg.alert_webhook_url, alert.webhook_body(), self.cfg)
