"""An escalation whose next tier cannot answer (connection refused, 503 after the pool's retries) through a real
gateway on loopback, real Redis and one upstream simulator process per tier: the client keeps the first tier's
answer — 200, as if not escalated, ``x-thinkgate-escalation: failed; tier=long; reason=…`` — the way an
escalation the budget refuses keeps it, instead of a 502 after the first answer was billed and thrown away. The
ledger has two events: the first answer billed once (status 200, no error code: the request's answer), the failed
escalation metered as a failed upstream call (502 ``upstream_unavailable``, nothing ran, cost 0); no reservation
and no write-ahead record is left behind."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from gateway.engine.redis_server import free_port
from tests.fixtures.gateway import SECRETS, accounting_gateway, keys_config
from tests.fixtures.redis_db import read_usage_events
from tests.fixtures.upstream import GatewayServer, SimProcess, sim_tiers, start_sim

QUESTION = "What is six times seven exactly?"


@pytest.fixture(scope="module")
def long_503() -> Iterator[SimProcess]:
    """The long tier's own simulator, answering every call 503."""
    sim = start_sim("--fail-mode", "503")
    try:
        yield sim
    finally:
        sim.stop()


@pytest.fixture(params=["refused", "503"])
def gw(request: pytest.FixtureRequest, upstream_sim: SimProcess, redis_url: str, tmp_path: Path,
       redis_prefix: str) -> Iterator[GatewayServer]:
    """``short`` (on the shared simulator) is cut in its thought, so it escalates to ``long``, which is down: a
    port nobody listens on, or a simulator that answers 503. alice has a daily budget (her calls reserve)."""
    down = (f"http://127.0.0.1:{free_port()}/v1" if request.param == "refused"
            else request.getfixturevalue("long_503").base_url)
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"thinking_budget": 100, "max_tokens": 4, "escalate_on": ["length_in_thought"]})
    tiers[2].update({"base_url": down, "max_retries": 1})
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                            auth=keys_config(alice={"budget_usd_day": "1"})) as g:
        yield g


def _check_ledger(gw: GatewayServer, redis_url: str, prefix: str, request_id: str) -> None:
    """Two events: the first answer (its id the client's ``x-request-id``) billed once as the request's answer,
    the escalation metered as the failed call it was; nothing reserved or open after."""
    # read once every call is settled: a third event (the first answer metered twice, or as escalated too) shows
    events = read_usage_events(redis_url, prefix, 2)
    client = redis.Redis.from_url(redis_url)
    try:
        assert len(events) == 2, events
        first = next(e for e in events if e["tier"] == "short")
        failed = next(e for e in events if e["tier"] == "long")
        assert first["request_id"] == request_id
        assert (first["status"], first["error_code"]) == (200, None)
        assert first["completion_tokens"] == 4 and first["prompt_tokens"] > 0 and first["cost_micro_usd"] > 0
        assert (failed["status"], failed["error_code"], failed["route_reason"]) == (502, "upstream_unavailable",
                                                                                     "escalated")
        assert failed["cost_micro_usd"] == 0 and failed["completion_tokens"] == 0
        assert client.hgetall(prefix + "lim:alice:resv") == {}
    finally:
        client.close()


def _headers_say_it_failed(r: httpx.Response, text: str) -> None:
    assert r.status_code == 200, text
    assert r.headers["x-thinkgate-tier"] == "short"
    assert r.headers["x-thinkgate-route-reason"] != "escalated"
    assert r.headers["x-thinkgate-escalation"] == "failed; tier=long; reason=upstream_unavailable"


def test_a_non_streamed_escalation_that_cannot_be_served_keeps_the_first_answer(
        gw: GatewayServer, redis_url: str, redis_prefix: str) -> None:
    r = httpx.post(gw.base_url + "/chat/completions", timeout=30,
                   headers={"authorization": f"Bearer {SECRETS['alice']}"},
                   json={"model": "short", "messages": [{"role": "user", "content": QUESTION}]})
    _headers_say_it_failed(r, r.text)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["reasoning"]  # the cut first answer
    assert r.json()["usage"]["completion_tokens"] == 4
    _check_ledger(gw, redis_url, redis_prefix, r.headers["x-request-id"])


def test_a_streamed_escalation_that_cannot_be_served_streams_the_first_answer(
        gw: GatewayServer, redis_url: str, redis_prefix: str) -> None:
    body = {"model": "short", "messages": [{"role": "user", "content": QUESTION}], "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {SECRETS['alice']}"}) as r:
        text = r.read().decode()
    _headers_say_it_failed(r, text)
    lines = [line for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert not any("error" in c for c in chunks)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning") or "" for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert reasoning and finish == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    _check_ledger(gw, redis_url, redis_prefix, r.headers["x-request-id"])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_messages_keep_the_first_answer_too(gw: GatewayServer, redis_url: str, redis_prefix: str,
                                            stream: bool) -> None:
    """``/v1/messages`` is served by the same proxy: the same answer, translated, with the same headers."""
    body = {"model": "short", "max_tokens": 32, "messages": [{"role": "user", "content": QUESTION}],
            "stream": stream}
    with httpx.stream("POST", gw.base_url + "/messages", json=body, timeout=30,
                      headers={"x-api-key": SECRETS["alice"]}) as r:
        text = r.read().decode()
    _headers_say_it_failed(r, text)
    if stream:
        assert "event: message_stop" in text and "event: error" not in text
        assert '"stop_reason":"max_tokens"' in text.replace(" ", "")
    else:
        assert json.loads(text)["stop_reason"] == "max_tokens"
    _check_ledger(gw, redis_url, redis_prefix, r.headers["x-request-id"])
