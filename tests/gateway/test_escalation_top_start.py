"""A two-tier cascade (``short`` → ``long``) whose escalation's call — ``long``, the top tier, which lists no
``escalate_on`` and so is not peeked for escalation — fails at the very start of its stream, through a real gateway
on loopback, real Redis and the upstream simulator.

``short`` is cut in its thought and escalates to ``long``. When ``long``'s stream breaks (its connection dropped),
stalls, or sends an in-stream error event (``data: {"error": …}``) before its first chunk that carries content —
right after its 200 headers, or after vLLM's role-only first chunk — nothing of it has reached the client: the
gateway reads the escalation's stream up to its first content chunk before it commits, so the client keeps
``short``'s answer, as for every other escalation that fails before it answers — 200, ``x-thinkgate-escalation:
failed; tier=long; reason=…``. The ledger has two events: ``short`` billed once as the request's answer (not as
escalated), ``long`` metered as the failed call it was (its prompt, nothing generated, partial); no reservation or
write-ahead record is left.

It was: ``short`` billed as escalated and thrown away, then a 200 from ``long`` with nothing but the in-stream error.

Once ``long``'s first content chunk is on its way to the client, a failure is what it was: relayed, then the
in-stream error (the last test).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.fixtures.gateway import SECRETS, accounting_gateway, keys_config
from tests.fixtures.redis_db import read_usage_events
from tests.fixtures.upstream import GatewayServer, SimProcess, sim_tiers

QUESTION = "What is six times seven exactly?"
AUTH = {"authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store"}
#: long's failure mode → the error code its failed call is metered with (and the escalation header names)
REASONS = {"drop": "upstream_stream_broken", "stall": "upstream_timeout", "error-event": "upstream_error"}


@pytest.fixture
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path: Path, redis_prefix: str) -> Iterator[GatewayServer]:
    """``short`` (cut in its thought by ``max_tokens: 4``) escalates to ``long`` on ``length_in_thought``; both on
    the shared simulator; ``long`` gives up on a silent stream after 1 s. alice has a daily budget (her calls
    reserve)."""
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"thinking_budget": 100, "max_tokens": 4, "escalate_on": ["length_in_thought"]})
    tiers[2].update({"read_timeout_s": 1.0, "max_retries": 1})
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                            auth=keys_config(alice={"budget_usd_day": "1"})) as g:
        yield g


def _events(redis_url: str, prefix: str, n: int) -> list[dict[str, Any]]:
    """The usage events once every call is settled (a third event, an attempt metered twice, would show up); alice
    holds no reservation."""
    events = read_usage_events(redis_url, prefix, n)
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.hgetall(prefix + "lim:alice:resv") == {}
    finally:
        client.close()
    return events


def _chat(gw: GatewayServer, mode: str, at: int | None) -> tuple[httpx.Response, str, str]:
    """A streamed chat request whose second upstream call (long's) fails with ``mode`` after ``at`` chunks (None:
    half of them); short's call, the first, answers."""
    tag = uuid.uuid4().hex
    sim: dict[str, Any] = {"fail": mode, "fail_from": 1, "tag": tag}
    if at is not None:
        sim["fail_at"] = at
    else:  # chunks 20 ms apart: long's first content is read (and relayed) before the failure comes — all at once,
        # content and failure are one read, nothing has reached the client, and the held answer is served instead
        sim["chunk_delay_ms"] = 20
    body = {"model": "short", "messages": [{"role": "user", "content": QUESTION}], "stream": True,
            "stream_options": {"include_usage": True}, "sim": sim}
    with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, timeout=30, headers=AUTH) as r:
        return r, r.read().decode(), tag


def _chunks(text: str) -> list[dict[str, Any]]:
    lines = [line for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]


@pytest.mark.parametrize("at", [0, 1], ids=["at-headers", "after-role-chunk"])
@pytest.mark.parametrize("mode", ["drop", "stall", "error-event"])
def test_a_top_tier_stream_that_fails_at_its_start_leaves_the_first_answer(
        gw: GatewayServer, upstream_sim: SimProcess, redis_url: str, redis_prefix: str, mode: str, at: int) -> None:
    r, text, tag = _chat(gw, mode, at)
    reason = REASONS[mode]
    # was: 200 from long with nothing but the in-stream error (short billed as escalated and thrown away)
    assert r.status_code == 200, text
    assert r.headers["x-thinkgate-tier"] == "short"
    assert r.headers["x-thinkgate-route-reason"] != "escalated"
    assert r.headers["x-thinkgate-escalation"] == f"failed; tier=long; reason={reason}"
    assert text.rstrip().endswith("data: [DONE]")
    chunks = _chunks(text)
    assert not any("error" in c for c in chunks), text
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["length"] and chunks[-1]["usage"]["completion_tokens"] == 4  # short's cut answer

    events = _events(redis_url, redis_prefix, 2)
    assert len(events) == 2 and sorted(e["tier"] for e in events) == ["long", "short"], events
    first = next(e for e in events if e["tier"] == "short")
    failed = next(e for e in events if e["tier"] == "long")
    assert first["request_id"] == r.headers["x-request-id"]
    assert (first["status"], first["error_code"], first["partial"]) == (200, None, False)
    assert first["completion_tokens"] == 4 and first["cost_micro_usd"] > 0
    assert isinstance(first["cost_micro_usd"], int) and isinstance(failed["cost_micro_usd"], int)
    assert (failed["status"], failed["error_code"], failed["route_reason"], failed["partial"]) == (
        504 if mode == "stall" else 502, reason, "escalated", True)
    # nothing generated before it failed; its prompt, which the upstream had, is billed
    assert failed["completion_tokens"] == 0 and failed["prompt_tokens"] > 0 and failed["cost_micro_usd"] > 0
    sent = upstream_sim.tag(tag)
    assert sent is not None and sent["attempts"] == 2, sent  # short's call and long's, each once


@pytest.mark.parametrize("mode", ["drop", "error-event"])
def test_a_top_tier_stream_that_fails_after_its_first_content_is_relayed(
        gw: GatewayServer, redis_url: str, redis_prefix: str, mode: str) -> None:
    """Half of long's chunks (its thought under way) reach the client, then the failure: unchanged — long's stream
    relayed, then the in-stream error; short metered as escalated, long as the failed call."""
    r, text, _ = _chat(gw, mode, None)
    assert r.status_code == 200, text
    assert (r.headers["x-thinkgate-tier"], r.headers["x-thinkgate-route-reason"]) == ("long", "escalated")
    assert "x-thinkgate-escalation" not in r.headers
    chunks = _chunks(text)
    assert any(c.get("choices") and c["choices"][0]["delta"].get("reasoning") for c in chunks), text
    assert "error" in chunks[-1], text

    events = _events(redis_url, redis_prefix, 2)
    assert len(events) == 2, events
    by_tier = {e["tier"]: e for e in events}
    assert (by_tier["short"]["status"], by_tier["short"]["error_code"]) == (200, "escalated_length_in_thought")
    assert (by_tier["long"]["status"], by_tier["long"]["partial"]) == (502, True)
    assert by_tier["long"]["completion_tokens"] > 0
