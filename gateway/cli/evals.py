"""``thinkgate eval tiers``: accuracy, reasoning tokens and cost of every tier of a running gateway.

The gateway is found like the OpenAI SDK finds its server: ``THINKGATE_URL`` (default
``http://127.0.0.1:8080``, with or without ``/v1``) and ``THINKGATE_API_KEY``. Each held-out problem is sent
once to each tier (``model: <tier>``, temperature 0, ``Cache-Control: no-store`` so a repeated run measures
the engine, not the cache) and verified with the task's exact verifier.

Output shape (also written as JSON)::

    {"tiers": {NAME: {"accuracy", "mean_reasoning_tokens", "max_reasoning_tokens", "cost_usd", "requests",
                      "by_difficulty": {LEVEL: {same keys}}}}}

``accuracy`` is a fraction in [0, 1]; token counts are upstream tokens from ``usage``; ``cost_usd`` is the
exact sum of per-request integer micro-USD (tier prices from ``/v1/models``) divided by 10^6.
"""

from __future__ import annotations

import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from gateway.config import Prices
from gateway.ledger.pricing import cost_micro_usd


def gateway_url() -> str:
    """Base URL of the gateway's OpenAI API (ending in ``/v1``) from ``THINKGATE_URL``."""
    url = os.environ.get("THINKGATE_URL", "http://127.0.0.1:8080").rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def gateway_key() -> str:
    """The API key from ``THINKGATE_API_KEY``; raises RuntimeError (with the fix) when unset."""
    key = os.environ.get("THINKGATE_API_KEY")
    if not key:
        raise RuntimeError("set THINKGATE_API_KEY (the dev key: cat .thinkgate/dev-key)")
    return key


@dataclass(frozen=True)
class Outcome:
    """One (tier, problem) measurement."""

    tier: str
    difficulty: int
    correct: bool
    reasoning_tokens: int
    cost_micro_usd: int


def tier_prices(models: list[dict[str, Any]]) -> dict[str, Prices]:
    """Prices per tier name from the gateway's ``/v1/models`` entries (their ``thinkgate.prices``)."""
    out: dict[str, Prices] = {}
    for m in models:
        prices = (m.get("thinkgate") or {}).get("prices")
        if prices:
            out[m["id"]] = Prices(**{k: Decimal(str(v)) for k, v in prices.items()})
    return out


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Aggregate outcomes of one group into the report's per-group keys."""
    n = len(outcomes)
    reasoning = [o.reasoning_tokens for o in outcomes]
    micro = sum(o.cost_micro_usd for o in outcomes)
    return {
        "requests": n,
        "accuracy": sum(o.correct for o in outcomes) / n if n else 0.0,
        "mean_reasoning_tokens": sum(reasoning) / n if n else 0.0,
        "max_reasoning_tokens": max(reasoning, default=0),
        "cost_usd": float(Decimal(micro) / Decimal(1_000_000)),
        "cost_micro_usd": micro,
    }


def report(outcomes: list[Outcome]) -> dict[str, Any]:
    """The full report: per tier, with a ``by_difficulty`` breakdown (keys are difficulty levels as str)."""
    by_tier: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_tier[o.tier].append(o)
    tiers: dict[str, Any] = {}
    for name, rows in by_tier.items():
        levels: dict[int, list[Outcome]] = defaultdict(list)
        for o in rows:
            levels[o.difficulty].append(o)
        entry = summarize(rows)
        entry["by_difficulty"] = {str(k): summarize(v) for k, v in sorted(levels.items())}
        tiers[name] = entry
    return {"tiers": tiers}


def run(
    tiers: list[str],
    task: str = "arith",
    n_per_level: int = 10,
    seed: int = 0,
    difficulties: list[int] | None = None,
    concurrency: int = 4,
    progress: bool = True,
) -> dict[str, Any]:
    """Send the held-out set of ``task`` through each tier of the gateway and return :func:`report`.

    Raises RuntimeError when the gateway is unreachable or a tier is unknown to it.
    """
    import httpx

    from router.errors import require
    from router.tasks import load_task, verify

    tqdm = require("tqdm", "eval", "thinkgate eval tiers").tqdm
    client = httpx.Client(base_url=gateway_url(), headers={"authorization": f"Bearer {gateway_key()}"},
                          timeout=300.0, transport=httpx.HTTPTransport(retries=1))
    try:
        resp = client.get("/models")
        resp.raise_for_status()
        models = list(resp.json()["data"])
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        client.close()
        raise RuntimeError(f"gateway at {gateway_url()} not reachable: {exc}") from exc
    prices = tier_prices(models)
    unknown = [t for t in tiers if t not in prices]
    if unknown:
        client.close()
        raise RuntimeError(f"tiers unknown to the gateway: {unknown} (it serves {sorted(prices)})")

    problems = []
    levels = difficulties or _task_levels(task)
    for level in levels:
        problems += load_task(task, "test", n_per_level, seed=seed, difficulties=[level])
    jobs = [(t, p) for t in tiers for p in problems]

    def one(job: tuple[str, Any]) -> Outcome:
        tier, problem = job
        r = client.post("/chat/completions", headers={"cache-control": "no-store"}, json={
            "model": tier, "messages": [{"role": "user", "content": problem.question}], "temperature": 0})
        r.raise_for_status()
        data = r.json()
        content = (data["choices"][0].get("message") or {}).get("content") or ""
        usage = data.get("usage") or {}
        reasoning_tokens = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        cost = cost_micro_usd(
            prices[tier],
            prompt_tokens=usage.get("prompt_tokens") or 0,
            cached_tokens=cached,
            completion_tokens=usage.get("completion_tokens") or 0,
        )
        return Outcome(tier, problem.difficulty, verify(problem, content), reasoning_tokens, cost)

    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            outcomes = list(tqdm(pool.map(one, jobs), total=len(jobs), disable=not progress, desc="eval tiers"))
    finally:
        client.close()
    return report(outcomes)


def _task_levels(task: str) -> list[int]:
    return {"arith": [1, 2, 3, 4, 5, 6], "gsm8k": [2, 3, 4, 5, 6], "math": [1, 2, 3, 4, 5]}[task]


def render(result: dict[str, Any]) -> Any:
    """A rich Table of the report: one row per (tier, difficulty) plus an "all" row per tier."""
    from rich.table import Table

    table = Table(title="ThinkGate tiers on held-out problems")
    for col in ("tier", "difficulty", "n", "accuracy", "mean reasoning tok", "max reasoning tok", "cost USD"):
        table.add_column(col, justify="right" if col not in ("tier",) else "left")
    for name, entry in result["tiers"].items():
        rows = [*entry["by_difficulty"].items(), ("all", entry)]
        for level, e in rows:
            table.add_row(
                name,
                str(level),
                str(e["requests"]),
                f"{e['accuracy']:.1%}",
                f"{e['mean_reasoning_tokens']:.1f}",
                str(e["max_reasoning_tokens"]),
                f"{Decimal(e['cost_micro_usd']) / Decimal(1_000_000):.6f}",
            )
    return table
