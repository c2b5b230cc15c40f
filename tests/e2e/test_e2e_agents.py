"""End to end through the real vLLM engine (fixture ``engine``): ``/v1/responses`` with the ``openai`` SDK and
``/v1/messages`` with the ``anthropic`` SDK, plain and streamed, each answer's usage equal to its metered event
(tokens and micro-dollars). Tools are not exercised here: the tiny model's server runs without a tool parser."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from gateway.config import Settings
from gateway.ledger.pricing import cost_micro_usd
from tests.fixtures.gateway import SECRETS, accounting_gateway, cleanup
from tests.fixtures.metered import events_of
from tests.fixtures.upstream import GatewayServer

pytestmark = pytest.mark.engine

DEFAULTS = {t.name: t for t in Settings.load().tiers}
QUESTION = "What is 12 + 7?"
FORCED_END_TOKENS = 3  # vLLM counts the end-of-thinking text it forces at the budget as reasoning


@pytest.fixture(scope="module")
def agents_gateway(engine: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    tiers = [{**DEFAULTS[n].model_dump(mode="json"), "base_url": engine, "model": "thinkgate-tiny"}
             for n in ("none", "short", "long")]
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    tmp: Path = tmp_path_factory.mktemp("agents-e2e")
    try:
        with accounting_gateway(engine, redis_url, tmp, prefix, tiers=tiers, cache={"mode": "off"},
                                routing={"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5],
                                         "default_tier": "long"}) as gw:
            yield gw
    finally:
        cleanup(redis_url, prefix)


def _price(gw: GatewayServer, tier: str, prompt: int, cached: int, completion: int) -> int:
    prices = next(t.prices for t in gw.settings.tiers if t.name == tier)
    return cost_micro_usd(prices, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion)


def _one_event(gw: GatewayServer, request_id: str) -> dict[str, Any]:
    rows = events_of(gw, request_id)
    assert len(rows) == 1, rows
    return rows[0]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_through_the_engine(agents_gateway: GatewayServer, stream: bool) -> None:
    gw = agents_gateway
    client = openai.OpenAI(base_url=gw.base_url, api_key=SECRETS["alice"], max_retries=0, timeout=120)
    if stream:
        with client.responses.with_streaming_response.create(model="short", input=QUESTION, temperature=0,
                                                             stream=True) as raw:
            request_id = raw.headers["x-request-id"]
            events = list(raw.parse())
        assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                             "response.incomplete")
        r = events[-1].response  # type: ignore[union-attr]
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
        assert text == r.output_text
    else:
        raw = client.responses.with_raw_response.create(model="short", input=QUESTION, temperature=0)
        request_id = raw.headers["x-request-id"]
        r = raw.parse()
    assert r.output_text.strip()
    u = r.usage
    assert u is not None and u.output_tokens_details.reasoning_tokens <= (DEFAULTS["short"].thinking_budget or 0) + \
        FORCED_END_TOKENS
    ev = _one_event(gw, request_id)
    assert ev["endpoint"] == "responses"
    assert (ev["prompt_tokens"], ev["completion_tokens"], ev["reasoning_tokens"], ev["cached_tokens"]) == (
        u.input_tokens, u.output_tokens, u.output_tokens_details.reasoning_tokens, u.input_tokens_details.cached_tokens)
    assert ev["cost_micro_usd"] == _price(gw, "short", u.input_tokens, u.input_tokens_details.cached_tokens,
                                          u.output_tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_through_the_engine(agents_gateway: GatewayServer, stream: bool) -> None:
    gw = agents_gateway
    client = anthropic.Anthropic(base_url=gw.url, api_key=SECRETS["alice"], max_retries=0, timeout=120)
    kw: dict[str, Any] = {"model": "long", "max_tokens": 200, "messages": [{"role": "user", "content": QUESTION}],
                          "thinking": {"type": "enabled", "budget_tokens": 24}, "extra_body": {"temperature": 0}}
    if stream:
        with client.messages.with_streaming_response.create(**kw, stream=True) as raw:
            request_id = raw.headers["x-request-id"]
            events = list(raw.parse())
        assert events[0].type == "message_start" and events[-1].type == "message_stop"
        usage = events[-2].usage  # type: ignore[union-attr]
        thinking = "".join(e.delta.thinking for e in events
                           if e.type == "content_block_delta" and e.delta.type == "thinking_delta")  # type: ignore[union-attr]
    else:
        raw = client.messages.with_raw_response.create(**kw)
        request_id = raw.headers["x-request-id"]
        m = raw.parse()
        usage = m.usage
        thinking = next((b.thinking for b in m.content if b.type == "thinking"), "")  # type: ignore[union-attr]
    assert thinking.strip()
    assert usage.output_tokens_details.thinking_tokens <= 24 + FORCED_END_TOKENS  # the smaller budget applied
    ev = _one_event(gw, request_id)
    cached = usage.cache_read_input_tokens or 0
    assert ev["endpoint"] == "messages"
    assert (ev["prompt_tokens"], ev["completion_tokens"]) == (usage.input_tokens + cached, usage.output_tokens)
    assert ev["cost_micro_usd"] == _price(gw, "long", usage.input_tokens + cached, cached, usage.output_tokens)
