"""OpenTelemetry traces through a real gateway (uvicorn on loopback, the simulator, real Redis): the SDK's
in-memory exporter for the span tree and its attributes, W3C trace context to the upstream (the simulator
records the headers it got) and from the client, then once over OTLP/HTTP to a loopback receiver that decodes
the POSTed protobuf. Off: no span, no ``traceparent`` upstream, no OpenTelemetry import."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import TelemetryConfig
from gateway.observability.telemetry import SdkSpans, Telemetry
from tests.fixtures.gateway import SECRETS, cleanup, gateway_settings
from tests.fixtures.otlp import OtlpReceiver
from tests.fixtures.upstream import TEST_KEY, GatewayServer, SimProcess, wait_for

REPO = Path(__file__).resolve().parents[2]
STEPS = {"route", "limits", "cache", "upstream", "metering"}


@pytest.fixture
def traced(upstream_sim: SimProcess, redis_url: str, tmp_path: Path) -> Iterator[tuple[GatewayServer, Any]]:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    exporter = InMemorySpanExporter()
    gw = GatewayServer(gateway_settings(upstream_sim.base_url, redis_url, prefix, tmp_path / "spool.jsonl"))
    gw.app.state.proxy.telemetry = Telemetry(TelemetryConfig(), sinks=[SdkSpans(exporter)])
    try:
        with gw:
            yield gw, exporter
    finally:
        cleanup(redis_url, prefix)


def _post(gw: GatewayServer, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(gw.base_url + "/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store", **headers})


def _request_spans(exporter: Any, n: int) -> list[Any]:
    assert wait_for(lambda: sum(1 for s in exporter.get_finished_spans() if s.parent is None
                                or s.kind.name == "SERVER") >= n, 10)
    return [s for s in exporter.get_finished_spans() if s.kind.name == "SERVER"]


def test_span_tree_attributes_and_traceparent(traced: tuple[GatewayServer, Any], upstream_sim: SimProcess) -> None:
    gw, exporter = traced
    tag = uuid.uuid4().hex
    r = _post(gw, {"model": "long", "messages": [{"role": "user", "content": "trace me " + tag}],
                   "sim": {"tag": tag}})
    assert r.status_code == 200
    (root,) = _request_spans(exporter, 1)
    children = [s for s in exporter.get_finished_spans() if s.parent is not None
                and s.parent.span_id == root.context.span_id]
    assert {s.name for s in children} == STEPS
    assert all(s.context.trace_id == root.context.trace_id for s in children)
    a = root.attributes
    usage = r.json()["usage"]
    assert root.name == "chat long"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "long"
    assert a["gen_ai.response.model"] == "sim-model" and a["thinkgate.tier"] == "long"
    assert a["thinkgate.route_reason"] == "forced"
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["thinkgate.usage.reasoning_tokens"] == usage["completion_tokens_details"]["reasoning_tokens"] > 0
    assert a["thinkgate.cost_micro_usd"] > 0 and a["http.response.status_code"] == 200
    assert a["thinkgate.request_id"] == r.headers["x-request-id"]
    # W3C trace context reached the upstream: the upstream span's ids
    upstream_span = next(s for s in children if s.name == "upstream")
    # a CLIENT span (it carries traceparent to a remote server), the other steps INTERNAL
    assert upstream_span.kind.name == "CLIENT"
    assert {s.kind.name for s in children if s.name != "upstream"} == {"INTERNAL"}
    got = upstream_sim.tag(tag)
    assert got is not None
    version, trace_id, span_id, flags = got["headers"]["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled (the SDK may also set the random-id flag)
    assert int(trace_id, 16) == root.context.trace_id and int(span_id, 16) == upstream_span.context.span_id


def test_stream_client_trace_and_refusal(traced: tuple[GatewayServer, Any]) -> None:
    gw, exporter = traced
    client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with httpx.stream("POST", gw.base_url + "/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store",
                               "traceparent": f"00-{client_trace}-00f067aa0ba902b7-01"},
                      json={"model": "auto", "stream": True, "stream_options": {"include_usage": True},
                            "messages": [{"role": "user", "content": "stream " + uuid.uuid4().hex}]}) as r:
        assert r.status_code == 200
        body = r.read().decode()
    assert "[DONE]" in body
    refused = _post(gw, {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
    assert refused.status_code in (400, 404)
    spans = _request_spans(exporter, 2)
    streamed = next(s for s in spans if s.attributes.get("thinkgate.endpoint") == "chat"
                    and s.attributes.get("http.response.status_code") == 200)
    assert streamed.context.trace_id == int(client_trace, 16)  # the client's trace continues through us
    assert streamed.parent is not None and streamed.parent.span_id == 0x00f067aa0ba902b7
    assert streamed.attributes["thinkgate.route_reason"] == "predicted"
    assert streamed.attributes["gen_ai.usage.output_tokens"] > 0
    # the span ended at the end of the stream, after its upstream and metering steps
    metering = next(s for s in exporter.get_finished_spans() if s.name == "metering"
                    and s.parent.span_id == streamed.context.span_id)
    assert metering.end_time <= streamed.end_time
    bad = next(s for s in spans if s.attributes.get("http.response.status_code") == refused.status_code)
    assert bad.attributes["error.type"] == refused.json()["error"]["code"]
    # a refusal's span still names what was asked for (the request span ends where the refusal is audited)
    assert bad.name == "chat no-such-model" and bad.attributes["gen_ai.request.model"] == "no-such-model"


class WireCapture:
    """A span sink that keeps the bytes :mod:`gateway.observability.otlp_wire` writes for each finished trace."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def trace_ended(self, trace: Any, attrs: Any, code: int, message: str, end: int) -> None:
        from gateway.observability.otlp_wire import encode_trace

        self.parts.append(encode_trace(trace, attrs, code, message, end))

    def step_ended(self, trace: Any, step: Any) -> None:
        from gateway.observability.otlp_wire import encode_step

        self.parts.append(encode_step(trace, step))

    def shutdown(self) -> None:
        pass


def test_hand_encoder_writes_what_the_sdk_encoder_writes(upstream_sim: SimProcess, redis_url: str,
                                                         tmp_path: Path) -> None:
    # gateway/observability/otlp_wire.py writes the OTLP bytes of each trace itself: the same message as the SDK's
    # encoder makes of the same trace as SDK ReadableSpans, span for span (ids, times, attributes, events, status,
    # flags)
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway.observability.otlp_wire import frame
    from gateway.observability.telemetry import SCOPE

    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    exporter, wire = InMemorySpanExporter(), WireCapture()
    gw = GatewayServer(gateway_settings(upstream_sim.base_url, redis_url, prefix, tmp_path / "spool.jsonl"))
    tel = Telemetry(TelemetryConfig(), sinks=[SdkSpans(exporter), wire])
    gw.app.state.proxy.telemetry = tel
    try:
        with gw:
            assert _post(gw, {"model": "long", "messages": [{"role": "user", "content": "enc " + uuid.uuid4().hex}]},
                         traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                         tracestate="vendor=a1,other=b2").status_code == 200
            assert _post(gw, {"model": "no-such-model",
                              "messages": [{"role": "user", "content": "x"}]}).status_code >= 400
            assert _post(gw, {"model": "short", "messages": [{"role": "user", "content": "enc " + uuid.uuid4().hex}],
                              "sim": {"fail": "500"}}).status_code >= 500
            spans = _request_spans(exporter, 3) and exporter.get_finished_spans()
    finally:
        cleanup(redis_url, prefix)
    assert {s.name for s in spans} >= STEPS and any(s.parent is not None and s.parent.is_remote for s in spans)
    assert any(s.context.trace_state.to_header() == "vendor=a1,other=b2" for s in spans)
    assert any(s.status.status_code.name == "ERROR" for s in spans)  # the upstream's 500 (and its failed step)
    ours = ExportTraceServiceRequest.FromString(frame(SdkSpans(exporter).resource.attributes, SCOPE,
                                                      b"".join(wire.parts)))
    assert ours == encode_spans(spans)
    assert len(ours.resource_spans[0].scope_spans[0].spans) == len(spans)


def test_otlp_http_export_to_a_loopback_receiver(upstream_sim: SimProcess, redis_url: str, tmp_path: Path) -> None:
    receiver = OtlpReceiver()
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    settings = gateway_settings(upstream_sim.base_url, redis_url, prefix, tmp_path / "spool.jsonl",
                                telemetry={"otlp_endpoint": receiver.url, "service_name": "thinkgate-test"})
    try:
        with GatewayServer(settings) as gw:
            r = _post(gw, {"model": "short", "messages": [{"role": "user", "content": "otlp " + uuid.uuid4().hex}]})
            assert r.status_code == 200
        # stopping the gateway flushed the batch processor
        deadline = time.monotonic() + 10
        while not any(s.name == "chat short" for _, s in receiver.spans()) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        receiver.close()
        cleanup(redis_url, prefix)
    names = {s.name for _, s in receiver.spans()}
    assert {"chat short", *STEPS} <= names
    assert set(receiver.content_types) == {"application/x-protobuf"}
    resource, root = next((res, s) for res, s in receiver.spans() if s.name == "chat short")
    attrs = {kv.key: kv.value for kv in root.attributes}
    assert attrs["thinkgate.tier"].string_value == "short"
    assert attrs["thinkgate.cost_micro_usd"].int_value > 0
    assert attrs["gen_ai.usage.input_tokens"].int_value > 0
    assert {kv.key: kv.value.string_value for kv in resource.attributes}["service.name"] == "thinkgate-test"


def test_off_adds_nothing(gateway: GatewayServer, upstream_sim: SimProcess) -> None:
    assert gateway.app.state.proxy.telemetry is None
    tag = uuid.uuid4().hex
    r = httpx.post(gateway.base_url + "/chat/completions", timeout=30, headers={"authorization": f"Bearer {TEST_KEY}"},
                   json={"model": "short", "messages": [{"role": "user", "content": "off"}], "sim": {"tag": tag}})
    assert r.status_code == 200
    got = upstream_sim.tag(tag)
    assert got is not None and "traceparent" not in got["headers"]
    # redis-py imports parts of OpenTelemetry itself when it is installed (redis.observability): the baseline.
    # The gateway's own (the trace SDK, the OTLP exporter, the propagator) must stay out.
    code = ("import sys; import redis.asyncio; "
            "otel = lambda: {m for m in sys.modules if m.startswith('opentelemetry')}; "
            "before = otel(); from gateway.app import create_app; from gateway.config import Settings; "
            "create_app(Settings.load(None, engine={'enabled': False}, routing={'router_path': None})); "
            "print(sorted(otel() - before))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "THINKGATE_STATE_DIR": "/tmp/tg-off"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_unsampled_requests_record_nothing_and_still_propagate(upstream_sim: SimProcess, redis_url: str,
                                                               tmp_path: Path) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    exporter = InMemorySpanExporter()
    gw = GatewayServer(gateway_settings(upstream_sim.base_url, redis_url, prefix, tmp_path / "spool.jsonl"))
    gw.app.state.proxy.telemetry = Telemetry(TelemetryConfig(sample_ratio=0.0), sinks=[SdkSpans(exporter)])
    tag = uuid.uuid4().hex
    try:
        with gw:
            r = _post(gw, {"model": "short", "messages": [{"role": "user", "content": "x"}], "sim": {"tag": tag}})
            assert r.status_code == 200
            time.sleep(0.3)
    finally:
        cleanup(redis_url, prefix)
    assert exporter.get_finished_spans() == ()
    got = upstream_sim.tag(tag)
    assert got is not None
    flags = int(got["headers"]["traceparent"].rsplit("-", 1)[1], 16)
    assert flags & 1 == 0  # not sampled, still propagated (the SDK may set the random-id flag)
