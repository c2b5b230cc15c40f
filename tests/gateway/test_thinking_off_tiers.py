"""A tier that does not think (``enable_thinking: false``: docs/closed-loop.md's ``no_think``; the ``none`` tier,
``budget_mode: off`` too) sends no thinking budget upstream, whatever the client asked on chat, /v1/responses or
/v1/messages, and ``x-thinkgate-thinking-budget`` claims none.

The client's budget was sent on beside ``enable_thinking: false`` (vLLM's ``thinking_token_budget`` — on a
``native`` tier the gateway even put it there itself) and the header reported it as the budget served, though the
model was told not to think at all.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fixtures.upstream import TEST_KEY, GatewayServer, SimProcess, sim_settings, sim_tiers

QUESTION = "Start with 7. Add 5, then multiply by 3. What is the result?"
BUDGET = 100


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str) -> Iterator[GatewayServer]:
    tiers = sim_tiers(upstream_sim.base_url)
    # docs/closed-loop.md's cheap tier: thinking off, the default budget_mode (native), no budget of its own
    tiers.insert(1, {**tiers[1], "name": "no_think", "enable_thinking": False, "thinking_budget": None})
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as g:
        yield g


def _post(gw: GatewayServer, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(gw.base_url + path, json=body, timeout=30,
                   headers={"authorization": f"Bearer {TEST_KEY}", "anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    return r


def _request(endpoint: str, model: str, tag: str) -> tuple[str, dict[str, Any]]:
    sim = {"sim": {"tag": tag}}
    if endpoint == "chat":
        return "/chat/completions", {"model": model, "messages": [{"role": "user", "content": QUESTION}],
                                     "thinking_token_budget": BUDGET, **sim}
    if endpoint == "responses":
        return "/responses", {"model": model, "input": QUESTION, "thinking_token_budget": BUDGET, **sim}
    return "/messages", {"model": model, "max_tokens": 2 * BUDGET, "messages": [{"role": "user", "content": QUESTION}],
                         "thinking": {"type": "enabled", "budget_tokens": BUDGET}, **sim}


@pytest.mark.parametrize("model", ["no_think", "none"])
@pytest.mark.parametrize("endpoint", ["chat", "responses", "messages"])
def test_a_tier_that_does_not_think_sends_no_budget_and_claims_none(
        gw: GatewayServer, upstream_sim: SimProcess, endpoint: str, model: str) -> None:
    tag = uuid.uuid4().hex
    path, body = _request(endpoint, model, tag)
    r = _post(gw, path, body)
    sent = upstream_sim.tag(tag)
    assert sent is not None
    assert sent["body"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert "thinking_token_budget" not in sent["body"] and "thinking" not in sent["body"]
    assert r.headers["x-thinkgate-tier"] == model
    assert "x-thinkgate-thinking-budget" not in r.headers


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
def test_a_tier_that_does_not_think_gets_no_reasoning_effort(
        gw: GatewayServer, upstream_sim: SimProcess, endpoint: str) -> None:
    # the client's effort was passed on beside enable_thinking: false; a thinking tier still gets it (the control)
    for model, passed in (("no_think", False), ("long", True)):
        tag = uuid.uuid4().hex
        path, body = _request(endpoint, model, tag)
        del body["thinking_token_budget"]
        if endpoint == "chat":
            body["reasoning_effort"] = "high"
        else:
            body["reasoning"] = {"effort": "high"}
        _post(gw, path, body)
        sent = upstream_sim.tag(tag)
        assert sent is not None
        assert ("reasoning_effort" in sent["body"]) is passed, (model, sent["body"])
        if passed:
            assert sent["body"]["reasoning_effort"] == "high"


def test_a_tier_that_thinks_still_gets_the_budget(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    # the control: the same requests on a native tier that thinks send the budget and say so
    for endpoint in ("chat", "responses", "messages"):
        tag = uuid.uuid4().hex
        path, body = _request(endpoint, "long", tag)
        r = _post(gw, path, body)
        sent = upstream_sim.tag(tag)
        assert sent is not None and sent["body"]["thinking_token_budget"] == BUDGET, endpoint
        assert r.headers["x-thinkgate-thinking-budget"] == str(BUDGET), endpoint
