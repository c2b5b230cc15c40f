"""Upstream faults and client disconnects on ``/v1/responses`` and ``/v1/messages``: each API's own error
shape (JSON before the 200, an in-stream event after it), and exactly one usage event per request with the
status the client got — a failed upstream or a vanished client never loses the record."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, accounting_gateway, cleanup
from tests.fixtures.metered import events_of
from tests.fixtures.upstream import GatewayServer, SimProcess, wait_for


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("faultgw"), prefix,
                                routing={"router_path": None, "fallback": False}) as g:
            yield g
    finally:
        cleanup(redis_url, prefix)


def one_event(gw: GatewayServer, request_id: str) -> dict[str, Any]:
    rows = events_of(gw, request_id)
    assert len(rows) == 1, rows
    return rows[0]


def failures(gw: GatewayServer, endpoint: str) -> int:
    """Usage events of ``endpoint`` with status 502 so far (error answers carry no request id to look up)."""
    r = httpx.get(gw.base_url + "/usage", params={"since": "0", "limit": "10000"},
                  headers={"authorization": f"Bearer {ADMIN_SECRET}"}, timeout=10)
    return sum(1 for row in r.json()["data"] if row["endpoint"] == endpoint and row["status"] == 502)


def test_upstream_500_before_the_answer(gw: GatewayServer) -> None:
    fail = {"sim": {"fail": "500"}}
    before = failures(gw, "responses"), failures(gw, "messages")
    r = httpx.post(gw.base_url + "/responses", json={"model": "long", "input": "hi", **fail},
                   headers={"authorization": f"Bearer {SECRETS['alice']}"}, timeout=10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
    r = httpx.post(gw.base_url + "/messages",
                   json={"model": "long", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **fail},
                   headers={"x-api-key": SECRETS["alice"]}, timeout=10)
    assert r.status_code == 502
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    with pytest.raises(anthropic.InternalServerError):
        anthropic.Anthropic(base_url=gw.url, api_key=SECRETS["alice"], max_retries=0).messages.create(
            model="long", max_tokens=16, messages=[{"role": "user", "content": "hi"}], extra_body=fail)
    assert wait_for(lambda: (failures(gw, "responses"), failures(gw, "messages")) == (before[0] + 1, before[1] + 2))
    time.sleep(0.2)  # a duplicate would show up now
    assert (failures(gw, "responses"), failures(gw, "messages")) == (before[0] + 1, before[1] + 2)


def test_in_stream_upstream_error_becomes_each_apis_failure_event(gw: GatewayServer) -> None:
    fail = {"sim": {"fail": "error-event"}}
    client = openai.OpenAI(base_url=gw.base_url, api_key=SECRETS["alice"], max_retries=0, timeout=30)
    with client.responses.with_streaming_response.create(model="long", input="tell me a story", stream=True,
                                                         extra_body=fail) as raw:
        request_id = raw.headers["x-request-id"]
        events = list(raw.parse())
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed" and events[-1].response.error is not None  # type: ignore[union-attr]
    assert "response.completed" not in {e.type for e in events}
    ev = one_event(gw, request_id)
    assert (ev["endpoint"], ev["status"], ev["partial"]) == ("responses", 502, True)

    ant = anthropic.Anthropic(base_url=gw.url, api_key=SECRETS["alice"], max_retries=0, timeout=30)
    with ant.messages.with_streaming_response.create(model="long", max_tokens=64, stream=True, extra_body=fail,
                                                     messages=[{"role": "user", "content": "tell me a story"}]) as raw:
        request_id = raw.headers["x-request-id"]
        with pytest.raises(anthropic.APIStatusError):
            list(raw.parse())
    ev = one_event(gw, request_id)
    assert (ev["endpoint"], ev["status"], ev["partial"]) == ("messages", 502, True)


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_client_disconnect_mid_stream_is_metered_once_as_499(gw: GatewayServer, upstream_sim: SimProcess,
                                                             api: str) -> None:
    tag = uuid.uuid4().hex
    slow = {"sim": {"tag": tag, "chunk_delay_ms": 200}}
    if api == "responses":
        url, body = "/responses", {"model": "long", "input": "a long answer please", "stream": True, **slow}
        headers = {"authorization": f"Bearer {SECRETS['alice']}"}
    else:
        url = "/messages"
        body = {"model": "long", "max_tokens": 64, "stream": True, **slow,
                "messages": [{"role": "user", "content": "a long answer please"}]}
        headers = {"x-api-key": SECRETS["alice"]}
    with httpx.Client(timeout=30) as c, c.stream("POST", gw.base_url + url, json=body, headers=headers) as r:
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # the first event arrived: go away
    rec = upstream_sim.wait_tag_status(tag, {"cancelled", "completed"})
    assert rec is not None and rec["status"] == "cancelled"  # the upstream generation was stopped
    ev = one_event(gw, request_id)
    assert (ev["endpoint"], ev["status"], ev["partial"]) == (api, 499, True)


def test_budget_refusals_in_each_apis_shape(upstream_sim: SimProcess, redis_url: str,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """A key whose whole budget cannot cover the request: 429 without ``Retry-After`` (no wait would admit it) and
    a message saying what would, in the API's own field (``max_output_tokens``, ``max_tokens``: it named chat's
    ``max_tokens (or max_completion_tokens) or n`` on both), OpenAI-shaped on /v1/responses
    (``openai.RateLimitError``), Anthropic-shaped on /v1/messages (``anthropic.RateLimitError``)."""
    from tests.fixtures.gateway import keys_config

    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("budgetgw"), prefix,
                                auth=keys_config(bob={"budget_usd_day": "0.000001"})) as bgw:
            with pytest.raises(openai.RateLimitError) as oerr:
                openai.OpenAI(base_url=bgw.base_url, api_key=SECRETS["bob"], max_retries=0).responses.create(
                    model="long", input="hello there")
            assert oerr.value.code == "budget_exceeded" and "retry-after" not in oerr.value.response.headers
            assert "more than the whole daily budget" in oerr.value.message
            # what lowers it, in this API's field: a Responses client has no max_tokens, max_completion_tokens or n
            assert "lower max_output_tokens, or raise the budget" in oerr.value.message, oerr.value.message
            assert "max_completion_tokens" not in oerr.value.message
            with pytest.raises(anthropic.RateLimitError) as aerr:
                anthropic.Anthropic(base_url=bgw.url, api_key=SECRETS["bob"], max_retries=0).messages.create(
                    model="long", max_tokens=64, messages=[{"role": "user", "content": "hello there"}])
            assert aerr.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
            assert "retry-after" not in aerr.value.response.headers
            assert "more than the whole daily budget" in aerr.value.body["error"]["message"]  # type: ignore[index]
            # Anthropic's cap is max_tokens alone (no max_completion_tokens, no n)
            assert "lower max_tokens, or raise the budget" in aerr.value.body["error"]["message"]  # type: ignore[index]
    finally:
        cleanup(redis_url, prefix)


#: each API's last event: what the client has once it is written
LAST_EVENT = {"chat": b"data: [DONE]", "responses": b"event: response.completed", "messages": b"event: message_stop"}


async def _leave_after_the_last_event(gw: GatewayServer, api: str) -> str:
    """Serve one stream of ``api`` through the gateway's ASGI app, on its own event loop, as uvicorn would — except
    that the client goes away the moment the last event is written, while that write is still being awaited (a
    socket send that yields, as uvicorn's flow control does): the relay has not resumed yet. Returns the request
    id."""
    path, body, headers = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a complete answer"}]},
                 [(b"authorization", f"Bearer {SECRETS['alice']}".encode())]),
        "responses": ("/v1/responses", {"input": "a complete answer"},
                      [(b"authorization", f"Bearer {SECRETS['alice']}".encode())]),
        "messages": ("/v1/messages", {"max_tokens": 64, "messages": [{"role": "user", "content": "a complete answer"}]},
                     [(b"x-api-key", SECRETS["alice"].encode())]),
    }[api]
    raw = json.dumps({"model": "long", "stream": True, "sim": {"tag": uuid.uuid4().hex}, **body}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), *headers],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", gw.port)}
    gone = asyncio.Event()
    sent_body = False
    request_id = ""
    got = b""

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal request_id, got
        if message["type"] == "http.response.start":
            assert message["status"] == 200
            request_id = dict(message["headers"])[b"x-request-id"].decode()
            return
        got += message.get("body", b"")
        if LAST_EVENT[api] in got and not gone.is_set():
            gone.set()  # the whole answer written: the client leaves while the write is still awaited
            await asyncio.sleep(0.2)

    await gw.app(scope, receive, send)
    assert LAST_EVENT[api] in got and request_id
    return request_id


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_client_that_leaves_after_the_last_event_got_a_complete_answer(gw: GatewayServer, api: str) -> None:
    """A client that goes away once the stream's last event (``[DONE]``, ``response.completed``,
    ``message_stop``) is written had the whole answer: metered 200, not partial — it was a 499
    ``client_disconnected`` (the status was set only when the relay resumed, which a disconnect prevents)."""
    loop = gw.server.servers[0].get_loop()
    request_id = asyncio.run_coroutine_threadsafe(_leave_after_the_last_event(gw, api), loop).result(timeout=30)
    ev = one_event(gw, request_id)
    assert (ev["status"], ev["partial"], ev["error_code"]) == (200, False, None), ev
    assert ev["completion_tokens"] > 0
