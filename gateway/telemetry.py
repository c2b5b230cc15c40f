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

An escalated first attempt is an event (``thinkgate.escalated``) on the request span. Spans are exported in
batches over OTLP/HTTP protobuf (``opentelemetry-exporter-otlp-proto-http``; ``pip install 'thinkgate[otel]'``)
by a provider of the gateway's own (the process-global one is left alone). ``telemetry.sample_ratio`` (1.0)
records that share of new traces; the others cost one sampling decision per request, record no step and still
propagate ``traceparent`` (flags 00). Spans are built when the request ends (see :class:`Telemetry`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from gateway.config import TelemetryConfig
from router.errors import require

OPERATIONS = {"chat": "chat", "responses": "chat", "messages": "chat", "completions": "text_completion",
              "embeddings": "embeddings"}

_CURRENT: ContextVar[RequestTrace | None] = ContextVar("thinkgate_trace", default=None)
_NULL = contextlib.nullcontext()


class Telemetry:
    """The tracer of one app. ``exporter``: a span exporter to use instead of OTLP/HTTP (tests give the SDK's
    ``InMemorySpanExporter``; it is then exported synchronously).

    Why spans are not made through ``Tracer.start_span``: the SDK's live span (a lock, attribute limits, context
    objects, a processor call at start and end) cost ~25 µs a span, six per request — more than the 10 % of a
    request's CPU the gateway allows tracing. A request records its steps as ``time_ns`` pairs and, when it
    ends, hands finished ``ReadableSpan`` objects (what the SDK's own spans become) to the span processor: the
    same sampler, id generator, resource, processor and exporter, no live span objects."""

    def __init__(self, cfg: TelemetryConfig, exporter: Any = None) -> None:
        require("opentelemetry.sdk", "otel", "telemetry.otlp_endpoint (OpenTelemetry traces)")
        from opentelemetry import trace as api
        from opentelemetry.sdk import trace as sdk
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._api = api
        self._sdk = sdk
        self.provider = sdk.TracerProvider(resource=Resource.create({"service.name": cfg.service_name}),
                                           sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
        if exporter is None:
            from gateway.otlp_wire import OtlpHttpExporter  # the spans' bytes written directly (see there)

            exporter = OtlpHttpExporter(str(cfg.otlp_endpoint), dict(cfg.headers), cfg.export_timeout_s)
            self.processor: Any = BatchSpanProcessor(exporter, max_queue_size=8192, max_export_batch_size=2048)
        else:
            self.processor = SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("thinkgate")  # for callers that want live spans of their own
        self.propagator = TraceContextTextMapPropagator()
        self.sampler = self.provider.sampler
        self.ids = self.provider.id_generator
        self.resource = _hashed_resource(self.provider.resource)
        self.scope = InstrumentationScope("thinkgate")
        self.SERVER, self.INTERNAL = api.SpanKind.SERVER, api.SpanKind.INTERNAL
        self.OK = sdk.Status(sdk.StatusCode.UNSET)
        self._sampled = api.TraceFlags(api.TraceFlags.SAMPLED)
        self._unsampled = api.TraceFlags(api.TraceFlags.DEFAULT)

    @classmethod
    def from_config(cls, cfg: TelemetryConfig) -> Telemetry | None:
        """A tracer when ``cfg.otlp_endpoint`` is set, else None (and nothing imported)."""
        return cls(cfg) if cfg.otlp_endpoint else None

    def begin(self, endpoint: str, headers: Mapping[str, str]) -> RequestTrace:
        """Start the trace of the request being served in this task (``endpoint``: the usage event's): the
        sampling decision and the ids as ``Tracer.start_span`` makes them, a client's ``traceparent`` continued."""
        start = time.time_ns()
        api = self._api
        parent_ctx = self.propagator.extract(headers) if "traceparent" in headers else None
        parent = api.get_current_span(parent_ctx).get_span_context() if parent_ctx is not None else None
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
        else:
            parent, trace_id = None, self.ids.generate_trace_id()
        name = OPERATIONS.get(endpoint, endpoint)
        decision = self.sampler.should_sample(parent_ctx, trace_id, name, self.SERVER)
        sampled = decision.decision.is_sampled()
        context = api.SpanContext(trace_id, self.ids.generate_span_id(), is_remote=False,
                                  trace_flags=self._sampled if sampled else self._unsampled,
                                  trace_state=decision.trace_state)
        trace = RequestTrace(self, context, parent, endpoint, start, sampled)
        _CURRENT.set(trace)
        return trace

    def emit(self, span: Any) -> None:
        self.processor.on_end(span)

    def shutdown(self) -> None:
        """Export what is queued and stop (on app shutdown)."""
        self.provider.shutdown()


def _hashed_resource(resource: Any) -> Any:
    """``resource`` with its hash computed once: the OTLP encoder groups spans by resource and the SDK's
    ``Resource.__hash__`` JSON-encodes the attributes on every call (a fifth of the encoding time)."""
    cls: Any = type(resource)
    base_hash = cls.__hash__

    class HashedResource(cls):
        _hash: int | None = None

        def __hash__(self) -> int:
            if self._hash is None:
                self._hash = int(base_hash(self))
            return self._hash

    return HashedResource(resource.attributes, resource.schema_url)


class _Step:
    """One child step being timed (a context manager; the span is made when the request ends)."""

    __slots__ = ("context", "end", "error", "name", "outer", "start", "trace")

    def __init__(self, trace: RequestTrace, name: str) -> None:
        self.trace, self.name = trace, name
        self.context: Any = None  # its SpanContext, made only when an outgoing call needs its traceparent
        self.error: BaseException | None = None

    def __enter__(self) -> _Step:
        trace = self.trace
        self.outer, trace.active = trace.active, self
        self.start = time.time_ns()
        return self

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        self.end = time.time_ns()
        self.error = exc
        trace = self.trace
        trace.active = self.outer
        if trace._ended:  # a step that outlived its request span (rare): exported on its own
            trace.tel.emit(trace._child_span(self))
        else:
            trace.steps.append(self)

    def span_context(self) -> Any:
        if self.context is None:
            tel, root = self.trace.tel, self.trace.context
            self.context = tel._api.SpanContext(root.trace_id, tel.ids.generate_span_id(), is_remote=False,
                                                trace_flags=root.trace_flags, trace_state=root.trace_state)
        return self.context


class RequestTrace:
    """One request's trace: its span context, its finished steps and the step running now (``active``, whose
    context the upstream call propagates)."""

    __slots__ = ("_ended", "active", "context", "endpoint", "events", "name", "parent", "sampled", "start",
                 "steps", "tel")

    def __init__(self, tel: Telemetry, context: Any, parent: Any, endpoint: str, start: int, sampled: bool) -> None:
        self.tel = tel
        self.context = context
        self.parent = parent
        self.endpoint = endpoint
        self.name = OPERATIONS.get(endpoint, endpoint)
        self.start = start
        self.sampled = sampled
        self.active: _Step | None = None
        self.steps: list[_Step] = []
        self.events: list[Any] = []
        self._ended = False

    def child(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Time one step (``route``, ``limits``, …) as a child span; nothing when the trace is not sampled."""
        return _Step(self, name) if self.sampled else _NULL

    def traceparent(self) -> str | None:
        # W3C traceparent of the active step (version 00, its trace and span ids, its trace flags)
        c = self.active.span_context() if self.active is not None else self.context
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"

    def _child_span(self, step: _Step) -> Any:
        tel, sdk = self.tel, self.tel._sdk
        status = tel.OK
        if step.error is not None:
            status = sdk.Status(sdk.StatusCode.ERROR, type(step.error).__name__)
        return sdk.ReadableSpan(step.name, step.span_context(), self.context, tel.resource, {}, (), (),
                                tel.INTERNAL, None, status, step.start, step.end, tel.scope)

    def _end(self, attrs: dict[str, Any], status: Any) -> None:
        self._ended = True
        if not self.sampled:
            return
        tel, sdk = self.tel, self.tel._sdk
        end = time.time_ns()
        for step in self.steps:
            tel.emit(self._child_span(step))
        self.steps = []
        tel.emit(sdk.ReadableSpan(self.name, self.context, self.parent, tel.resource, attrs, tuple(self.events),
                                  (), tel.SERVER, None, status, self.start, end, tel.scope))

    def finish(self, record: Any) -> None:
        """End the request span with the attributes of its usage record (see the module doc)."""
        if self._ended or record.endpoint != self.endpoint:  # e.g. the semantic cache's embedding record
            return
        sdk = self.tel._sdk
        if (record.error_code or "").startswith("escalated_"):
            if self.sampled:
                self.events.append(sdk.Event("thinkgate.escalated", {
                    "thinkgate.tier": record.tier or "", "thinkgate.error_code": record.error_code,
                    "thinkgate.cost_micro_usd": record.cost_micro_usd}))
            return
        if not self.sampled:
            self._ended = True
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
        status = self.tel.OK
        if record.status >= 400:
            attrs["error.type"] = record.error_code or str(record.status)
            if record.status >= 500:
                status = sdk.Status(sdk.StatusCode.ERROR, record.error_code or str(record.status))
        self._end(attrs, status)

    def fail(self, exc: BaseException) -> None:
        """End the request span for a request refused or broken before its usage record (no-op after finish)."""
        if self._ended:
            return
        sdk = self.tel._sdk
        status = int(getattr(exc, "status", 500))
        code = str(getattr(exc, "code", None) or type(exc).__name__)
        self._end({"http.response.status_code": status, "error.type": code, "thinkgate.endpoint": self.endpoint},
                  sdk.Status(sdk.StatusCode.ERROR, code) if status >= 500 else self.tel.OK)


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


def finish(record: Any) -> None:
    """End the current request's span from its metered usage record (no-op when off)."""
    trace = _CURRENT.get()
    if trace is not None:
        trace.finish(record)
