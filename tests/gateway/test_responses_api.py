"""``POST /v1/responses`` through the official ``openai`` SDK against a real gateway over the upstream simulator:
content, reasoning, tools, JSON schema, streaming events, stored conversations, cache scoping, and usage that
matches the metered event to the token and micro-dollar (one event per request)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.ledger.pricing import cost_micro_usd
from tests.fixtures.gateway import SECRETS, accounting_gateway, cleanup
from tests.fixtures.metered import events_of
from tests.fixtures.upstream import GatewayServer, SimProcess
from tests.fixtures.upstream_sim import answer_words, reasoning_words, schema_value

USER = "what is seven times six"
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "reason": {"type": "string"}},
          "required": ["answer", "reason"], "additionalProperties": False}


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("respgw"), prefix) as g:
            yield g
    finally:
        cleanup(redis_url, prefix)


def sdk(gw: GatewayServer, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=SECRETS[who], max_retries=0, timeout=30)


def assert_metered(gw: GatewayServer, request_id: str, usage: Any, tier: str, cached: bool = False) -> dict[str, Any]:
    """Exactly one usage event for the request, with the answer's token counts and their exact price."""
    rows = events_of(gw, request_id)
    assert len(rows) == 1, rows
    ev = rows[0]
    assert ev["endpoint"] == "responses" and ev["tier"] == tier and ev["status"] == 200
    assert ev["prompt_tokens"] == usage.input_tokens
    assert ev["completion_tokens"] == usage.output_tokens
    assert ev["reasoning_tokens"] == usage.output_tokens_details.reasoning_tokens
    assert ev["cached_tokens"] == usage.input_tokens_details.cached_tokens
    prices = next(t.prices for t in gw.settings.tiers if t.name == tier)
    price = cost_micro_usd(prices, prompt_tokens=usage.input_tokens,
                           cached_tokens=usage.input_tokens_details.cached_tokens,
                           completion_tokens=usage.output_tokens)
    assert (ev["cost_micro_usd"], ev["saved_micro_usd"]) == ((0, price) if cached else (price, 0))
    return ev


def tag() -> dict[str, Any]:
    return {"sim": {"tag": uuid.uuid4().hex}}


def test_plain_text_reasoning_and_usage_match_the_event(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    extra = tag()
    raw = sdk(gw).responses.with_raw_response.create(model="long", input=USER, instructions="Be brief.",
                                                     max_output_tokens=200, metadata={"run": "1"},
                                                     extra_body=extra)
    assert raw.headers["x-thinkgate-tier"] == "long"
    r = raw.parse()
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == " ".join(answer_words(USER))
    prompt = "Be brief.\n" + USER
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == " ".join(reasoning_words(prompt))  # type: ignore[union-attr,index]
    assert r.metadata == {"run": "1"} and r.instructions == "Be brief." and r.max_output_tokens == 200
    assert r.usage is not None
    assert r.usage.input_tokens == len(prompt.split()) + 3 * 2
    assert r.usage.output_tokens == len(reasoning_words(prompt)) + len(answer_words(USER))
    assert r.usage.output_tokens_details.reasoning_tokens == len(reasoning_words(prompt))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert_metered(gw, raw.headers["x-request-id"], r.usage, "long")
    sent = upstream_sim.tag(extra["sim"]["tag"])["body"]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": USER}]
    assert sent["max_tokens"] == 200 and "metadata" not in sent and "input" not in sent


def test_streamed_typed_events_and_completed_usage(gw: GatewayServer) -> None:
    with sdk(gw).responses.with_streaming_response.create(model="long", input=USER, stream=True) as raw:
        request_id = raw.headers["x-request-id"]
        events = list(raw.parse())
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("response.output_item.added", "response.reasoning_text.delta", "response.content_part.added",
                 "response.output_text.delta", "response.output_text.done", "response.output_item.done"):
        assert kind in types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    assert text == " ".join(answer_words(USER)) and thought == " ".join(reasoning_words(USER))
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.status == "completed"
    assert final.usage.output_tokens == len(reasoning_words(USER)) + len(answer_words(USER))
    assert_metered(gw, request_id, final.usage, "long")


def test_function_tool_round_trip_by_items_and_by_previous_response_id(
    gw: GatewayServer, upstream_sim: SimProcess
) -> None:
    client = sdk(gw)
    question = "weather in Paris today"
    first = client.responses.with_raw_response.create(model="short", input=question, tools=[WEATHER_TOOL],
                                                      tool_choice="auto")
    r1 = first.parse()
    calls = [item for item in r1.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert args == {"city": question}
    assert r1.usage is not None
    assert_metered(gw, first.headers["x-request-id"], r1.usage, "short")
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny 21 C"}
    # 1. stateless: the whole conversation as items (the SDK's own output items passed back)
    extra = tag()
    r2 = client.responses.create(
        model="short", tools=[WEATHER_TOOL], store=False, extra_body=extra,
        input=[{"role": "user", "content": question}, *[i.model_dump(exclude_none=True) for i in r1.output], result],
    )
    assert r2.output_text == "result: sunny 21 C"
    sent = upstream_sim.tag(extra["sim"]["tag"])["body"]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert sent[1]["tool_calls"][0]["id"] == calls[0].call_id and sent[2]["tool_call_id"] == calls[0].call_id
    # 2. stateful: previous_response_id (stored in Redis) + only the tool output
    extra = tag()
    r3 = client.responses.create(model="short", tools=[WEATHER_TOOL], previous_response_id=r1.id, input=[result],
                                 extra_body=extra)
    assert r3.output_text == "result: sunny 21 C" and r3.previous_response_id == r1.id
    assert upstream_sim.tag(extra["sim"]["tag"])["body"]["messages"] == sent
    # store: false → nothing to continue from
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="short", previous_response_id=r2.id, input="and tomorrow?")
    assert err.value.code == "previous_response_not_found"


def test_streamed_function_call_arguments_relayed_intact(gw: GatewayServer) -> None:
    question = "weather in Rome"
    events = list(sdk(gw).responses.create(model="long", input=question, tools=[WEATHER_TOOL], stream=True,
                                           tool_choice={"type": "function", "name": "get_weather"}))
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(d.delta for d in deltas) == done.arguments  # type: ignore[union-attr]
    assert json.loads(done.arguments) == {"city": question}  # type: ignore[union-attr]
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    assert added.item.name == "get_weather"  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    call = next(i for i in final.output if i.type == "function_call")
    assert call.arguments == done.arguments and call.call_id == added.item.call_id  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output(gw: GatewayServer, upstream_sim: SimProcess, stream: bool) -> None:
    extra = tag()
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    if stream:
        events = list(sdk(gw).responses.create(model="short", input=USER, text=fmt, stream=True,  # type: ignore[arg-type]
                                               extra_body=extra))
        text = events[-1].response.output_text  # type: ignore[union-attr]
    else:
        text = sdk(gw).responses.create(model="short", input=USER, text=fmt, extra_body=extra).output_text  # type: ignore[arg-type]
    assert json.loads(text) == schema_value(SCHEMA, USER)
    sent = upstream_sim.tag(extra["sim"]["tag"])["body"]
    assert sent["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def test_reasoning_effort_picks_the_tier(gw: GatewayServer) -> None:
    raw = sdk(gw).responses.with_raw_response.create(model="auto", input=USER, reasoning={"effort": "high"})
    assert (raw.headers["x-thinkgate-tier"], raw.headers["x-thinkgate-route-reason"]) == ("long", "effort")
    raw = sdk(gw).responses.with_raw_response.create(model="auto", input=USER, reasoning={"effort": "xhigh"})
    assert (raw.headers["x-thinkgate-tier"], raw.headers["x-thinkgate-route-reason"]) == ("long", "effort")
    raw = sdk(gw).responses.with_raw_response.create(model="auto", input=USER, reasoning={"effort": "none"})
    assert raw.headers["x-thinkgate-tier"] == "none"
    r = raw.parse()
    assert [i.type for i in r.output] == ["message"] and r.usage.output_tokens_details.reasoning_tokens == 0  # type: ignore[union-attr]


def test_max_output_tokens_makes_an_incomplete_response(gw: GatewayServer) -> None:
    r = sdk(gw).responses.create(model="long", input=USER, max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 5
    events = list(sdk(gw).responses.create(model="long", input=USER, max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete"


def test_conversations_are_per_key(gw: GatewayServer) -> None:
    r = sdk(gw, "alice").responses.create(model="short", input="remember the number nine")
    with pytest.raises(openai.BadRequestError) as err:
        sdk(gw, "bob").responses.create(model="short", input="which number?", previous_response_id=r.id)
    assert err.value.code == "previous_response_not_found"
    again = sdk(gw, "alice").responses.create(model="short", input="which number?", previous_response_id=r.id)
    assert again.output_text == "echo: which number?"


def test_cache_hits_are_tenant_scoped_and_replay_streams(gw: GatewayServer) -> None:
    prompt = f"cache me {uuid.uuid4().hex[:6]}"
    a = sdk(gw, "alice").responses.with_raw_response.create(model="long", input=prompt, temperature=0)
    assert a.headers["x-thinkgate-cache"] == "miss"
    hit = sdk(gw, "alice").responses.with_raw_response.create(model="long", input=prompt, temperature=0)
    assert hit.headers["x-thinkgate-cache"] == "hit"
    assert hit.parse().output_text == a.parse().output_text
    ev = assert_metered(gw, hit.headers["x-request-id"], hit.parse().usage, "long", cached=True)
    assert ev["cached"] is True
    other = sdk(gw, "bob").responses.with_raw_response.create(model="long", input=prompt, temperature=0)
    assert other.headers["x-thinkgate-cache"] == "miss"  # another tenant never sees alice's entry
    with sdk(gw, "alice").responses.with_streaming_response.create(model="long", input=prompt, temperature=0,
                                                                   stream=True) as raw:
        assert raw.headers["x-thinkgate-cache"] == "hit"
        events = list(raw.parse())
    assert events[-1].response.output_text == a.parse().output_text  # type: ignore[union-attr]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        a.parse().output[0].content[0].text  # type: ignore[union-attr,index]


@pytest.mark.parametrize("body,param,code", [
    ({"background": True}, "background", "unsupported_parameter"),
    ({"tools": [{"type": "web_search"}]}, "tools.0", "unsupported_parameter"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0", "unsupported_parameter"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0", "unsupported_parameter"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_text"}]}]},
     "input.0.content.0.text", "invalid_request"),  # no text: it was sent upstream as an empty prompt, and billed
    ({"max_output_tokens": 0}, "max_output_tokens", None),
    ({"text": {"format": {"type": "yaml"}}}, "text.format", None),
    # a response has one answer: passed through to chat, n = 8 billed eight choices and showed one
    ({"n": 8}, "n", "unknown_parameter"),
    ({"best_of": 3}, "best_of", "unknown_parameter"),
])
def test_refused_fields_are_clear_400s(gw: GatewayServer, body: dict[str, Any], param: str, code: str | None) -> None:
    """Each refusal names the field, with the code docs/gateway.md's table gives (``unsupported_parameter`` for
    what the gateway does not serve)."""
    r = httpx.post(gw.base_url + "/responses", json={"model": "short", "input": "hi", **body},
                   headers={"authorization": f"Bearer {SECRETS['alice']}"}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    if code is not None:
        assert r.json()["error"]["code"] == code


@pytest.mark.parametrize("body,param,code,message", [
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "invalid_value",
     "Invalid value: 'extreme'. Supported values are: 'none', 'minimal', 'low', 'medium', 'high', 'xhigh', "
     "and 'max'."),
    ({"reasoning": {"effort": 3}}, "reasoning.effort", "invalid_type",
     "Invalid type for 'reasoning.effort': expected one of 'none', 'minimal', 'low', 'medium', 'high', 'xhigh', "
     "or 'max', but got an integer instead."),
    ({"reasoning": {"effort": "low", "budget": 10}}, "reasoning.budget", "unknown_parameter",
     "Unknown parameter: 'reasoning.budget'."),
    ({"reasoning": {"summary": "verbose"}}, "reasoning.summary", "invalid_value",
     "Invalid value: 'verbose'. Supported values are: 'auto', 'concise', and 'detailed'."),
    ({"reasoning": "high"}, "reasoning", "invalid_type",
     "Invalid type for 'reasoning': expected an object, but got a string instead."),
    ({"max_output_tokens": "64"}, "max_output_tokens", "invalid_type",
     "Invalid type for 'max_output_tokens': expected an integer, but got a string instead."),
    ({"max_output_tokens": True}, "max_output_tokens", "invalid_type",
     "Invalid type for 'max_output_tokens': expected an integer, but got a boolean instead."),
    ({"max_output_tokens": 0}, "max_output_tokens", "integer_below_min_value",
     "Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 1, but got 0 instead."),
])
def test_reasoning_and_max_output_tokens_are_checked_like_openai(
    gw: GatewayServer, upstream_sim: SimProcess, body: dict[str, Any], param: str, code: str, message: str
) -> None:
    """OpenAI's checks of ``reasoning`` (effort and summary values, unknown fields) and ``max_output_tokens``,
    with its error shape and codes — on a forced tier too, where nothing else would catch them; nothing is sent
    upstream."""
    before = upstream_sim.stats()["requests"]
    for model in ("short", "auto"):
        with pytest.raises(openai.BadRequestError) as err:
            sdk(gw).responses.create(model=model, input="hi", **body)
        assert err.value.status_code == 400
        assert (err.value.code, err.value.param, err.value.type) == (code, param, "invalid_request_error")
        assert isinstance(err.value.body, dict) and err.value.body["message"] == message
    assert upstream_sim.stats()["requests"] == before


def test_every_openai_effort_and_reasoning_field_is_accepted(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    """The whole enum passes on a forced tier (the upstream decides what it does with it); ``summary``,
    ``generate_summary``, ``context`` and ``mode`` are accepted and not sent upstream."""
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        extra = tag()
        r = sdk(gw).responses.create(model="short", input="hi", extra_body=extra,
                                     reasoning={"effort": effort, "summary": "auto",
                                                "generate_summary": "concise", "context": "current_turn",
                                                "mode": "standard"})
        assert r.status == "completed" and r.reasoning is not None and r.reasoning.effort == effort
        sent = upstream_sim.tag(extra["sim"]["tag"])["body"]
        assert sent["reasoning_effort"] == effort and "reasoning" not in sent


def test_missing_key_is_401(gw: GatewayServer) -> None:
    r = httpx.post(gw.base_url + "/responses", json={"model": "short", "input": "hi"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_retrieve_and_delete_a_stored_response(gw: GatewayServer) -> None:
    alice = sdk(gw, "alice")
    r = alice.responses.create(model="short", input="store this answer " + uuid.uuid4().hex)
    got = alice.responses.retrieve(r.id)  # the SDK's own call: GET /v1/responses/{id}
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    # a streamed answer is stored as its final response object
    with alice.responses.stream(model="short", input="stream and store " + uuid.uuid4().hex) as s:
        final = s.get_final_response()
    assert alice.responses.retrieve(final.id).output_text == final.output_text
    # another key's is not found; store: false is not kept
    with pytest.raises(openai.NotFoundError) as err:
        sdk(gw, "bob").responses.retrieve(r.id)
    assert err.value.status_code == 404 and err.value.code == "not_found"
    unstored = alice.responses.create(model="short", input="do not keep " + uuid.uuid4().hex, store=False)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)
    # delete: only the owner's key, then it is gone (neither retrievable nor continuable)
    with pytest.raises(openai.NotFoundError):
        sdk(gw, "bob").responses.delete(r.id)
    d = httpx.delete(f"{gw.base_url}/responses/{r.id}", headers={"authorization": f"Bearer {SECRETS['alice']}"},
                     timeout=10)
    assert d.status_code == 200 and d.json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as cont:
        alice.responses.create(model="short", input="and now?", previous_response_id=r.id)
    assert cont.value.code == "previous_response_not_found"
    assert httpx.get(f"{gw.base_url}/responses/{final.id}", timeout=10).status_code == 401  # no key


def test_the_item_the_cap_cut_is_incomplete(gw: GatewayServer) -> None:
    """``max_output_tokens`` hit: the item being written when the cap came is ``status: incomplete`` (OpenAI's item
    statuses: in_progress, completed, incomplete), streamed and not — it was marked ``completed``."""
    r = sdk(gw).responses.create(model="long", input=USER, max_output_tokens=5)
    assert r.status == "incomplete" and r.output[-1].status == "incomplete"  # type: ignore[union-attr]
    events = list(sdk(gw).responses.create(model="long", input=USER, max_output_tokens=5, stream=True))
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done and done[-1].item.status == "incomplete"  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == "response.incomplete" and final.output[-1].status == "incomplete"



def failed_stream(gw: GatewayServer, fail: str = "error-event") -> tuple[list[Any], str]:
    """(the events, the request id) of a stream whose upstream fails halfway (``fail``: the simulator's fault —
    ``error-event`` sends an error event, ``drop`` aborts the connection)."""
    # chunk_delay_ms: the fault in a network read of its own; a drop read with the frames before it is raised by
    # aiohttp before what it buffered is handed over, and a loaded box relays nothing (see test_tools_paths.py)
    sim = {"fail": fail, "chunk_delay_ms": 20}
    with sdk(gw).responses.with_streaming_response.create(model="long", input="tell me a story", stream=True,
                                                          extra_body={"sim": sim}) as raw:
        events = list(raw.parse())
    assert events[-1].type == "response.failed"
    return events, raw.headers["x-request-id"]


def test_the_item_a_failure_cut_is_incomplete(gw: GatewayServer) -> None:
    """An upstream error mid-stream: the item it cut is ``incomplete`` in its ``output_item.done`` and in
    ``response.failed`` — it was marked ``completed``."""
    events, _ = failed_stream(gw)
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done and done[-1].item.status == "incomplete"
    assert events[-1].response.output[-1].status == "incomplete"


def test_a_failed_stream_says_server_error(gw: GatewayServer) -> None:
    """``response.failed`` carries one of OpenAI's Responses error codes (``ResponseError.code``:
    ``server_error``, ...); it carried the upstream's ``"500"``."""
    failed = failed_stream(gw)[0][-1].response
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "server_error"
    assert failed.error.message == "simulated engine error"


def assert_usage_is_the_record(usage: Any, ev: dict[str, Any]) -> None:
    """A ``response`` object's ``usage`` says the counts its usage event was metered."""
    assert usage is not None, ev
    assert (usage.input_tokens, usage.output_tokens, usage.output_tokens_details.reasoning_tokens,
            usage.input_tokens_details.cached_tokens, usage.total_tokens) == (
        ev["prompt_tokens"], ev["completion_tokens"], ev["reasoning_tokens"], ev["cached_tokens"],
        ev["prompt_tokens"] + ev["completion_tokens"])


@pytest.mark.parametrize(("fail", "code"), [("error-event", "upstream_error"), ("drop", "upstream_stream_broken")])
def test_a_failed_stream_carries_the_usage_it_was_metered(gw: GatewayServer, fail: str, code: str) -> None:
    """``response.failed`` carries the usage the failed call was metered (the prompt and the deltas read, counted),
    as OpenAI's carries the usage it knows — it said ``usage: null`` for a call billed."""
    events, request_id = failed_stream(gw, fail)
    rows = events_of(gw, request_id)
    assert len(rows) == 1, rows
    ev = rows[0]
    assert (ev["status"], ev["error_code"], ev["partial"]) == (502, code, True), ev
    assert ev["prompt_tokens"] > 0 and ev["completion_tokens"] > 0, ev
    assert_usage_is_the_record(events[-1].response.usage, ev)


#: a chunk no translator expects after the first one: a choice whose ``index`` is no integer (the relay passes it on)
BAD_INDEX = {"choices": [{"index": "x", "delta": {"content": "x"}, "finish_reason": None}]}


def test_a_chunk_the_translator_fails_on_ends_the_stream_as_failed(gw: GatewayServer) -> None:
    """The translation raising (here on a chunk it did not expect) ends the stream with ``response.failed``
    (``server_error``) carrying the usage metered, once the answer was read to its end: metered as the whole call it
    was (200, the upstream's usage). It broke the stream (no closing event: the SDK's read failed) and was metered as
    the client's disconnect (499, partial)."""
    with sdk(gw).responses.with_streaming_response.create(
            model="long", input=USER, stream=True, extra_body={"sim": {**tag()["sim"], "inject": BAD_INDEX}}) as raw:
        events = list(raw.parse())
    assert events[-1].type == "response.failed", [e.type for e in events]
    failed = events[-1].response
    assert failed.error is not None and failed.error.code == "server_error"
    rows = events_of(gw, raw.headers["x-request-id"])
    assert len(rows) == 1, rows
    assert (rows[0]["status"], rows[0]["partial"], rows[0]["usage_source"]) == (200, False, "upstream"), rows[0]
    assert_usage_is_the_record(failed.usage, rows[0])


@pytest.mark.parametrize(("index", "call_index", "what"), [
    pytest.param("0", 0, "choice", id="choice-digit-string"),
    pytest.param(1.5, 0, "choice", id="choice-float"),
    pytest.param(0, "x", "tool call", id="tool-call-string"),
])
def test_a_chunk_whose_index_is_no_integer_ends_the_stream_as_failed(gw: GatewayServer, index: Any, call_index: Any,
                                                                     what: str) -> None:
    """A choice or tool-call ``index`` that is no integer ends the stream with ``response.failed`` naming the
    upstream's fault, metered as the whole call. ``"0"`` was relayed as choice 0, ``1.5`` dropped, a tool call's
    ``"x"`` taken for call 0: each stream ended as a ``completed`` response."""
    call = {"index": call_index, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{"}}
    bad = {"choices": [{"index": index, "delta": {"content": "x", "tool_calls": [call]}, "finish_reason": None}]}
    with sdk(gw).responses.with_streaming_response.create(
            model="long", input=USER, stream=True, extra_body={"sim": {**tag()["sim"], "inject": bad}}) as raw:
        events = list(raw.parse())
    assert events[-1].type == "response.failed", [e.type for e in events]
    failed = events[-1].response
    assert failed.error is not None and (failed.error.code, failed.error.message) == (
        "server_error", f"the upstream sent a {what} index that is no integer")
    rows = events_of(gw, raw.headers["x-request-id"])
    assert len(rows) == 1, rows
    assert (rows[0]["status"], rows[0]["partial"], rows[0]["usage_source"]) == (200, False, "upstream"), rows[0]
    assert_usage_is_the_record(failed.usage, rows[0])
