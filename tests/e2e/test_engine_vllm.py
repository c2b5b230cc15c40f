"""The shipped tiny model behind the real vLLM server: budgets enforced, answers verified, thinking off.

All requests are greedy (temperature 0). Budgets are vLLM's per-request ``thinking_token_budget`` (tokens);
the ``\\n`` after ``<think>`` in the prompt counts against it and the forced ``</think>`` counts as reasoning.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from router.tasks import load_task, verify

pytestmark = pytest.mark.engine
MODEL = "thinkgate-tiny"


def _chat(base_url: str, question: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": 512, **extra}
    r = httpx.post(f"{base_url}/chat/completions", json=body, timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def _reasoning_tokens(data: dict[str, Any]) -> int:
    return int(data["usage"]["completion_tokens_details"]["reasoning_tokens"])


def test_models_endpoint_lists_the_tiny_model(engine: str) -> None:
    r = httpx.get(f"{engine}/models", timeout=10, trust_env=False)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]


def test_short_tier_budget_solves_easy_problems(engine: str) -> None:
    budget = Settings.load().tier("short").thinking_budget
    assert budget is not None
    probs = load_task("arith", "test", 10, seed=7, difficulties=[1])
    correct = 0
    for p in probs:
        data = _chat(engine, p.question, thinking_token_budget=budget)
        msg = data["choices"][0]["message"]
        assert _reasoning_tokens(data) <= budget + 1  # + the forced </think>
        assert msg["reasoning"] and "<think>" not in (msg["content"] or "")
        assert msg["content"].lstrip().startswith("The answer is ")
        correct += verify(p, msg["content"])
    assert correct >= 9, f"{correct}/10 easy problems solved within {budget} thinking tokens"


def test_tiny_budget_is_enforced_and_still_answers(engine: str) -> None:
    p = load_task("arith", "test", 1, seed=3, difficulties=[6])[0]
    free = _chat(engine, p.question)
    assert _reasoning_tokens(free) > 12, "an unbudgeted 6-step thought is longer than the cap below"
    data = _chat(engine, p.question, thinking_token_budget=6)
    msg = data["choices"][0]["message"]
    assert _reasoning_tokens(data) <= 7
    assert data["choices"][0]["finish_reason"] == "stop"
    assert (msg["content"] or "").lstrip().startswith("The answer is ")


def test_long_budget_beats_short_budget_on_hard_problems(engine: str) -> None:
    settings = Settings.load()
    short, long_ = settings.tier("short").thinking_budget, settings.tier("long").thinking_budget
    probs = load_task("arith", "test", 12, seed=11, difficulties=[5, 6])
    jobs = [(name, b, p) for p in probs for name, b in (("short", short), ("long", long_))]

    def solve(job: tuple[str, int | None, Any]) -> tuple[str, bool]:
        name, b, p = job
        data = _chat(engine, p.question, thinking_token_budget=b, max_tokens=1024)
        return name, verify(p, data["choices"][0]["message"]["content"] or "")

    wins = {"short": 0, "long": 0}
    with ThreadPoolExecutor(8) as pool:  # vLLM batches these; batching may flip a rare near-tie, the margin absorbs it
        for name, ok in pool.map(solve, jobs):
            wins[name] += ok
    assert wins["long"] >= wins["short"] + 4, wins


def test_thinking_disabled_answers_directly(engine: str) -> None:
    p = load_task("arith", "test", 1, seed=5, difficulties=[1])[0]
    data = _chat(engine, p.question, chat_template_kwargs={"enable_thinking": False})
    msg = data["choices"][0]["message"]
    assert not msg.get("reasoning")
    assert _reasoning_tokens(data) == 0
    assert msg["content"].lstrip().startswith("The answer is ")
    assert data["usage"]["completion_tokens"] <= 12


def test_streaming_with_budget_reports_usage(engine: str) -> None:
    p = load_task("arith", "test", 1, seed=9, difficulties=[2])[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": p.question}], "temperature": 0,
            "max_tokens": 256, "stream": True, "stream_options": {"include_usage": True}, "thinking_token_budget": 64}
    reasoning, content, usage = [], [], None
    with httpx.stream("POST", f"{engine}/chat/completions", json=body, timeout=120, trust_env=False) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                delta = ch.get("delta", {})
                reasoning.append(delta.get("reasoning") or "")
                content.append(delta.get("content") or "")
    assert "".join(reasoning).strip() and verify(p, "".join(content))
    assert usage is not None and 0 < usage["completion_tokens_details"]["reasoning_tokens"] <= 65
