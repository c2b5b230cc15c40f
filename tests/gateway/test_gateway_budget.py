"""Thinking budgets through the gateway over the simulator: forced mode (two phases, one seamless response,
streamed and not), the loop guard, and escalation (both calls metered, route reason ``escalated``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from gateway.ledger.record import UsageRecord
from tests.fixtures.upstream import (
    TEST_KEY,
    GatewayServer,
    SimProcess,
    hang_up_when,
    sim_settings,
    sim_tiers,
    start_sim,
    wait_for,
)

BUDGET = 8
QUESTION = "Start with 7. Add 5, then multiply by 3. What is the result of all these steps please?"


def _tiers(sim: SimProcess, **short: Any) -> list[dict[str, Any]]:
    tiers = sim_tiers(sim.base_url)
    tiers[1].update({"budget_mode": "forced", "thinking_budget": BUDGET, "max_tokens": 64, **short})
    return tiers


@pytest.fixture
def forced_gateway(upstream_sim: SimProcess, redis_url: str) -> Iterator[tuple[GatewayServer, list[UsageRecord]]]:
    settings = sim_settings(upstream_sim.base_url, redis_url, tiers=_tiers(upstream_sim))
    with GatewayServer(settings) as gw:
        records: list[UsageRecord] = []
        gw.app.state.proxy.usage_sinks.append(records.append)
        yield gw, records


def _client(gw: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=30)


def _stream_text(client: openai.OpenAI, **kw: Any) -> tuple[str, str, dict[str, Any], Any]:
    raw = client.chat.completions.with_raw_response.create(stream=True, stream_options={"include_usage": True}, **kw)
    reasoning, content, usage, ids = [], [], None, set()
    for chunk in raw.parse():
        ids.add(chunk.id)
        if chunk.usage:
            usage = chunk.usage.model_dump()
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            reasoning.append(extra.get("reasoning") or "")
            content.append(c.delta.content or "")
    assert len(ids) == 1, "one seamless stream: every chunk carries the same id"
    return "".join(reasoning), "".join(content), usage or {}, raw.headers


def test_forced_budget_non_stream(forced_gateway: tuple[GatewayServer, list[UsageRecord]],
                                  upstream_sim: SimProcess) -> None:
    gw, records = forced_gateway
    tag = uuid.uuid4().hex
    raw = _client(gw).chat.completions.with_raw_response.create(
        model="short", messages=[{"role": "user", "content": QUESTION}], extra_body={"sim": {"tag": tag}})
    resp = raw.parse()
    msg = resp.choices[0].message
    reasoning = (msg.model_extra or {}).get("reasoning") or ""
    assert 0 < len(reasoning.split()) <= BUDGET
    assert msg.content and msg.content.startswith("echo:")
    usage = resp.usage
    assert usage.completion_tokens_details.reasoning_tokens == len(reasoning.split()) <= BUDGET
    # phase 2 re-reads the prompt plus the thought: summed prompt tokens exceed the question's own
    single = len(QUESTION.split()) + 3
    assert usage.prompt_tokens > 2 * single
    assert usage.completion_tokens == usage.completion_tokens_details.reasoning_tokens + len(msg.content.split())
    last = upstream_sim.tag(tag)
    assert last is not None
    body = last["body"]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["messages"][-1]["content"] == "<think>\n" + reasoning + "\n</think>\n\n"
    assert "thinking_token_budget" not in body
    assert raw.headers["x-thinkgate-tier"] == "short"
    rec = records[-1]
    assert (rec.prompt_tokens, rec.completion_tokens, rec.reasoning_tokens) == (
        usage.prompt_tokens, usage.completion_tokens, usage.completion_tokens_details.reasoning_tokens)


def test_a_smaller_request_budget_cuts_the_forced_thought(forced_gateway: tuple[GatewayServer, list[UsageRecord]],
                                                           upstream_sim: SimProcess) -> None:
    # the request's thinking_token_budget (and a key's max_thinking_budget, applied through it) below the tier's:
    # the thought phase stops there, and the header says so (the tier's budget used to cut it, whatever was asked)
    gw, _ = forced_gateway
    for asked, served in ((3, 3), (50, BUDGET)):
        raw = _client(gw).chat.completions.with_raw_response.create(
            model="short", messages=[{"role": "user", "content": QUESTION}],
            extra_body={"thinking_token_budget": asked, "sim": {"tag": uuid.uuid4().hex}})
        msg = raw.parse().choices[0].message
        assert 0 < len(((msg.model_extra or {}).get("reasoning") or "").split()) <= served
        assert raw.parse().usage.completion_tokens_details.reasoning_tokens <= served
        assert raw.headers["x-thinkgate-thinking-budget"] == str(served)
    # no thinking asked: one pass with thinking off (phase 1 used to think a token, phase 2 to bill the prompt again)
    t = uuid.uuid4().hex
    raw = _client(gw).chat.completions.with_raw_response.create(
        model="short", messages=[{"role": "user", "content": QUESTION}],
        extra_body={"thinking_token_budget": 0, "sim": {"tag": t}})
    assert raw.headers["x-thinkgate-thinking-budget"] == "0"
    sent = upstream_sim.tag(t)
    assert sent is not None and sent["attempts"] == 1
    assert sent["body"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert "continue_final_message" not in sent["body"] and "thinking_token_budget" not in sent["body"]
    # the same for a client's own enable_thinking: false (an Anthropic request's thinking: disabled translates to it)
    t = uuid.uuid4().hex
    _client(gw).chat.completions.create(model="short", messages=[{"role": "user", "content": QUESTION}],
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                    "sim": {"tag": t}})
    sent = upstream_sim.tag(t)
    assert sent is not None and sent["attempts"] == 1 and "continue_final_message" not in sent["body"]


def test_forced_budget_stream_equals_non_stream(forced_gateway: tuple[GatewayServer, list[UsageRecord]]) -> None:
    gw, records = forced_gateway
    client = _client(gw)
    msgs = [{"role": "user", "content": QUESTION}]
    before = len(records)
    resp = client.chat.completions.create(model="short", messages=msgs)
    reasoning, content, usage, _ = _stream_text(client, model="short", messages=msgs)
    # the stream's usage record is written once its last byte is sent: the client may read that byte first
    assert wait_for(lambda: len(records) >= before + 2, timeout_s=10), records[before:]
    assert reasoning == (resp.choices[0].message.model_extra or {}).get("reasoning")
    assert content == resp.choices[0].message.content
    assert usage["prompt_tokens"] == resp.usage.prompt_tokens
    assert usage["completion_tokens"] == resp.usage.completion_tokens
    assert usage["completion_tokens_details"]["reasoning_tokens"] <= BUDGET
    assert records[-1].cost_micro_usd == records[-2].cost_micro_usd > 0


def test_forced_budget_completions(forced_gateway: tuple[GatewayServer, list[UsageRecord]]) -> None:
    gw, _ = forced_gateway
    resp = _client(gw).completions.create(model="short", prompt="<think>\n" + QUESTION)
    text = resp.choices[0].text
    thought, answer = text.split("</think>", 1)
    assert len(thought.split()) <= BUDGET and answer.strip()
    # reasoning tokens = the thought phase's completion tokens (the simulator also counts the marker word)
    assert len(thought.split()) <= resp.usage.completion_tokens_details.reasoning_tokens <= BUDGET + 1


def test_loop_guard_cuts_a_repeating_thought(upstream_sim: SimProcess, redis_url: str) -> None:
    # The simulator's thought cycles the prompt's words: a three-word prompt repeats at once.
    tiers = _tiers(upstream_sim, thinking_budget=60, loop_guard={"ngram": 3, "max_repeats": 2})
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as gw:
        client = _client(gw)
        resp = client.chat.completions.create(model="short", messages=[{"role": "user", "content": "red green blue"}])
        reasoning = (resp.choices[0].message.model_extra or {}).get("reasoning") or ""
        assert 3 < len(reasoning.split()) < 10, reasoning
        assert resp.choices[0].message.content
        # the cut thought is billed: phase 1's counted tokens are in the completion (a review found them dropped
        # when the merged usage rejected phase 1's usage for lacking prompt_tokens)
        u = resp.usage
        assert u is not None and u.completion_tokens_details is not None
        assert u.completion_tokens >= u.completion_tokens_details.reasoning_tokens >= len(reasoning.split())
    tiers = _tiers(upstream_sim, thinking_budget=60)
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as gw:
        resp = _client(gw).chat.completions.create(model="short",
                                                   messages=[{"role": "user", "content": "red green blue"}])
        # unguarded, the whole 19-word cycle (and, the simulator never writing </think>, its echo) is thought
        assert len(((resp.choices[0].message.model_extra or {}).get("reasoning") or "").split()) >= 19


@pytest.mark.parametrize("stream,why", [(False, "length_in_thought"), (True, "length_in_thought"),
                                        (False, "empty_answer"), (True, "empty_answer")])
def test_escalation_when_cut_inside_the_thought(upstream_sim: SimProcess, redis_url: str, stream: bool,
                                                why: str) -> None:
    # short: native budget far above max_tokens, so the answer never starts → escalate to long
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"thinking_budget": 100, "max_tokens": 4, "escalate_on": [why]})
    # an RPM limit on a key of this case's own (a fresh window), so the answer's x-ratelimit-* headers show both
    # admissions: the first call's and the escalation's
    auth = {"keys": [{"id": f"esc-{uuid.uuid4().hex[:8]}", "secret": TEST_KEY, "rpm": 1000}]}
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers, auth=auth)) as gw:
        records: list[UsageRecord] = []
        gw.app.state.proxy.usage_sinks.append(records.append)
        client = _client(gw)
        msgs = [{"role": "user", "content": QUESTION}]
        if stream:
            _, content, _, headers = _stream_text(client, model="short", messages=msgs)
        else:
            raw = client.chat.completions.with_raw_response.create(model="short", messages=msgs)
            content, headers = raw.parse().choices[0].message.content, raw.headers
        assert content and content.startswith("echo:")
        assert headers["x-thinkgate-tier"] == "long"
        assert headers["x-thinkgate-route-reason"] == "escalated"
        assert 1000 - int(headers["x-ratelimit-remaining-requests"]) == 2  # the first call and the escalation
        # a stream's usage record is finished after [DONE] reached the client: wait for it (bounded)
        deadline = time.monotonic() + 5
        while len(records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        first, second = records[-2:]
        assert (first.tier, first.route_reason, first.error_code) == ("short", "forced", f"escalated_{why}")
        assert first.completion_tokens == 4 and first.cost_micro_usd > 0
        assert (second.tier, second.route_reason, second.status) == ("long", "escalated", 200)
        assert second.cost_micro_usd > 0


@pytest.mark.parametrize("stream", [False, True])
def test_no_escalation_when_the_clients_own_max_tokens_cut_it(upstream_sim: SimProcess, redis_url: str,
                                                             stream: bool) -> None:
    """The same cut, made by the client's ``max_tokens`` (below the tier's cap): the next tier is held to the same
    bound, so escalating paid a second call for the same empty answer (a new-user helper with the Anthropic SDK)."""
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"thinking_budget": 100, "escalate_on": ["empty_answer", "length_in_thought"]})
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as gw:
        records: list[UsageRecord] = []
        gw.app.state.proxy.usage_sinks.append(records.append)
        raw = _client(gw).chat.completions.with_raw_response.create(
            model="short", messages=[{"role": "user", "content": QUESTION}], max_tokens=4, stream=stream)
        if stream:
            finishes = [c.choices[0].finish_reason for c in raw.parse() if c.choices and c.choices[0].finish_reason]
            assert finishes == ["length"]
        else:
            assert raw.parse().choices[0].finish_reason == "length"
        assert raw.headers["x-thinkgate-tier"] == "short"
        assert raw.headers["x-thinkgate-route-reason"] == "forced"
        assert wait_for(lambda: len(records) >= 1, timeout_s=5)
        time.sleep(0.2)
        assert [(r.tier, r.error_code) for r in records] == [("short", None)]  # one call, not two


def test_a_stream_broken_while_peeked_is_a_502_and_its_record_says_so(upstream_sim: SimProcess,
                                                                      redis_url: str) -> None:
    """A tier that escalates reads its stream before the client sees a byte; a stream that breaks there is the
    client's 502 ``upstream_stream_broken`` naming the tier — and the usage record says the same (it said 500
    ``internal_error``: a gateway bug in the ledger for an upstream failure)."""
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"escalate_on": ["empty_answer", "abstain"]})  # abstain: the whole stream is read first
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as gw:
        records: list[UsageRecord] = []
        gw.app.state.proxy.usage_sinks.append(records.append)
        r = httpx.post(gw.base_url + "/chat/completions", headers={"authorization": f"Bearer {TEST_KEY}"},
                       json={"model": "short", "stream": True, "messages": [{"role": "user", "content": QUESTION}],
                             "sim": {"fail": "drop", "chunk_delay_ms": 20}}, timeout=30)  # drop: own read
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["code"] == "upstream_stream_broken" and "'short'" in err["message"]
        assert wait_for(lambda: len(records) >= 1, timeout_s=5)
        assert (records[0].status, records[0].error_code, records[0].partial) == (502, "upstream_stream_broken", True)
        # what it had sent before the break is billed, as on a tier that does not escalate (it was 0)
        assert records[0].usage_source == "counted" and records[0].completion_tokens > 0
        assert records[0].prompt_tokens > 0 and records[0].cost_micro_usd > 0


def test_an_attempt_ended_by_an_error_event_is_billed_what_it_generated(upstream_sim: SimProcess,
                                                                         redis_url: str) -> None:
    """The cheap tier's stream ends with the upstream's error event after some thought (no usage chunk), while the
    gateway peeks it for escalation: the call failed, a 502 ``upstream_error`` as a stream that broke there is (it was
    escalated as an empty answer — see tests/gateway/test_escalation_peek_error.py), and it is metered on the deltas
    it sent and its prompt — it was metered at 0 (``usage_source: none``) though the upstream had generated them."""
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"thinking_budget": 100, "escalate_on": ["empty_answer"]})
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as gw:
        records: list[UsageRecord] = []
        gw.app.state.proxy.usage_sinks.append(records.append)
        r = httpx.post(gw.base_url + "/chat/completions", headers={"authorization": f"Bearer {TEST_KEY}"},
                       # a short question: a thought of 16+ words, an answer of 3, so the error comes in the thought
                       json={"model": "short", "stream": True, "messages": [{"role": "user", "content": "hi there"}],
                             "sim": {"fail": "error-event"}}, timeout=30)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
        assert wait_for(lambda: len(records) >= 1, timeout_s=5)
        [first] = records  # long was not called
        assert (first.tier, first.status, first.error_code, first.usage_source, first.partial) == (
            "short", 502, "upstream_error", "counted", True)
        assert first.completion_tokens > 0 and first.prompt_tokens > 0 and first.cost_micro_usd > 0


def test_no_escalation_when_the_answer_is_there(upstream_sim: SimProcess, redis_url: str) -> None:
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"escalate_on": ["empty_answer", "length_in_thought"]})
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as gw:
        for stream in (False, True):
            raw = _client(gw).chat.completions.with_raw_response.create(
                model="short", messages=[{"role": "user", "content": QUESTION}], stream=stream)
            assert raw.headers["x-thinkgate-tier"] == "short"
            assert raw.headers["x-thinkgate-route-reason"] == "forced"
            if stream:
                assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)


def test_an_escalation_admitted_and_never_sent_settles_its_reservation(redis_url: str, redis_prefix: str,
                                                                       tmp_path: Path) -> None:
    """A client that hangs up after the escalation was admitted and before it was sent (here: while the first
    attempt's answer, which came with no usage, is being counted by a slow ``/tokenize``) leaves no reservation
    behind: the escalation is metered as the cancelled call it is (status 499, nothing sent, cost 0), settling its
    reservation at every level at once. Before, it held the key's, tags' and global budgets for
    ``limits.reservation_ttl_s`` (600 s) — in hard mode, a budget that refused requests for nothing."""
    from tests.fixtures.gateway import SECRETS, accounting_gateway, keys_config

    sim = start_sim("--tokenize-delay-ms", "3000")
    try:
        tiers = sim_tiers(sim.base_url)
        tiers[1].update({"thinking_budget": 100, "max_tokens": 4, "escalate_on": ["length_in_thought"]})
        with accounting_gateway(sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                                auth=keys_config(alice={"budget_usd_day": "1"})) as gw:
            body = {"model": "short", "messages": [{"role": "user", "content": QUESTION}],
                    "sim": {"usage": "omit"}}  # the first answer is counted: /tokenize, 3 s
            # the hang-up comes while the answer is counted (a 1.0 s read timeout could come before a loaded gateway
            # got there)
            hang_up_when(gw, "/chat/completions", body, {"authorization": f"Bearer {SECRETS['alice']}"},
                         lambda: sim.stats()["tokenize"] >= 1)
            check = redis.Redis.from_url(redis_url)
            try:
                assert wait_for(lambda: len(check.xrange(redis_prefix + "usage:events")) >= 2, timeout_s=10)
                time.sleep(0.3)
                events = [orjson.loads(f[b"e"]) for _, f in check.xrange(redis_prefix + "usage:events")]
                assert sorted((e["tier"], e["status"]) for e in events) == [("long", 499), ("short", 499)]
                assert [e["cost_micro_usd"] for e in events if e["tier"] == "long"] == [0]
                assert sim.stats()["requests"] == 1  # the escalation was never sent
                assert check.hgetall(redis_prefix + "lim:alice:resv") == {}
                assert check.hlen(redis_prefix + "wal:open") == 0
            finally:
                check.close()
    finally:
        sim.stop()
