"""Upstream faults: refused connections (with tier fallback), timeouts, 5xx with and without retry, a stream
dropped or stalled midway, an in-stream engine error, and a client that disconnects mid-stream.

Each case gets its documented status or in-stream error, within a bounded time (no hung request).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.fixtures.ports import leased_port
from tests.fixtures.upstream import (
    TEST_KEY,
    GatewayServer,
    SimProcess,
    StreamRead,
    hang_up_once_upstream,
    sim_settings,
    start_sim,
    wait_for,
)

MESSAGES = [{"role": "user", "content": "tell me a story about a fox"}]
RESPONSE_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 1.0
HANG_S = 8.0  # the fault simulator's hang; well above READ_TIMEOUT_S, well below the test timeout


def tag() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def fault_sim() -> Iterator[SimProcess]:
    sim = start_sim("--hang-s", str(HANG_S))
    try:
        yield sim
    finally:
        sim.stop()


def fault_tiers(sim: SimProcess, dead_port: int) -> list[dict[str, Any]]:
    common = {"model": "sim-model", "connect_timeout_s": 1.0, "read_timeout_s": READ_TIMEOUT_S,
              "response_timeout_s": RESPONSE_TIMEOUT_S}
    return [
        {**common, "name": "down", "base_url": f"http://127.0.0.1:{dead_port}/v1", "max_retries": 1},
        {**common, "name": "ok", "base_url": sim.base_url, "max_retries": 2},
    ]


@pytest.fixture(scope="module")
def dead_port() -> Iterator[int]:
    """A port where nothing listens, leased for the module (no other test server is started there)."""
    with leased_port() as port:
        yield port


def fault_settings(sim: SimProcess, redis_url: str, fallback: bool, dead_port: int) -> Any:
    return sim_settings(
        sim.base_url, redis_url, tiers=fault_tiers(sim, dead_port),
        routing={"router_path": None, "routed_tiers": ["down", "ok"], "thresholds": [0.5], "default_tier": "ok",
                 "effort_tiers": {"low": "down", "high": "ok"}, "fallback": fallback},
    )


@pytest.fixture(scope="module")
def fault_gateway(fault_sim: SimProcess, redis_url: str, dead_port: int) -> Iterator[GatewayServer]:
    with GatewayServer(fault_settings(fault_sim, redis_url, fallback=True, dead_port=dead_port)) as gw:
        yield gw


@pytest.fixture
def client(fault_gateway: GatewayServer) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=fault_gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=15)
    yield c
    c.close()


@pytest.fixture
def records(fault_gateway: GatewayServer) -> Iterator[list[Any]]:
    got: list[Any] = []
    sinks = fault_gateway.app.state.proxy.usage_sinks
    sinks.append(got.append)
    yield got
    sinks.remove(got.append)


@pytest.mark.parametrize("stream", [False, True])
def test_refused_connection_falls_back_to_next_tier(client: openai.OpenAI, stream: bool) -> None:
    raw = client.chat.completions.with_raw_response.create(model="down", messages=MESSAGES, stream=stream)
    assert raw.headers["x-thinkgate-tier"] == "ok"
    assert raw.headers["x-thinkgate-route-reason"] == "fallback"
    if stream:
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices).startswith("echo:")
    else:
        assert raw.parse().choices[0].message.content.startswith("echo:")


def test_refused_connection_without_fallback_is_502(fault_sim: SimProcess, redis_url: str, dead_port: int) -> None:
    with GatewayServer(fault_settings(fault_sim, redis_url, fallback=False, dead_port=dead_port)) as gw:
        c = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=15)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            c.chat.completions.create(model="down", messages=MESSAGES)
        assert time.monotonic() - t0 < 5
        assert info.value.status_code == 502
        assert info.value.code == "upstream_unavailable"  # type: ignore[attr-defined]
        dead = gw.settings.tier("down").base_url
        assert "127.0.0.1" not in info.value.message and dead not in info.value.message  # the address stays inside
        assert "x-should-retry" not in info.value.response.headers  # nothing ran upstream: the SDK may retry
        # one tier's upstream down: degraded, still ready — upstreams are shared by every replica, and the other
        # tier answers (a 503 here emptied the load balancer's backend while each replica could serve)
        r = httpx.get(gw.url + "/ready", timeout=10)
        assert r.status_code == 200 and r.json()["upstreams"] == {"down": False, "ok": True}
        assert r.json()["status"] == "degraded"


def test_ready_fails_when_no_upstream_answers(redis_url: str, fault_sim: SimProcess,
        port_lease: Callable[[], int]) -> None:
    """Every generation tier's upstream down: this replica can serve no chat or completion, so it is not ready —
    an embeddings tier that answers does not make it ready."""
    dead = f"http://127.0.0.1:{port_lease()}/v1"
    tiers = [{"name": "emb", "base_url": fault_sim.base_url, "model": "m", "embeddings": True}]
    tiers += [{"name": n, "base_url": dead, "model": "m", "connect_timeout_s": 0.5} for n in ("a", "b")]
    settings = sim_settings(dead, redis_url, tiers=tiers, routing={"router_path": None, "routed_tiers": ["a", "b"],
                                                                   "thresholds": [0.5], "default_tier": "b",
                                                                   "effort_tiers": {"low": "a", "high": "b"}})
    with GatewayServer(settings) as gw:
        r = httpx.get(gw.url + "/ready", timeout=10)
        assert r.status_code == 503 and r.json() | {"redis_synced": None} == {
            "status": "not_ready", "redis": True, "redis_synced": None,
            "upstreams": {"emb": True, "a": False, "b": False}}


def test_an_upstream_400_keeps_the_field_it_names(client: openai.OpenAI) -> None:
    # vLLM's 400 names the field in error.param: the client's SDK gets it (it was null)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="ok", messages=MESSAGES, top_logprobs=2)
    assert info.value.code == "upstream_rejected" and info.value.param == "top_logprobs"  # type: ignore[attr-defined]


def test_a_non_streamed_answer_may_take_longer_than_read_timeout(client: openai.OpenAI) -> None:
    # vLLM sends a non-streamed answer whole when the generation ends: a long thought is silence until then, and
    # it was cut at read_timeout_s (120 s by default) with a 504
    delay_ms = (READ_TIMEOUT_S + (RESPONSE_TIMEOUT_S - READ_TIMEOUT_S) / 2) * 1000
    r = client.chat.completions.create(model="ok", messages=MESSAGES, extra_body={"sim": {"delay_ms": delay_ms}})
    assert r.choices[0].message.content


def test_upstream_500_is_502_without_retry(client: openai.OpenAI, fault_sim: SimProcess, records: list[Any]) -> None:
    t = tag()
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="ok", messages=MESSAGES, extra_body={"sim": {"fail": "500", "tag": t}})
    assert info.value.status_code == 502
    assert info.value.type == "upstream_error"  # type: ignore[attr-defined]
    assert "500" in info.value.message
    assert fault_sim.tag(t)["attempts"] == 1
    assert [r.status for r in records] == [502]
    # the error names the request id of its usage record, as a success does
    assert info.value.response.headers["x-request-id"] == records[0].request_id


def test_a_200_with_an_error_document_is_a_502(client: openai.OpenAI, fault_sim: SimProcess,
                                               records: list[Any]) -> None:
    """An upstream (or a proxy before it) answering 200 with ``{"error": …}`` and no choices: the call failed. The
    gateway passed it on as a 200, which the SDK read as a completion with no choices; now a 502 ``upstream_error``
    with the upstream's message (not retried, ``x-should-retry: false``: the engine may have run), recorded as
    such."""
    t = tag()
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="ok", messages=MESSAGES,
                                       extra_body={"sim": {"fail": "json-error", "tag": t}})
    assert info.value.status_code == 502 and info.value.type == "upstream_error"  # type: ignore[attr-defined]
    assert "simulated engine error" in info.value.message
    assert info.value.response.headers.get("x-should-retry") == "false"
    assert fault_sim.tag(t)["attempts"] == 1
    assert [(r.status, r.error_code) for r in records] == [(502, "upstream_error")]


def test_upstream_503_is_retried_then_succeeds(client: openai.OpenAI, fault_sim: SimProcess) -> None:
    t = tag()
    for stream in (False, True):
        t = tag()
        raw = client.chat.completions.with_raw_response.create(
            model="ok", messages=MESSAGES, stream=stream, extra_body={"sim": {"fail": "503", "fail_times": 2, "tag": t}}
        )
        assert raw.status_code == 200 and raw.headers["x-thinkgate-route-reason"] == "forced"
        raw.parse()
        assert fault_sim.tag(t)["attempts"] == 3


def test_upstream_503_persisting_is_502(client: openai.OpenAI, fault_sim: SimProcess) -> None:
    t = tag()
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="ok", messages=MESSAGES, extra_body={"sim": {"fail": "503", "tag": t}})
    assert info.value.status_code == 502
    assert fault_sim.tag(t)["attempts"] == 3  # 1 + max_retries


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_timeout_is_504(client: openai.OpenAI, fault_sim: SimProcess, stream: bool) -> None:
    t = tag()
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="ok", messages=MESSAGES, stream=stream,
                                       extra_body={"sim": {"fail": "timeout", "tag": t}})
    elapsed = time.monotonic() - t0
    assert info.value.status_code == 504
    assert info.value.code == "upstream_timeout"  # type: ignore[attr-defined]
    assert len(info.value.response.headers["x-request-id"]) == 32
    # a stream's silence is read_timeout_s; a non-streamed answer, which comes whole at the end, response_timeout_s
    limit = READ_TIMEOUT_S if stream else RESPONSE_TIMEOUT_S
    assert limit <= elapsed < limit + 3
    assert fault_sim.tag(t)["attempts"] == 1  # a read timeout is not retried
    # The gateway hung up, so the simulator sees its client go away long before its hang ends.
    rec = fault_sim.wait_tag_status(t, {"cancelled", "failed"}, timeout_s=HANG_S / 2)
    assert rec is not None and rec["status"] == "cancelled"


def test_stream_dropped_midway_ends_with_error_event(client: openai.OpenAI, records: list[Any]) -> None:
    # chunk_delay_ms: the drop in a network read of its own; read with the frames before it, aiohttp raises it before
    # handing over what it buffered, and a loaded box relays nothing (tests/gateway/test_tools_paths.py saw it)
    got: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as info:
        for chunk in client.chat.completions.create(model="ok", messages=MESSAGES, stream=True,
                                                     extra_body={"sim": {"fail": "drop", "chunk_delay_ms": 20}}):
            got.extend(getattr(c.delta, "reasoning", None) or "" for c in chunk.choices)
    assert time.monotonic() - t0 < 5
    assert got, "the chunks before the drop were relayed"
    assert info.value.body["code"] == "upstream_stream_broken"  # type: ignore[index]
    assert wait_for(lambda: len(records) == 1, timeout_s=15)  # generous: CI boxes are loaded
    rec = records[0]
    assert (rec.status, rec.partial, rec.usage_source) == (502, True, "counted")
    assert rec.completion_tokens > 0 and rec.cost_micro_usd >= 0
    assert rec.prompt_tokens > 0  # the prompt was read before the first chunk: billed (tokenized or estimated)


def test_non_stream_drop_is_502(client: openai.OpenAI, fault_sim: SimProcess) -> None:
    # a 200 whose body breaks: the generation ran (vLLM sends that 200 once it is done), so it is neither retried
    # nor sent again elsewhere — it was retried as a connection error: up to 3 generations (and a fallback's)
    # for one metered call
    t = tag()
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="ok", messages=MESSAGES,
                                       extra_body={"sim": {"fail": "drop", "fail_times": 1, "tag": t}})
    assert info.value.status_code == 502
    assert info.value.type == "upstream_error" and "broke its body" in info.value.message  # type: ignore[attr-defined]
    assert fault_sim.tag(t)["attempts"] == 1
    # nor by the client's SDK (the OpenAI and Anthropic SDKs retry every 5xx unless told not to): three
    # generations for one call again, each metered at 0
    assert info.value.response.headers.get("x-should-retry") == "false"
    # the client is told what failed, not where: no internal address in the message
    assert "127.0.0.1" not in info.value.message and str(fault_sim.port) not in info.value.message


def test_stream_stalled_midway_ends_with_timeout_event(client: openai.OpenAI, records: list[Any]) -> None:
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as info:
        for _ in client.chat.completions.create(model="ok", messages=MESSAGES, stream=True,
                                                extra_body={"sim": {"fail": "stall"}}):
            pass
    assert READ_TIMEOUT_S <= time.monotonic() - t0 < READ_TIMEOUT_S + 3
    assert info.value.body["code"] == "upstream_timeout"  # type: ignore[index]
    assert wait_for(lambda: len(records) == 1) and records[0].status == 504


def test_in_stream_engine_error_is_forwarded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIError, match="simulated engine error"):
        for _ in client.chat.completions.create(model="ok", messages=MESSAGES, stream=True,
                                                extra_body={"sim": {"fail": "error-event"}}):
            pass


#: a usage the simulated upstream reports (``"sim": {"usage": …}``) that no count of the gateway's would give
REPORTED_USAGE = {"prompt_tokens": 41, "completion_tokens": 97, "total_tokens": 138,
                  "completion_tokens_details": {"reasoning_tokens": 60}}


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_answered_with_a_json_body_is_relayed_as_a_stream(client: openai.OpenAI, records: list[Any],
                                                                 include_usage: bool) -> None:
    """An upstream (or a proxy before it) that answers a stream request 200 with the whole answer as one JSON
    document (``application/json``, not SSE). The gateway read no ``data:`` line in it: the client got an in-stream
    ``upstream_stream_broken`` and the call was billed the counted prompt alone, though the upstream said what it
    used. Now the answer reaches the client as a valid stream (its text, the usage chunk when asked, ``[DONE]``) and
    the usage event bills the reported usage."""
    expected = client.chat.completions.create(model="ok", messages=MESSAGES, extra_body={"sim": {"fail": "none"}})
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    stream = client.chat.completions.create(model="ok", messages=MESSAGES, stream=True, **options,  # type: ignore[call-overload]
                                            extra_body={"sim": {"fail": "json-body", "usage": REPORTED_USAGE}})
    got = StreamRead().read(stream)
    message = expected.choices[0].message
    assert (got.content, got.reasoning, got.finish) == (message.content, (message.model_extra or {})["reasoning"],
                                                        "stop")
    assert got.usage == (REPORTED_USAGE if include_usage else None)
    assert wait_for(lambda: len(records) == 2)
    rec = records[1]
    assert (rec.status, rec.error_code, rec.partial, rec.usage_source) == (200, None, False, "upstream")
    assert (rec.prompt_tokens, rec.completion_tokens, rec.reasoning_tokens) == (41, 97, 60)


@pytest.mark.parametrize(("inject", "code"), [
    ({"choices": [], "error": {"message": "simulated engine error", "type": "InternalServerError", "code": 500}},
     "upstream_error"),
    ({"choices": "abc"}, "upstream_stream_broken"),
])
def test_stream_answered_with_a_json_error_or_garbage_is_an_in_stream_error(
        client: openai.OpenAI, records: list[Any], inject: dict[str, Any], code: str) -> None:
    """A streamed call's JSON body that is no answer: an error document is passed on as the in-stream error it is,
    a malformed one is a broken stream — as before, never a 200 with nothing in it."""
    with pytest.raises(openai.APIError) as info:
        for _ in client.chat.completions.create(model="ok", messages=MESSAGES, stream=True,
                                                extra_body={"sim": {"fail": "json-body", "inject": inject}}):
            pass
    if code == "upstream_error":
        assert "simulated engine error" in info.value.message
    else:
        assert info.value.body["code"] == code  # type: ignore[index]
    assert wait_for(lambda: len(records) == 1)
    assert (records[0].status, records[0].error_code) == (502, code)


def test_client_disconnect_cancels_upstream(fault_gateway: GatewayServer, fault_sim: SimProcess,
                                            records: list[Any]) -> None:
    t = tag()
    body = {"model": "ok", "stream": True, "messages": MESSAGES,
            "sim": {"tag": t, "chunk_delay_ms": 100}}  # ~25 chunks → 2.5 s if nobody hung up
    with httpx.Client(timeout=10) as h, h.stream("POST", fault_gateway.base_url + "/chat/completions", json=body,
                                                 headers={"authorization": f"Bearer {TEST_KEY}"}) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data:"):
                seen += 1
            if seen == 3:
                break
    # Closing the client's connection must close the gateway's upstream request, not let it run to the end.
    rec = fault_sim.wait_tag_status(t, {"cancelled", "completed"}, timeout_s=15)
    assert rec is not None and rec["status"] == "cancelled", rec
    assert rec["chunks_sent"] < 20
    # this request's record (an earlier test's stream may settle meanwhile: a cut stream's settle asks the upstream
    # to count its prompt); generous: CI boxes are loaded
    assert wait_for(lambda: any(x.request_id == rid for x in records), timeout_s=15)
    usage = next(x for x in records if x.request_id == rid)
    assert (usage.status, usage.partial, usage.usage_source) == (499, True, "counted")
    assert usage.completion_tokens >= 1


def test_an_upstream_redirect_is_not_followed(redis_url: str, tmp_path: Any) -> None:
    """An upstream answering 307 to another address: aiohttp followed it and re-sent the prompt there (a security
    review's catcher received it, and its ``{}`` became the client's 200). Now a 3xx is an upstream error."""
    import http.server
    import threading

    from tests.fixtures.gateway import SECRETS, accounting_gateway
    from tests.fixtures.upstream import sim_tiers

    caught: list[str] = []

    class Catcher(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            caught.append(self.path)
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    catcher = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Catcher)

    class Redirect(Catcher):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(307)
            self.send_header("location", f"http://127.0.0.1:{catcher.server_port}/steal")
            self.send_header("content-length", "0")
            self.end_headers()

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    for server in (catcher, upstream):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{upstream.server_port}/v1"
        tiers = sim_tiers(base, max_retries=0)
        routing = {"router_path": None, "routed_tiers": ["short", "long"], "fallback": False}
        with accounting_gateway(base, redis_url, tmp_path, tiers=tiers, routing=routing) as g:
            r = httpx.post(g.base_url + "/chat/completions", headers={"authorization": f"Bearer {SECRETS['alice']}"},
                           json={"model": "long", "messages": MESSAGES}, timeout=30)
    finally:
        for server in (catcher, upstream):
            server.shutdown()
            server.server_close()
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error", r.text
    assert caught == []


def test_an_upstream_answer_past_the_size_bounds_is_a_502(redis_url: str, tmp_path: Any) -> None:
    """A gzip body that inflates past the answer bound (70 MB of zeros in ~70 KB), and a stream whose data line
    never ends: both were read whole (a security review's gateway reached 1 GB). Now: 502 upstream_error, and the
    stream's in-stream error, within bounded memory."""
    import gzip
    import http.server
    import json
    import threading

    from gateway.openai.sse import MAX_LINE_BYTES
    from gateway.upstream.pool import MAX_RESPONSE_BYTES
    from tests.fixtures.gateway import SECRETS, accounting_gateway
    from tests.fixtures.upstream import sim_tiers

    bomb = gzip.compress(b"0" * (MAX_RESPONSE_BYTES + 6 * 1024 * 1024), compresslevel=9)

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
            self.send_response(200)
            if body.get("stream"):
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                self.wfile.write(b"data: " + b"x" * (MAX_LINE_BYTES + 1024 * 1024))
                self.wfile.flush()
                return
            self.send_header("content-type", "application/json")
            self.send_header("content-encoding", "gzip")
            self.send_header("content-length", str(len(bomb)))
            self.end_headers()
            self.wfile.write(bomb)

        def log_message(self, *args: object) -> None:
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{upstream.server_port}/v1"
        routing = {"router_path": None, "routed_tiers": ["short", "long"], "fallback": False}
        with accounting_gateway(base, redis_url, tmp_path, tiers=sim_tiers(base, max_retries=0), routing=routing) as g:
            auth = {"authorization": f"Bearer {SECRETS['alice']}"}
            r = httpx.post(g.base_url + "/chat/completions", headers=auth, timeout=60,
                           json={"model": "long", "messages": MESSAGES})
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error", r.text[:300]
            s = httpx.post(g.base_url + "/chat/completions", headers=auth, timeout=60,
                           json={"model": "long", "messages": MESSAGES, "stream": True})
            assert s.status_code == 200 and '"upstream_stream_broken"' in s.text, s.text[:300]
    finally:
        upstream.shutdown()
        upstream.server_close()


def test_disconnect_during_a_fallback_bills_the_fallback_call(redis_url: str) -> None:
    """The routed tier's upstream refuses (503), the call falls back to a dearer tier whose upstream is slow, and
    the client hangs up while that call runs. The prompt the fallback upstream had is billed — on the fallback
    tier, at its prices (it was billed at the refusing tier's, and the record named the tier nothing ran on)."""
    from decimal import Decimal

    from gateway.ledger.pricing import cost_micro_usd

    failing = start_sim("--fail-mode", "503", "--model", "cheap-model")
    slow = start_sim("--delay-ms", "4000", "--model", "dear-model")
    try:
        common = {"connect_timeout_s": 1.0, "read_timeout_s": 10.0, "max_retries": 0}
        tiers = [
            {**common, "name": "cheap", "base_url": failing.base_url, "model": "cheap-model",
             "prices": {"input_usd_per_mtok": Decimal("0.10"), "output_usd_per_mtok": Decimal("0.40")}},
            {**common, "name": "dear", "base_url": slow.base_url, "model": "dear-model",
             "prices": {"input_usd_per_mtok": Decimal("3.00"), "output_usd_per_mtok": Decimal("12.00")}},
        ]
        settings = sim_settings(slow.base_url, redis_url, tiers=tiers, routing={
            "router_path": None, "routed_tiers": ["cheap", "dear"], "thresholds": [0.5], "default_tier": "dear",
            "fallback": True})
        with GatewayServer(settings) as gw:
            got: list[Any] = []
            gw.app.state.proxy.usage_sinks.append(got.append)
            t = tag()
            # the client gives up mid-call (once the fallback upstream has it) and closes the connection
            hang_up_once_upstream(gw, "/chat/completions", {"model": "cheap", "messages": MESSAGES, "sim": {"tag": t}},
                                  {"authorization": f"Bearer {TEST_KEY}"}, slow, t, after_s=1.0)
            rec = slow.wait_tag_status(t, {"cancelled", "completed"}, timeout_s=10)
            assert rec is not None and rec["status"] == "cancelled", rec  # the fallback call was the one in flight
            assert failing.tag(t) is not None and failing.tag(t)["status"] == "failed"  # the routed tier refused
            assert wait_for(lambda: len(got) == 1, timeout_s=10), got
            usage = got[0]
            assert (usage.status, usage.error_code, usage.partial) == (499, "client_disconnected", True)
            assert (usage.tier, usage.upstream_model, usage.route_reason) == ("dear", "dear-model", "fallback")
            assert usage.usage_source == "counted" and usage.prompt_tokens == 7 + 3  # the sim's words + template
            dear = gw.settings.tier("dear").prices
            assert usage.cost_micro_usd == cost_micro_usd(dear, prompt_tokens=10, cached_tokens=0,
                                                          completion_tokens=0) == 30
    finally:
        failing.stop()
        slow.stop()


def _post_chat(gw: GatewayServer, sim: dict[str, Any], path: str = "/chat/completions",
               model: str = "ok") -> httpx.Response:
    """One non-streamed request through ``gw`` with the simulator's per-request ``sim`` options."""
    body: dict[str, Any] = {"model": model, "messages": MESSAGES, "sim": sim}
    if path == "/messages":
        body["max_tokens"] = 32
    return httpx.post(gw.base_url + path, json=body, headers={"authorization": f"Bearer {TEST_KEY}"}, timeout=15)


def test_an_upstream_429_keeps_its_retry_after(client: openai.OpenAI, fault_gateway: GatewayServer) -> None:
    """The upstream's 429 says when to come back: the client's 429 says so too (it lost the header, and the SDK
    retried at once with its own backoff), in OpenAI's and in Anthropic's API."""
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="ok", messages=MESSAGES,
                                       extra_body={"sim": {"fail": "429", "retry_after": "7"}})
    assert (info.value.type, info.value.code) == ("rate_limit_error", "upstream_rejected")  # type: ignore[attr-defined]
    assert info.value.response.headers["retry-after"] == "7"
    r = _post_chat(fault_gateway, {"fail": "429", "retry_after": "7", "retry_after_ms": "6500"})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
    assert (r.headers["retry-after"], r.headers["retry-after-ms"]) == ("7", "6500")  # OpenAI's ms header too
    anthropic_429 = _post_chat(fault_gateway, {"fail": "429", "retry_after": "7"}, path="/messages")
    assert anthropic_429.status_code == 429 and anthropic_429.json()["type"] == "error", anthropic_429.text
    assert anthropic_429.headers["retry-after"] == "7"


def test_an_upstream_503_retry_after_reaches_the_502(fault_gateway: GatewayServer, fault_sim: SimProcess) -> None:
    """A 503 that asks for 7 s: not asked again within the call (the gateway used to retry it twice within a
    second, each meeting the same refusal); the client's 502 ``upstream_unavailable`` (which the SDK retries, after
    the wait) carries its Retry-After, and no ``x-should-retry: false``."""
    t = tag()
    started = time.monotonic()
    r = _post_chat(fault_gateway, {"fail": "503", "retry_after": "7", "tag": t})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable", r.text
    assert r.headers["retry-after"] == "7" and "x-should-retry" not in r.headers
    assert fault_sim.tag(t)["attempts"] == 1
    assert time.monotonic() - started < 5


def test_an_upstream_503_short_wait_is_waited_out_before_each_retry(fault_gateway: GatewayServer,
                                                                       fault_sim: SimProcess) -> None:
    """A 503 asking for 400 ms (``retry-after-ms``, OpenAI's header; preferred to the coarser ``Retry-After``)
    is within the backoff's range: retried, each time after at least that wait; a 503 without a wait is retried
    at the backoff alone (50–100 ms, then 100–200 ms)."""
    t = tag()
    started = time.monotonic()
    r = _post_chat(fault_gateway, {"fail": "503", "retry_after": "1", "retry_after_ms": "400", "tag": t})
    waited = time.monotonic() - started
    assert r.status_code == 502 and r.headers["retry-after-ms"] == "400", r.text
    assert fault_sim.tag(t)["attempts"] == 3  # 1 + max_retries, each refused
    assert waited >= 0.8, waited  # two waits of at least 400 ms
    t = tag()
    started = time.monotonic()
    r = _post_chat(fault_gateway, {"fail": "503", "tag": t})
    assert r.status_code == 502 and fault_sim.tag(t)["attempts"] == 3
    assert time.monotonic() - started < waited, "a wait was taken where none was asked"


@pytest.mark.parametrize(("sent", "passed"), [
    ("7.2", "8"),  # rounded up: waiting less than asked meets the same refusal
    ("99999999", "86400"),  # capped at a day
    ("-3", None), ("soon", None), ("nan", None),  # no header beats a wrong one
    ("Wed, 21 Oct 2015 07:28:00 GMT", "0"),  # an HTTP-date already past
    (None, None),  # none sent, none made up
])
def test_an_upstream_retry_after_is_sanitised(fault_gateway: GatewayServer, sent: str | None,
                                              passed: str | None) -> None:
    r = _post_chat(fault_gateway, {"fail": "429"} if sent is None else {"fail": "429", "retry_after": sent})
    assert r.status_code == 429, r.text
    assert r.headers.get("retry-after") == passed


def test_an_upstream_retry_after_http_date_becomes_seconds(fault_gateway: GatewayServer) -> None:
    from email.utils import formatdate

    r = _post_chat(fault_gateway, {"fail": "429", "retry_after": formatdate(time.time() + 30, usegmt=True)})
    assert r.status_code == 429 and 25 <= int(r.headers["retry-after"]) <= 31, r.headers


def test_the_retry_after_is_that_of_the_failure_the_client_sees(redis_url: str) -> None:
    """The routed tier's upstream answers 503 with Retry-After: 7 and the call falls back to a later tier: the
    client's error carries the fallback's own Retry-After — or none when the fallback sent none — never the 7 of
    an attempt it does not see."""
    first = start_sim("--fail-mode", "503", "--retry-after", "7")
    second = start_sim("--fail-mode", "503")
    try:
        common = {"model": "sim-model", "connect_timeout_s": 1.0, "read_timeout_s": 5.0, "max_retries": 0}
        tiers = [{**common, "name": "first", "base_url": first.base_url},
                 {**common, "name": "second", "base_url": second.base_url}]
        settings = sim_settings(first.base_url, redis_url, tiers=tiers, routing={
            "router_path": None, "routed_tiers": ["first", "second"], "thresholds": [0.5], "default_tier": "second",
            "effort_tiers": {"low": "first", "high": "second"}, "fallback": True})
        with GatewayServer(settings) as gw:
            t = tag()
            r = _post_chat(gw, {"tag": t}, model="first")
            assert r.status_code == 502 and "second" in r.json()["error"]["message"], r.text
            assert first.tag(t)["status"] == second.tag(t)["status"] == "failed"  # both tiers were asked
            assert "retry-after" not in r.headers
            second.set_mode(retry_after="3")
            r = _post_chat(gw, {}, model="first")
            assert r.status_code == 502 and r.headers["retry-after"] == "3", r.headers
            second.set_mode(fail_mode="429")
            r = _post_chat(gw, {}, model="first")
            assert r.status_code == 429 and r.headers["retry-after"] == "3", r.headers
    finally:
        first.stop()
        second.stop()
