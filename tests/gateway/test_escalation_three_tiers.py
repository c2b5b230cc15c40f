"""A three-tier cascade (``short`` → ``mid`` → ``long``) through a real gateway on loopback, real Redis and one
upstream simulator process per broken tier.

``short`` is cut in its thought and escalates to ``mid``, which lists ``escalate_on`` itself: its stream is peeked
before any byte reaches the client. When ``mid``'s stream breaks (its connection dropped), stalls, or ends in an
in-stream error event (``data: {"error": …}``, as vLLM and OpenAI send when generation fails after the 200 headers)
during that peek, nothing was sent: the client keeps ``short``'s answer, as the two-tier case does when the next tier
cannot answer — 200, ``x-thinkgate-escalation: failed; tier=mid; reason=…`` — instead of the 502 it got (the first
answer billed as escalated and thrown away; for the error event, mid's thought and the error relayed after a 200).
The ledger has two events: ``short`` billed once as the request's answer, ``mid`` metered as the failed call it was
(what it streamed before failing, partial); ``long`` is never called.

A cascade that goes all the way up leaves one ``escalation`` outcome per escalated step, each naming the tier it
asked (``other_tier``); the second step's says which route reason the request's first attempt had
(``escalated_from``), as the escalated answer's usage record does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.fixtures.gateway import SECRETS, accounting_gateway, keys_config
from tests.fixtures.redis_db import read_outcomes, read_usage_events
from tests.fixtures.upstream import GatewayServer, SimProcess, sim_tiers, start_sim, wait_for

QUESTION = "What is six times seven exactly?"
AUTH = {"authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store"}
CUT = {"thinking_budget": 100, "max_tokens": 4, "escalate_on": ["length_in_thought"]}


def _three_tiers(base_url: str, mid_url: str, **mid: Any) -> list[dict[str, Any]]:
    """``short`` (cut in its thought: escalates), ``mid`` on ``mid_url`` (escalates the same way, so its stream is
    peeked), ``long`` — the simulator's tiers with ``mid`` between the last two."""
    _, short, long = sim_tiers(base_url)
    short.update(CUT)
    middle = {**long, "name": "mid", "base_url": mid_url, "escalate_on": ["length_in_thought"], "max_retries": 1,
              **mid}
    return [short, middle, long]


#: mid's failure mode → the error code its failed call is metered with (and the escalation header names)
REASONS = {"drop": "upstream_stream_broken", "stall": "upstream_timeout", "error-event": "upstream_error"}


@pytest.fixture(scope="module", params=["drop", "stall", "error-event"])
def mid_sim(request: pytest.FixtureRequest) -> Iterator[tuple[SimProcess, str]]:
    """``mid``'s own simulator: every stream sends half its chunks (inside the thought), then drops the connection,
    hangs, or sends an error event and ends (the in-stream error was read as an answer with no finish reason: not
    cut by length, so mid's stream was relayed — 200, mid's thought, then the error event)."""
    sim = start_sim("--fail-mode", request.param, "--hang-s", "5")
    try:
        yield sim, request.param
    finally:
        sim.stop()


@pytest.fixture
def broken(mid_sim: tuple[SimProcess, str], upstream_sim: SimProcess, redis_url: str, tmp_path: Path,
           redis_prefix: str) -> Iterator[tuple[GatewayServer, str]]:
    sim, mode = mid_sim
    tiers = _three_tiers(upstream_sim.base_url, sim.base_url, read_timeout_s=1.0)
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                            auth=keys_config(alice={"budget_usd_day": "1"})) as g:
        yield g, mode


def _stream(gw: GatewayServer, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[httpx.Response,
                                                                                                    str]:
    with httpx.stream("POST", gw.base_url + path, json=body, timeout=30, headers=headers) as r:
        return r, r.read().decode()


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_middle_tier_whose_stream_breaks_in_the_peek_leaves_the_first_answer(
        broken: tuple[GatewayServer, str], redis_url: str, redis_prefix: str, api: str) -> None:
    gw, mode = broken
    messages = [{"role": "user", "content": QUESTION}]
    if api == "chat":
        r, text = _stream(gw, "/chat/completions", {"model": "short", "messages": messages, "stream": True,
                                                    "stream_options": {"include_usage": True}}, AUTH)
    else:
        r, text = _stream(gw, "/messages", {"model": "short", "max_tokens": 32, "messages": messages,
                                            "stream": True}, {"x-api-key": SECRETS["alice"]})
    reason = REASONS[mode]
    assert r.status_code == 200, text  # was: 502 (504 for the stall) with nothing sent; the error event relayed
    assert r.headers["x-thinkgate-tier"] == "short"
    assert r.headers["x-thinkgate-route-reason"] != "escalated"
    assert r.headers["x-thinkgate-escalation"] == f"failed; tier=mid; reason={reason}"
    if api == "chat":
        lines = [line for line in text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert not any("error" in c for c in chunks)
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finish == ["length"] and chunks[-1]["usage"]["completion_tokens"] == 4  # short's cut answer
    else:
        assert "event: message_stop" in text and "event: error" not in text
        assert '"stop_reason":"max_tokens"' in text.replace(" ", "")

    events = read_usage_events(redis_url, redis_prefix, 2)
    assert sorted(e["tier"] for e in events) == ["mid", "short"], events  # long was never called
    first = next(e for e in events if e["tier"] == "short")
    failed = next(e for e in events if e["tier"] == "mid")
    assert first["request_id"] == r.headers["x-request-id"]
    assert (first["status"], first["error_code"], first["partial"]) == (200, None, False)
    assert first["completion_tokens"] == 4 and first["cost_micro_usd"] > 0
    assert (failed["status"], failed["error_code"], failed["route_reason"], failed["partial"]) == (
        504 if mode == "stall" else 502, reason, "escalated", True)
    # what mid streamed before it broke (half its chunks, inside its thought) and its prompt are billed
    assert failed["completion_tokens"] > 0 and failed["prompt_tokens"] > 0 and failed["cost_micro_usd"] > 0
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.hgetall(redis_prefix + "lim:alice:resv") == {}
    finally:
        client.close()

    # the served answer was judged too weak by short's escalate_on: an escalation outcome naming the tier it asked
    rid = r.headers["x-request-id"]
    assert wait_for(lambda: any(o.request_id == rid for o in read_outcomes(redis_url, redis_prefix)), timeout_s=5)
    [o] = [o for o in read_outcomes(redis_url, redis_prefix) if o.request_id == rid]
    assert (o.source, o.tier, o.judge, o.other_tier) == ("escalation", "short", "escalation:length_in_thought", "mid")


@pytest.fixture
def cascade(upstream_sim: SimProcess, redis_url: str, tmp_path: Path, redis_prefix: str) -> Iterator[GatewayServer]:
    """All three tiers on the shared simulator: ``short`` and ``mid`` both cut in their thought, ``long`` answers."""
    tiers = _three_tiers(upstream_sim.base_url, upstream_sim.base_url, **CUT)
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                            auth=keys_config()) as g:
        yield g


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_each_escalated_step_is_an_outcome_naming_the_tier_it_asked(
        cascade: GatewayServer, redis_url: str, redis_prefix: str, stream: bool) -> None:
    r, text = _stream(cascade, "/chat/completions",
                      {"model": "short", "messages": [{"role": "user", "content": QUESTION}], "stream": stream}, AUTH)
    assert r.status_code == 200, text
    assert (r.headers["x-thinkgate-tier"], r.headers["x-thinkgate-route-reason"]) == ("long", "escalated")
    events = read_usage_events(redis_url, redis_prefix, 3)
    assert sorted((e["tier"], e["error_code"]) for e in events) == [
        ("long", None), ("mid", "escalated_length_in_thought"), ("short", "escalated_length_in_thought")]

    def escalations() -> list[Any]:
        return [o for o in read_outcomes(redis_url, redis_prefix) if o.source == "escalation"]
    assert wait_for(lambda: len(escalations()) == 2, timeout_s=5), escalations()
    by_tier = {o.tier: o for o in escalations()}
    short, mid = by_tier["short"], by_tier["mid"]
    # was: other_tier None on both, escalated_from None on mid's
    assert (short.route_reason, short.escalated_from, short.other_tier) == ("forced", None, "mid")
    assert (mid.route_reason, mid.escalated_from, mid.other_tier) == ("escalated", "forced", "long")
