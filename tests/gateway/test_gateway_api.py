"""Every endpoint through the official OpenAI SDK against a real uvicorn gateway over the upstream simulator.

Checks content, reasoning, usage (incl. reasoning tokens), headers and what the upstream actually received.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.fixtures.upstream import wait_for
from tests.fixtures.upstream_sim import answer_words, reasoning_words

USER = "what is seven times six"
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": USER}]
SHORT_BUDGET = 8  # thinking_budget of the "short" tier in tests.fixtures.upstream.sim_tiers


def tag_body(tag: str, **sim: Any) -> dict[str, Any]:
    return {"sim": {"tag": tag, **sim}}


def new_tag() -> str:
    return uuid.uuid4().hex


def test_chat_auto_non_stream_content_usage_headers(openai_client: openai.OpenAI, upstream_sim: Any) -> None:
    tag = new_tag()
    raw = openai_client.chat.completions.with_raw_response.create(
        model="auto", messages=MESSAGES, extra_body=tag_body(tag)
    )
    assert raw.headers["x-thinkgate-tier"] == "short"
    assert raw.headers["x-thinkgate-route-reason"] == "predicted"
    difficulty = float(raw.headers["x-thinkgate-difficulty"])
    assert 0.0 <= difficulty < 0.5
    c = raw.parse()
    msg = c.choices[0].message
    assert msg.content == " ".join(answer_words(USER))
    expected_reasoning = reasoning_words(USER)[:SHORT_BUDGET]
    assert msg.reasoning == " ".join(expected_reasoning)  # type: ignore[attr-defined]
    assert c.usage is not None
    assert c.usage.completion_tokens_details is not None
    assert c.usage.completion_tokens_details.reasoning_tokens == SHORT_BUDGET
    assert c.usage.completion_tokens == SHORT_BUDGET + len(answer_words(USER))
    assert c.usage.prompt_tokens == len(USER.split()) + 3
    sent = upstream_sim.tag(tag)["body"]
    assert sent["model"] == "sim-model"
    assert sent["thinking_token_budget"] == SHORT_BUDGET
    assert sent["max_tokens"] == 64


def test_chat_stream_with_usage(openai_client: openai.OpenAI, upstream_sim: Any) -> None:
    tag = new_tag()
    raw = openai_client.chat.completions.with_raw_response.create(
        model="long", messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        extra_body=tag_body(tag),
    )
    assert raw.headers["x-thinkgate-tier"] == "long"
    assert raw.headers["x-thinkgate-route-reason"] == "forced"
    assert "x-thinkgate-difficulty" not in raw.headers
    assert raw.headers["content-type"].startswith("text/event-stream")
    content, reasoning, usages, finish = [], [], [], None
    for chunk in raw.parse():
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for ch in chunk.choices:
            content.append(ch.delta.content or "")
            reasoning.append(getattr(ch.delta, "reasoning", None) or "")
            finish = ch.finish_reason or finish
    assert "".join(content) == " ".join(answer_words(USER))
    assert "".join(reasoning) == " ".join(reasoning_words(USER))
    assert finish == "stop"
    assert len(usages) == 1
    u = usages[0]
    assert u.completion_tokens_details.reasoning_tokens == len(reasoning_words(USER))
    assert u.completion_tokens == len(reasoning_words(USER)) + len(answer_words(USER))
    sent = upstream_sim.tag(tag)["body"]
    assert "thinking_token_budget" not in sent  # the long tier has no budget
    assert sent["stream_options"] == {"include_usage": True}


def test_chat_stream_without_usage_hides_usage_chunk(openai_client: openai.OpenAI, upstream_sim: Any) -> None:
    tag = new_tag()
    chunks = list(openai_client.chat.completions.create(
        model="short", messages=MESSAGES, stream=True, extra_body=tag_body(tag)
    ))
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    # The gateway still asked the upstream for usage, to meter the request.
    assert upstream_sim.tag(tag)["body"]["stream_options"] == {"include_usage": True}
    # vLLM's per-chunk usage comes only with include_usage: without it, the client's continuous_usage_stats is not
    # passed on (the gateway's own include_usage would have turned it on); with it, it is
    for asked, sent in (({"continuous_usage_stats": True}, {"include_usage": True}),
                        ({"include_usage": True, "continuous_usage_stats": True},
                         {"include_usage": True, "continuous_usage_stats": True})):
        tag = new_tag()
        list(openai_client.chat.completions.create(model="short", messages=MESSAGES, stream=True,
                                                   stream_options=asked, extra_body=tag_body(tag)))  # type: ignore[arg-type]
        assert upstream_sim.tag(tag)["body"]["stream_options"] == sent


def test_completions_non_stream_and_stream(openai_client: openai.OpenAI) -> None:
    prompt = "count the apples"
    raw = openai_client.completions.with_raw_response.create(model="long", prompt=prompt)
    assert raw.headers["x-thinkgate-tier"] == "long"
    c = raw.parse()
    expected = f"{' '.join(reasoning_words(prompt))} </think> {' '.join(answer_words(prompt))}"
    assert c.choices[0].text == expected
    assert c.usage is not None and c.usage.prompt_tokens == len(prompt.split())
    assert c.usage.completion_tokens == len(expected.split())
    text, usages = [], []
    for chunk in openai_client.completions.create(
        model="long", prompt=prompt, stream=True, stream_options={"include_usage": True}
    ):
        text.extend(ch.text for ch in chunk.choices)
        if chunk.usage is not None:
            usages.append(chunk.usage)
    assert "".join(text) == expected
    assert len(usages) == 1 and usages[0].completion_tokens == len(expected.split())


def test_n_stop_and_max_tokens_caps(openai_client: openai.OpenAI, upstream_sim: Any) -> None:
    c = openai_client.chat.completions.create(model="long", messages=MESSAGES, n=2)
    assert [ch.index for ch in c.choices] == [0, 1]
    assert c.choices[0].message.content == c.choices[1].message.content
    c = openai_client.chat.completions.create(model="long", messages=MESSAGES, stop=["seven"])
    assert c.choices[0].message.content == "echo: what is"
    # A client cap above the tier's is lowered to the tier's; max_completion_tokens becomes max_tokens.
    tag = new_tag()
    openai_client.chat.completions.create(model="short", messages=MESSAGES, max_tokens=10_000, extra_body=tag_body(tag))
    assert upstream_sim.tag(tag)["body"]["max_tokens"] == 64
    tag = new_tag()
    c = openai_client.chat.completions.create(
        model="long", messages=MESSAGES, max_completion_tokens=5, extra_body=tag_body(tag)
    )
    sent = upstream_sim.tag(tag)["body"]
    assert sent["max_tokens"] == 5 and "max_completion_tokens" not in sent
    assert c.choices[0].finish_reason == "length"
    assert c.usage is not None and c.usage.completion_tokens == 5


def test_unknown_fields_pass_through_and_thinking_off_merges(openai_client: openai.OpenAI, upstream_sim: Any) -> None:
    tag = new_tag()
    c = openai_client.chat.completions.create(
        model="none",
        messages=MESSAGES,
        temperature=0.3,
        extra_body={"chat_template_kwargs": {"custom": 1}, "top_k": 7, **tag_body(tag)},
    )
    sent = upstream_sim.tag(tag)["body"]
    assert sent["chat_template_kwargs"] == {"custom": 1, "enable_thinking": False}
    assert sent["top_k"] == 7 and sent["temperature"] == 0.3
    assert "thinking_token_budget" not in sent  # budget_mode off
    assert getattr(c.choices[0].message, "reasoning", None) is None
    assert c.usage is not None and c.usage.completion_tokens_details.reasoning_tokens == 0


def test_client_thinking_budget_below_tier_is_kept(openai_client: openai.OpenAI, upstream_sim: Any) -> None:
    tag = new_tag()
    c = openai_client.chat.completions.create(
        model="short", messages=MESSAGES, extra_body={"thinking_token_budget": 3, **tag_body(tag)}
    )
    assert upstream_sim.tag(tag)["body"]["thinking_token_budget"] == 3
    assert c.usage is not None and c.usage.completion_tokens_details.reasoning_tokens == 3
    tag = new_tag()
    openai_client.chat.completions.create(
        model="short", messages=MESSAGES, extra_body={"thinking_token_budget": 500, **tag_body(tag)}
    )
    assert upstream_sim.tag(tag)["body"]["thinking_token_budget"] == SHORT_BUDGET


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_tokens_filled_from_tokenize(openai_client: openai.OpenAI, upstream_sim: Any, stream: bool) -> None:
    before = upstream_sim.stats()["tokenize"]
    extra = {"sim": {"fail": "no-reasoning-count"}}
    if stream:
        usages = [
            ch.usage
            for ch in openai_client.chat.completions.create(
                model="long", messages=MESSAGES, stream=True, stream_options={"include_usage": True},
                extra_body=extra,
            )
            if ch.usage is not None
        ]
        assert len(usages) == 1
        usage = usages[0]
    else:
        usage = openai_client.chat.completions.create(model="long", messages=MESSAGES, extra_body=extra).usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == len(reasoning_words(USER))
    assert upstream_sim.stats()["tokenize"] == before + 1


def test_models_lists_auto_and_tiers(openai_client: openai.OpenAI) -> None:
    models = {m.id: m for m in openai_client.models.list()}
    assert list(models) == ["auto", "none", "short", "long"]
    short = models["short"].model_extra["thinkgate"]  # type: ignore[index]
    assert short["thinking_budget"] == SHORT_BUDGET and short["max_tokens"] == 64
    assert short["prices"] == {"input_usd_per_mtok": "0.10", "cached_input_usd_per_mtok": "0.05",
                               "output_usd_per_mtok": "0.40"}
    assert models["long"].model_extra["thinkgate"]["thinking_budget"] is None  # type: ignore[index]
    assert models["auto"].model_extra["thinkgate"]["routed_tiers"] == ["short", "long"]  # type: ignore[index]


def test_a_trailing_slash_is_served_not_redirected(gateway: Any) -> None:
    """``POST /v1/chat/completions/`` (a base URL joined with a slash too many): answered like the path without
    it. It was a 307 to the Host the client named — an internal address behind a proxy, and the body sent twice."""
    from tests.fixtures.upstream import TEST_KEY

    for path in ("/v1/chat/completions/", "/chat/completions/"):
        r = httpx.post(gateway.url + path, headers={"authorization": f"Bearer {TEST_KEY}"}, timeout=30,
                       json={"model": "auto", "messages": MESSAGES})
        assert r.status_code == 200, (path, r.status_code, r.text)
        assert r.json()["object"] == "chat.completion"
    # other paths with a slash too many: an honest 404, not a redirect to the Host the client named
    for path in ("/dashboard/", "/metrics/", "/v1/feedback/"):
        r = httpx.get(gateway.url + path, headers={"host": "evil.example"}, timeout=10, follow_redirects=False)
        assert r.status_code == 404 and "location" not in r.headers, (path, r.status_code)
    assert httpx.get(gateway.url + "/openapi.json", timeout=10).status_code == 404  # no page without a key


def test_health_and_ready_need_no_key(gateway: Any) -> None:
    r = httpx.get(gateway.url + "/health", timeout=5)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = httpx.get(gateway.url + "/ready", timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ready" and body["redis"] is True
    assert body["upstreams"] == {"none": True, "short": True, "long": True}
    # HEAD too (load balancers' and uptime checkers' probes): the status, no body (it was a 405)
    for path in ("/health", "/ready"):
        h = httpx.head(gateway.url + path, timeout=10)
        assert h.status_code == 200 and h.content == b"", path


def test_usage_record_priced_exactly(gateway: Any, openai_client: openai.OpenAI) -> None:
    records: list[Any] = []
    sinks = gateway.app.state.proxy.usage_sinks
    sinks.append(records.append)
    try:
        openai_client.chat.completions.create(model="long", messages=MESSAGES)
        list(openai_client.chat.completions.create(model="long", messages=MESSAGES, stream=True))
        # The streamed record is finished after the last byte went out: allow the server a moment.
        assert wait_for(lambda: len(records) == 2)
    finally:
        sinks.remove(records.append)
    assert len(records) == 2
    prompt = len(USER.split()) + 3
    completion = len(reasoning_words(USER)) + len(answer_words(USER))
    # long tier: 0.50 in / 2.00 out USD per 1M tokens → micro-USD = 0.5·prompt + 2·completion, half up.
    expected = int(prompt * 0.5 + completion * 2 + 0.5)
    for rec, stream in zip(records, (False, True), strict=True):
        assert (rec.stream, rec.status, rec.tier, rec.key_id, rec.tags) == (stream, 200, "long", "test", {"team": "qa"})
        assert (rec.prompt_tokens, rec.completion_tokens) == (prompt, completion)
        assert rec.reasoning_tokens == len(reasoning_words(USER))
        assert rec.cost_micro_usd == expected
        assert rec.usage_source == "upstream" and rec.ttft_ms is not None and rec.latency_ms >= rec.ttft_ms


def test_startup_heap_is_frozen_for_the_collector(gateway: Any) -> None:
    """Full garbage collections must not traverse what imports and startup left (gateway/app.py): hundreds of
    thousands of objects whose traversal stopped the event loop for 0.2–1.8 s every few seconds under load."""
    import gc

    assert gc.get_freeze_count() > 10_000
