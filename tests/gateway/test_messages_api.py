"""``POST /v1/messages`` through the official ``anthropic`` SDK against a real gateway over the upstream
simulator: content blocks, thinking (budget → tier), tools, Anthropic's stream events and error shape, cache
scoping, and usage that matches the metered event to the token and micro-dollar (one event per request)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from gateway.ledger.pricing import cost_micro_usd
from tests.fixtures.gateway import SECRETS, accounting_gateway, cleanup
from tests.fixtures.metered import events_of
from tests.fixtures.upstream import TEST_KEY, GatewayServer, SimProcess, sim_settings, sim_tiers
from tests.fixtures.upstream_sim import answer_words, reasoning_words

USER = "what is seven times six"
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("msggw"), prefix) as g:
            yield g
    finally:
        cleanup(redis_url, prefix)


def sdk(gw: GatewayServer, who: str = "alice") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=SECRETS[who], max_retries=0, timeout=30)


def tag() -> dict[str, Any]:
    return {"sim": {"tag": uuid.uuid4().hex}}


def assert_metered(gw: GatewayServer, request_id: str, usage: Any, tier: str, cached: bool = False) -> dict[str, Any]:
    rows = events_of(gw, request_id)
    assert len(rows) == 1, rows
    ev = rows[0]
    assert ev["endpoint"] == "messages" and ev["tier"] == tier and ev["status"] == 200
    cached_tokens = usage.cache_read_input_tokens or 0
    assert ev["prompt_tokens"] == usage.input_tokens + cached_tokens and ev["cached_tokens"] == cached_tokens
    assert ev["completion_tokens"] == usage.output_tokens
    assert ev["reasoning_tokens"] == usage.output_tokens_details.thinking_tokens
    prices = next(t.prices for t in gw.settings.tiers if t.name == tier)
    price = cost_micro_usd(prices, prompt_tokens=ev["prompt_tokens"], cached_tokens=cached_tokens,
                           completion_tokens=usage.output_tokens)
    assert (ev["cost_micro_usd"], ev["saved_micro_usd"]) == ((0, price) if cached else (price, 0))
    return ev


def test_plain_message_blocks_and_usage_match_the_event(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    extra = tag()
    raw = sdk(gw).messages.with_raw_response.create(
        model="long", max_tokens=200, system="Be brief.", messages=[{"role": "user", "content": USER}],
        extra_body=extra, extra_headers={"anthropic-version": "2023-06-01"})
    assert raw.headers["x-thinkgate-tier"] == "long"
    m = raw.parse()
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    # thinking not asked for: no thinking block (Anthropic's API; `m.content[0].text` must work), though the tier
    # thought — its tokens are in output_tokens
    assert [b.type for b in m.content] == ["text"]
    prompt = "Be brief.\n" + USER
    assert m.content[0].text == " ".join(answer_words(USER))  # type: ignore[union-attr]
    assert m.stop_reason == "end_turn"
    assert m.usage.input_tokens == len(prompt.split()) + 3 * 2
    assert m.usage.output_tokens == len(reasoning_words(prompt)) + len(answer_words(USER))
    assert_metered(gw, raw.headers["x-request-id"], m.usage, "long")
    sent = upstream_sim.tag(extra["sim"]["tag"])["body"]
    assert sent["messages"][0] == {"role": "system", "content": "Be brief."} and sent["max_tokens"] == 200
    asked = sdk(gw).messages.create(model="long", max_tokens=200, system="Be brief.",
                                    messages=[{"role": "user", "content": USER}],
                                    thinking={"type": "enabled", "budget_tokens": 150})
    assert [b.type for b in asked.content] == ["thinking", "text"]
    assert asked.content[0].thinking == " ".join(reasoning_words(prompt))  # type: ignore[union-attr]
    assert asked.usage.output_tokens == m.usage.output_tokens


def test_bearer_auth_and_anthropic_error_shape(gw: GatewayServer) -> None:
    body = {"model": "short", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(gw.base_url + "/messages", json=body, headers={"authorization": f"Bearer {SECRETS['bob']}"},
                   timeout=10)
    assert r.status_code == 200 and r.json()["content"][-1]["text"] == "echo: hi"
    r = httpx.post(gw.base_url + "/messages", json={**body, "max_tokens": None},
                   headers={"x-api-key": SECRETS["bob"]}, timeout=10)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens: Field required"}}
    r = httpx.post(gw.base_url + "/messages", json=body, headers={"x-api-key": "nope"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as nf:  # Anthropic's 404 not_found_error for an unknown model
        sdk(gw).messages.create(model="no-such-tier", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=gw.url, api_key="wrong", max_retries=0).messages.create(
            model="short", max_tokens=8, messages=[{"role": "user", "content": "hi"}])


def test_every_answer_carries_anthropics_request_id_header(gw: GatewayServer) -> None:
    # Anthropic sends request-id on every response; its SDK reads that one (APIStatusError.request_id, _request_id)
    body: Any = {"model": "short", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": SECRETS["bob"]}
    for b in (body, {**body, "stream": True}, {**body, "max_tokens": 0}, {**body, "model": "no-such-tier"}):
        r = httpx.post(gw.base_url + "/messages", json=b, headers=headers, timeout=10)
        assert r.headers.get("request-id") == r.headers["x-request-id"], (r.status_code, dict(r.headers))
    with pytest.raises(anthropic.NotFoundError) as nf:
        sdk(gw).messages.create(model="no-such-tier", max_tokens=8, messages=body["messages"])
    assert nf.value.request_id and nf.value.request_id == nf.value.response.headers["x-request-id"]


def test_rate_limits_under_anthropic_names_too(gw: GatewayServer, redis_url: str) -> None:
    from datetime import UTC, datetime

    from tests.fixtures.gateway import create_key

    secret = create_key(redis_url, gw.settings.redis.key_prefix, f"rl-{uuid.uuid4().hex[:8]}", rpm=2, tpm=100_000)
    c = anthropic.Anthropic(base_url=gw.url, api_key=secret, max_retries=0, timeout=30)
    msgs: Any = [{"role": "user", "content": "hi"}]
    r = c.messages.with_raw_response.create(model="short", max_tokens=8, messages=msgs)
    h = r.headers
    assert (h["anthropic-ratelimit-requests-limit"], h["anthropic-ratelimit-requests-remaining"]) == ("2", "1")
    assert h["x-ratelimit-remaining-requests"] == "1"  # the OpenAI names stay
    assert h["anthropic-ratelimit-tokens-limit"] == "100000"
    reset = datetime.strptime(h["anthropic-ratelimit-requests-reset"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert 0 < reset.timestamp() - datetime.now(UTC).timestamp() <= 121  # RFC 3339, within two windows
    with c.messages.with_streaming_response.create(model="short", max_tokens=8, messages=msgs, stream=True) as s:
        assert s.headers["anthropic-ratelimit-requests-remaining"] == "0"
        s.read()
    with pytest.raises(anthropic.RateLimitError) as info:
        c.messages.create(model="short", max_tokens=8, messages=msgs)
    h = info.value.response.headers
    assert h["anthropic-ratelimit-requests-remaining"] == "0" and int(h["retry-after"]) >= 1
    assert info.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


def test_unserved_messages_paths_answer_in_anthropic_shape(gw: GatewayServer) -> None:
    # the Message Batches API is not served: the SDK gets Anthropic's 404, not an OpenAI-shaped body
    with pytest.raises(anthropic.NotFoundError) as nf:
        sdk(gw).messages.batches.list()
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert "/v1/messages/batches" in nf.value.body["error"]["message"]  # type: ignore[index]
    r = httpx.get(gw.base_url + "/messages", headers={"x-api-key": SECRETS["bob"]}, timeout=10)
    assert r.status_code == 405 and r.json()["type"] == "error" and "GET /v1/messages" in r.json()["error"]["message"]
    # a client error, not Anthropic's api_error ("an unexpected error internal to Anthropic's systems", a 500's)
    assert r.json()["error"]["type"] == "invalid_request_error"
    # the OpenAI side keeps OpenAI's shape
    r = httpx.get(gw.base_url + "/no-such-thing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and "type" not in r.json()


def test_streamed_events_and_final_usage(gw: GatewayServer) -> None:
    with sdk(gw).messages.with_streaming_response.create(
            model="long", max_tokens=200, messages=[{"role": "user", "content": USER}], stream=True) as raw:
        request_id = raw.headers["x-request-id"]
        events = list(raw.parse())
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]  # type: ignore[union-attr]
    assert starts == ["text"] and types.count("content_block_stop") == 1  # thinking not asked for
    deltas = [e.delta for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert "".join(d.text for d in deltas if d.type == "text_delta") == " ".join(answer_words(USER))
    with sdk(gw).messages.with_streaming_response.create(
            model="long", max_tokens=200, messages=[{"role": "user", "content": USER}], stream=True,
            thinking={"type": "enabled", "budget_tokens": 150}) as raw_thinking:
        thinking_events = list(raw_thinking.parse())
    starts = [e.content_block.type for e in thinking_events
              if e.type == "content_block_start"]  # type: ignore[union-attr]
    assert starts == ["thinking", "text"]
    deltas = [e.delta for e in thinking_events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == " ".join(reasoning_words(USER))
    # as Anthropic's: the thinking block ends with its signature_delta (empty: the upstream signs nothing), right
    # before that block's content_block_stop
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in thinking_events]
    at = kinds.index(("content_block_delta", "signature_delta"))
    assert kinds[at - 1] == ("content_block_delta", "thinking_delta") and kinds[at + 1][0] == "content_block_stop"
    assert [d.signature for d in deltas if d.type == "signature_delta"] == [""]
    delta = events[-2]
    assert delta.delta.stop_reason == "end_turn"  # type: ignore[union-attr]
    assert_metered(gw, request_id, delta.usage, "long")  # type: ignore[union-attr]
    # the SDK's accumulating helper ends with the same message
    with sdk(gw).messages.stream(model="long", max_tokens=200, messages=[{"role": "user", "content": USER}]) as s:
        final = s.get_final_message()
    assert final.content[0].text == " ".join(answer_words(USER))  # type: ignore[union-attr]
    assert final.usage.input_tokens == len(USER.split()) + 3 and final.usage.output_tokens == delta.usage.output_tokens  # type: ignore[union-attr]


def test_thinking_budget_picks_the_cheapest_covering_tier_or_applies_the_smaller_budget(
    gw: GatewayServer, upstream_sim: SimProcess
) -> None:
    msgs = [{"role": "user", "content": USER}]
    # 4 tokens: the routed tier (short, budget 8) covers it → stays there, 4 applied
    extra = tag()
    raw = sdk(gw).messages.with_raw_response.create(model="auto", max_tokens=64, messages=msgs, extra_body=extra,
                                                    thinking={"type": "enabled", "budget_tokens": 4})
    assert (raw.headers["x-thinkgate-tier"], raw.headers["x-thinkgate-route-reason"]) == ("short", "predicted")
    m = raw.parse()
    assert m.content[0].thinking == " ".join(reasoning_words(USER)[:4])  # type: ignore[union-attr]
    assert upstream_sim.tag(extra["sim"]["tag"])["body"]["thinking_token_budget"] == 4
    assert_metered(gw, raw.headers["x-request-id"], m.usage, "short")
    # 100 tokens: short's 8 do not cover it → the cheapest tier that does (long, unlimited)
    raw = sdk(gw).messages.with_raw_response.create(model="auto", max_tokens=200, messages=msgs,
                                                    thinking={"type": "enabled", "budget_tokens": 100})
    assert (raw.headers["x-thinkgate-tier"], raw.headers["x-thinkgate-route-reason"]) == ("long", "effort")
    assert raw.parse().content[0].thinking == " ".join(reasoning_words(USER))  # type: ignore[union-attr]
    # a forced tier is kept: its own (smaller) budget applies
    raw = sdk(gw).messages.with_raw_response.create(model="short", max_tokens=128, messages=msgs,
                                                    thinking={"type": "enabled", "budget_tokens": 100})
    assert raw.headers["x-thinkgate-tier"] == "short"
    assert raw.parse().content[0].thinking == " ".join(reasoning_words(USER)[:8])  # type: ignore[union-attr]
    # disabled → thinking off on the routed tier
    extra = tag()
    m = sdk(gw).messages.create(model="long", max_tokens=64, messages=msgs, thinking={"type": "disabled"},
                                extra_body=extra)
    assert [b.type for b in m.content] == ["text"]
    assert upstream_sim.tag(extra["sim"]["tag"])["body"]["chat_template_kwargs"] == {"enable_thinking": False}


def test_the_covering_tier_is_one_whose_range_serves_the_budget(upstream_sim: SimProcess, redis_url: str) -> None:
    """A tier covers ``budget_tokens`` N when the budget it serves for N — the smaller of N and its own, clamped into
    its ``thinking_budget_range``, as chat serves a ``thinking_token_budget`` — is at least N. An unlimited tier
    with a range [8, 12] counted as covering 100 and served 12; now the cheapest tier that serves N gets it, else
    the one that serves the most. A named tier is kept and clamps, as on chat."""
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"thinking_budget": None, "thinking_budget_range": [8, 12]})  # short, routed for USER
    tiers[2].update({"thinking_budget": None, "thinking_budget_range": [8, 64]})  # long
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as g:
        client = anthropic.Anthropic(base_url=g.url, api_key=TEST_KEY, max_retries=0, timeout=30)
        for model, budget, tier, reason, applied in (
                ("auto", 10, "short", "predicted", 10),  # served as asked: stays
                ("auto", 4, "short", "predicted", 8),  # served at the range's minimum, more than asked: stays
                ("auto", 50, "long", "effort", 50),  # short serves 12: the cheapest tier that serves 50
                ("auto", 100, "long", "effort", 64),  # none serves 100: the one that serves the most
                ("short", 100, "short", "forced", 12)):  # a named tier is kept, clamped as on chat
            raw = client.messages.with_raw_response.create(
                model=model, max_tokens=2 * budget + 64, messages=[{"role": "user", "content": USER}],
                thinking={"type": "enabled", "budget_tokens": budget}, extra_body=tag())
            got = (raw.headers["x-thinkgate-tier"], raw.headers["x-thinkgate-route-reason"],
                   raw.headers["x-thinkgate-thinking-budget"])
            assert got == (tier, reason, str(applied)), (model, budget)


def test_the_covering_tier_is_one_the_key_may_use(gw: GatewayServer, redis_url: str) -> None:
    """``thinking.budget_tokens`` that the routed tier does not cover moves the request to a covering tier — only
    among the tiers the key may use. It looked at every tier, so a key held to ``none``/``short`` asking for 100
    was moved to ``long`` and refused (403) by its own policy; now it stays on the one it may use that serves the
    most."""
    from tests.fixtures.gateway import create_key

    secret = create_key(redis_url, gw.settings.redis.key_prefix, f"two-{uuid.uuid4().hex[:8]}",
                        allowed_tiers=["none", "short"])
    client = anthropic.Anthropic(base_url=gw.url, api_key=secret, max_retries=0, timeout=30)
    raw = client.messages.with_raw_response.create(model="auto", max_tokens=264,
                                                   messages=[{"role": "user", "content": USER}],
                                                   thinking={"type": "enabled", "budget_tokens": 100})
    assert raw.status_code == 200
    assert raw.headers["x-thinkgate-tier"] == "short"


@pytest.mark.parametrize("field", ["n", "best_of"])
def test_several_answers_are_refused_not_billed(gw: GatewayServer, field: str) -> None:
    """A message has one answer: ``n`` (or ``best_of``) passed through to the chat upstream billed every choice
    and showed the first (``n: 8`` cost eight answers). Refused as Anthropic refuses a field it does not define;
    1 is harmless and accepted."""
    body = {"model": "short", "max_tokens": 32, "messages": [{"role": "user", "content": USER}], field: 8}
    head = {"x-api-key": SECRETS["alice"], "anthropic-version": "2023-06-01"}
    r = httpx.post(gw.base_url + "/messages", json=body, headers=head, timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and field in r.json()["error"]["message"]
    ok = httpx.post(gw.base_url + "/messages", json={**body, field: 1}, headers=head, timeout=30)
    assert ok.status_code == 200, ok.text


def test_tool_use_round_trip(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    client = sdk(gw)
    question = "weather in Paris today"
    first = client.messages.with_raw_response.create(model="short", max_tokens=64, tools=[WEATHER],  # type: ignore[list-item]
                                                     messages=[{"role": "user", "content": question}])
    m1 = first.parse()
    assert m1.stop_reason == "tool_use"
    use = next(b for b in m1.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input == {"city": question}  # type: ignore[union-attr]
    assert_metered(gw, first.headers["x-request-id"], m1.usage, "short")
    extra = tag()
    m2 = client.messages.create(
        model="short", max_tokens=64, tools=[WEATHER], extra_body=extra,  # type: ignore[list-item]
        messages=[{"role": "user", "content": question}, {"role": "assistant", "content": m1.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,  # type: ignore[union-attr]
                                                "content": "sunny 21 C"}]}])
    assert m2.content[-1].text == "result: sunny 21 C" and m2.stop_reason == "end_turn"  # type: ignore[union-attr]
    sent = upstream_sim.tag(extra["sim"]["tag"])["body"]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert sent[1]["tool_calls"][0]["id"] == use.id and sent[2] == {  # type: ignore[union-attr]
        "role": "tool", "tool_call_id": use.id, "content": "sunny 21 C"}  # type: ignore[union-attr]
    assert json.loads(sent[1]["tool_calls"][0]["function"]["arguments"]) == {"city": question}


def test_streamed_tool_use_input_json_deltas(gw: GatewayServer) -> None:
    question = "weather in Rome"
    events = list(sdk(gw).messages.create(model="long", max_tokens=200, tools=[WEATHER], stream=True,  # type: ignore[list-item]
                                          tool_choice={"type": "tool", "name": "get_weather"},
                                          messages=[{"role": "user", "content": question}]))
    start = next(e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use")
    assert start.content_block.name == "get_weather" and start.content_block.input == {}  # type: ignore[union-attr]
    parts = [e.delta.partial_json for e in events
             if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]  # type: ignore[union-attr]
    assert len(parts) > 1 and json.loads("".join(parts)) == {"city": question}
    assert events[-2].delta.stop_reason == "tool_use"  # type: ignore[union-attr]
    with sdk(gw).messages.stream(model="long", max_tokens=200, tools=[WEATHER],  # type: ignore[list-item]
                                 messages=[{"role": "user", "content": question}]) as s:
        final = s.get_final_message()
    assert next(b for b in final.content if b.type == "tool_use").input == {"city": question}  # type: ignore[union-attr]


def test_cache_is_tenant_scoped(gw: GatewayServer) -> None:
    # this SDK version has no temperature argument: sent as a body field
    kw: dict[str, Any] = {"model": "long", "max_tokens": 64, "extra_body": {"temperature": 0},
                          "messages": [{"role": "user", "content": f"cache me {uuid.uuid4().hex[:6]}"}]}
    a = sdk(gw, "alice").messages.with_raw_response.create(**kw)
    hit = sdk(gw, "alice").messages.with_raw_response.create(**kw)
    assert (a.headers["x-thinkgate-cache"], hit.headers["x-thinkgate-cache"]) == ("miss", "hit")
    assert hit.parse().content == a.parse().content
    assert_metered(gw, hit.headers["x-request-id"], hit.parse().usage, "long", cached=True)
    assert sdk(gw, "bob").messages.with_raw_response.create(**kw).headers["x-thinkgate-cache"] == "miss"
    events = list(sdk(gw, "alice").messages.create(**kw, stream=True))  # a hit, replayed as a stream
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")  # type: ignore[union-attr]
    assert text == a.parse().content[-1].text  # type: ignore[union-attr]


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    # Anthropic's own rules, not OpenAI's: temperature and top_p in [0, 1] (1.5 passed as a chat temperature)
    ({"temperature": 1.5}, "temperature"), ({"top_p": -0.1}, "top_p"),
    ({"max_tokens": "x"}, "max_tokens"),  # it said "'max_tokens' is required" of a field that was there
    ({"metadata": {"user_id": 7}}, "metadata.user_id"),  # dropped silently
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),  # no text: an empty prompt, billed
])
def test_refused_fields_are_anthropic_400s(gw: GatewayServer, body: dict[str, Any], param: str) -> None:
    base = {"model": "short", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(gw.base_url + "/messages", json={**base, **body}, headers={"x-api-key": SECRETS["alice"]},
                   timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert param.split(".")[0] in r.json()["error"]["message"] or param in r.json()["error"]["message"]


@pytest.mark.parametrize("budget,max_tokens", [(64, 64), (100, 64)])
def test_thinking_budget_not_below_max_tokens_is_anthropic_400(gw: GatewayServer, upstream_sim: SimProcess,
                                                               budget: int, max_tokens: int) -> None:
    """Anthropic's rule: ``max_tokens`` must be greater than ``thinking.budget_tokens`` (thinking counts toward
    ``max_tokens``); refused before any upstream call, streamed or not."""
    before = upstream_sim.stats()["requests"]
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as err:
            sdk(gw).messages.create(model="long", max_tokens=max_tokens, messages=[{"role": "user", "content": USER}],
                                    thinking={"type": "enabled", "budget_tokens": budget}, stream=stream)
        body = err.value.body
        assert isinstance(body, dict) and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error"
        assert "`max_tokens` must be greater than `thinking.budget_tokens`" in body["error"]["message"]
    assert upstream_sim.stats()["requests"] == before


def test_interleaved_thinking_beta_lets_the_budget_exceed_max_tokens(gw: GatewayServer) -> None:
    """With ``anthropic-beta: interleaved-thinking-2025-05-14`` the budget spans the turn's thinking blocks and may
    exceed ``max_tokens`` (as on Anthropic's API)."""
    m = sdk(gw).messages.create(model="long", max_tokens=4, messages=[{"role": "user", "content": USER}],
                                thinking={"type": "enabled", "budget_tokens": 16},
                                extra_headers={"anthropic-beta": "foo-2025-01-01, interleaved-thinking-2025-05-14"})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 4


def test_small_thinking_budget_is_a_documented_relaxation(gw: GatewayServer) -> None:
    """Anthropic's ``budget_tokens >= 1024`` is relaxed to ``>= 1``: the local tiers think in tens of tokens."""
    m = sdk(gw).messages.create(model="long", max_tokens=64, messages=[{"role": "user", "content": USER}],
                                thinking={"type": "enabled", "budget_tokens": 3})
    assert m.content[0].thinking == " ".join(reasoning_words(USER)[:3])  # type: ignore[union-attr]


def test_stop_sequences(gw: GatewayServer) -> None:
    kw: dict[str, Any] = {"model": "long", "max_tokens": 64, "stop_sequences": ["seven"],
                          "messages": [{"role": "user", "content": USER}]}
    m = sdk(gw).messages.create(**kw)
    assert m.content[-1].text == "echo: what is"  # type: ignore[union-attr]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "seven")
    events = list(sdk(gw).messages.create(**kw, stream=True))
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", "seven")  # type: ignore[union-attr]


def test_count_tokens_keeps_the_keys_tier_policy(gw: GatewayServer, redis_url: str) -> None:
    """A key held to one tier was counted on any (``x-thinkgate-tier: long``): count_tokens now routes as a
    message does — 403 for a tier the key may not use."""
    from tests.fixtures.gateway import create_key

    secret = create_key(redis_url, gw.settings.redis.key_prefix, f"one-{uuid.uuid4().hex[:8]}", allowed_tiers=["short"])
    body = {"model": "auto", "max_tokens": 16, "messages": [{"role": "user", "content": USER}]}
    head = {"x-api-key": secret, "anthropic-version": "2023-06-01"}
    r = httpx.post(gw.base_url + "/messages/count_tokens", json=body, headers={**head, "x-thinkgate-tier": "long"},
                   timeout=10)
    assert r.status_code == 403 and r.json()["type"] == "error", r.text
    ok = httpx.post(gw.base_url + "/messages/count_tokens", json=body, headers={**head, "x-thinkgate-tier": "short"},
                    timeout=10)
    assert ok.status_code == 200 and ok.headers["x-thinkgate-tier"] == "short", ok.text


def test_count_tokens(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    msgs = [{"role": "user", "content": USER}]
    before = upstream_sim.stats()["requests"]
    n = sdk(gw).messages.count_tokens(model="auto", system="Be brief.", messages=msgs)  # type: ignore[arg-type]
    assert n.input_tokens == len(("Be brief. " + USER).split()) + 3 * 2  # the simulator's /tokenize
    # the same count as the message's own usage, and nothing generated
    m = sdk(gw).messages.create(model="short", max_tokens=16, system="Be brief.", messages=msgs)  # type: ignore[arg-type]
    assert m.usage.input_tokens == n.input_tokens
    assert upstream_sim.stats()["requests"] == before + 1


def test_the_anthropic_sdk_lists_and_retrieves_models(gw: GatewayServer) -> None:
    """``models.list`` / ``models.retrieve`` of the Anthropic SDK (``x-api-key``, ``anthropic-version``): its own
    page and ``ModelInfo`` shape, and its error shape — it got a 401 (Bearer only), then OpenAI-shaped cards with
    ``created_at``, ``display_name`` and ``type`` all None. The OpenAI SDK still gets OpenAI's list."""
    page = sdk(gw).models.list()
    ids = [m.id for m in page.data]
    assert ids[0] == "auto" and {"short", "long"} <= set(ids)
    assert all(m.type == "model" and m.display_name == m.id and m.created_at.year >= 2024 for m in page.data)
    assert page.has_more is False and (page.first_id, page.last_id) == (ids[0], ids[-1])
    one = sdk(gw).models.retrieve("long")
    assert (one.id, one.type) == ("long", "model")
    with pytest.raises(anthropic.NotFoundError) as nf:
        sdk(gw).models.retrieve("nope")
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    bad = anthropic.Anthropic(base_url=gw.url, api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError):
        bad.models.list()
    import openai

    listed = openai.OpenAI(base_url=gw.base_url, api_key=SECRETS["alice"], max_retries=0).models.list()
    assert listed.data[0].id == "auto" and listed.data[0].object == "model"


def test_a_content_filter_finish_is_a_refusal(gw: GatewayServer) -> None:
    """An upstream that stopped on its content filter (``finish_reason: content_filter``) answers
    ``stop_reason: refusal`` — Anthropic's value for a declined answer —, not ``end_turn`` (a normal answer)."""
    filtered = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "I can't help with that."},
                             "finish_reason": "content_filter"}]}
    m = sdk(gw).messages.create(model="short", max_tokens=64, messages=[{"role": "user", "content": USER}],
                                extra_body={"sim": {"inject": filtered}})
    assert m.stop_reason == "refusal" and m.stop_sequence is None
    assert [b.type for b in m.content] == ["text"]


def _choice(index: Any) -> dict[str, Any]:
    return {"choices": [{"index": index, "delta": {"content": "x"}, "finish_reason": None}]}


def _call(index: Any) -> dict[str, Any]:
    call = {"index": index, "id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": "{"}}
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}


NO_INTEGER_INDEX = [
    pytest.param(_choice("x"), "choice", id="choice-string"),
    pytest.param(_choice([0]), "choice", id="choice-list"),
    pytest.param(_choice("0"), "choice", id="choice-digit-string"),
    pytest.param(_choice(0.5), "choice", id="choice-float-below-1"),
    pytest.param(_choice(1.5), "choice", id="choice-float"),
    pytest.param(_choice(True), "choice", id="choice-true"),
    pytest.param(_choice(False), "choice", id="choice-false"),
    pytest.param(_call("x"), "tool call", id="tool-call-string"),
    pytest.param(_call(0.0), "tool call", id="tool-call-float"),
]


@pytest.mark.parametrize(("bad", "what"), NO_INTEGER_INDEX)
def test_a_chunk_whose_index_is_no_integer_ends_the_stream_with_an_error_event(gw: GatewayServer,
                                                                               bad: dict[str, Any],
                                                                               what: str) -> None:
    """A chunk whose choice (or tool call) ``index`` is no integer — which choice or call its delta belongs to is
    unknown — ends the stream with Anthropic's ``error`` event (``api_error``; the SDK raises it) that names the
    upstream's fault, once the answer was read to its end, metered as the whole call it was (200, the upstream's
    usage). ``int(index or 0)`` decided by value: ``"x"`` and ``[0]`` raised (said as the gateway's own failure),
    ``"0"``, ``0.5`` and ``false`` were relayed as choice 0, ``1.5`` and ``true`` dropped, a tool call's odd index
    was call 0 — those streams ended as a whole ``end_turn`` message."""
    with sdk(gw).messages.with_streaming_response.create(
            model="long", max_tokens=200, messages=[{"role": "user", "content": USER}], stream=True,
            extra_body={"sim": {**tag()["sim"], "inject": bad}}) as raw:
        request_id = raw.headers["x-request-id"]
        with pytest.raises(anthropic.APIStatusError) as err:
            list(raw.parse())
    assert err.value.body == {"type": "error", "error": {
        "type": "api_error", "message": f"the upstream sent a {what} index that is no integer"}}
    rows = events_of(gw, request_id)
    assert len(rows) == 1, rows
    assert (rows[0]["status"], rows[0]["partial"], rows[0]["usage_source"]) == (200, False, "upstream"), rows[0]


def test_tool_arguments_nested_too_deep_to_write_back_are_an_empty_input(gw: GatewayServer) -> None:
    """A non-streamed answer whose tool call's arguments nest deeper than the gateway writes JSON (orjson: 254 levels,
    reading 1,024) answers 200 with ``input: {}``, as arguments that are no JSON object do. It was a 500 for an answer
    generated and billed (the SDKs retry a 500: billed again)."""
    deep = '{"a":' * 300 + "1" + "}" * 300
    call = {"id": "call_deep", "type": "function", "function": {"name": "get_weather", "arguments": deep}}
    inject = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                           "finish_reason": "tool_calls"}]}
    raw = sdk(gw).messages.with_raw_response.create(
        model="long", max_tokens=200, messages=[{"role": "user", "content": USER}], tools=[WEATHER],
        extra_body={"sim": {**tag()["sim"], "inject": inject}})
    m = raw.parse()
    assert m.stop_reason == "tool_use"
    assert [(b.type, b.id, b.input) for b in m.content] == [("tool_use", "call_deep", {})]  # type: ignore[union-attr]
    assert_metered(gw, raw.headers["x-request-id"], m.usage, "long")
