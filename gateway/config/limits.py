"""Spend limits and rate limits (``limits:``): admission in ``gateway/state/limits.py``.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from gateway.config.base import _Strict
from gateway.config.paths import STATE_DIR


class LevelBudget(_Strict):
    """A budget of a level above the key (a tag, or the whole gateway), USD per UTC day / month."""

    usd_day: Decimal | None = Field(None, ge=0)
    usd_month: Decimal | None = Field(None, ge=0)


class LimitsConfig(_Strict):
    """Budgets and rate limits. ``budget_mode``: ``hard`` admits only when spend + open reservations + this
    request's upper-bound estimate fit in every budget it is under; ``soft`` admits while spend + open
    reservations are below the budget (overshoot bounded by one capped request; ``docs/metering.md``) — the keys'
    budgets' mode: shadow and judge calls are always admitted ``hard`` (``routing.shadow.max_usd_day``).
    ``tag_budgets`` (``"team=a": {usd_day, usd_month}``) are shared by every key with that tag,
    ``global_budget`` by all keys; budgets set with ``thinkgate budgets set`` (Redis) override these per level
    and are in force for the next request (admission reads them in Redis); the per-process copy re-read every
    ``budget_refresh_s`` seconds serves only while Redis is down. ``on_redis_down``: ``fail_open`` admits on local
    approximate counters, ``fail_closed`` refuses (503). A reservation not settled within
    ``reservation_ttl_s`` seconds (a crashed replica) stops counting; streams renew theirs while they run, up to
    ``max_stream_s``. Alerts fire once per period and level
    at each of ``alert_fractions`` of a budget."""

    budget_mode: Literal["hard", "soft"] = "hard"
    tag_budgets: dict[str, LevelBudget] = Field(default_factory=dict)
    global_budget: LevelBudget | None = None
    budget_refresh_s: float = Field(2.0, ge=0)
    on_redis_down: Literal["fail_open", "fail_closed"] = "fail_open"
    alert_fractions: list[float] = Field(default_factory=lambda: [0.5, 0.8, 1.0])
    alert_webhook_url: str | None = None
    alert_webhook_timeout_s: float = Field(2.0, gt=0)
    alert_webhook_attempts: int = Field(5, ge=1, le=20)
    alert_webhook_backoff_s: float = Field(0.5, ge=0)
    alert_dead_letter_path: Path = STATE_DIR / "alerts-dead-letter.jsonl"
    reservation_ttl_s: float = Field(600.0, gt=0)
    #: a stream renews its reservations every third of ``reservation_ttl_s`` while it runs, and is cut (finish
    #: reason ``length``, metered) once it has run this long — counted from the request's first upstream call, the
    #: escalation peek's hold included (``gateway/pipeline/exchange.py``) — so no reservation outlives its bound
    max_stream_s: float = Field(3600.0, gt=0)
    #: ``auto``: on a single Redis (or Sentinel) one hot-path script per request — admission at every level,
    #: the write-ahead record and the exact-cache lookup together (``HOT_LUA``); on Redis Cluster one call per
    #: slot: admission at every level in the shared slot (``redis.cluster_placement: shared``), or the key's level
    #: in its slot then the levels above it with rollback (``tenant``), then the cache in the tenant's slot;
    #: ``single`` / ``grouped`` (one call per level, with rollback) force one shape where the slots allow
    #: (``tenant`` is always grouped by slot; ``gateway/state/limits.py``)
    admission_script: Literal["auto", "single", "grouped"] = "auto"

    @field_validator("alert_fractions")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        if any(not 0 < f <= 10 for f in v):
            raise ValueError("alert_fractions must be in (0, 10]")
        return sorted(set(v))

    @field_validator("tag_budgets")
    @classmethod
    def _tags(cls, v: dict[str, LevelBudget]) -> dict[str, LevelBudget]:
        for tag in v:
            k, sep, _ = tag.partition("=")
            if not sep or not k or "|" in tag:
                raise ValueError(f"tag budget keys are 'name=value', got {tag!r}")
        return v

