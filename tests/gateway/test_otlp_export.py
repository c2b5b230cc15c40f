"""The OTLP/HTTP batch exporter (gateway/observability/otlp_wire.py) against a real loopback receiver: batches arrive as
``ExportTraceServiceRequest`` protobuf, 503s are retried with backoff, a 400 drops the batch, a full queue
drops and counts, shutdown flushes; and the sampler decides as the SDK's ``ParentBased(TraceIdRatioBased)``."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from gateway.config import TelemetryConfig
from gateway.ledger.record import UsageRecord
from gateway.observability.otlp_wire import OtlpBatchExporter
from gateway.observability.telemetry import SCOPE, Telemetry, finish, span
from tests.fixtures.otlp import OtlpReceiver

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")


def _one_request(tel: Telemetry, tier: str = "short") -> None:
    tel.begin("chat", {})
    for step in ("route", "limits", "cache", "upstream", "metering"):
        with span(step):
            pass
    finish(UsageRecord(endpoint="chat", requested_model="auto", tier=tier, upstream_model="m", route_reason="predicted",
                       prompt_tokens=12, completion_tokens=300, reasoning_tokens=200, cost_micro_usd=1234))


def _exporter(url: str, **kw: Any) -> OtlpBatchExporter:
    return OtlpBatchExporter(url, {"service.name": "thinkgate-test"}, SCOPE, {"x-tenant": "t1"}, **kw)


def test_batches_arrive_and_503s_are_retried() -> None:
    receiver = OtlpReceiver([503, 503])
    exporter = _exporter(receiver.url, timeout_s=10.0, max_export_batch_size=12, schedule_delay_s=30)
    tel = Telemetry(TelemetryConfig(), sinks=[exporter])
    try:
        _one_request(tel)
        _one_request(tel, tier="long")  # 12 spans: the batch is full, the thread wakes before its 30 s delay
        deadline = time.monotonic() + 8
        while not receiver.requests and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        exporter.shutdown()
        receiver.close()
    assert receiver.posts == 3 and len(receiver.requests) == 1  # two 503s, then accepted
    assert receiver.times[2] - receiver.times[1] >= 0.9  # backoff doubles: 0.5 s, then 1 s
    spans = [s for _, s in receiver.spans()]
    assert len(spans) == 12 and exporter.exported == 12 and exporter.dropped == 0
    roots = [s for s in spans if s.kind == 2]  # SPAN_KIND_SERVER
    tiers = [{kv.key: kv.value for kv in s.attributes}["thinkgate.tier"].string_value for s in roots]
    assert tiers == ["short", "long"]
    rs = receiver.requests[0].resource_spans[0]
    assert {kv.key: kv.value.string_value for kv in rs.resource.attributes} == {"service.name": "thinkgate-test"}
    assert rs.scope_spans[0].scope.name == SCOPE


def test_refused_batch_is_dropped_full_queue_counts_and_shutdown_flushes() -> None:
    receiver = OtlpReceiver([400])
    exporter = _exporter(receiver.url, max_export_batch_size=6, max_queue_size=12, schedule_delay_s=30)
    tel = Telemetry(TelemetryConfig(), sinks=[exporter])
    try:
        _one_request(tel)  # a full batch: POSTed at once and refused with 400 (not retried)
        deadline = time.monotonic() + 5
        while exporter.dropped < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert receiver.posts == 1 and exporter.dropped == 6
        slow = _exporter(receiver.url, max_export_batch_size=100, max_queue_size=12, schedule_delay_s=30)
        tel.sinks = [slow]
        for _ in range(3):  # 18 spans into a queue of 12: the third trace is dropped, whole
            _one_request(tel)
        assert slow.dropped == 6
        slow.shutdown()  # the queued 12 spans go out before the thread stops
        assert slow.exported == 12 and len(receiver.spans()) == 12
    finally:
        exporter.shutdown()
        receiver.close()


def test_sampling_decides_as_the_sdk_sampler() -> None:
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    rng = random.Random(7)
    ids = [rng.getrandbits(128) for _ in range(3000)]
    for ratio in (0.0, 0.1, 0.5, 1.0):
        tel = Telemetry(TelemetryConfig(sample_ratio=ratio), sinks=[])
        sdk = ParentBased(TraceIdRatioBased(ratio))
        ours = [tel.samples(t) for t in ids]
        assert ours == [sdk.should_sample(None, t, "chat").decision.is_sampled() for t in ids]
        assert abs(sum(ours) / len(ids) - ratio) < 0.03
    # a client's sampled flag is followed whatever the ratio
    tel = Telemetry(TelemetryConfig(sample_ratio=0.0), sinks=[])
    assert tel.begin("chat", {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}).sampled
    tel = Telemetry(TelemetryConfig(sample_ratio=1.0), sinks=[])
    assert not tel.begin("chat", {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"}).sampled
    # a malformed one starts a new trace
    trace = tel.begin("chat", {"traceparent": "00-zz-00f067aa0ba902b7-01"})
    assert trace.parent_id is None and trace.sampled


def test_traceparent_parse_agrees_with_the_sdk_propagator() -> None:
    from opentelemetry import trace as api
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from gateway.observability.telemetry import parse_traceparent

    tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = [f"00-{tid}-{sid}-01", f"00-{tid}-{sid}-00", f" 00-{tid}-{sid}-03 ", f"01-{tid}-{sid}-01-extra",
               f"00-{tid}-{sid}-01-extra", f"ff-{tid}-{sid}-01", f"00-{'0' * 32}-{sid}-01", f"00-{tid}-{'0' * 16}-01",
               f"00-{tid.upper()}-{sid}-01", f"00-{tid[:-1]}-{sid}-01", f"00_{tid}-{sid}-01", f"0g-{tid}-{sid}-01",
               "", "garbage", f"00-{tid}-{sid}-1", f"00-{tid}-{sid}-01" + "x" * 500]
    prop = TraceContextTextMapPropagator()
    for h in headers:
        ctx = api.get_current_span(prop.extract({"traceparent": h})).get_span_context()
        sdk = (ctx.trace_id, ctx.span_id, int(ctx.trace_flags)) if ctx.is_valid else None
        assert parse_traceparent(h) == sdk, h
    # tracestate: continued as the SDK's TraceState parses it (one malformed member: none of it)
    tel = Telemetry(TelemetryConfig(), sinks=[])
    trace = tel.begin("chat", {"traceparent": headers[0], "tracestate": "a=1,b=2"})
    assert trace.trace_state == "a=1,b=2" and trace.remote and trace.parent_id == int(sid, 16)
    assert tel.begin("chat", {"traceparent": headers[0], "tracestate": "a=1,bad key=3"}).trace_state == ""
