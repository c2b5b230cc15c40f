"""The usage event (the unit of metering, one per request, cache hits included) and its exact cost.

Besides who, what and how much, an event carries ``cached_tokens`` (prompt tokens the upstream served from its
prefix cache, billed at the cached rate), ``endpoint``, ``partial`` (the client went away before the end) and
``usage_source`` (where the token counts came from). ``docs/metering.md`` describes every field.

Cost, integer micro-USD (1 USD = 1 000 000 micro-USD), is :func:`gateway.ledger.pricing.cost_micro_usd` (the one
formula): ``(prompt − cached)·input + cached·cached_input + completion·output`` with prices in USD per 1M
tokens, exact ``Decimal`` arithmetic, rounded once per event (half up). Reasoning tokens are completion
tokens (a breakdown, not an addition).
"""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, Literal

import orjson

from gateway.config import Prices
from gateway.ledger.pricing import cost_micro_usd

__all__ = ["COUNTER_FIELDS", "CUBE_ONLY_FIELDS", "ROUTER_DECIDED", "Endpoint", "RouteReason", "UsageEvent",
           "UsageSource", "WireEndpoint", "cost_micro_usd", "counter_increments", "cube_only_increments",
           "micro_to_usd", "new_event_id", "usd_to_micro"]

#: Where an event's token counts came from: reported by the upstream, counted by the gateway, a cache hit, none.
UsageSource = Literal["upstream", "counted", "cache", "none"]
#: The two OpenAI endpoints the request pipeline speaks to clients and upstreams (``/v1/chat/completions``,
#: ``/v1/completions``).
WireEndpoint = Literal["chat", "completions"]
#: The API a usage event was served through: the wire endpoints, the APIs translated onto chat
#: (``/v1/responses``, ``/v1/messages``) and the embeddings pass-through.
Endpoint = Literal["chat", "completions", "responses", "messages", "embeddings"]
#: Why a request went to its tier (``x-thinkgate-route-reason``, the ``route_reason`` of its usage event).
#: ``spot_check``: the router chose a cheaper tier and the top tier served it, at random
#: (``routing.retrain.spot_check``);
#: ``explore``: the router chose a tier and the one below served it, at random (``routing.retrain.explore``).
RouteReason = Literal["predicted", "forced", "effort", "fallback", "escalated", "cache", "shadow", "spot_check",
                      "explore"]
#: The route reasons of a request whose tier the router decided (as chosen, explored or spot-checked): real routed
#: traffic and spend, unlike a forced, effort, fallback, escalated, cache or shadow one.
ROUTER_DECIDED: frozenset[str] = frozenset({"predicted", "explore", "spot_check"})


def micro_to_usd(micro: int) -> Decimal:
    """Integer micro-USD → exact ``Decimal`` USD with six places."""
    return (Decimal(micro) / Decimal(1_000_000)).quantize(Decimal("0.000001"))


def usd_to_micro(usd: Decimal) -> int:
    """``Decimal`` USD → integer micro-USD (half up)."""
    return int((usd * 1_000_000).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def new_event_id() -> str:
    """A fresh unique event id (UUID4, 32 hex chars)."""
    return uuid.uuid4().hex


@dataclass(slots=True)
class UsageEvent:
    """One request's usage. ``ts`` is the request start, epoch seconds (UTC); durations in ms.

    ``status`` is the HTTP status the client got (499 when the client disconnected first, as nginx logs
    it). ``cached`` means served from the response cache: then ``cost_micro_usd`` is 0 and
    ``saved_micro_usd`` is what the upstream call would have cost at the tier's current prices. A *semantic*
    hit (a similar question's answer) also has ``cache_request_id`` (the request that produced the stored
    answer) and ``cache_similarity`` (in [0, 1]); both are None otherwise.
    ``audit`` marks the record of a request refused before any upstream call (400/401/403/413/429, or a 5xx
    such as ``limits_unavailable``): cost 0, kept in the stream and the exports, never in the counters, spend
    sums or budgets.
    ``over_bound`` marks an event whose tokens were held to the call's admitted bound: the upstream reported (or
    the gateway counted, or a dead process's write-ahead record claimed) more than the call could use — an
    upstream that ignored ``max_tokens`` or misreports — and the event carries, and is priced at, the bound. The
    request itself may have succeeded (status 200): the mark is on the event, not in ``error_code``, so it shows
    in the exports and ``GET /v1/usage`` beside whatever status and code the request had.
    """

    key_id: str
    requested_model: str
    event_id: str = field(default_factory=new_event_id)
    ts: float = field(default_factory=time.time)
    tags: dict[str, str] = field(default_factory=dict)
    request_id: str = ""
    endpoint: Endpoint = "chat"
    tier: str | None = None
    upstream_model: str | None = None
    route_reason: RouteReason | None = None
    difficulty: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached: bool = False
    cost_micro_usd: int = 0
    saved_micro_usd: int = 0
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    status: int = 200
    error_code: str | None = None
    stream: bool = False
    partial: bool = False
    usage_source: UsageSource = "upstream"
    cache_request_id: str | None = None
    cache_similarity: float | None = None
    audit: bool = False
    over_bound: bool = False

    @property
    def day(self) -> str:
        """UTC day of ``ts``, ``YYYY-MM-DD`` (the budget and counter period)."""
        return _utc_day(int(self.ts // 86400))

    @property
    def month(self) -> str:
        """UTC month of ``ts``, ``YYYY-MM``."""
        return self.day[:7]

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def upstream_tokens(self) -> int:
        """Tokens the upstream processed for this request (0 for a cache hit): what TPM limits count."""
        return 0 if self.cached else self.total_tokens

    @property
    def minute(self) -> int:
        """Index of the 60 s window of ``ts`` (``floor(ts_ms / 60000)``), the TPM window of the request."""
        return int(self.ts * 1000) // 60_000

    def price(self, prices: Prices) -> None:
        """Fill ``cost_micro_usd`` (or, for a cache hit, ``saved_micro_usd`` with cost 0) from the tokens."""
        value = cost_micro_usd(prices, prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                               completion_tokens=self.completion_tokens)
        if self.cached:
            self.cost_micro_usd, self.saved_micro_usd = 0, value
        else:
            self.cost_micro_usd, self.saved_micro_usd = value, 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> bytes:
        # orjson serialises dataclasses itself (same keys, same order as asdict) at a tenth of the cost.
        return orjson.dumps(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UsageEvent:
        """Build from a dict, ignoring unknown fields (events written by a newer version)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_json(cls, raw: bytes | str) -> UsageEvent:
        return cls.from_dict(orjson.loads(raw))


@functools.lru_cache(maxsize=64)
def _utc_day(day_number: int) -> str:
    """``YYYY-MM-DD`` of the ``day_number``-th UTC day since the epoch (metering asks several times per event)."""
    return datetime.fromtimestamp(day_number * 86400, UTC).strftime("%Y-%m-%d")


COUNTER_FIELDS: tuple[str, ...] = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost_micro_usd",
    "saved_micro_usd",
    "cache_hits",
    "errors",
    "partial",
)


#: counters of the per-day usage cubes (``gateway/ledger/aggregate.py``) and the grouped exports that are in no counter
#: hash of a key or tier (the metering script writes them to the cube only): ``over_bound_events``, the events whose
#: tokens were held to the call's admitted bound (:attr:`UsageEvent.over_bound`)
CUBE_ONLY_FIELDS: tuple[str, ...] = ("over_bound_events",)


def cube_only_increments(event: UsageEvent) -> dict[str, int]:
    """What ``event`` adds to the :data:`CUBE_ONLY_FIELDS` of its cube cell and group (an audit event: nothing — it
    was refused before any call, so nothing was held to a bound)."""
    return {"over_bound_events": int(event.over_bound and not event.audit)}


def counter_increments(event: UsageEvent) -> dict[str, int]:
    """What one event adds to each counter hash (all integers; nothing for an audit event)."""
    if event.audit:
        return dict.fromkeys(COUNTER_FIELDS, 0)
    return {
        "requests": 1,
        "prompt_tokens": event.prompt_tokens,
        "cached_tokens": event.cached_tokens,
        "completion_tokens": event.completion_tokens,
        "reasoning_tokens": event.reasoning_tokens,
        "cost_micro_usd": event.cost_micro_usd,
        "saved_micro_usd": event.saved_micro_usd,
        "cache_hits": int(event.cached),
        "errors": int(event.status >= 400 and event.status != 499),
        "partial": int(event.partial),
    }
