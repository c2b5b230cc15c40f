"""OpenTelemetry traces of the request path, opt-in: on only when ``telemetry.otlp_endpoint`` is set.

Off (the default) nothing is imported and nothing is created: :func:`span` returns a shared null context and
:func:`finish` / :func:`traceparent` return at once (one context-variable read each).

On, each request is one ``SERVER`` span (name ``"{gen_ai.operation.name} {gen_ai.request.model}"``, the GenAI
semantic conventions' form) with a child span per step — ``route``, ``limits``, ``cache``, ``upstream`` (until
the upstream's response headers; a stream's body is read under the request span) and ``metering`` (the usage
record handed to the sinks: metrics now, the Redis write queued). A ``traceparent`` header from the client is
continued; the upstream call carries the W3C ``traceparent`` of its ``upstream`` span. The request span ends
when the request's usage record is metered (the end of a stream included) or when it is refused, with:

- ``gen_ai.operation.name`` (``chat`` | ``text_completion`` | ``embeddings``), ``gen_ai.request.model``,
  ``gen_ai.response.model`` (the tier's upstream model), ``gen_ai.usage.input_tokens``,
  ``gen_ai.usage.output_tokens`` (tokens, upstream's count);
- ``thinkgate.tier``, ``thinkgate.route_reason``, ``thinkgate.usage.reasoning_tokens``,
  ``thinkgate.cost_micro_usd`` (integer micro-USD), ``thinkgate.cached``, ``thinkgate.difficulty`` (router
  score, when scored), ``thinkgate.request_id``, ``thinkgate.endpoint``;
- ``http.response.status_code`` and, for a failure, ``error.type`` (the gateway's error code) and status ERROR.

An escalated first attempt is an event (``thinkgate.escalated``) on the request span, and so is an escalation's
call that failed while the first answer could still be served (``thinkgate.escalation_failed``). Spans go to OTLP/HTTP
protobuf in batches (:class:`gateway.observability.otlp_wire.OtlpBatchExporter`; the ``otel`` extra).
``telemetry.sample_ratio`` (1.0) records that share of new traces, decided as the SDK's
``ParentBased(TraceIdRatioBased)`` decides; the others cost one sampling decision per request, record no step
and still propagate ``traceparent`` (flags 00).

Why there are no SDK span objects on the request path: measured under load (bench/RESULTS.md "Telemetry
overhead"), the SDK's live spans (~25 µs a span, six per request), then finished ``ReadableSpan`` objects with
the SDK's batch processor and encoder, each cost more than the 10 % of a request's CPU the gateway allows
tracing. A request records its steps as ``time_ns`` pairs and random ids (drawn as the SDK's
``RandomIdGenerator`` draws them); when it ends, a :class:`SpanSink` turns them into spans: the OTLP bytes
directly (:mod:`gateway.observability.otlp_wire`), or SDK ``ReadableSpan`` objects for any SDK ``SpanExporter``
(:class:`SdkSpans`: the SDK's in-memory exporter in the tests, the same spans the wire carries).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Protocol

from gateway.config import TelemetryConfig
from gateway.observability.otlp_wire import CLIENT_STEP
from router.errors import require

OPERATIONS = {"chat": "chat", "responses": "chat", "messages": "chat", "completions": "text_completion",
              "embeddings": "embeddings"}
SCOPE = "thinkgate"  # the instrumentation scope of every span

# the OTLP proto's Status.code numbering (trace/v1), which the API's StatusCode shares
STATUS_UNSET, STATUS_ERROR = 0, 2

_CURRENT: ContextVar[RequestTrace | None] = ContextVar("thinkgate_trace", default=None)
_NULL = contextlib.nullcontext()
_MASK64 = (1 << 64) - 1
_bits = random.getrandbits


def new_span_id() -> int:
    """A random non-zero 64-bit span id (the SDK's ``RandomIdGenerator``: ``random.getrandbits``)."""
    sid = _bits(64)
    while not sid:
        sid = _bits(64)
    return sid


def new_trace_id() -> int:
    """A random non-zero 128-bit trace id."""
    tid = _bits(128)
    while not tid:
        tid = _bits(128)
    return tid


_HEX = frozenset("0123456789abcdef")


def parse_traceparent(value: str | None) -> tuple[int, int, int] | None:
    """A W3C ``traceparent`` header as (trace id, parent span id, trace flags), or None when absent or malformed
    — the rules of the SDK's ``TraceContextTextMapPropagator``: ``version-traceid-parentid-flags`` in lower-case
    hex, ids not all zero, version ``ff`` invalid, nothing after the flags for version ``00`` (a later version
    may add ``-…`` fields), at most 512 characters. Written here because the SDK's parse (a regex, a context
    and a span object) cost ~12 µs a request."""
    if value is None:
        return None
    v = value.strip()
    if not 55 <= len(v) <= 512 or v[2] != "-" or v[35] != "-" or v[52] != "-":
        return None
    version, tid, sid, flags, rest = v[:2], v[3:35], v[36:52], v[53:55], v[55:]
    if not _HEX.issuperset(version + tid + sid + flags) or version == "ff" or (rest and (version == "00"
                                                                                       or rest[0] != "-")):
        return None
    trace_id, span_id = int(tid, 16), int(sid, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(flags, 16)


def _trace_state(headers: Mapping[str, str]) -> str:
    """The client's ``tracestate`` as the SDK's ``TraceState`` parses it (invalid members dropped; all of the
    header's fields joined), in header form; "" when none."""
    getlist = getattr(headers, "getlist", None)
    values = getlist("tracestate") if getlist is not None else [v for v in [headers.get("tracestate")] if v]
    if not values or sum(len(v) for v in values) + len(values) - 1 > 512:  # the SDK ignores one that long too
        return ""
    from opentelemetry.trace.span import TraceState

    return str(TraceState.from_header(values).to_header())


class SpanSink(Protocol):
    """Where finished traces go: :class:`gateway.observability.otlp_wire.OtlpBatchExporter` or :class:`SdkSpans`."""

    def trace_ended(self, trace: RequestTrace, attrs: Mapping[str, Any], code: int, message: str,
                    end: int) -> None:
        """``trace`` ended at ``end`` (ns since the epoch) with request-span ``attrs`` and status ``code``
        (``STATUS_*``) / ``message``; its finished steps are ``trace.steps``."""

    def step_ended(self, trace: RequestTrace, step: Step) -> None:
        """A step that outlived its request span (rare): one child span on its own."""

    def shutdown(self) -> None:
        """Hand on what is queued and stop (app shutdown; may block up to the export timeout)."""


class Telemetry:
    """The tracer of one app: sampling, ids, context propagation and the sinks of finished traces.

    ``sinks``: where finished traces go instead of OTLP/HTTP to ``cfg.otlp_endpoint`` (tests give
    ``[SdkSpans(InMemorySpanExporter())]``, or that and a capturing wire encoder)."""

    def __init__(self, cfg: TelemetryConfig, sinks: Sequence[SpanSink] | None = None) -> None:
        require("opentelemetry.sdk", "otel", "telemetry.otlp_endpoint (OpenTelemetry traces)")
        from opentelemetry.sdk.resources import Resource

        #: the SDK's resource: ``service.name`` and the ``telemetry.sdk.*`` attributes it adds
        self.resource = Resource.create({"service.name": cfg.service_name})
        # ParentBased(TraceIdRatioBased(ratio)) as the SDK computes it: a new trace is sampled when the low
        # 64 bits of its id are below round(ratio · 2^64); a parent's sampled flag is followed
        self.bound = round(cfg.sample_ratio * (1 << 64))
        if sinks is None:
            from gateway.observability.otlp_wire import (
                OtlpBatchExporter,  # the spans' bytes written directly (see there)
            )

            sinks = [OtlpBatchExporter(str(cfg.otlp_endpoint), self.resource.attributes, SCOPE, dict(cfg.headers),
                                       cfg.export_timeout_s)]
        self.sinks = list(sinks)

    @classmethod
    def from_config(cls, cfg: TelemetryConfig) -> Telemetry | None:
        """A tracer when ``cfg.otlp_endpoint`` is set, else None (and nothing imported)."""
        return cls(cfg) if cfg.otlp_endpoint else None

    def begin(self, endpoint: str, headers: Mapping[str, str]) -> RequestTrace:
        """Start the trace of the request being served in this task (``endpoint``: the usage event's), a client's
        ``traceparent`` (and ``tracestate``) continued; a malformed one starts a new trace, as in the SDK."""
        start = time.time_ns()
        parent = parse_traceparent(headers.get("traceparent"))
        parent_id: int | None = None
        if parent is not None:
            trace_id, parent_id, flags = parent
            sampled, remote = bool(flags & 1), True
            trace_state = _trace_state(headers)
        else:
            trace_id, remote, trace_state = new_trace_id(), False, ""
            sampled = self.samples(trace_id)
        trace = RequestTrace(self, trace_id, new_span_id(), parent_id, remote, trace_state, endpoint, start, sampled)
        _CURRENT.set(trace)
        return trace

    def samples(self, trace_id: int) -> bool:
        """Whether a new trace with this id is recorded (``TraceIdRatioBased``: its low 64 bits under the bound)."""
        return (trace_id & _MASK64) < self.bound

    def shutdown(self) -> None:
        """Export what is queued and stop (on app shutdown)."""
        for sink in self.sinks:
            sink.shutdown()


class Step:
    """One child step being timed (a context manager; its span is made when the request ends). ``span_id`` is
    drawn when an outgoing call needs its ``traceparent`` or when it is exported."""

    __slots__ = ("end", "error", "name", "outer", "span_id", "start", "trace")

    def __init__(self, trace: RequestTrace, name: str) -> None:
        self.trace, self.name = trace, name
        self.span_id = 0
        self.error: str | None = None  # the exception's class name when the step raised

    def __enter__(self) -> Step:
        trace = self.trace
        self.outer, trace.active = trace.active, self
        self.start = time.time_ns()
        return self

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        self.end = time.time_ns()
        if exc is not None:
            self.error = type(exc).__name__
        trace = self.trace
        trace.active = self.outer
        if trace.ended:
            for sink in trace.tel.sinks:
                sink.step_ended(trace, self)
        else:
            trace.steps.append(self)

    def sid(self) -> int:
        if not self.span_id:
            self.span_id = new_span_id()
        return self.span_id


class RequestTrace:
    """One request's trace: ids (``trace_id`` 128-bit, ``span_id`` of the request span, ``parent_id`` of a
    client's span or None, ``remote``: that parent came from the client), ``trace_state`` (the W3C header form,
    "" when none), its finished steps and the step running now (``active``, whose id the upstream call
    propagates), its events (``(time_ns, name, attributes)``) and times in ns since the epoch."""

    __slots__ = ("active", "ended", "endpoint", "events", "name", "parent_id", "remote", "sampled",
                 "span_id", "start", "steps", "tel", "trace_id", "trace_state")

    def __init__(self, tel: Telemetry, trace_id: int, span_id: int, parent_id: int | None, remote: bool,
                 trace_state: str, endpoint: str, start: int, sampled: bool) -> None:
        self.tel = tel
        self.trace_id, self.span_id, self.parent_id, self.remote = trace_id, span_id, parent_id, remote
        self.trace_state = trace_state
        self.endpoint = endpoint
        self.name = OPERATIONS.get(endpoint, endpoint)
        self.start = start
        self.sampled = sampled
        self.active: Step | None = None
        self.steps: list[Step] = []
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.ended = False

    def child(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Time one step (``route``, ``limits``, …) as a child span; nothing when the trace is not sampled."""
        return Step(self, name) if self.sampled else _NULL

    def traceparent(self) -> str:
        """The W3C ``traceparent`` of the active step (version 00, trace id, span id, sampled flag)."""
        sid = self.active.sid() if self.active is not None else self.span_id
        return f"00-{self.trace_id:032x}-{sid:016x}-{'01' if self.sampled else '00'}"

    def _end(self, attrs: dict[str, Any], code: int, message: str) -> None:
        self.ended = True
        if not self.sampled:
            return
        end = time.time_ns()
        for sink in self.tel.sinks:  # steps stay: a sink may read them later (nothing appends once ended)
            sink.trace_ended(self, attrs, code, message, end)

    def finish(self, record: Any) -> None:
        """End the request span with the attributes of its usage record (see the module doc)."""
        if self.ended or record.endpoint != self.endpoint:  # e.g. the semantic cache's embedding record
            return
        if (record.error_code or "").startswith("escalated_"):
            self.event("thinkgate.escalated", record)
            return
        if not self.sampled:
            self.ended = True
            return
        op = OPERATIONS.get(record.endpoint, record.endpoint)
        model = str(record.requested_model or "")
        self.name = f"{op} {model}".strip()
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": op, "gen_ai.request.model": model,
            "gen_ai.usage.input_tokens": record.prompt_tokens, "gen_ai.usage.output_tokens": record.completion_tokens,
            "thinkgate.usage.reasoning_tokens": record.reasoning_tokens,
            "thinkgate.cost_micro_usd": record.cost_micro_usd, "thinkgate.cached": record.cached,
            "thinkgate.request_id": record.request_id, "thinkgate.endpoint": record.endpoint,
            "http.response.status_code": record.status,
        }
        if record.upstream_model:
            attrs["gen_ai.response.model"] = record.upstream_model
        if record.tier:
            attrs["thinkgate.tier"] = record.tier
        if record.route_reason:
            attrs["thinkgate.route_reason"] = record.route_reason
        if record.difficulty is not None:
            attrs["thinkgate.difficulty"] = float(record.difficulty)
        code, message = STATUS_UNSET, ""
        if record.status >= 400:
            attrs["error.type"] = record.error_code or str(record.status)
            if record.status >= 500:
                code, message = STATUS_ERROR, record.error_code or str(record.status)
        self._end(attrs, code, message)

    def event(self, name: str, record: Any) -> None:
        """An event on the request span about one attempt's usage record (its tier, error code and cost) that does
        not end it: an escalated first attempt, an escalation's failed call."""
        if self.sampled and not self.ended and record.endpoint == self.endpoint:
            self.events.append((time.time_ns(), name, {
                "thinkgate.tier": record.tier or "", "thinkgate.error_code": record.error_code or "",
                "thinkgate.cost_micro_usd": record.cost_micro_usd}))

    def fail(self, exc: BaseException) -> None:
        """End the request span for a request refused or broken before its usage record (no-op after finish)."""
        if self.ended:
            return
        status = int(getattr(exc, "status", 500))
        code = str(getattr(exc, "code", None) or type(exc).__name__)
        attrs = {"http.response.status_code": status, "error.type": code, "thinkgate.endpoint": self.endpoint}
        self._end(attrs, *((STATUS_ERROR, code) if status >= 500 else (STATUS_UNSET, "")))


class SdkSpans:
    """A :class:`SpanSink` that hands finished traces to an OpenTelemetry SDK ``SpanExporter`` as the SDK's own
    ``ReadableSpan`` objects (synchronously, one export call per trace): e.g. the SDK's
    ``InMemorySpanExporter`` in the tests, or any SDK exporter a deployment wants instead of OTLP/HTTP."""

    def __init__(self, exporter: Any, resource: Any = None) -> None:
        from opentelemetry import trace as api
        from opentelemetry.sdk import trace as sdk
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.exporter = exporter
        self._api, self._sdk = api, sdk
        self.resource = resource if resource is not None else Resource.create({"service.name": "thinkgate"})
        self.scope = InstrumentationScope(SCOPE)

    def _context(self, trace: RequestTrace, span_id: int) -> Any:
        api = self._api
        flags = api.TraceFlags(api.TraceFlags.SAMPLED)
        state = api.TraceState.from_header([trace.trace_state]) if trace.trace_state else None
        return api.SpanContext(trace.trace_id, span_id, is_remote=False, trace_flags=flags, trace_state=state)

    def _status(self, code: int, message: str) -> Any:
        sdk = self._sdk
        return sdk.Status(sdk.StatusCode.ERROR, message) if code == STATUS_ERROR else sdk.Status(sdk.StatusCode.UNSET)

    def _step(self, trace: RequestTrace, step: Step) -> Any:
        status = self._status(STATUS_ERROR, step.error) if step.error else self._status(STATUS_UNSET, "")
        kind = self._api.SpanKind.CLIENT if step.name == CLIENT_STEP else self._api.SpanKind.INTERNAL
        return self._sdk.ReadableSpan(step.name, self._context(trace, step.sid()), self._context(trace, trace.span_id),
                                      self.resource, {}, (), (), kind, None, status, step.start, step.end, self.scope)

    def spans(self, trace: RequestTrace, attrs: Mapping[str, Any], code: int, message: str,
              end: int) -> list[Any]:
        """The trace as SDK ``ReadableSpan`` objects: its steps, then the request span."""
        api, sdk = self._api, self._sdk
        parent = None
        if trace.parent_id is not None:
            state = api.TraceState.from_header([trace.trace_state]) if trace.trace_state else None
            parent = api.SpanContext(trace.trace_id, trace.parent_id, is_remote=trace.remote,
                                     trace_flags=api.TraceFlags(api.TraceFlags.SAMPLED), trace_state=state)
        events = tuple(sdk.Event(name, attributes, ts) for ts, name, attributes in trace.events)
        root = sdk.ReadableSpan(trace.name, self._context(trace, trace.span_id), parent, self.resource, dict(attrs),
                                events, (), api.SpanKind.SERVER, None, self._status(code, message), trace.start,
                                end, self.scope)
        return [*(self._step(trace, s) for s in trace.steps), root]

    def trace_ended(self, trace: RequestTrace, attrs: Mapping[str, Any], code: int, message: str,
                    end: int) -> None:
        self.exporter.export(self.spans(trace, attrs, code, message, end))

    def step_ended(self, trace: RequestTrace, step: Step) -> None:
        self.exporter.export([self._step(trace, step)])

    def shutdown(self) -> None:
        self.exporter.shutdown()


def current() -> RequestTrace | None:
    """The trace of the request served in this task, or None (telemetry off, or outside a request)."""
    return _CURRENT.get()


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current request (a shared null context when telemetry is off)."""
    trace = _CURRENT.get()
    return _NULL if trace is None else trace.child(name)


def traceparent() -> str | None:
    """The W3C ``traceparent`` for an outgoing call from the current step, or None when off."""
    trace = _CURRENT.get()
    return None if trace is None else trace.traceparent()


def event(name: str, record: Any) -> None:
    """An event on the current request's span about an attempt's record (:meth:`RequestTrace.event`; no-op when
    off)."""
    trace = _CURRENT.get()
    if trace is not None:
        trace.event(name, record)


def finish(record: Any) -> None:
    """End the current request's span from its metered usage record (no-op when off)."""
    trace = _CURRENT.get()
    if trace is not None:
        trace.finish(record)
