"""A ``forced`` tier (two-phase budget forcing) over an upstream that does not answer its phases as a clean SSE
stream: the whole answer as one JSON document (``application/json``), or an engine error — an in-stream
``{"error": …}`` event or such a document as the body — in the thought phase or the answer phase.

The relay serves the first as the stream it would have been and passes the second on as the in-stream error
(``tests/gateway/test_gateway_faults.py``); a forced tier must do the same, and meter the call as the relay does.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import orjson
import pytest
import redis

from gateway.ledger.event import UsageEvent
from gateway.ledger.record import UsageRecord
from gateway.state.keys import RedisKeys
from tests.fixtures.upstream import (
    SESSION_PREFIX,
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


def _event(redis_url: str, request_id: str) -> UsageEvent:
    """The usage event of ``request_id`` in Redis (the ledger's event stream), once it was written."""
    client = redis.Redis.from_url(redis_url)
    found: list[UsageEvent] = []

    def written() -> bool:
        found[:] = [e for _, f in client.xrange(RedisKeys(SESSION_PREFIX).events)
                    if (e := UsageEvent.from_json(f[b"e"])).request_id == request_id]
        return bool(found)

    try:
        assert wait_for(written, timeout_s=10), f"no usage event of {request_id} in Redis"
    finally:
        client.close()
    return found[0]


@pytest.mark.parametrize("mode", ["error-event", "json-error"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_call_that_fails_in_phase_2_is_billed_the_thought_and_the_answer_phase_it_began(
        forced: tuple[GatewayServer, list[UsageRecord]], upstream_sim: SimProcess, redis_url: str, endpoint: str,
        mode: str) -> None:
    """Phase 1 completed and reported its usage; phase 2 was answered 200, then failed (an error event after some of
    the answer, or the error document as its body). Streamed or not, the call is billed the same: phase 1 as reported
    (its completion as reasoning), phase 2's prompt (phase 1's and the thought again) and the answer deltas it sent
    — in the usage event in Redis. Not streamed it was billed no tokens at all; streamed, phase 1's prompt (counted)
    and the deltas, not phase 2's prompt. The client's errors are unchanged (the tests above)."""
    gw, records = forced
    client = _client(gw)
    chat = endpoint == "chat"
    ask: dict[str, Any] = {"messages": MESSAGES} if chat else {"prompt": QUESTION}
    create = client.chat.completions.create if chat else client.completions.create
    whole = create(model="short", **ask, extra_body={"sim": {"fail": "none"}})  # type: ignore[operator]
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    thought = whole.usage.completion_tokens_details.reasoning_tokens  # phase 1's reported completion
    assert thought and 0 < thought < whole.usage.completion_tokens
    prompt1 = httpx.post(upstream_sim.root + "/tokenize", json=ask, timeout=5).json()["count"]

    before = len(records)
    got = StreamRead()
    with pytest.raises(openai.APIError, match="simulated engine error"):
        got.read(create(model="short", **ask, stream=True,  # type: ignore[operator]
                        extra_body={"sim": {"fail": mode, "tag": uuid.uuid4().hex, "fail_from": 1}}))
    with pytest.raises(openai.APIStatusError, match="simulated engine error") as info:
        create(model="short", **ask,  # type: ignore[operator]
               extra_body={"sim": {"fail": mode, "tag": uuid.uuid4().hex, "fail_from": 1}})
    assert info.value.status_code == 502
    assert wait_for(lambda: len(records) == before + 2, timeout_s=10)
    streamed, answered = (_event(redis_url, r.request_id) for r in records[before:])
    assert (streamed.stream, answered.stream) == (True, False)
    for ev in (streamed, answered):
        assert (ev.status, ev.error_code, ev.partial, ev.usage_source, ev.over_bound) == (
            502, "upstream_error", True, "counted", False)
        assert ev.reasoning_tokens == thought
        # phase 2's prompt re-reads phase 1's and the thought: both billed, never more than a complete call's
        assert 2 * prompt1 + thought <= ev.prompt_tokens <= whole.usage.prompt_tokens
        assert ev.cost_micro_usd > 0
    if chat:  # the answer deltas the client got before the error, one token each (none after an error body)
        assert streamed.completion_tokens == thought + got.deltas
        assert (got.deltas > 0) == (mode == "error-event")
    assert (answered.prompt_tokens, answered.completion_tokens, answered.reasoning_tokens, answered.cost_micro_usd) \
        == (streamed.prompt_tokens, streamed.completion_tokens, streamed.reasoning_tokens, streamed.cost_micro_usd)


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


@pytest.mark.parametrize("fault", [("error-event", "upstream_error"), ("close", "upstream_stream_broken")])
@pytest.mark.parametrize("thought", [3, 0])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_call_that_fails_in_phase_1_is_billed_its_prompt_and_the_thought_it_read(
        forced: tuple[GatewayServer, list[UsageRecord]], upstream_sim: SimProcess, redis_url: str, endpoint: str,
        thought: int, fault: tuple[str, str]) -> None:
    """Phase 1 was answered 200 and failed after ``thought`` deltas of the thought (an error event, or an end without
    ``[DONE]``), before its usage chunk: no answer phase. Streamed or not, the call is billed what the relay bills a
    failed stream — the prompt counted (the upstream's /tokenize) and one token per delta read, ``partial``,
    ``usage_source: counted`` — in the usage event in Redis. Not streamed it was billed nothing (the plain error was
    raised: no usage was known); streamed, a completion's phase 1 that broke before its first delta failed the
    priming of the stream and was billed nothing either. The client's errors are unchanged: 502 and its code."""
    gw, records = forced
    client = _client(gw)
    chat = endpoint == "chat"
    ask: dict[str, Any] = {"messages": MESSAGES} if chat else {"prompt": QUESTION}
    create = client.chat.completions.create if chat else client.completions.create
    prompt = httpx.post(upstream_sim.root + "/tokenize", json=ask, timeout=5).json()["count"]
    mode, code = fault
    # the sim's chunks: chat's role chunk first, then one word of the thought a chunk (completions: no role chunk)
    sim = {"fail": mode, "fail_at": thought + chat}

    before = len(records)
    got = StreamRead()
    with pytest.raises(openai.APIError):  # the upstream's error event as it came, or the relay's broken stream
        got.read(create(model="short", **ask, stream=True,  # type: ignore[operator]
                        extra_body={"sim": {**sim, "tag": uuid.uuid4().hex}}))
    assert len((got.reasoning if chat else got.content).split()) == thought  # what the client was relayed
    tag = uuid.uuid4().hex
    with pytest.raises(openai.APIStatusError) as info:
        create(model="short", **ask, extra_body={"sim": {**sim, "tag": tag}})  # type: ignore[operator]
    assert info.value.status_code == 502
    assert info.value.body["code"] == code  # type: ignore[index]
    seen = upstream_sim.tag(tag)
    assert seen is not None and seen["attempts"] == 1  # no answer phase after a failed thought
    assert wait_for(lambda: len(records) == before + 2, timeout_s=10)
    streamed, answered = (_event(redis_url, r.request_id) for r in records[before:])
    assert (streamed.stream, answered.stream) == (True, False)
    for ev in (streamed, answered):
        assert (ev.status, ev.error_code, ev.partial, ev.usage_source, ev.over_bound) == (
            502, code, True, "counted", False)
        # the relay's count: the prompt, one completion token a delta; a chat thought's deltas are reasoning
        assert (ev.prompt_tokens, ev.completion_tokens, ev.reasoning_tokens) == (
            prompt, thought, thought if chat else 0)
        assert ev.cost_micro_usd > 0
    assert answered.cost_micro_usd == streamed.cost_micro_usd




@contextlib.contextmanager
def _forced_gateway(upstream_sim: SimProcess, redis_url: str, escalate_on: list[str] | None,
                    read_timeout_s: float) -> Iterator[tuple[GatewayServer, list[UsageRecord]]]:
    """A gateway whose tier ``short`` is forced (:data:`BUDGET`), relayed as it comes (``escalate_on`` None) or
    peeked for escalation first; with the usage records it sinks."""
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"budget_mode": "forced", "thinking_budget": BUDGET, "max_tokens": 64,
                     "read_timeout_s": read_timeout_s})
    if escalate_on is not None:
        tiers[1]["escalate_on"] = escalate_on
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as gw:
        records: list[UsageRecord] = []
        gw.app.state.proxy.usage_sinks.append(records.append)
        yield gw, records

@pytest.fixture(scope="module", params=[None, ["empty_answer"], ["abstain"]], ids=["relayed", "peeked", "peeked-whole"])
def forced_peeked(request: pytest.FixtureRequest, upstream_sim: SimProcess,
                  redis_url: str) -> Iterator[tuple[GatewayServer, list[UsageRecord]]]:
    """The ``forced`` tier as above, relayed as it comes (no ``escalate_on``) or peeked for escalation first: up to
    its answer's first content (``empty_answer``) or to its end (``abstain``), the next tier called only for a weak
    answer."""
    # read_timeout_s: a stalled phase fails after a second, not the default ten
    with _forced_gateway(upstream_sim, redis_url, request.param, read_timeout_s=1.0) as served:
        yield served


@pytest.mark.parametrize("answered", [0, 2])
@pytest.mark.parametrize("mode", ["close", "stall", "error-event"])
def test_a_stream_whose_phase_2_fails_is_billed_as_the_call_not_streamed(
        forced_peeked: tuple[GatewayServer, list[UsageRecord]], upstream_sim: SimProcess, redis_url: str,
        mode: str, answered: int) -> None:
    """Phase 1 completed with its usage reported; phase 2 was answered 200 and, after ``answered`` deltas of the
    answer, ended without ``[DONE]`` (``close``: the relay's broken stream), stalled (504) or sent an engine error
    event. Relayed
    as it came or failed inside the escalation peek (before the client got a byte), the streamed request is billed
    exactly what the same request not streamed is (:meth:`ForcedBudget._spent`): phase 1 as reported, phase 2's
    prompt (phase 1's and the thought again) and the answer deltas phase 2 sent — ``partial``, ``usage_source:
    counted``. In the peek it was billed the client's prompt counted and the deltas (phase 2's prompt left out) when
    the stream broke, and the bill as the upstream's report (``usage_source: upstream``) before an error event."""
    gw, records = forced_peeked
    client = _client(gw)
    whole_call = client.chat.completions.create(model="short", messages=MESSAGES, extra_body={"sim": {"fail": "none"}})
    assert whole_call.usage is not None and whole_call.usage.completion_tokens_details is not None
    thought = whole_call.usage.completion_tokens_details.reasoning_tokens  # phase 1's reported completion
    assert thought and 0 < thought < whole_call.usage.completion_tokens
    prompt1 = httpx.post(upstream_sim.root + "/tokenize", json={"messages": MESSAGES}, timeout=5).json()["count"]
    # phase 2's chunks: the role chunk, then one word of the answer a chunk; the fault comes after 1 + answered
    sim = {"fail": mode, "fail_from": 1, "fail_at": 1 + answered}

    before = len(records)
    got = StreamRead()
    with pytest.raises(openai.APIError):  # the client's error is the relay's (or the peek's 502), as it was
        got.read(client.chat.completions.create(
            model="short", messages=MESSAGES, stream=True, stream_options={"include_usage": True},
            extra_body={"sim": {**sim, "tag": uuid.uuid4().hex}}))
    assert got.usage is None  # the bill is metered, never shown on a failed stream
    tag = uuid.uuid4().hex
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="short", messages=MESSAGES, extra_body={"sim": {**sim, "tag": tag}})
    status = 504 if mode == "stall" else 502
    assert info.value.status_code == status
    seen = upstream_sim.tag(tag)
    assert seen is not None and seen["attempts"] == 2  # both phases, and no escalation after the failure
    assert wait_for(lambda: len(records) == before + 2, timeout_s=10)
    streamed, answered_ev = (_event(redis_url, r.request_id) for r in records[before:])
    assert (streamed.stream, answered_ev.stream) == (True, False)
    assert streamed.tier == answered_ev.tier == "short"
    for ev in (streamed, answered_ev):
        assert (ev.status, ev.partial, ev.usage_source, ev.over_bound) == (status, True, "counted", False)
        assert ev.reasoning_tokens == thought
        assert 2 * prompt1 + thought <= ev.prompt_tokens <= whole_call.usage.prompt_tokens  # phase 2's prompt in
        assert ev.completion_tokens == thought + answered  # the answer deltas phase 2 sent, one token each
        assert ev.cost_micro_usd > 0
    assert (streamed.prompt_tokens, streamed.completion_tokens, streamed.reasoning_tokens, streamed.cost_micro_usd) \
        == (answered_ev.prompt_tokens, answered_ev.completion_tokens, answered_ev.reasoning_tokens,
            answered_ev.cost_micro_usd)


@pytest.fixture(scope="module", params=[None, ["empty_answer"], ["abstain"]], ids=["relayed", "peeked", "peeked-whole"])
def forced_left(request: pytest.FixtureRequest, upstream_sim: SimProcess,
                redis_url: str) -> Iterator[tuple[GatewayServer, list[UsageRecord]]]:
    """:func:`forced_peeked`'s tiers with a read timeout far above the time a test client takes to hang up on a
    stalled answer phase: the client leaves first, never the timeout."""
    with _forced_gateway(upstream_sim, redis_url, request.param, read_timeout_s=10.0) as served:
        yield served


def _thought_and_prompt(client: openai.OpenAI, upstream_sim: SimProcess) -> tuple[int, int, int]:
    """(phase 1's reported completion — the thought —, the client's prompt by the sim's /tokenize, a complete call's
    prompt) of ``MESSAGES`` on the forced tier."""
    whole_call = client.chat.completions.create(model="short", messages=MESSAGES, extra_body={"sim": {"fail": "none"}})
    assert whole_call.usage is not None and whole_call.usage.completion_tokens_details is not None
    thought = whole_call.usage.completion_tokens_details.reasoning_tokens
    assert thought and 0 < thought < whole_call.usage.completion_tokens
    prompt1 = httpx.post(upstream_sim.root + "/tokenize", json={"messages": MESSAGES}, timeout=5).json()["count"]
    return thought, prompt1, whole_call.usage.prompt_tokens


_DELTA = re.compile(rb'"content":"[^"]+"')  # an answer delta in the SSE bytes a client read


def _leave_when(gw: GatewayServer, body: dict[str, Any], ready: Callable[[bytes], bool]) -> bytes:
    """POST ``body`` (a stream) on a raw socket, read what comes until ``ready(what came)``, then hang up: what
    came."""
    url = urlsplit(gw.base_url)
    payload = orjson.dumps(body)
    head = (f"POST {url.path}/chat/completions HTTP/1.1\r\nhost: {url.hostname}:{url.port}\r\n"
            f"authorization: Bearer {TEST_KEY}\r\ncontent-type: application/json\r\ncache-control: no-store\r\n"
            f"content-length: {len(payload)}\r\n\r\n").encode()
    got = b""
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=10) as sock:
        sock.sendall(head + payload)
        sock.settimeout(0.02)
        deadline = time.monotonic() + 10
        while not ready(got):
            assert time.monotonic() < deadline, got
            with contextlib.suppress(TimeoutError):
                got += sock.recv(65536)
    return got


@pytest.mark.parametrize("answered", [2, 0])
def test_a_client_gone_in_phase_2_is_billed_as_the_call_failed_there(
        forced_left: tuple[GatewayServer, list[UsageRecord]], upstream_sim: SimProcess, redis_url: str,
        answered: int) -> None:
    """The client hangs up while phase 2 runs, after ``answered`` answer deltas (phase 2 then waits on its upstream):
    relayed (the client got them), or while the escalation peek holds the stream back — up to the answer's start
    (``empty_answer``: the client got them, relayed from the peek's read) or to its end (``abstain``: the client
    got nothing, the peek read them). The call is billed what the same call is billed had it failed there — the bill
    of :meth:`ForcedBudget._spent`, the one the non-streamed call failed after as many deltas gets: phase 1 as
    reported, phase 2's prompt (phase 1's and the thought again), the answer deltas — ``partial``, ``counted``,
    499 ``client_disconnected``. It was billed the client's prompt counted and the deltas: phase 2's prompt, the
    whole thought re-read, left out."""
    gw, records = forced_left
    client = _client(gw)
    before = len(records) + 2  # the two calls before the one under test
    thought, prompt1, whole_prompt = _thought_and_prompt(client, upstream_sim)
    # phase 2 sends its role chunk and ``answered`` deltas, then waits (hang_s): the client leaves meanwhile
    sim = {"fail": "stall", "fail_from": 1, "fail_at": 1 + answered}
    probe = uuid.uuid4().hex  # phase 1's chunks: a call whose phase 2 ends at once
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model="short", messages=MESSAGES, extra_body={
            "sim": {"fail": "close", "fail_from": 1, "fail_at": 0, "tag": probe}})
    probed = upstream_sim.tag(probe)
    assert probed is not None and probed["attempts"] == 2
    stalled = probed["chunks_sent"] + 1 + answered  # the sim's chunks once phase 2 waits

    assert wait_for(lambda: len(records) == before, timeout_s=10)
    tag = uuid.uuid4().hex
    peeked_whole = gw.app.state.settings.tiers[1].escalate_on == ["abstain"]

    def ready(got: bytes) -> bool:
        sent = upstream_sim.tag(tag)
        if sent is None or sent["chunks_sent"] < stalled:
            return False
        if peeked_whole or not answered:  # nothing to see: the gateway had a beat to read what phase 2 sent
            time.sleep(0.3)
            return True
        return len(_DELTA.findall(got)) >= answered

    got = _leave_when(gw, {"model": "short", "stream": True, "messages": MESSAGES,
                           "stream_options": {"include_usage": True}, "sim": {**sim, "tag": tag}}, ready)
    assert len(_DELTA.findall(got)) == (0 if peeked_whole else answered)
    assert upstream_sim.wait_tag_status(tag, {"cancelled"}) is not None  # phase 2's call closed with the client
    assert wait_for(lambda: len(records) == before + 1, timeout_s=10)
    with pytest.raises(openai.APIStatusError):  # the same call failed where the client left
        client.chat.completions.create(model="short", messages=MESSAGES, extra_body={
            "sim": {"fail": "error-event", "fail_from": 1, "fail_at": 1 + answered, "tag": uuid.uuid4().hex}})
    assert wait_for(lambda: len(records) == before + 2, timeout_s=10)
    gone, failed = (_event(redis_url, r.request_id) for r in records[before:])
    assert (gone.stream, failed.stream) == (True, False)
    assert (gone.status, gone.error_code, gone.partial, gone.usage_source, gone.over_bound) == (
        499, "client_disconnected", True, "counted", False)
    assert gone.reasoning_tokens == thought
    assert 2 * prompt1 + thought <= gone.prompt_tokens <= whole_prompt  # phase 2's prompt in
    assert gone.completion_tokens == thought + answered  # the answer deltas phase 2 sent, one token each
    assert (gone.prompt_tokens, gone.completion_tokens, gone.reasoning_tokens, gone.cost_micro_usd) == (
        failed.prompt_tokens, failed.completion_tokens, failed.reasoning_tokens, failed.cost_micro_usd)
    assert gone.cost_micro_usd > 0


MAX_STREAM_S = 2.0
CHUNK_MS = 100  # phase 1 (~12 chunks) ends ~1.2 s in; phase 2 (~20 chunks) runs past the bound


@pytest.fixture(scope="module")
def forced_bounded(upstream_sim: SimProcess, redis_url: str) -> Iterator[tuple[GatewayServer, list[UsageRecord]]]:
    """The forced tier, relayed, under ``limits.max_stream_s``."""
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"budget_mode": "forced", "thinking_budget": BUDGET, "max_tokens": 64})
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers,
                                    limits={"max_stream_s": MAX_STREAM_S})) as gw:
        records: list[UsageRecord] = []
        gw.app.state.proxy.usage_sinks.append(records.append)
        yield gw, records


def test_a_stream_cut_at_its_bound_in_phase_2_is_billed_as_the_call_failed_there(
        forced_bounded: tuple[GatewayServer, list[UsageRecord]], upstream_sim: SimProcess, redis_url: str) -> None:
    """A slow forced stream reaches ``limits.max_stream_s`` in its answer phase: cut as any stream (``finish_reason:
    "length"``, ``[DONE]``), metered as the cut path meters (200, ``stream_max_duration``, partial, counted) — and
    billed what the same call is billed had it failed there (:meth:`ForcedBudget._spent`, as the non-streamed call
    failed after as many answer deltas is), phase 2's prompt in; the usage chunk the client asked for says so. It was
    billed the client's prompt counted and the deltas: phase 2's prompt, the whole thought re-read, left out."""
    gw, records = forced_bounded
    client = _client(gw)
    before = len(records) + 1  # the call before the one under test
    thought, prompt1, whole_prompt = _thought_and_prompt(client, upstream_sim)
    assert wait_for(lambda: len(records) == before, timeout_s=10)
    got = StreamRead().read(client.chat.completions.create(
        model="short", messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        extra_body={"sim": {"chunk_delay_ms": CHUNK_MS, "tag": uuid.uuid4().hex}}))
    assert got.finish == "length" and 0 < len(got.reasoning.split()) <= BUDGET
    assert got.deltas > 0  # cut in phase 2, after some of the answer
    assert wait_for(lambda: len(records) == before + 1, timeout_s=10)
    with pytest.raises(openai.APIStatusError):  # the same call failed where it was cut
        client.chat.completions.create(model="short", messages=MESSAGES, extra_body={
            "sim": {"fail": "error-event", "fail_from": 1, "fail_at": 1 + got.deltas, "tag": uuid.uuid4().hex}})
    assert wait_for(lambda: len(records) == before + 2, timeout_s=10)
    cut, failed = (_event(redis_url, r.request_id) for r in records[before:])
    assert (cut.status, cut.error_code, cut.partial, cut.usage_source, cut.over_bound) == (
        200, "stream_max_duration", True, "counted", False)
    assert cut.reasoning_tokens == thought
    assert 2 * prompt1 + thought <= cut.prompt_tokens <= whole_prompt  # phase 2's prompt in
    assert cut.completion_tokens == thought + got.deltas
    assert (cut.prompt_tokens, cut.completion_tokens, cut.reasoning_tokens, cut.cost_micro_usd) == (
        failed.prompt_tokens, failed.completion_tokens, failed.reasoning_tokens, failed.cost_micro_usd)
    assert got.usage is not None and (got.usage["prompt_tokens"], got.usage["completion_tokens"]) == (
        cut.prompt_tokens, cut.completion_tokens)  # the client is told what was metered


#: phase 1's usage as the sim reports it (``"sim": {"usage"}``): far from what counting the client's prompt (~20) and
#: the thought's deltas would give, so that the bill says which it is
P1_USAGE = {"prompt_tokens": 1000, "completion_tokens": 7, "total_tokens": 1007,
            "prompt_tokens_details": {"cached_tokens": 400}}


@pytest.mark.parametrize("window", ["before-phase-1-done", "phase-2-opening"])
def test_a_client_gone_once_phase_1_reported_is_billed_that_report(
        forced_left: tuple[GatewayServer, list[UsageRecord]], upstream_sim: SimProcess, redis_url: str,
        window: str) -> None:
    """The client hangs up once phase 1's usage came and before phase 2 was answered: phase 1 stalls after its usage
    chunk, before ``[DONE]`` (``before-phase-1-done``), or phase 2's request hangs before its 200
    (``phase-2-opening``). Relayed or peeked, the call is billed phase 1's usage as the upstream reported it
    (its completion as reasoning), ``usage_source: upstream``, 499 ``client_disconnected``, partial — nothing of
    phase 2, which was never answered (:meth:`ForcedBudget.spent`: the 200 is the gateway's only sign an upstream
    read a prompt). It was billed the client's prompt counted and the thought's deltas before phase 2 began, and
    phase 1's report labelled ``counted`` while phase 2 opened."""
    gw, records = forced_left
    before = len(records) + 1  # the probe's
    probe = uuid.uuid4().hex  # phase 1's chunks ([DONE] included): a call whose phase 2 ends at once
    with pytest.raises(openai.APIStatusError):
        _client(gw).chat.completions.create(model="short", messages=MESSAGES, extra_body={
            "sim": {"fail": "close", "fail_from": 1, "fail_at": 0, "tag": probe, "usage": P1_USAGE}})
    probed = upstream_sim.tag(probe)
    assert probed is not None and probed["attempts"] == 2
    phase1 = probed["chunks_sent"]
    # phase 1 stalls before its [DONE] (its first attempt only), or phase 2 sends nothing before its 200
    sim = {"fail": "stall", "fail_times": 1, "fail_at": phase1 - 1} if window == "before-phase-1-done" else \
        {"fail": "timeout", "fail_from": 1}
    attempts = 1 if window == "before-phase-1-done" else 2
    assert wait_for(lambda: len(records) == before, timeout_s=10)
    tag = uuid.uuid4().hex

    def ready(_: bytes) -> bool:
        sent = upstream_sim.tag(tag)
        if sent is None or sent["attempts"] < attempts or sent["chunks_sent"] < phase1 - 1:
            return False
        time.sleep(0.3)  # the gateway had a beat to read phase 1's usage chunk (or to open phase 2)
        return True

    _leave_when(gw, {"model": "short", "stream": True, "messages": MESSAGES, "stream_options": {"include_usage": True},
                     "sim": {**sim, "tag": tag, "usage": P1_USAGE}}, ready)
    seen = upstream_sim.wait_tag_status(tag, {"cancelled"})  # the call in flight closed with the client
    assert seen is not None and seen["status"] == "cancelled" and seen["attempts"] == attempts
    assert wait_for(lambda: len(records) == before + 1, timeout_s=10)
    gone = _event(redis_url, records[before].request_id)
    assert (gone.status, gone.error_code, gone.partial, gone.usage_source, gone.over_bound) == (
        499, "client_disconnected", True, "upstream", False)
    assert (gone.prompt_tokens, gone.cached_tokens, gone.completion_tokens, gone.reasoning_tokens) == (1000, 400, 7, 7)
    assert gone.cost_micro_usd > 0


@pytest.mark.parametrize("fault", [("error-event", 502, "upstream_error"), ("close", 502, "upstream_stream_broken"),
                                   ("stall", 504, "upstream_timeout")], ids=["error-event", "close", "stall"])
def test_one_of_n_generations_failing_in_phase_1_fails_the_call_billed_all_that_ran(
        upstream_sim: SimProcess, redis_url: str, fault: tuple[str, int, str]) -> None:
    """``n = 2``, not streamed: one generation's phase 1 fails after 3 deltas of its thought (an engine error event,
    an end without ``[DONE]``, or a stall past the read timeout), the other completes. The call fails with that
    generation's error, and is billed what both ran — exactly a complete ``n = 1`` call's usage plus what the same
    failure alone is billed (its prompt counted, one token a delta read, as reasoning) — ``partial``, ``counted``."""
    mode, status, code = fault
    sim = {"fail": mode, "fail_at": 1 + 3}  # chat's role chunk, then 3 words of the thought
    with _forced_gateway(upstream_sim, redis_url, None, read_timeout_s=1.0) as (gw, records):
        client = _client(gw)
        whole = client.chat.completions.create(model="short", messages=MESSAGES, extra_body={"sim": {"fail": "none"}})
        assert whole.usage is not None
        with pytest.raises(openai.APIStatusError) as alone:
            client.chat.completions.create(model="short", messages=MESSAGES,
                                           extra_body={"sim": {**sim, "tag": uuid.uuid4().hex}})
        tag = uuid.uuid4().hex
        with pytest.raises(openai.APIStatusError) as info:  # the first generation's phase 1 to arrive fails
            client.chat.completions.create(model="short", messages=MESSAGES, n=2,
                                           extra_body={"sim": {**sim, "fail_times": 1, "tag": tag}})
        assert info.value.status_code == alone.value.status_code == status
        assert info.value.body["code"] == code  # type: ignore[index]
        seen = upstream_sim.tag(tag)
        assert seen is not None and seen["attempts"] == 3  # two thoughts, one answer: nothing after the failure
        assert wait_for(lambda: len(records) == 3, timeout_s=10)
    failed, both = (_event(redis_url, r.request_id) for r in records[1:])
    for ev in (failed, both):
        assert (ev.status, ev.error_code, ev.partial, ev.usage_source) == (status, code, True, "counted")
    assert failed.completion_tokens == failed.reasoning_tokens == 3
    assert whole.usage.completion_tokens_details is not None
    assert (both.prompt_tokens, both.completion_tokens, both.reasoning_tokens) == (
        whole.usage.prompt_tokens + failed.prompt_tokens, whole.usage.completion_tokens + failed.completion_tokens,
        whole.usage.completion_tokens_details.reasoning_tokens + failed.reasoning_tokens)
    assert both.cost_micro_usd > failed.cost_micro_usd > 0


@pytest.mark.parametrize("tier", ["none", "short"], ids=["plain", "forced"])
def test_a_stream_that_stalls_is_cut_at_its_bound_not_at_the_read_timeout(
        forced_bounded: tuple[GatewayServer, list[UsageRecord]], redis_url: str, tier: str) -> None:
    """An upstream stalls mid-stream (a plain tier; the forced tier in its answer phase, after 2 answer deltas) with a
    read timeout (10 s) far past ``limits.max_stream_s`` (2 s): the stream is cut at its bound as any stream that
    reaches it (``finish_reason: "length"``, ``[DONE]``; 200 ``stream_max_duration``, partial) — the forced one billed
    as had it failed there (phase 1 as reported, phase 2's prompt, the 2 deltas; ``counted``). The bound was checked
    only when a batch came: the stall ran on to the read timeout, a 504 at 10 s."""
    gw, records = forced_bounded
    before = len(records)
    sim = {"fail": "stall", "fail_at": 1 + 2, "tag": uuid.uuid4().hex, **({"fail_from": 1} if tier == "short" else {})}
    started = time.monotonic()
    got = StreamRead().read(_client(gw).chat.completions.create(
        model=tier, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, extra_body={"sim": sim}))
    took = time.monotonic() - started
    assert got.finish == "length" and got.deltas == 2
    assert MAX_STREAM_S <= took < MAX_STREAM_S + 2
    assert wait_for(lambda: len(records) == before + 1, timeout_s=10)
    cut = _event(redis_url, records[before].request_id)
    assert (cut.status, cut.error_code, cut.partial, cut.usage_source) == (200, "stream_max_duration", True, "counted")
    assert got.usage is not None and got.usage["completion_tokens"] == cut.completion_tokens
    if tier == "short":
        assert cut.completion_tokens == cut.reasoning_tokens + 2 and cut.prompt_tokens > 2 * cut.reasoning_tokens


@pytest.mark.parametrize("fault", [("drop", 502, "upstream_stream_broken"), ("close", 502, "upstream_stream_broken"),
                                   ("error-event", 502, "upstream_error")], ids=["drop", "close", "error-event"])
def test_a_phase_1_that_fails_once_it_reported_is_billed_that_report(
        forced_peeked: tuple[GatewayServer, list[UsageRecord]], upstream_sim: SimProcess, redis_url: str,
        fault: tuple[str, int, str]) -> None:
    """Phase 1 sent its usage chunk and then failed before ``[DONE]``: its connection dropped (the simulator's break),
    it ended without ``[DONE]``, or sent an engine error event (a stall takes the drop's way: any exception there).
    Relayed, failed in the escalation peek, or not streamed, the call is billed phase 1's usage as the upstream
    reported it (its completion as reasoning), ``usage_source: upstream``, partial, with the client's error — as the
    relay bills a plain stream that fails after its usage chunk. It was billed the client's prompt counted and the
    thought's deltas, ``counted``, in all three paths."""
    gw, records = forced_peeked
    client = _client(gw)
    mode, status, code = fault
    before = len(records) + 1  # the probe's
    probe = uuid.uuid4().hex  # phase 1's chunks ([DONE] included): a call whose phase 2 ends at once
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model="short", messages=MESSAGES, extra_body={
            "sim": {"fail": "close", "fail_from": 1, "fail_at": 0, "tag": probe, "usage": P1_USAGE}})
    probed = upstream_sim.tag(probe)
    assert probed is not None and probed["attempts"] == 2
    sim = {"fail": mode, "fail_at": probed["chunks_sent"] - 1, "usage": P1_USAGE}  # after the usage chunk

    assert wait_for(lambda: len(records) == before, timeout_s=10)
    tag = uuid.uuid4().hex
    with pytest.raises(openai.APIError):  # the relay's error (an error event as it came), or the peek's 502/504
        StreamRead().read(client.chat.completions.create(
            model="short", messages=MESSAGES, stream=True, stream_options={"include_usage": True},
            extra_body={"sim": {**sim, "tag": tag}}))
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="short", messages=MESSAGES, extra_body={"sim": {**sim}})
    assert info.value.status_code == status  # (a drop not streamed is upstream_error, as it was)
    seen = upstream_sim.tag(tag)
    assert seen is not None and seen["attempts"] == 1  # no answer phase, no escalation after the failure
    assert wait_for(lambda: len(records) == before + 2, timeout_s=10)
    for rec in records[before:]:
        ev = _event(redis_url, rec.request_id)
        assert (ev.status, ev.partial, ev.usage_source) == (status, True, "upstream")
        assert ev.error_code == (code if ev.stream else info.value.body["code"])  # type: ignore[index]
        assert (ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens, ev.reasoning_tokens) == (1000, 400, 7, 7)
        assert ev.cost_micro_usd > 0


@pytest.mark.parametrize("index", ["x", [0], 1.5], ids=["string", "list", "float"])
def test_a_non_streamed_forced_answer_skips_a_tool_call_whose_index_is_no_integer(
        forced: tuple[GatewayServer, list[UsageRecord]], index: Any) -> None:
    """A forced, non-streamed call whose phases carry a tool-call delta under an ``index`` that is no integer: the
    answer is served as the stream assembler serves a plain one (``gateway.openai.chunks``: the call skipped),
    billed as reported. ``int(index)`` raised mid-assembly on ``"x"`` and ``[0]``: a 500 after the upstream was
    paid (and the SDKs retry a 500); ``1.5`` was filed under call 1."""
    gw, records = forced
    before = len(records)
    call = {"index": index, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chunk = {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}
    answer = _client(gw).chat.completions.create(model="short", messages=MESSAGES,
                                                 extra_body={"sim": {"inject": chunk}})
    assert answer.choices[0].message.content and answer.choices[0].message.content.startswith("echo:")
    assert not answer.choices[0].message.tool_calls
    assert wait_for(lambda: len(records) == before + 1, timeout_s=10)
    rec = records[-1]
    assert (rec.status, rec.error_code, rec.usage_source) == (200, None, "upstream")


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_a_forced_json_answer_has_openais_choice_fields(forced: tuple[GatewayServer, list[UsageRecord]],
                                                        path: str) -> None:
    """Every choice of a forced JSON answer carries ``logprobs`` (null), as OpenAI's and the plain tiers' do; the
    forced one had no such key (the SDK fills None, a raw-JSON client found the field missing)."""
    gw, _ = forced
    ask: dict[str, Any] = {"messages": MESSAGES} if path == "/chat/completions" else {"prompt": QUESTION}
    r = httpx.post(gw.base_url + path, json={"model": "short", "n": 2, **ask},
                   headers={"authorization": f"Bearer {TEST_KEY}"}, timeout=30)
    r.raise_for_status()
    body = r.json()
    assert body["object"] == ("chat.completion" if path == "/chat/completions" else "text_completion")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all("logprobs" in c and c["logprobs"] is None for c in body["choices"])
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
