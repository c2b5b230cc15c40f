"""An upstream stream that ends cleanly — the response completes, no transport error — before its first content and
without ``data: [DONE]``, read while the gateway holds it back to decide an escalation: through a real gateway on
loopback, real Redis and the upstream simulator (``"sim": {"fail": "close"}``), for chat completions and messages.

Every complete OpenAI/vLLM stream ends with ``[DONE]``: one that closes without it is cut short, a failed call like a
stream that broke, and nothing of it has reached the client yet. So it is handled as the break is (``upstream_
stream_broken``, the call metered as the failed call it was: partial, its prompt billed):

- the request's first call, peeked for escalation: a 502 (``test_escalation_peek_error.py``'s drop);
- an escalation's call to the top tier, read up to its first content before it is relayed: the client keeps the
  first answer, ``x-thinkgate-escalation: failed; tier=long; reason=upstream_stream_broken``
  (``test_escalation_top_start.py``'s drop);
- a middle tier of a three-tier cascade, peeked in turn: the same, ``tier=mid``; ``long`` is never called
  (``test_escalation_three_tiers.py``'s drop).

It was: taken as an answer with no finish reason (not cut, not escalated) and relayed — a 200 from the failed tier,
then the relay found no ``[DONE]`` and sent an in-stream error after the 200 had gone.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from tests.fixtures.gateway import SECRETS, accounting_gateway, keys_config
from tests.fixtures.redis_db import read_usage_events
from tests.fixtures.upstream import GatewayServer, SimProcess, sim_tiers

QUESTION = "What is six times seven exactly?"
CUT = {"thinking_budget": 100, "max_tokens": 4, "escalate_on": ["length_in_thought"]}
REASON = "upstream_stream_broken"


@pytest.fixture
def two(upstream_sim: SimProcess, redis_url: str, tmp_path: Path, redis_prefix: str) -> Iterator[GatewayServer]:
    """``short`` (cut in its thought by ``max_tokens: 4``) escalates to ``long`` on ``length_in_thought``; both on
    the shared simulator. alice has a daily budget (her calls reserve)."""
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update(CUT)
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                            auth=keys_config(alice={"budget_usd_day": "1"})) as g:
        yield g


@pytest.fixture
def three(upstream_sim: SimProcess, redis_url: str, tmp_path: Path, redis_prefix: str) -> Iterator[GatewayServer]:
    """``short`` → ``mid`` → ``long``, all on the shared simulator: ``short`` and ``mid`` both cut in their thought
    (``mid``'s stream is peeked for escalation in turn), ``long`` answers."""
    _, short, long = sim_tiers(upstream_sim.base_url)
    short.update(CUT)
    mid = {**long, "name": "mid", "max_retries": 1, **CUT}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            tiers=[short, mid, long], auth=keys_config(alice={"budget_usd_day": "1"})) as g:
        yield g


def _send(gw: GatewayServer, api: str, sim: dict[str, Any]) -> tuple[httpx.Response, str]:
    """A streamed request to ``short`` (chat completions with its usage chunk, or messages) carrying ``sim``."""
    messages = [{"role": "user", "content": QUESTION}]
    if api == "chat":
        path, headers = "/chat/completions", {"authorization": f"Bearer {SECRETS['alice']}"}
        body: dict[str, Any] = {"model": "short", "messages": messages, "stream": True,
                                "stream_options": {"include_usage": True}}
    else:
        path, headers = "/messages", {"x-api-key": SECRETS["alice"]}
        body = {"model": "short", "max_tokens": 32, "messages": messages, "stream": True}
    body["sim"] = sim
    with httpx.stream("POST", gw.base_url + path, json=body, timeout=30,
                      headers={**headers, "cache-control": "no-store"}) as r:
        return r, r.read().decode()


def _served_first_answer(r: httpx.Response, text: str, api: str, tier: str) -> None:
    """The client got ``short``'s cut answer, complete, and the note that ``tier`` failed."""
    assert r.status_code == 200, text
    assert r.headers["x-thinkgate-tier"] == "short"
    assert r.headers["x-thinkgate-route-reason"] != "escalated"
    assert r.headers["x-thinkgate-escalation"] == f"failed; tier={tier}; reason={REASON}"
    if api == "chat":
        lines = [line for line in text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", text
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert not any("error" in c for c in chunks), text
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finish == ["length"] and chunks[-1]["usage"]["completion_tokens"] == 4  # short's cut answer
    else:
        assert "event: message_stop" in text and "event: error" not in text, text
        assert '"stop_reason":"max_tokens"' in text.replace(" ", "")


def _settled(redis_url: str, prefix: str, n: int) -> list[dict[str, Any]]:
    """The ``n`` usage events once settled; alice holds no reservation."""
    events = read_usage_events(redis_url, prefix, n)
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.hgetall(prefix + "lim:alice:resv") == {}
    finally:
        client.close()
    return events


def _failed_call(event: dict[str, Any], generated: bool = False) -> None:
    """Metered as the break is: 502 ``upstream_stream_broken``, partial, its prompt and what it streamed (nothing,
    unless ``generated``) billed."""
    assert (event["status"], event["error_code"], event["partial"]) == (502, REASON, True), event
    assert (event["completion_tokens"] > 0) is generated, event
    assert event["prompt_tokens"] > 0 and event["cost_micro_usd"] > 0


@pytest.mark.parametrize("at", [0, 1], ids=["at-headers", "after-role-chunk"])
@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_first_call_that_closes_without_done_in_the_peek_is_a_502(
        two: GatewayServer, upstream_sim: SimProcess, redis_url: str, redis_prefix: str, api: str, at: int) -> None:
    tag = uuid.uuid4().hex
    r, text = _send(two, api, {"fail": "close", "fail_at": at, "fail_times": 1, "tag": tag})  # long would answer
    # was: 200 from short (nothing to escalate: no finish reason), then an in-stream error
    assert r.status_code == 502, text
    err = orjson.loads(text)["error"]
    assert "ended without [DONE]" in err["message"], err
    if api == "chat":
        assert err["code"] == REASON
    assert "x-thinkgate-escalation" not in r.headers

    [event] = _settled(redis_url, redis_prefix, 1)  # long was never called
    assert (event["tier"], event["request_id"]) == ("short", r.headers["x-request-id"])
    _failed_call(event)
    sent = upstream_sim.tag(tag)
    assert sent is not None and sent["attempts"] == 1, sent  # one upstream call: short's


@pytest.mark.parametrize("at", [0, 1], ids=["at-headers", "after-role-chunk"])
@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_top_tier_stream_that_closes_without_done_at_its_start_leaves_the_first_answer(
        two: GatewayServer, upstream_sim: SimProcess, redis_url: str, redis_prefix: str, api: str, at: int) -> None:
    tag = uuid.uuid4().hex
    r, text = _send(two, api, {"fail": "close", "fail_at": at, "fail_from": 1, "tag": tag})  # long's call closes
    # was: 200 from long, nothing of its answer, then an in-stream error (short billed as escalated, thrown away)
    _served_first_answer(r, text, api, "long")

    events = _settled(redis_url, redis_prefix, 2)
    assert sorted(e["tier"] for e in events) == ["long", "short"], events
    first = next(e for e in events if e["tier"] == "short")
    failed = next(e for e in events if e["tier"] == "long")
    assert first["request_id"] == r.headers["x-request-id"]
    assert (first["status"], first["error_code"], first["partial"]) == (200, None, False)
    assert first["completion_tokens"] == 4 and first["cost_micro_usd"] > 0
    assert failed["route_reason"] == "escalated"
    _failed_call(failed)
    sent = upstream_sim.tag(tag)
    assert sent is not None and sent["attempts"] == 2, sent  # short's call and long's, each once


@pytest.mark.parametrize("at", [0, 1, None], ids=["at-headers", "after-role-chunk", "inside-thought"])
@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_middle_tier_stream_that_closes_without_done_in_the_peek_leaves_the_first_answer(
        three: GatewayServer, upstream_sim: SimProcess, redis_url: str, redis_prefix: str, api: str,
        at: int | None) -> None:
    tag = uuid.uuid4().hex
    sim: dict[str, Any] = {"fail": "close", "fail_from": 1, "tag": tag}  # mid's call closes
    if at is not None:
        sim["fail_at"] = at
    r, text = _send(three, api, sim)  # (None: after half its chunks, inside its thought — held back all the same)
    # was: 200 from mid (no finish reason: not escalated), nothing of its answer, then an in-stream error
    _served_first_answer(r, text, api, "mid")

    events = _settled(redis_url, redis_prefix, 2)
    assert sorted(e["tier"] for e in events) == ["mid", "short"], events  # long was never called
    first = next(e for e in events if e["tier"] == "short")
    failed = next(e for e in events if e["tier"] == "mid")
    assert first["request_id"] == r.headers["x-request-id"]
    assert (first["status"], first["error_code"], first["partial"]) == (200, None, False)
    assert failed["route_reason"] == "escalated"
    _failed_call(failed, generated=at is None)
    sent = upstream_sim.tag(tag)
    assert sent is not None and sent["attempts"] == 2, sent  # short's call and mid's; not long's


def test_a_top_tier_stream_that_closes_without_done_after_its_first_content_is_relayed(
        two: GatewayServer, redis_url: str, redis_prefix: str) -> None:
    """Unchanged: half of long's chunks (its thought under way, 20 ms apart so its first content is relayed before
    the end comes) reach the client, then the stream ends without ``[DONE]`` — relayed, then the in-stream error;
    short metered as escalated, long as the broken call."""
    r, text = _send(two, "chat", {"fail": "close", "fail_from": 1, "chunk_delay_ms": 20, "tag": uuid.uuid4().hex})
    assert r.status_code == 200, text
    assert (r.headers["x-thinkgate-tier"], r.headers["x-thinkgate-route-reason"]) == ("long", "escalated")
    assert "x-thinkgate-escalation" not in r.headers
    chunks = [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")]
    assert any(c.get("choices") and c["choices"][0]["delta"].get("reasoning") for c in chunks), text
    assert chunks[-1]["error"]["code"] == REASON, text

    events = _settled(redis_url, redis_prefix, 2)
    by_tier = {e["tier"]: e for e in events}
    assert (by_tier["short"]["status"], by_tier["short"]["error_code"]) == (200, "escalated_length_in_thought")
    _failed_call(by_tier["long"], generated=True)
