"""A ``forced`` tier (two-phase budget forcing) over an upstream that does not answer its phases as a clean SSE
stream: the whole answer as one JSON document (``application/json``), or an engine error — an in-stream
``{"error": …}`` event or such a document as the body — in the thought phase or the answer phase.

The relay serves the first as the stream it would have been and passes the second on as the in-stream error
(``tests/gateway/test_gateway_faults.py``); a forced tier must do the same, and meter the call as the relay does.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from gateway.ledger.record import UsageRecord
from tests.fixtures.upstream import (
    TEST_KEY,
    GatewayServer,
    SimProcess,
    StreamRead,
    sim_settings,
    sim_tiers,
    wait_for,
)

BUDGET = 8
QUESTION = "Start with 7. Add 5, then multiply by 3. What is the result of all these steps?"
MESSAGES = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def forced(upstream_sim: SimProcess, redis_url: str) -> Iterator[tuple[GatewayServer, list[UsageRecord]]]:
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"budget_mode": "forced", "thinking_budget": BUDGET, "max_tokens": 64})
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as gw:
        records: list[UsageRecord] = []
        gw.app.state.proxy.usage_sinks.append(records.append)
        yield gw, records


def _client(gw: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=30)


def _streamed(client: openai.OpenAI, sim: dict[str, Any]) -> tuple[str, str, str | None, dict[str, Any] | None]:
    """(reasoning, content, finish_reason, usage) of a streamed forced answer with ``include_usage``."""
    got = StreamRead().read(client.chat.completions.create(  # type: ignore[call-overload]
        model="short", messages=MESSAGES, stream=True, stream_options={"include_usage": True}, extra_body={"sim": sim}))
    return got.reasoning, got.content, got.finish, got.usage


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tier_serves_phases_answered_with_a_json_body(
        forced: tuple[GatewayServer, list[UsageRecord]], stream: bool) -> None:
    """Both phases answered 200 with one JSON document each: the same thought, answer and usage as over SSE, billed
    the usage the upstream reported. Read with the SSE parser, the phases had no ``data:`` line: the client got an
    empty thought and answer, a 200, and a usage of nothing."""
    gw, records = forced
    client = _client(gw)
    before = len(records)
    if stream:
        sse = _streamed(client, {"fail": "none"})
        got = _streamed(client, {"fail": "json-body"})
    else:
        answers = [client.chat.completions.create(model="short", messages=MESSAGES, extra_body={"sim": {"fail": f}})
                   for f in ("none", "json-body")]
        sse, got = [((a.choices[0].message.model_extra or {}).get("reasoning"), a.choices[0].message.content,
                     a.choices[0].finish_reason, a.usage.model_dump(exclude_none=True) if a.usage else None)
                    for a in answers]
    reasoning, content, _, usage = got
    assert reasoning and 0 < len(reasoning.split()) <= BUDGET and content and content.startswith("echo:")
    assert got == sse
    assert wait_for(lambda: len(records) == before + 2, timeout_s=10)
    over_sse, rec = records[before:]
    assert (rec.status, rec.error_code, rec.partial, rec.usage_source) == (200, None, False, "upstream")
    assert usage is not None
    assert (rec.prompt_tokens, rec.completion_tokens, rec.reasoning_tokens) == (
        usage["prompt_tokens"], usage["completion_tokens"], usage["completion_tokens_details"]["reasoning_tokens"])
    assert rec.cost_micro_usd == over_sse.cost_micro_usd > 0


@pytest.mark.parametrize("mode", ["error-event", "json-error"])
@pytest.mark.parametrize("phase", [1, 2])
def test_a_phase_that_ends_in_an_engine_error_fails_the_stream(
        forced: tuple[GatewayServer, list[UsageRecord]], upstream_sim: SimProcess, mode: str, phase: int) -> None:
    """An engine error in either phase (an in-stream event, or the error document as the JSON body) reaches the
    client as the relay's in-stream error, and the call is metered as the relay meters a failed stream: status 502
    ``upstream_error``, partial, the deltas relayed and the prompt counted. It was skipped: phase 2 answered from
    a thought cut short (or the answer stopped), the client got a complete-looking 200 and was billed for one."""
    gw, records = forced
    before = len(records)
    tag = uuid.uuid4().hex
    with pytest.raises(openai.APIError) as info:
        _streamed(_client(gw), {"fail": mode, "tag": tag, "fail_from": phase - 1})
    assert "simulated engine error" in info.value.message
    seen = upstream_sim.tag(tag)
    assert seen is not None and seen["attempts"] == phase  # no answer phase after a failed thought
    assert wait_for(lambda: len(records) == before + 1, timeout_s=10)
    rec = records[-1]
    assert (rec.status, rec.error_code, rec.partial, rec.usage_source) == (502, "upstream_error", True, "counted")
    assert rec.prompt_tokens > 0
    if phase == 2:  # the thought was relayed before the answer phase failed: billed, as reasoning
        assert 0 < rec.reasoning_tokens <= rec.completion_tokens
        assert rec.cost_micro_usd > 0


@pytest.mark.parametrize("phase", [1, 2])
def test_a_non_streamed_forced_call_whose_phase_fails_is_a_502(
        forced: tuple[GatewayServer, list[UsageRecord]], phase: int) -> None:
    """Not streamed, the phases are streamed all the same: an engine error in one is the call's 502 (OpenAI's
    error shape, the upstream's message), not a 200 built around the gap nor a 500."""
    gw, records = forced
    before = len(records)
    with pytest.raises(openai.APIStatusError) as info:
        _client(gw).chat.completions.create(
            model="short", messages=MESSAGES,
            extra_body={"sim": {"fail": "error-event", "tag": uuid.uuid4().hex, "fail_from": phase - 1}})
    assert info.value.status_code == 502 and "simulated engine error" in info.value.message
    assert wait_for(lambda: len(records) == before + 1, timeout_s=10)
    assert (records[-1].status, records[-1].error_code) == (502, "upstream_error")


def test_a_phase_stream_that_ends_without_done_is_a_broken_stream(
        forced: tuple[GatewayServer, list[UsageRecord]]) -> None:
    """A phase answered with a JSON body that is no answer (the relay's broken stream): the client gets
    ``upstream_stream_broken``, as on a tier without forcing — it got an empty, complete-looking answer."""
    gw, records = forced
    before = len(records)
    with pytest.raises(openai.APIError) as info:
        _streamed(_client(gw), {"fail": "json-body", "inject": {"choices": "abc"}})
    assert info.value.body["code"] == "upstream_stream_broken"  # type: ignore[index]
    assert wait_for(lambda: len(records) == before + 1, timeout_s=10)
    assert (records[-1].status, records[-1].error_code) == (502, "upstream_stream_broken")
