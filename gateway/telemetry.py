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
records that share of new traces; the others cost a sampling decision per span and still propagate
``traceparent`` (flags 00).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
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
    ``InMemorySpanExporter``; it is then exported synchronously)."""

    def __init__(self, cfg: TelemetryConfig, exporter: Any = None) -> None:
        require("opentelemetry.sdk", "otel", "telemetry.otlp_endpoint (OpenTelemetry traces)")
        from opentelemetry import trace as api
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._api = api
        self.provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
        if exporter is None:
            require("opentelemetry.exporter.otlp.proto.http", "otel", "telemetry.otlp_endpoint (OTLP/HTTP)")
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=cfg.otlp_endpoint, headers=dict(cfg.headers) or None,
                                        timeout=int(cfg.export_timeout_s))
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("thinkgate")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_config(cls, cfg: TelemetryConfig) -> Telemetry | None:
        """A tracer when ``cfg.otlp_endpoint`` is set, else None (and nothing imported)."""
        return cls(cfg) if cfg.otlp_endpoint else None

    def begin(self, endpoint: str, headers: Mapping[str, str]) -> RequestTrace:
        """Start the span of the request being served in this task (``endpoint``: the usage event's)."""
        parent = self.propagator.extract(headers)
        span = self.tracer.start_span(OPERATIONS.get(endpoint, endpoint), context=parent,
                                      kind=self._api.SpanKind.SERVER)
        trace = RequestTrace(self, span, endpoint)
        _CURRENT.set(trace)
        return trace

    def shutdown(self) -> None:
        """Export what is queued and stop (on app shutdown)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's span and its current child (``active``, whose context the upstream call propagates)."""

    __slots__ = ("_ctx", "_ended", "active", "endpoint", "span", "tel")

    def __init__(self, tel: Telemetry, span: Any, endpoint: str) -> None:
        self.tel = tel
        self.span = span
        self._ctx = tel._api.set_span_in_context(span)  # the children's parent, built once
        self.endpoint = endpoint
        self.active: Any = None
        self._ended = False

    @contextlib.contextmanager
    def child(self, name: str) -> Iterator[Any]:
        span = self.tel.tracer.start_span(name, context=self._ctx)
        outer, self.active = self.active, span
        try:
            yield span
        except BaseException as exc:
            api = self.tel._api
            span.record_exception(exc)
            span.set_status(api.Status(api.StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            self.active = outer
            span.end()

    def traceparent(self) -> str | None:
        # W3C traceparent of the active step (version 00, its trace and span ids, its trace flags)
        c = (self.active or self.span).get_span_context()
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"

    def finish(self, record: Any) -> None:
        """End the request span with the attributes of its usage record (see the module doc)."""
        if self._ended or record.endpoint != self.endpoint:  # e.g. the semantic cache's embedding record
            return
        span = self.span
        if (record.error_code or "").startswith("escalated_"):
            span.add_event("thinkgate.escalated", {"thinkgate.tier": record.tier or "",
                                                   "thinkgate.error_code": record.error_code,
                                                   "thinkgate.cost_micro_usd": record.cost_micro_usd})
            return
        self._ended = True
        op = OPERATIONS.get(record.endpoint, record.endpoint)
        model = str(record.requested_model or "")
        span.update_name(f"{op} {model}".strip())
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
        span.set_attributes(attrs)
        if record.status >= 400:
            span.set_attribute("error.type", record.error_code or str(record.status))
            if record.status >= 500:
                api = self.tel._api
                span.set_status(api.Status(api.StatusCode.ERROR, record.error_code or str(record.status)))
        span.end()

    def fail(self, exc: BaseException) -> None:
        """End the request span for a request refused or broken before its usage record (no-op after finish)."""
        if self._ended:
            return
        self._ended = True
        api = self.tel._api
        status = getattr(exc, "status", 500)
        code = getattr(exc, "code", None) or type(exc).__name__
        self.span.set_attributes({"http.response.status_code": int(status), "error.type": str(code),
                                  "thinkgate.endpoint": self.endpoint})
        if int(status) >= 500:
            self.span.set_status(api.Status(api.StatusCode.ERROR, str(code)))
        self.span.end()


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
