"""End to end through a real inference engine: the gateway in front of the real vLLM server serving the
shipped tiny model (fixture ``engine``, started once per session). Per tier, streamed and not: reasoning tokens
within the tier's budget (native and forced), verified answers on easy problems, usage summed across forced
phases, escalation on a deliberately tiny budget, and ``thinkgate eval tiers`` on a small held-out set."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from gateway.config import Settings
from gateway.ledger.record import UsageRecord
from router.tasks import load_task, verify
from tests.fixtures.upstream import TEST_KEY, GatewayServer, sim_settings

pytestmark = pytest.mark.engine

DEFAULTS = {t.name: t for t in Settings.load().tiers}
SHORT_BUDGET = DEFAULTS["short"].thinking_budget or 0
LONG_BUDGET = DEFAULTS["long"].thinking_budget or 0
# vLLM counts the end-of-thinking text it forces at the budget as reasoning (3 tokens of "\n</think>\n\n")
FORCED_END_TOKENS = 3


def _tiers(engine: str) -> list[dict[str, Any]]:
    def tier(name: str, **kw: Any) -> dict[str, Any]:
        base = DEFAULTS[name].model_dump(mode="json") if name in DEFAULTS else DEFAULTS["short"].model_dump(mode="json")
        return {**base, "name": name, "base_url": engine, "model": "thinkgate-tiny", **kw}

    return [
        tier("none"),
        # escalation test bed: the answer can never start within 4 tokens
        tier("tiny", thinking_budget=200, max_tokens=4, escalate_on=["length_in_thought"]),
        tier("short"),
        tier("short_forced", budget_mode="forced"),
        tier("long"),
    ]


@pytest.fixture(scope="module")
def engine_gateway(engine: str, redis_url: str) -> Iterator[tuple[GatewayServer, list[UsageRecord]]]:
    settings = sim_settings(engine, redis_url, tiers=_tiers(engine),
                            routing={"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5],
                                     "default_tier": "long", "effort_tiers": {}},
                            cache={"mode": "off"})
    with GatewayServer(settings) as gw:
        records: list[UsageRecord] = []
        gw.app.state.proxy.usage_sinks.append(records.append)
        yield gw, records


@pytest.fixture
def client(engine_gateway: tuple[GatewayServer, list[UsageRecord]]) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=engine_gateway[0].base_url, api_key=TEST_KEY, max_retries=0, timeout=120)
    yield c
    c.close()


def _ask(client: openai.OpenAI, tier: str, question: str, stream: bool) -> tuple[str, str, dict[str, Any], Any]:
    """(reasoning, content, usage dict, headers) of one greedy request, streamed or not."""
    msgs = [{"role": "user", "content": question}]
    if not stream:
        raw = client.chat.completions.with_raw_response.create(model=tier, messages=msgs, temperature=0)
        resp = raw.parse()
        msg = resp.choices[0].message
        return (msg.model_extra or {}).get("reasoning") or "", msg.content or "", resp.usage.model_dump(), raw.headers
    raw = client.chat.completions.with_raw_response.create(model=tier, messages=msgs, temperature=0, stream=True,
                                                           stream_options={"include_usage": True})
    reasoning, content, usage = [], [], {}
    for chunk in raw.parse():
        if chunk.usage:
            usage = chunk.usage.model_dump()
        for c in chunk.choices:
            reasoning.append((c.delta.model_extra or {}).get("reasoning") or "")
            content.append(c.delta.content or "")
    return "".join(reasoning), "".join(content), usage, raw.headers


EASY = load_task("arith", "test", 4, seed=11, difficulties=[1])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tier", ["short", "short_forced", "long"])
def test_tier_budget_and_easy_answers(client: openai.OpenAI, tier: str, stream: bool) -> None:
    budget = LONG_BUDGET if tier == "long" else SHORT_BUDGET
    slack = 0 if tier == "short_forced" else FORCED_END_TOKENS
    solved = 0
    for p in EASY:
        reasoning, content, usage, headers = _ask(client, tier, p.question, stream)
        assert headers["x-thinkgate-tier"] == tier
        r = usage["completion_tokens_details"]["reasoning_tokens"]
        assert 0 < r <= budget + slack, (tier, r)
        assert usage["completion_tokens"] >= r
        assert reasoning, "the thought is returned as message.reasoning"
        solved += verify(p, content)
    assert solved >= len(EASY) - 1, f"{tier}: {solved}/{len(EASY)} easy problems solved"


def test_thinking_off_tier(client: openai.OpenAI) -> None:
    for stream in (False, True):
        reasoning, content, usage, _ = _ask(client, "none", EASY[0].question, stream)
        assert not reasoning.strip()
        assert not (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
        assert content.strip()


def test_forced_usage_is_the_sum_of_both_phases(client: openai.OpenAI, engine: str) -> None:
    """Phase 2 re-sends the prompt plus the thought: its prompt tokens are the question's plus the thought's
    plus the closing text, and completion tokens are the thought's plus the answer's, exactly."""
    import httpx

    p = EASY[0]
    _, content, usage, _ = _ask(client, "short_forced", p.question, stream=False)
    root = engine[:-3]

    def count(**payload: Any) -> int:
        r = httpx.post(root + "/tokenize", json={"model": "thinkgate-tiny", **payload}, timeout=30)
        r.raise_for_status()
        return int(r.json()["count"])

    p1 = count(messages=[{"role": "user", "content": p.question}], add_generation_prompt=True)
    thought = usage["completion_tokens_details"]["reasoning_tokens"]
    close = count(prompt="\n</think>\n\n", add_special_tokens=False)
    answer_tokens = usage["completion_tokens"] - thought
    # re-tokenising text can merge differently at the seams: allow a few tokens either way
    assert abs(answer_tokens - count(prompt=content, add_special_tokens=False)) <= 2
    assert 0 < thought <= SHORT_BUDGET
    assert abs(usage["prompt_tokens"] - (2 * p1 + thought + close)) <= 4, "both phases' prompts are billed"


@pytest.mark.parametrize("stream", [False, True])
def test_escalation_on_a_tiny_budget(client: openai.OpenAI, engine_gateway: Any, stream: bool) -> None:
    _, records = engine_gateway
    p = EASY[1]
    before = len(records)
    _, content, usage, headers = _ask(client, "tiny", p.question, stream)
    assert headers["x-thinkgate-tier"] == "short"
    assert headers["x-thinkgate-route-reason"] == "escalated"
    assert verify(p, content)
    new = records[before:]
    assert [r.tier for r in new] == ["tiny", "short"]
    assert new[0].error_code == "escalated_length_in_thought" and new[0].completion_tokens == 4
    assert new[1].route_reason == "escalated" and new[1].completion_tokens == usage["completion_tokens"]


def test_eval_tiers_report(engine_gateway: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.cli.evals import run

    gw, records = engine_gateway
    monkeypatch.setenv("THINKGATE_URL", gw.url)
    monkeypatch.setenv("THINKGATE_API_KEY", TEST_KEY)
    before = len(records)
    result = run(["short", "long"], task="arith", n_per_level=2, difficulties=[1, 4], concurrency=2, progress=False)
    # the report's cost is the gateway's metered cost of the same requests, to the micro-dollar
    metered = sum(r.cost_micro_usd for r in records[before:])
    assert sum(result["tiers"][t]["cost_micro_usd"] for t in ("short", "long")) == metered > 0
    for name in ("short", "long"):
        entry = result["tiers"][name]
        assert entry["requests"] == 4
        assert set(entry["by_difficulty"]) == {"1", "4"}
        assert 0 <= entry["accuracy"] <= 1 and entry["cost_usd"] > 0
        assert entry["max_reasoning_tokens"] <= (LONG_BUDGET if name == "long" else SHORT_BUDGET) + FORCED_END_TOKENS
    assert result["tiers"]["long"]["mean_reasoning_tokens"] > result["tiers"]["short"]["mean_reasoning_tokens"]
