"""The response cache through a real gateway and the OpenAI SDK: hits, tenant isolation, stream ↔ non-stream,
single-flight, Cache-Control, and how hits are metered."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.ledger.event import cost_micro_usd
from tests.fixtures.gateway import SECRETS, accounting_gateway, usage_events
from tests.fixtures.upstream import GatewayServer, SimProcess


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("cachegw")) as g:
        yield g


def client(gw: GatewayServer, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=SECRETS[who], max_retries=0, timeout=30)


def ask(tag: str, **extra: Any) -> dict[str, Any]:
    return {"model": "short", "messages": [{"role": "user", "content": f"what is two plus two {tag}"}],
            "temperature": 0, "extra_body": {"sim": {"tag": tag, **extra}}}


def test_miss_then_hit_with_headers_and_hit_metering(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    c = client(gw)
    first = c.chat.completions.with_raw_response.create(**ask(tag))
    assert first.headers["x-thinkgate-cache"] == "miss"
    assert first.headers["x-thinkgate-route-reason"] == "forced"
    second = c.chat.completions.with_raw_response.create(**ask(tag))
    assert second.headers["x-thinkgate-cache"] == "hit"
    assert second.headers["x-thinkgate-route-reason"] == "cache"
    assert second.headers["x-thinkgate-tier"] == "short"
    a, b = first.parse(), second.parse()
    assert a.choices[0].message.content == b.choices[0].message.content
    # a hit is its own completion: its own id (vLLM's shape) and creation time, never the stored answer's
    assert b.id != a.id and b.id.startswith("chatcmpl-") and len(b.id) == len("chatcmpl-") + 32
    assert b.created >= a.created
    third = c.chat.completions.create(**ask(tag))
    assert third.id not in (a.id, b.id)
    assert a.usage == b.usage
    assert upstream_sim.tag(tag)["attempts"] == 1  # the hit never reached the upstream
    events = usage_events(gw, [first.headers["x-request-id"], second.headers["x-request-id"]])
    miss_ev, hit_ev = events[first.headers["x-request-id"]], events[second.headers["x-request-id"]]
    tier = gw.settings.tier("short")
    price = cost_micro_usd(tier.prices, prompt_tokens=miss_ev.prompt_tokens, cached_tokens=miss_ev.cached_tokens,
                           completion_tokens=miss_ev.completion_tokens)
    assert (miss_ev.cached, miss_ev.cost_micro_usd, miss_ev.saved_micro_usd) == (False, price, 0)
    assert (hit_ev.cached, hit_ev.cost_micro_usd, hit_ev.saved_micro_usd) == (True, 0, price)
    assert hit_ev.route_reason == "cache" and hit_ev.usage_source == "cache"
    assert (hit_ev.prompt_tokens, hit_ev.completion_tokens) == (miss_ev.prompt_tokens, miss_ev.completion_tokens)


def test_two_keys_never_share_an_answer(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    r1 = client(gw, "alice").chat.completions.with_raw_response.create(**ask(tag))
    r2 = client(gw, "bob").chat.completions.with_raw_response.create(**ask(tag))
    assert (r1.headers["x-thinkgate-cache"], r2.headers["x-thinkgate-cache"]) == ("miss", "miss")
    assert upstream_sim.tag(tag)["attempts"] == 2
    r3 = client(gw, "bob").chat.completions.with_raw_response.create(**ask(tag))
    assert r3.headers["x-thinkgate-cache"] == "hit"


@pytest.mark.parametrize("first_stream", [True, False])
def test_stream_and_non_stream_serve_each_other(gw: GatewayServer, upstream_sim: SimProcess,
                                                first_stream: bool) -> None:
    tag = uuid.uuid4().hex
    c = client(gw)

    def streamed() -> tuple[str, str, str, Any]:
        raw = c.chat.completions.with_raw_response.create(**ask(tag), stream=True,
                                                           stream_options={"include_usage": True})
        content, reasoning, usage = [], [], None
        for chunk in raw.parse():  # the SDK's own SSE parser: it raises on malformed streams
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                content.append(ch.delta.content or "")
                reasoning.append(getattr(ch.delta, "reasoning", None) or "")
        return raw.headers["x-thinkgate-cache"], "".join(content), "".join(reasoning), usage

    def plain() -> tuple[str, str, str, Any]:
        raw = c.chat.completions.with_raw_response.create(**ask(tag))
        msg = raw.parse().choices[0].message
        return raw.headers["x-thinkgate-cache"], msg.content or "", getattr(msg, "reasoning", "") or "", \
            raw.parse().usage

    one, two = (streamed, plain) if first_stream else (plain, streamed)
    h1, content1, reasoning1, usage1 = one()
    h2, content2, reasoning2, usage2 = two()
    assert (h1, h2) == ("miss", "hit")
    assert content1.encode() == content2.encode() and content1
    assert reasoning1.encode() == reasoning2.encode() and reasoning1
    assert usage1 is not None and usage2 is not None
    assert usage1.completion_tokens == usage2.completion_tokens and usage1.prompt_tokens == usage2.prompt_tokens
    assert upstream_sim.tag(tag)["attempts"] == 1


@pytest.mark.parametrize("first_stream", [False, True])
def test_a_hit_serves_the_stored_logprobs(gw: GatewayServer, first_stream: bool) -> None:
    # a hit dropped them ("logprobs": null on every replayed chunk, and on a body assembled from a stream)
    tag = uuid.uuid4().hex
    c = client(gw)
    req = {**ask(tag), "logprobs": True, "top_logprobs": 2}

    def streamed() -> tuple[str, list[Any]]:
        raw = c.chat.completions.with_raw_response.create(**req, stream=True)
        tokens: list[Any] = []
        for chunk in raw.parse():
            for ch in chunk.choices:
                if ch.logprobs is not None and ch.logprobs.content:
                    tokens += ch.logprobs.content
        return raw.headers["x-thinkgate-cache"], tokens

    def plain() -> tuple[str, list[Any]]:
        raw = c.chat.completions.with_raw_response.create(**req)
        lp = raw.parse().choices[0].logprobs
        return raw.headers["x-thinkgate-cache"], list(lp.content or []) if lp is not None else []

    one, two = (streamed, plain) if first_stream else (plain, streamed)
    (h1, lp1), (h2, lp2) = one(), two()
    assert (h1, h2) == ("miss", "hit")
    assert lp1 and [t.model_dump() for t in lp1] == [t.model_dump() for t in lp2]
    assert all(len(t.top_logprobs) == 2 for t in lp2)


def test_replayed_stream_without_usage_and_raw_sse_framing(gw: GatewayServer) -> None:
    tag = uuid.uuid4().hex
    body = {"model": "short", "messages": [{"role": "user", "content": f"count {tag}"}], "temperature": 0,
            "sim": {"tag": tag}}
    headers = {"authorization": f"Bearer {SECRETS['alice']}"}
    stored = httpx.post(gw.base_url + "/chat/completions", json=body, headers=headers, timeout=30)
    stored.raise_for_status()
    r = httpx.post(gw.base_url + "/chat/completions", json={**body, "stream": True}, headers=headers, timeout=30)
    assert r.headers["x-thinkgate-cache"] == "hit"
    assert r.headers["content-type"].startswith("text/event-stream")
    events = r.content.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"] for c in chunks)  # no usage chunk: the client did not ask for one
    ids = {c["id"] for c in chunks}  # one id for the whole replayed stream, not the stored answer's
    assert len(ids) == 1 and stored.json()["id"] not in ids
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_single_flight_16_concurrent_identical_misses(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    body = {"model": "short", "messages": [{"role": "user", "content": f"slow question {tag}"}], "temperature": 0,
            "sim": {"tag": tag, "delay_ms": 400}}
    headers = {"authorization": f"Bearer {SECRETS['alice']}"}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as http:
            return await asyncio.gather(*(http.post(gw.base_url + "/chat/completions", json=body, headers=headers)
                                          for _ in range(16)))

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    assert upstream_sim.tag(tag)["attempts"] == 1
    kinds = sorted(r.headers["x-thinkgate-cache"] for r in responses)
    assert kinds == ["hit"] * 15 + ["miss"]
    assert len({r.json()["choices"][0]["message"]["content"] for r in responses}) == 1
    assert len({r.json()["id"] for r in responses}) == 16  # the same answer, 16 completions


def test_cache_control_and_policy(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    c = client(gw)
    r = c.chat.completions.with_raw_response.create(**ask(tag), extra_headers={"cache-control": "no-store"})
    assert r.headers["x-thinkgate-cache"] == "bypass"
    r = c.chat.completions.with_raw_response.create(**ask(tag))
    assert r.headers["x-thinkgate-cache"] == "miss"  # no-store left nothing behind
    r = c.chat.completions.with_raw_response.create(**ask(tag), extra_headers={"cache-control": "no-cache"})
    assert r.headers["x-thinkgate-cache"] == "miss"
    assert upstream_sim.tag(tag)["attempts"] == 3
    sampled = {**ask(tag), "temperature": 0.7}
    assert c.chat.completions.with_raw_response.create(**sampled).headers["x-thinkgate-cache"] == "bypass"
    seeded = {**sampled, "seed": 11}
    assert c.chat.completions.with_raw_response.create(**seeded).headers["x-thinkgate-cache"] == "miss"
    assert c.chat.completions.with_raw_response.create(**seeded).headers["x-thinkgate-cache"] == "hit"


def test_failed_upstream_answers_are_not_cached(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    c = client(gw)
    with pytest.raises(openai.APIStatusError):
        c.chat.completions.create(**ask(tag, fail="500"))
    with pytest.raises(openai.APIError):
        list(c.chat.completions.create(**ask(tag, fail="drop"), stream=True))
    ok = c.chat.completions.with_raw_response.create(**ask(tag))
    assert ok.headers["x-thinkgate-cache"] == "miss"


def test_completions_endpoint_is_cached_too(gw: GatewayServer, upstream_sim: SimProcess, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    c = client(gw)
    kw = {"model": "short", "prompt": f"one two three {tag}", "temperature": 0, "extra_body": {"sim": {"tag": tag}}}
    a = c.completions.with_raw_response.create(**kw)
    b = c.completions.with_raw_response.create(**kw, stream=True)
    assert (a.headers["x-thinkgate-cache"], b.headers["x-thinkgate-cache"]) == ("miss", "hit")
    text = "".join(ch.choices[0].text for ch in b.parse() if ch.choices)
    assert text == a.parse().choices[0].text


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_a_streamed_tool_call_served_as_json_has_null_content(gw: GatewayServer) -> None:
    # the body assembled from a stream said "content": "" next to the tool calls; OpenAI (ChatCompletionMessage)
    # and the live JSON answer say null when the answer only calls tools
    tag = uuid.uuid4().hex
    c = client(gw)
    req = {**ask(tag), "tools": WEATHER}
    live = c.chat.completions.with_raw_response.create(**req, stream=True)
    calls = [d.tool_calls for ch in live.parse() for choice in ch.choices if (d := choice.delta).tool_calls]
    assert live.headers["x-thinkgate-cache"] == "miss" and calls
    raw = httpx.post(gw.base_url + "/chat/completions", json={**{k: v for k, v in req.items() if k != "extra_body"},
                                                              **req["extra_body"]},
                     headers={"authorization": f"Bearer {SECRETS['alice']}"}, timeout=30)
    assert raw.headers["x-thinkgate-cache"] == "hit"
    msg = raw.json()["choices"][0]["message"]
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert raw.json()["choices"][0]["finish_reason"] == "tool_calls"
