"""Tools and structured outputs through every path of the gateway: streamed tool-call deltas relayed intact on
chat, cached replays (JSON and streamed) that keep tool calls and reasoning on chat, Responses and Messages,
and a cascade tier (``escalate_on: [empty_answer]``) that does not mistake a tool call for an empty answer."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.fixtures.gateway import SECRETS, accounting_gateway, cleanup
from tests.fixtures.upstream import GatewayServer, SimProcess, sim_tiers

CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
RESP_TOOL = {"type": "function", "name": "get_weather", "parameters": CHAT_TOOL["function"]["parameters"]}
MSG_TOOL = {"name": "get_weather", "input_schema": CHAT_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1]["escalate_on"] = ["empty_answer"]  # short: a cascade tier, as in the shipped defaults
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("toolgw"), prefix,
                                tiers=tiers) as g:
            yield g
    finally:
        cleanup(redis_url, prefix)


def oai(gw: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=SECRETS["alice"], max_retries=0, timeout=30)


def ant(gw: GatewayServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=SECRETS["alice"], max_retries=0, timeout=30)


def q(text: str = "weather in Oslo") -> str:
    return f"{text} {uuid.uuid4().hex[:6]}"


def chat_stream_calls(chunks: Any) -> tuple[list[dict[str, Any]], str, str | None]:
    """(tool calls assembled from the deltas, reasoning text, finish reason) of a chat stream."""
    calls: dict[int, dict[str, Any]] = {}
    reasoning, finish = "", None
    for c in chunks:
        for ch in c.choices:
            reasoning += getattr(ch.delta, "reasoning", None) or ""
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or ():
                slot = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                slot["id"] = d.id or slot["id"]
                slot["name"] = (d.function.name if d.function else None) or slot["name"]
                slot["arguments"] += (d.function.arguments if d.function else None) or ""
    return [calls[i] for i in sorted(calls)], reasoning, finish


def test_chat_streamed_tool_call_deltas_are_relayed_intact(gw: GatewayServer) -> None:
    question = q()
    msgs = [{"role": "user", "content": question}]
    plain = oai(gw).chat.completions.create(model="long", messages=msgs, tools=[CHAT_TOOL])  # type: ignore[arg-type,list-item]
    call = plain.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert plain.choices[0].finish_reason == "tool_calls" and plain.choices[0].message.content is None
    calls, _, finish = chat_stream_calls(oai(gw).chat.completions.create(
        model="long", messages=msgs, tools=[CHAT_TOOL], stream=True))  # type: ignore[arg-type,list-item]
    assert finish == "tool_calls"
    assert calls == [{"id": call.id, "name": "get_weather", "arguments": call.function.arguments}]  # type: ignore[union-attr]
    assert json.loads(calls[0]["arguments"]) == {"city": " ".join(question.split()[:8]), "days": 4}


def test_a_cut_tool_call_stream_is_metered_on_its_relayed_deltas(gw: GatewayServer) -> None:
    """The upstream drops a tool-call stream: the usage event counts what was relayed (one token per delta), as for
    text. Tool-call deltas were not counted: 0 tokens, cost 0, for output the client received."""
    import httpx

    from tests.fixtures.metered import events_of

    # chunk_delay_ms: each frame in a network read of its own. Without it a loaded box can read the frames and the
    # drop in one go, and aiohttp raises the drop before handing over what it buffered: 0 relayed (a CI run).
    body = {"model": "none", "stream": True, "tools": [CHAT_TOOL], "sim": {"fail": "drop", "chunk_delay_ms": 20},
            "messages": [{"role": "user", "content": q("what is the weather in the city of paris this week")}]}
    with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {SECRETS['alice']}"}) as r:
        rid = r.headers["x-request-id"]
        payloads = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(p) for p in payloads if p != "[DONE]"]
    relayed = sum(1 for c in chunks for ch in c.get("choices") or ()
                  if any((d.get("function") or {}).get("arguments") or (d.get("function") or {}).get("name")
                         for d in (ch.get("delta") or {}).get("tool_calls") or ()))
    assert relayed >= 3 and "error" in chunks[-1]  # cut after some argument deltas, ended by an error event
    [ev] = events_of(gw, rid)
    assert ev["partial"] is True and ev["usage_source"] == "counted"
    assert ev["completion_tokens"] == relayed and ev["cost_micro_usd"] > 0


def test_a_tool_call_is_not_an_empty_answer_for_the_cascade(gw: GatewayServer) -> None:
    msgs = [{"role": "user", "content": q()}]
    for stream in (False, True):
        raw = oai(gw).chat.completions.with_raw_response.create(model="short", messages=msgs, tools=[CHAT_TOOL],  # type: ignore[arg-type,list-item]
                                                               stream=stream)
        assert (raw.headers["x-thinkgate-tier"], raw.headers["x-thinkgate-route-reason"]) == ("short", "forced")
    raw = oai(gw).responses.with_raw_response.create(model="short", input=q(), tools=[RESP_TOOL])  # type: ignore[list-item]
    assert raw.headers["x-thinkgate-route-reason"] == "forced"
    assert [i.type for i in raw.parse().output][-1] == "function_call"
    raw = ant(gw).messages.with_raw_response.create(model="short", max_tokens=64, tools=[MSG_TOOL],  # type: ignore[list-item]
                                                    messages=[{"role": "user", "content": q()}])
    assert raw.headers["x-thinkgate-route-reason"] == "forced" and raw.parse().stop_reason == "tool_use"
    # the control, an answer that really is empty (the tier's cap cut it in its thought) escalating on
    # ``empty_answer``, is tests/gateway/test_gateway_budget.py::test_escalation_when_cut_inside_the_thought: cut by
    # the client's own max_tokens it stays (test_no_escalation_when_the_clients_own_max_tokens_cut_it)


def test_chat_cached_replay_keeps_tool_calls_and_reasoning(gw: GatewayServer) -> None:
    kw: dict[str, Any] = {"model": "long", "messages": [{"role": "user", "content": q()}], "tools": [CHAT_TOOL],
                          "temperature": 0}
    first = oai(gw).chat.completions.with_raw_response.create(**kw)
    hit = oai(gw).chat.completions.with_raw_response.create(**kw)
    assert (first.headers["x-thinkgate-cache"], hit.headers["x-thinkgate-cache"]) == ("miss", "hit")
    a, b = first.parse().choices[0].message, hit.parse().choices[0].message
    assert b.tool_calls == a.tool_calls and b.reasoning == a.reasoning  # type: ignore[attr-defined]
    with oai(gw).chat.completions.with_streaming_response.create(**kw, stream=True) as raw:
        assert raw.headers["x-thinkgate-cache"] == "hit"
        calls, reasoning, finish = chat_stream_calls(raw.parse())
    assert calls == [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
                     for c in a.tool_calls or ()]
    assert reasoning == a.reasoning and finish == "tool_calls"  # type: ignore[attr-defined]


def test_responses_and_messages_cached_streamed_replays_keep_tool_calls(gw: GatewayServer) -> None:
    kw: dict[str, Any] = {"model": "long", "input": q(), "tools": [RESP_TOOL], "temperature": 0}
    first = oai(gw).responses.create(**kw)
    call = next(i for i in first.output if i.type == "function_call")
    with oai(gw).responses.with_streaming_response.create(**kw, stream=True) as raw:
        assert raw.headers["x-thinkgate-cache"] == "hit"
        events = list(raw.parse())
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments  # type: ignore[union-attr]
    final = next(i for i in events[-1].response.output if i.type == "function_call")  # type: ignore[union-attr]
    assert (final.call_id, final.name) == (call.call_id, call.name)  # type: ignore[union-attr]
    assert "response.reasoning_text.delta" in {e.type for e in events}

    mk: dict[str, Any] = {"model": "long", "max_tokens": 64, "tools": [MSG_TOOL], "extra_body": {"temperature": 0},
                          "messages": [{"role": "user", "content": q()}]}
    m = ant(gw).messages.create(**mk)
    use = next(b for b in m.content if b.type == "tool_use")
    with ant(gw).messages.with_streaming_response.create(**mk, stream=True) as raw:
        assert raw.headers["x-thinkgate-cache"] == "hit"
        events = list(raw.parse())
    parts = "".join(e.delta.partial_json for e in events
                    if e.type == "content_block_delta" and e.delta.type == "input_json_delta")  # type: ignore[union-attr]
    assert json.loads(parts) == use.input  # type: ignore[union-attr]
    start = next(e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use")
    assert start.content_block.id == use.id  # type: ignore[union-attr]
    # thinking not asked for: no thinking block, as Anthropic's API
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["tool_use"]  # type: ignore[union-attr]


def test_a_forced_budget_tier_keeps_the_tool_call(upstream_sim: SimProcess, redis_url: str,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two-phase budget forcing (``budget_mode: forced``): the answer phase's tool call reaches the client,
    JSON and streamed, and through the Responses translation."""
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1]["budget_mode"] = "forced"
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("forcedtools"), prefix,
                                tiers=tiers) as fgw:
            question = q()
            msgs = [{"role": "user", "content": question}]
            plain = oai(fgw).chat.completions.create(model="short", messages=msgs, tools=[CHAT_TOOL])  # type: ignore[arg-type,list-item]
            choice = plain.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
            args = json.loads(choice.message.tool_calls[0].function.arguments)  # type: ignore[union-attr]
            assert args["city"].startswith("weather in Oslo")
            calls, reasoning, finish = chat_stream_calls(oai(fgw).chat.completions.create(
                model="short", messages=msgs, tools=[CHAT_TOOL], stream=True))  # type: ignore[arg-type,list-item]
            assert finish == "tool_calls" and reasoning
            assert [json.loads(c["arguments"]) for c in calls] == [args]
            r = oai(fgw).responses.create(model="short", input=question, tools=[RESP_TOOL])  # type: ignore[list-item]
            assert [i.type for i in r.output][-1] == "function_call"
    finally:
        cleanup(redis_url, prefix)
