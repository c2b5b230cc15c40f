"""Prometheus metrics (``GET /metrics``), fed from the usage events and the request path.

One ``CollectorRegistry`` per app (several apps can live in one process, as in the tests). Label values are
bounded: ``tier`` and ``model`` are the configured tier names / upstream models (anything else is
``other``; requests refused before routing are ``_unrouted``), ``route_reason`` the nine known reasons,
``cache`` hit|semantic-hit|miss|bypass, ``status`` a class (2xx, 4xx, 5xx, 499), ``kind`` prompt|cached|completion|
reasoning, ``code`` the gateway's own error codes; ``key_id`` only when ``metrics.key_id_label`` is set.

Series (counters get ``_total``): ``thinkgate_requests``, ``thinkgate_tokens``, ``thinkgate_cost_micro_usd``,
``thinkgate_saved_micro_usd``, ``thinkgate_cache_requests``, ``thinkgate_semantic_cache_requests``
(``result``: hit|guard_rejected|below_threshold|miss|bypass), ``thinkgate_route_decisions``,
``thinkgate_upstream_errors``, ``thinkgate_limit_rejections``, ``thinkgate_refused_requests`` (every request
refused before an upstream call, by ``status`` and ``code``), ``thinkgate_session_routes{state}``; histograms
``thinkgate_request_latency_seconds`` and ``thinkgate_ttft_seconds``; gauges ``thinkgate_redis_breaker_open``,
``thinkgate_usage_spool_bytes``, ``thinkgate_usage_dead_letter_bytes``, ``thinkgate_usage_quarantine_bytes``; the
upstream pools' series ``thinkgate_upstream_*{upstream}`` (``gateway/upstream/balancer.py``); and these counters:
``thinkgate_usage_spooled_events_total``, ``thinkgate_usage_dead_lettered_events_total`` (events Redis refused,
kept in the dead-letter spool), ``thinkgate_usage_unreplicated_events_total`` (counted events also spooled: too few
replica acks), ``thinkgate_usage_quarantined_events_total{reason}`` (events a replay set aside, neither counted nor
dropped: ``past_dedup_window``, ``malformed``, ``unreadable``; ``gateway/state/spool.py`` ``Quarantine``),
``thinkgate_write_ahead_unreplicated_records_total`` (write-ahead records re-asserted that too few replicas
acknowledged; ``WriteAhead.reassert``),
``thinkgate_write_ahead_reconciled_records_total{outcome}`` (records of dead gateway processes this one settled:
``metered`` — also counted in its request, token and cost series, as the dead process would have —, ``released``:
never sent upstream; ``gateway/state/write_ahead.py``),
``thinkgate_redis_stall_timeouts_total`` (Redis calls that timed out while the event loop stalled: each failed
without opening the breaker; ``gateway/state/breaker.py``),
``thinkgate_admission_refused_scripts_total{script}`` (admission scripts Redis refused with an error reply, each
having written nothing: ``admit`` — a call then decided as with Redis down, ``limits.on_redis_down`` —, ``rollback``,
``renew``; ``gateway/state/limits.py``),
``thinkgate_conversations_not_stored_total{reason}`` (``/v1/responses`` conversations not stored after the answer:
``redis_down``, ``refused`` — an error reply such as OOM, READONLY, NOPERM; ``gateway/state/conversations.py``); with
``routing.target`` set, ``thinkgate_routing_share{tier}`` (the controller's window),
``thinkgate_routing_target_share`` and ``thinkgate_routing_threshold{tier}`` (the cut point into that tier);
``thinkgate_routing_drift_psi{kind}`` (score | tier, the drift alarm).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.config import MetricsConfig, TierConfig
from gateway.ledger.event import UsageEvent
from gateway.state.conversations import NOT_STORED_REASONS
from gateway.state.limits import REFUSED_SCRIPTS
from gateway.state.spool import QUARANTINE_REASONS

#: the ``outcome`` label of ``thinkgate_write_ahead_reconciled_records_total``
RECONCILE_OUTCOMES = ("metered", "released")
ROUTE_REASONS = frozenset({"predicted", "forced", "effort", "fallback", "escalated", "cache", "shadow", "spot_check",
                           "explore"})
ENDPOINTS = frozenset({"chat", "completions", "responses", "messages", "embeddings"})
CACHE_RESULTS = frozenset({"hit", "semantic-hit", "miss", "bypass"})
SEMANTIC_RESULTS = frozenset({"hit", "guard_rejected", "below_threshold", "miss", "bypass"})
ERROR_CODES = frozenset({"upstream_error", "upstream_unavailable", "upstream_timeout", "upstream_rejected",
                         "upstream_stream_broken", "client_disconnected", "budget_exceeded",
                         "rate_limit_exceeded", "limits_unavailable", "key_store_unavailable",
                         "stream_max_duration"})
#: every code a refused request can carry (a finite set: label values; ``tests/gateway/test_refusal_codes.py``
#: checks that each code the gateway's errors name is here), anything else counted as ``other``
REFUSAL_CODES = frozenset({
    "invalid_request", "invalid_json", "invalid_value", "invalid_type", "integer_below_min_value",
    "unsupported_parameter", "unknown_parameter", "model_not_found", "not_found", "method_not_allowed",
    "previous_response_not_found", "request_not_found", "key_not_found", "missing_api_key", "invalid_api_key",
    "permission_denied", "tier_not_allowed", "request_timeout", "request_too_large", "usage_scan_too_large",
    "budget_exceeded", "rate_limit_exceeded", "overloaded", "limits_unavailable", "key_store_unavailable",
    "outcomes_unavailable", "usage_unavailable", "conversation_store_unavailable", "internal_error"})
# seconds, up to limits.max_stream_s's default (3600): a reasoning stream past 300 s landed in +Inf, and
# histogram_quantile then read a p99 of 300 s without saying so
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
CONTENT_TYPE = CONTENT_TYPE_LATEST
MAX_CACHED_CHILDREN = 10_000

# No ``*_created`` series (the process start time, once per counter and label set: a second sample per series
# that no query uses). Process-wide: the gateway is the process.
disable_created_metrics()


def status_class(status: int) -> str:
    return "499" if status == 499 else f"{status // 100}xx"


class Metrics:
    """The gateway's Prometheus series on a private registry."""

    def __init__(self, cfg: MetricsConfig, tiers: Iterable[TierConfig]) -> None:
        tiers = list(tiers)
        self.tier_names = frozenset(t.name for t in tiers) | {"_unrouted"}
        self.models = frozenset(t.model for t in tiers)
        self.key_label = cfg.key_id_label
        r = self.registry = CollectorRegistry(auto_describe=True)
        k = ["key_id"] if self.key_label else []
        self.requests = Counter("thinkgate_requests", "Requests answered (one per usage event).",
                                ["endpoint", "tier", "model", "route_reason", "cache", "status", *k], registry=r)
        self.tokens = Counter("thinkgate_tokens", "Tokens by kind (cached ⊂ prompt, reasoning ⊂ completion).",
                              ["tier", "model", "kind", *k], registry=r)
        self.cost = Counter("thinkgate_cost_micro_usd", "Upstream cost, micro-USD.", ["tier", "model", *k],
                            registry=r)
        self.saved = Counter("thinkgate_saved_micro_usd", "Cost avoided by cache hits, micro-USD.",
                             ["tier", "model", *k], registry=r)
        self.cache = Counter("thinkgate_cache_requests", "Response-cache outcomes.", ["result"], registry=r)
        self.semantic_lookups = Counter(
            "thinkgate_semantic_cache_requests", "Semantic-cache lookups after an exact miss, by outcome "
            "(hit, guard_rejected, below_threshold, miss, bypass).", ["result"], registry=r)
        self.routes = Counter("thinkgate_route_decisions", "Routing decisions.", ["tier", "reason"], registry=r)
        self.sessions = Counter(
            "thinkgate_session_routes", "Session-sticky routing by state: new (a first routed turn pinned its "
            "tier), sticky (a later turn kept it), flip_avoided (sticky turns the router alone would have sent "
            "elsewhere), repinned (an escalated turn moved the session).", ["state"], registry=r)
        self.upstream_errors = Counter("thinkgate_upstream_errors", "Failed or broken upstream calls.",
                                       ["tier", "code"], registry=r)
        self.rejections = Counter("thinkgate_limit_rejections", "Requests refused by budgets/limits.", ["code"],
                                  registry=r)
        self.refusals = Counter("thinkgate_refused_requests",
                                "Requests refused before any upstream call (each has an audit event).",
                                ["status", "code"], registry=r)
        self.latency = Histogram("thinkgate_request_latency_seconds", "Request latency (to the last byte).",
                                 ["tier", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("thinkgate_ttft_seconds", "Time to the first content byte.", ["tier", "stream"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.breaker_open = Gauge("thinkgate_redis_breaker_open", "1 while the Redis circuit breaker is open.",
                                  registry=r)
        self.spool_bytes = Gauge("thinkgate_usage_spool_bytes", "Bytes of usage events waiting in the spool (and, with "
                                 "metering.replica_acks, in the spool of events too few replicas acknowledged).",
                                 registry=r)
        # a counter (rate() over it reads spooling as it happens); render() adds what the spool counted since
        self.spooled = Counter("thinkgate_usage_spooled_events", "Usage events this process has spooled "
                               "(Redis down: kept on disk, replayed later).", registry=r)
        self.dead_letter_bytes = Gauge("thinkgate_usage_dead_letter_bytes", "Bytes of usage events Redis refused "
                                       "(an error reply), waiting in the dead-letter spool.", registry=r)
        self.dead_lettered = Counter("thinkgate_usage_dead_lettered_events", "Usage events this process put in the "
                                     "dead-letter spool (Redis refused them: nothing written; retried later).",
                                     registry=r)
        self.unreplicated = Counter("thinkgate_usage_unreplicated_events", "Counted usage events this process kept "
                                    "in the unacked spool as well: fewer Redis replicas than metering.replica_acks "
                                    "acknowledged them in time (replayed; dropped where they survived).", registry=r)
        self.quarantine_bytes = Gauge("thinkgate_usage_quarantine_bytes", "Bytes of usage events set aside in the "
                                      "quarantine file: neither counted nor dropped, an operator decides.", registry=r)
        self.quarantined = Counter(
            "thinkgate_usage_quarantined_events", "Usage events this process set aside in the quarantine file, by "
            "reason: past_dedup_window — older than metering.dedup_ttl_s less an hour, a replay could have counted "
            "them twice; malformed — a dead letter whose write cannot be built; unreadable — a spool line that is "
            "no event.", ["reason"], registry=r)
        for reason in QUARANTINE_REASONS:  # exposed at 0 from the start
            self.quarantined.labels(reason)
        self.wal_unreplicated = Counter("thinkgate_write_ahead_unreplicated_records", "Write-ahead records this "
                                        "process re-asserted that fewer Redis replicas than metering.replica_acks "
                                        "acknowledged in time (written again at the next heartbeat while open).",
                                        registry=r)
        # only a once-a-minute log line said so, and under fail_open such a call is no rejection either
        self.refused_scripts = Counter(
            "thinkgate_admission_refused_scripts", "Admission script calls Redis refused with an error reply (a key "
            "of the wrong type, a counter that is no integer; nothing written): script=admit — the call decided as "
            "with Redis down (limits.on_redis_down) —, rollback, renew.", ["script"], registry=r)
        for script in REFUSED_SCRIPTS:  # exposed at 0 from the start, as the label-less counters are
            self.refused_scripts.labels(script)
        # the answer is delivered either way: only this series (and a log line) says its continuation is lost
        self.not_stored = Counter(
            "thinkgate_conversations_not_stored", "/v1/responses conversations not stored after the answer was "
            "delivered (previous_response_id then unknown), by reason: redis_down, refused (an error reply: OOM, "
            "READONLY, NOPERM).", ["reason"], registry=r)
        for reason in NOT_STORED_REASONS:  # exposed at 0 from the start
            self.not_stored.labels(reason)
        # a killed process's requests, settled by this one: only this series and a WARNING line per record say so
        self.reconciled = Counter(
            "thinkgate_write_ahead_reconciled_records", "Write-ahead records of dead gateway processes this process "
            "settled: metered (a usage event written for the request, counted in this process's request, token and "
            "cost series too), released (never sent upstream: reservations released, an audit event written).",
            ["outcome"], registry=r)
        for outcome in RECONCILE_OUTCOMES:  # exposed at 0 from the start
            self.reconciled.labels(outcome)
        # a stalled loop's timeouts fail calls without opening the breaker: only this series shows them
        self.stall_timeouts = Counter("thinkgate_redis_stall_timeouts", "Redis calls that timed out while this "
                                      "process's event loop stalled (a starved host): each call failed — the caller "
                                      "degraded as with Redis down — but the breaker stayed closed.", registry=r)
        #: the process counts the counters above were last brought up to (:meth:`_catch_up`), by series/label
        self._seen: dict[tuple[int, str], int] = {}
        self.routing_share = Gauge("thinkgate_routing_share", "Share of the routed requests in the cost-target "
                                   "controller's window, by routed tier.", ["tier"], registry=r)
        # registered with the controller only (render): a label-less gauge is always exposed, and 0 read as
        # "target 0%" where no routing.target is set
        self.routing_target_share = Gauge("thinkgate_routing_target_share", "The top routed tier's target share "
                                          "(routing.target; NaN while a spend target is not measured yet).",
                                          registry=None)
        self._target_registered = False
        self.routing_threshold = Gauge("thinkgate_routing_threshold", "Routing cut points in force, by the tier a "
                                       "score at or above it goes to.", ["tier"], registry=r)
        self.drift_psi = Gauge("thinkgate_routing_drift_psi", "Population Stability Index of the realized router "
                               "scores (kind=score) and tier mix (kind=tier) against the router file's calibration.",
                               ["kind"], registry=r)
        #: set by the app when the controller is on: () -> (share by tier, target share, threshold by tier)
        self.routing_view: Callable[[], tuple[dict[str, float], float | None, dict[str, float]]] | None = None
        #: without the controller: tier → the cut point into it (``thinkgate_routing_threshold``)
        self.thresholds_view: Callable[[], dict[str, float]] | None = None

        # (metric id, label values) -> child: prometheus_client's labels() validates and locks on every call
        # (~3 µs, ten times per request); the series themselves are still created on first use, as before.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def session(self, state: str) -> None:
        """Count one session-routing outcome (``new``, ``sticky``, ``flip_avoided``, ``repinned``)."""
        self._child(self.sessions, state).inc()

    def _child(self, metric: Any, *values: str) -> Any:
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            if len(self._children) >= MAX_CACHED_CHILDREN:  # key_id labels: keep the map bounded
                self._children.clear()
            child = self._children[key] = metric.labels(*values)
        return child

    def _tier(self, tier: str | None) -> str:
        if tier is None:
            return "_unrouted"
        return tier if tier in self.tier_names else "other"

    def _model(self, model: str | None) -> str:
        return model if model in self.models else "other"

    def observe(self, event: UsageEvent, cache: str) -> None:
        """Count one finished request from its usage event; ``cache`` = the request's cache outcome."""
        tier, model = self._tier(event.tier), self._model(event.upstream_model)
        k = (event.key_id,) if self.key_label else ()
        reason = event.route_reason if event.route_reason in ROUTE_REASONS else "other"
        cache = cache if cache in CACHE_RESULTS else "bypass"
        child = self._child
        child(self.requests, event.endpoint if event.endpoint in ENDPOINTS else "other", tier, model,
              reason, cache, status_class(event.status), *k).inc()
        for kind, n in (("prompt", event.prompt_tokens), ("cached", event.cached_tokens),
                        ("completion", event.completion_tokens), ("reasoning", event.reasoning_tokens)):
            if n:
                child(self.tokens, tier, model, kind, *k).inc(n)
        if event.cost_micro_usd:
            child(self.cost, tier, model, *k).inc(event.cost_micro_usd)
        if event.saved_micro_usd:
            child(self.saved, tier, model, *k).inc(event.saved_micro_usd)
        child(self.cache, cache).inc()
        child(self.routes, tier, reason).inc()
        if event.status >= 500:
            code = event.error_code if event.error_code in ERROR_CODES else "other"
            child(self.upstream_errors, tier, code).inc()
        if reason == "shadow":  # the gateway's own background call: no client waited for it
            return
        stream = "true" if event.stream else "false"
        child(self.latency, tier, stream).observe(event.latency_ms / 1000)
        if event.ttft_ms is not None:
            child(self.ttft, tier, stream).observe(event.ttft_ms / 1000)

    def drift(self, values: dict[str, float]) -> None:
        """Set the drift gauges (``kind`` → PSI)."""
        for kind, v in values.items():
            self._child(self.drift_psi, kind).set(v)

    def semantic(self, result: str) -> None:
        """Count one semantic-cache lookup by its outcome."""
        self._child(self.semantic_lookups, result if result in SEMANTIC_RESULTS else "bypass").inc()

    def rejected(self, code: str | None) -> None:
        """Count a refusal by budgets/limits (429/503 before routing)."""
        self._child(self.rejections, code if code in ERROR_CODES else "other").inc()

    def refused(self, status: int, code: str | None) -> None:
        """Count a request refused before any upstream call, by HTTP status and error code."""
        self._child(self.refusals, str(status), code if code in REFUSAL_CODES else "other").inc()

    def _catch_up(self, counter: Counter, label: str, count: int) -> None:
        """Grow ``counter`` (its ``label`` child; "" for a label-less one) by what the process count ``count`` grew
        since the last call: the counts live in the components (``Meter.spooled``…), the series here."""
        key = (id(counter), label)  # the counters live as long as this object
        seen = self._seen.get(key, 0)
        if count > seen:
            (counter.labels(label) if label else counter).inc(count - seen)
            self._seen[key] = count

    def render(self, breaker_open: bool, spool_bytes: int, spooled: int, dead_letter_bytes: int = 0,
               dead_lettered: int = 0, unreplicated: int = 0,
               refused_scripts: Mapping[str, int] | None = None, quarantine_bytes: int = 0,
               quarantined: Mapping[str, int] | None = None, wal_unreplicated: int = 0,
               stall_timeouts: int = 0, not_stored: Mapping[str, int] | None = None,
               reconciled: Mapping[str, int] | None = None) -> bytes:
        """The exposition text, with the gauges set from the current state; the counters fed from a process count
        (``spooled``, ``dead_lettered``, ``unreplicated``, ``refused_scripts``: ``Limits.refused_scripts``,
        ``quarantined``: ``Quarantine.counts`` by reason, ``wal_unreplicated``: ``WriteAhead.unreplicated``,
        ``stall_timeouts``: ``Breaker.stall_timeouts``, ``not_stored``: ``ConversationStore.not_stored`` by reason,
        ``reconciled``: ``WriteAhead.reconciled`` / ``released`` by :data:`RECONCILE_OUTCOMES`)
        grow by
        what it counted since the last call."""
        self.breaker_open.set(1 if breaker_open else 0)
        self.spool_bytes.set(spool_bytes)
        self._catch_up(self.spooled, "", spooled)
        self.dead_letter_bytes.set(dead_letter_bytes)
        self._catch_up(self.dead_lettered, "", dead_lettered)
        self._catch_up(self.unreplicated, "", unreplicated)
        self.quarantine_bytes.set(quarantine_bytes)
        for reason, n in (quarantined or {}).items():
            if reason in QUARANTINE_REASONS:  # a known label value only
                self._catch_up(self.quarantined, reason, n)
        self._catch_up(self.wal_unreplicated, "", wal_unreplicated)
        self._catch_up(self.stall_timeouts, "", stall_timeouts)
        for script, n in (refused_scripts or {}).items():
            if script in REFUSED_SCRIPTS:  # a known label value only
                self._catch_up(self.refused_scripts, script, n)
        for reason, n in (not_stored or {}).items():
            if reason in NOT_STORED_REASONS:
                self._catch_up(self.not_stored, reason, n)
        for outcome, n in (reconciled or {}).items():
            if outcome in RECONCILE_OUTCOMES:
                self._catch_up(self.reconciled, outcome, n)
        if self.routing_view is not None:
            if not self._target_registered:
                self.registry.register(self.routing_target_share)
                self._target_registered = True
            shares, target, cuts = self.routing_view()
            for tier, v in shares.items():
                self._child(self.routing_share, tier).set(v)
            self.routing_target_share.set(float("nan") if target is None else target)
            for tier, v in cuts.items():
                self._child(self.routing_threshold, tier).set(v)
        elif self.thresholds_view is not None:
            for tier, v in self.thresholds_view().items():
                self._child(self.routing_threshold, tier).set(v)
        return generate_latest(self.registry)

