"""The per-request usage record: what one request cost and how it was served.

One :class:`UsageRecord` is produced for every request that reached routing (errors included), filled in
along the request path and finished when the response is complete (or the client went away). :func:`emit`
logs it as one JSON line on the ``thinkgate.usage`` logger; metering builds the
:class:`~gateway.ledger.event.UsageEvent` from it (``gateway/pipeline/accounting.py``).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

import orjson

from gateway.config import TierConfig
from gateway.ledger.event import Endpoint, RouteReason, UsageSource
from gateway.ledger.pricing import cost_micro_usd
from gateway.openai.usage import usage_counts, usage_limit

log = logging.getLogger("thinkgate.usage")


@dataclass(slots=True)
class UsageRecord:
    """Usage of one request. Token counts are tokens; times are milliseconds; cost is integer micro-USD.

    ``status`` is the HTTP status the client got (499 = client disconnected mid-stream; 502/504 after a
    streamed 200 = upstream broke the stream). ``route_reason``: :data:`~gateway.ledger.event.RouteReason`.
    ``usage_source``: ``upstream`` (reported by the upstream), ``counted`` (estimated by the gateway from the
    relayed deltas: stream broken or client gone), ``cache`` (replayed from the response cache) or ``none``.
    ``partial``: the response did not complete. ``cached``: served from the response cache — then
    ``cost_micro_usd`` is 0 and ``saved_micro_usd`` what the upstream call would have cost. Field names
    match :class:`gateway.ledger.event.UsageEvent`, which metering builds from this record.
    """

    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    ts: float = field(default_factory=time.time)
    key_id: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    endpoint: Endpoint = "chat"
    requested_model: str | None = None
    tier: str | None = None
    upstream_model: str | None = None
    route_reason: RouteReason | None = None
    difficulty: float | None = None
    stream: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    usage_source: UsageSource = "none"
    partial: bool = False
    cost_micro_usd: int = 0
    cached: bool = False
    saved_micro_usd: int = 0
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    status: int = 200
    error_code: str | None = None
    cache_request_id: str | None = None  # semantic hit: the request whose stored answer was served
    cache_similarity: float | None = None  # semantic hit: similarity of the two questions
    # the completion count was held to ``completion_bound`` (the upstream reported, or the gateway counted, more than
    # the call could generate): the usage event says so (``UsageEvent.over_bound``), not only a log line
    over_bound: bool = False
    routing_window: str | None = None  # the text the router scored (not metered; outcomes keep its digest)
    # an escalated attempt: the route reason of the request's first attempt (``predicted``: the router's choice;
    # ``forced``, ``explore``…: not) — the realised floor counts an escalated answer only when the router chose it
    escalated_from: RouteReason | None = None
    # an escalated attempt (``error_code`` ``escalated_<why>``): the tier its escalation asked (the outcome's
    # ``other_tier``)
    escalated_to: str | None = None
    # an answer the cascade judged too weak (``tier.escalate_on`` gave ``why``) and served all the same, because the
    # escalation was refused (budget, key policy) or its call failed: (why, the tier it would have asked, the
    # ``x-thinkgate-escalation`` note). The outcome store records it as the ``escalation`` outcome an escalated
    # attempt is ("the cheaper tier did not suffice"): the verdict is on this answer, whether or not the next tier
    # could be reached
    escalation_not_taken: tuple[str, str, str] | None = None
    # the most completion tokens the current upstream call may generate (admission's ``Estimate.completion``: the
    # tier and its fallbacks)
    completion_bound: int | None = None
    # the most tokens (prompt + completion) the current upstream call may be billed (admission's
    # ``Estimate.tokens``): how large a reported count may be and still be one (``usage_limit``)
    token_bound: int | None = None
    # the most prompt tokens the current upstream call may be billed (admission's ``Estimate.prompt``): the write-ahead
    # record carries it, and a dead process's record that claims more is metered at it
    prompt_bound: int | None = None
    _t0: float = field(default_factory=time.perf_counter, repr=False)

    def set_usage(self, usage: dict[str, Any] | None, completion: bool = True) -> bool:
        """Take counts from an OpenAI/vLLM ``usage`` object; True when taken. False — nothing set — when there is
        none or it is not one the gateway can meter (:func:`gateway.openai.usage.usage_counts`: missing, null,
        negative or absurd counts): the caller counts the call itself. A completion count above
        :attr:`completion_bound` (the most the call was allowed to generate) is metered at the bound: the upstream
        ignored ``max_tokens`` or misreports, and admission reserved no more; :attr:`over_bound` says so on the
        event (set or cleared by every count taken: the last count is the one metered). ``completion=False``: an
        embeddings usage (no completion count)."""
        counts = usage_counts(usage, completion, self.usage_limit)
        if counts is None:
            if usage:
                log.warning("request %s: upstream usage %.200r is not a usage object the gateway can meter; "
                            "counting the call itself", self.request_id, usage)
            return False
        self.usage_source = "upstream"
        self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.reasoning_tokens = counts
        bound = self.completion_bound
        self.over_bound = bound is not None and self.completion_tokens > bound
        if bound is not None and self.over_bound:
            log.warning("request %s: upstream reported %d completion tokens, above the %d it was allowed; metered %d",
                        self.request_id, self.completion_tokens, bound, bound)
            self.completion_tokens, self.reasoning_tokens = bound, min(self.reasoning_tokens, bound)
        return True

    @property
    def usage_limit(self) -> int:
        """The largest count one usage field of this call may carry (:func:`gateway.openai.usage.usage_limit` of
        :attr:`token_bound`)."""
        return usage_limit(self.token_bound)

    def set_counted(self, completion: int, reasoning: int) -> None:
        """Counts the gateway made itself (no usage from the upstream to trust): ``completion`` and ``reasoning``
        tokens, held to :attr:`completion_bound` as a reported count is (an upstream that ignores ``max_tokens``
        and sends no usage overspent a hard budget; :attr:`over_bound` says when it was); ``usage_source: counted``.
        The prompt is the caller's."""
        bound = self.completion_bound if self.completion_bound is not None else completion
        self.over_bound = completion > bound
        self.completion_tokens = min(completion, bound)
        self.reasoning_tokens = min(reasoning, self.completion_tokens)
        self.usage_source = "counted"

    def mark_first_byte(self) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self._t0) * 1000

    def finish(self, tier: TierConfig | None, status: int | None = None) -> UsageRecord:
        """Stamp latency and status, price the tokens with ``tier``'s prices (a cache hit: cost 0, the price
        goes to ``saved_micro_usd``); returns self."""
        if status is not None:
            self.status = status
        self.latency_ms = (time.perf_counter() - self._t0) * 1000
        if tier is not None:
            cost = cost_micro_usd(tier.prices, prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                                  completion_tokens=self.completion_tokens)
            self.cost_micro_usd, self.saved_micro_usd = (0, cost) if self.cached else (cost, 0)
        return self

    def to_dict(self) -> dict[str, Any]:
        # Flat fields only: a comprehension is ~10x cheaper than dataclasses.asdict on the request path.
        return {name: getattr(self, name) for name in _PUBLIC_FIELDS}


# Not logged: private fields, and the routing window — the user's prompt text, which only the outcome store may
# keep, and only under ``routing.outcomes.retain_text`` (a data-retention decision; docs/closed-loop.md).
_UNLOGGED = frozenset({"routing_window", "escalated_from", "escalated_to", "escalation_not_taken", "completion_bound",
                       "token_bound", "prompt_bound"})
_PUBLIC_FIELDS = tuple(f.name for f in fields(UsageRecord) if not f.name.startswith("_") and f.name not in _UNLOGGED)


def emit(record: UsageRecord) -> None:
    """Log a finished record as one JSON line on the ``thinkgate.usage`` logger (at INFO)."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s", orjson.dumps(record.to_dict()).decode())
