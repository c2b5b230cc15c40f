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

The top tier's start read decides by the order in the stream, not by the network's reads (``"sim": {"empty_chunks":
N}`` content-less chunks first, ``"one_write"`` the whole body in one read): ending after many empty chunks is still
before its first content (it was relayed once the read had taken 8 network reads, caught when the same bytes came in
one), and a first content followed by the end is relayed, then reported, whether the end shared its read or not.
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

from gateway.pipeline.escalation import START_IDLE_CHUNKS
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


def _first_kept_long_failed(r: httpx.Response, redis_url: str, prefix: str, sim: SimProcess, tag: str) -> None:
    """Two events: ``short``'s answer served as it was (200, its 4 tokens billed) and ``long``'s escalated call
    metered as the failed call it was; each tier called once."""
    events = _settled(redis_url, prefix, 2)
    by_tier = {e["tier"]: e for e in events}
    assert sorted(by_tier) == ["long", "short"], events
    first, failed = by_tier["short"], by_tier["long"]
    assert first["request_id"] == r.headers["x-request-id"]
    assert (first["status"], first["error_code"], first["partial"]) == (200, None, False)
    assert first["completion_tokens"] == 4 and first["cost_micro_usd"] > 0
    assert failed["route_reason"] == "escalated"
    _failed_call(failed)
    sent = sim.tag(tag)
    assert sent is not None and sent["attempts"] == 2, sent  # short's call and long's, each once


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

    _first_kept_long_failed(r, redis_url, redis_prefix, upstream_sim, tag)


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


# --- the start read: content-less chunks first, and where the end comes (not how the network split the reads) ---

EMPTY = 10  # content-less chunks after the role chunk: more than the start read's old bound (8 network reads)
#: the same bytes delivered chunk by chunk (20 ms apart: a read each, the end too) or in one network read
SPLITS: dict[str, dict[str, Any]] = {"reads": {"chunk_delay_ms": 20}, "one-read": {"one_write": True}}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_top_tier_stream_that_closes_after_empty_chunks_leaves_the_first_answer(
        two: GatewayServer, upstream_sim: SimProcess, redis_url: str, redis_prefix: str, api: str, split: str) -> None:
    """long sends its role chunk and ten empty ones, then ends without ``[DONE]``: before its first content, a failed
    call whatever the read count — the first answer kept, long billed as the break (its prompt, nothing generated).
    It was: the start read stopped after 8 network reads and relayed it (a 200 from long, then the in-stream error);
    in one read it was already caught — the same bytes, handled two ways."""
    tag = uuid.uuid4().hex
    sim: dict[str, Any] = {"fail": "close", "fail_from": 1, "empty_chunks": EMPTY, "fail_at": 1 + EMPTY, "tag": tag,
                           **SPLITS[split]}
    r, text = _send(two, api, sim)
    _served_first_answer(r, text, api, "long")

    _first_kept_long_failed(r, redis_url, redis_prefix, upstream_sim, tag)


@pytest.mark.parametrize("split", list(SPLITS))
def test_a_first_call_that_closes_after_empty_chunks_is_a_502(
        two: GatewayServer, upstream_sim: SimProcess, redis_url: str, redis_prefix: str, split: str) -> None:
    """The request's first call, peeked for escalation, the same way: a 502 whatever the read count."""
    tag = uuid.uuid4().hex
    sim: dict[str, Any] = {"fail": "close", "fail_times": 1, "empty_chunks": EMPTY, "fail_at": 1 + EMPTY, "tag": tag,
           **SPLITS[split]}
    r, text = _send(two, "chat", sim)
    assert r.status_code == 502, text
    assert orjson.loads(text)["error"]["code"] == REASON
    [event] = _settled(redis_url, redis_prefix, 1)
    assert event["tier"] == "short"
    _failed_call(event)


@pytest.mark.parametrize("split", list(SPLITS))
def test_a_top_tier_stream_that_answers_after_empty_chunks_is_relayed_whole(
        two: GatewayServer, redis_url: str, redis_prefix: str, split: str) -> None:
    """Held on through the empty chunks, long's stream is relayed whole once its content comes: role chunk, the
    empty chunks, its answer, [DONE] — short metered as escalated, long as the answer."""
    r, text = _send(two, "chat", {"empty_chunks": EMPTY, "tag": uuid.uuid4().hex, **SPLITS[split]})
    assert r.status_code == 200, text
    assert (r.headers["x-thinkgate-tier"], r.headers["x-thinkgate-route-reason"]) == ("long", "escalated")
    lines = [line for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", text
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"] == {}) == EMPTY, text
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]).strip(), text

    by_tier = {e["tier"]: e for e in _settled(redis_url, redis_prefix, 2)}
    assert (by_tier["short"]["status"], by_tier["short"]["error_code"]) == (200, "escalated_length_in_thought")
    assert (by_tier["long"]["status"], by_tier["long"]["error_code"], by_tier["long"]["partial"]) == (200, None, False)


@pytest.mark.parametrize("split", list(SPLITS))
def test_a_top_tier_stream_whose_first_content_and_end_share_a_read_is_relayed_as_when_apart(
        two: GatewayServer, redis_url: str, redis_prefix: str, split: str) -> None:
    """long's role chunk and first reasoning delta, then the end without ``[DONE]``: its first content came before
    its end, so it is the client's — relayed, then the in-stream error, long billed as the break with what it
    generated — whether the end came in a read of its own or in the same read as the content (where the gateway
    could have seen both before answering: the order in the stream decides, not the network's reads)."""
    r, text = _send(two, "chat", {"fail": "close", "fail_from": 1, "fail_at": 2, "tag": uuid.uuid4().hex,
                                  **SPLITS[split]})
    assert r.status_code == 200, text
    assert (r.headers["x-thinkgate-tier"], r.headers["x-thinkgate-route-reason"]) == ("long", "escalated")
    assert "x-thinkgate-escalation" not in r.headers
    chunks = [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")]
    assert [c["choices"][0]["delta"].get("reasoning") for c in chunks[:-1]] == [None, "what"], text
    assert chunks[-1]["error"]["code"] == REASON, text

    by_tier = {e["tier"]: e for e in _settled(redis_url, redis_prefix, 2)}
    assert (by_tier["short"]["status"], by_tier["short"]["error_code"]) == (200, "escalated_length_in_thought")
    _failed_call(by_tier["long"], generated=True)
    assert by_tier["long"]["completion_tokens"] == 1  # the one delta relayed (no usage came: counted)


def test_a_top_tier_stream_past_the_idle_bound_is_relayed(two: GatewayServer, redis_url: str,
                                                           redis_prefix: str) -> None:
    """The content-less chunks held are bounded (``START_IDLE_CHUNKS``, the buffer's bound): a stream that sends more
    before its first content is relayed from there, as it comes — its end without ``[DONE]`` then the relay's
    in-stream error (documented: docs/thinking-budgets.md)."""
    many = START_IDLE_CHUNKS + 6
    r, text = _send(two, "chat", {"fail": "close", "fail_from": 1, "empty_chunks": many, "fail_at": 1 + many,
                                  "one_write": True, "tag": uuid.uuid4().hex})
    assert r.status_code == 200, text
    assert r.headers["x-thinkgate-tier"] == "long"
    chunks = [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")]
    assert len(chunks) == 1 + many + 1 and chunks[-1]["error"]["code"] == REASON, text[-500:]
    by_tier = {e["tier"]: e for e in _settled(redis_url, redis_prefix, 2)}
    _failed_call(by_tier["long"])
