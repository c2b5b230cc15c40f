"""The request's first call, peeked for escalation, whose stream fails inside its thought — through a real gateway
on loopback, real Redis and the upstream simulator.

A tier that lists ``escalate_on`` has its stream peeked before any byte reaches the client. A stream that fails
meanwhile — its connection dropped (``drop``), or an in-stream error event as vLLM and OpenAI send when generation
fails after the 200 headers (``error-event``: ``data: {"error": …}``) — has sent the client nothing: it is a 502, as
any upstream failure before the answer began (``upstream_stream_broken`` for the drop, ``upstream_error`` for the
upstream's own error, as the relay and a non-streamed call's 200 error document name it), whichever escalation
conditions the tier lists. The call is metered once, as the failed call it was: ``partial``, what it streamed
before failing (counted deltas) and its prompt billed; the next tier is not called; no reservation or write-ahead
record is left behind.

The in-stream error was read as an answer with no finish reason: with ``length_in_thought`` the gateway relayed the
stream (200, the thought, then the error event); with ``empty_answer`` it escalated it as an empty answer, the
failed call billed as an escalated 200.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from tests.fixtures.gateway import SECRETS, accounting_gateway, keys_config
from tests.fixtures.redis_db import read_usage_events
from tests.fixtures.upstream import GatewayServer, SimProcess, sim_tiers

QUESTION = "What is six times seven exactly?"
AUTH = {"authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store"}


@pytest.fixture(params=["length_in_thought", "empty_answer"])
def gw(request: pytest.FixtureRequest, upstream_sim: SimProcess, redis_url: str, tmp_path: Path,
       redis_prefix: str) -> Iterator[GatewayServer]:
    """``short`` (cut in its thought by ``max_tokens: 4``) escalates to ``long`` on the condition of the param;
    both on the shared simulator. alice has a daily budget (her calls reserve)."""
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"thinking_budget": 100, "max_tokens": 4, "escalate_on": [request.param]})
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                            auth=keys_config(alice={"budget_usd_day": "1"})) as g:
        yield g


@pytest.mark.parametrize("mode", ["drop", "error-event"])
def test_a_first_call_that_fails_in_the_peek_is_a_502(gw: GatewayServer, upstream_sim: SimProcess, redis_url: str,
                                                      redis_prefix: str, mode: str) -> None:
    tag = uuid.uuid4().hex
    body = {"model": "short", "messages": [{"role": "user", "content": QUESTION}], "stream": True,
            "stream_options": {"include_usage": True},
            "sim": {"fail": mode, "fail_times": 1, "tag": tag}}  # only the first call fails: long would answer
    with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, timeout=30, headers=AUTH) as r:
        text = r.read().decode()
    code = "upstream_stream_broken" if mode == "drop" else "upstream_error"
    # was, for the error event: 200 and the thought, then the error event (length_in_thought), or long's answer
    # (empty_answer)
    assert r.status_code == 502, text
    err = orjson.loads(text)["error"]
    assert err["code"] == code
    if mode == "error-event":
        assert "simulated engine error" in err["message"]  # what the upstream said, as the relay passes it on
    assert r.headers["x-request-id"]
    assert "x-thinkgate-escalation" not in r.headers

    [event] = read_usage_events(redis_url, redis_prefix, 1)  # long was never called
    assert event["request_id"] == r.headers["x-request-id"]
    assert (event["tier"], event["status"], event["error_code"], event["partial"]) == ("short", 502, code, True)
    # what short streamed before it failed (inside its thought) and its prompt are billed
    assert event["completion_tokens"] > 0 and event["prompt_tokens"] > 0 and event["cost_micro_usd"] > 0
    assert event["usage_source"] == "counted"
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.hgetall(redis_prefix + "lim:alice:resv") == {}
    finally:
        client.close()
    sent = upstream_sim.tag(tag)
    assert sent is not None and sent["attempts"] == 1, sent  # one upstream call: short's
