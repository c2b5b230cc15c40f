"""``thinkgate eval tiers``: accuracy, reasoning tokens and cost of every tier of a running gateway.

The gateway is found like the OpenAI SDK finds its server (:meth:`router.probe.ProbeClient.from_env`):
``THINKGATE_URL`` (default ``http://127.0.0.1:8080``, with or without ``/v1``) and ``THINKGATE_API_KEY``. Each
held-out problem is sent once to each tier (``model: <tier>``, temperature 0, ``Cache-Control: no-store`` so a
repeated run measures the engine, not the cache) and verified with the task's exact verifier.

Output shape (also written as JSON)::

    {"tiers": {NAME: {"accuracy", "mean_reasoning_tokens", "max_reasoning_tokens", "cost_usd", "requests",
                      "by_difficulty": {LEVEL: {same keys}}}}}

``accuracy`` is a fraction in [0, 1]; token counts are upstream tokens from ``usage``; ``cost_usd`` is the
exact sum of per-request integer micro-USD (tier prices from ``/v1/models``) divided by 10^6.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from gateway.config import Prices
from gateway.ledger.pricing import cost_micro_usd


def tier_prices(models: list[dict[str, Any]]) -> dict[str, Prices]:
    """Prices per tier name from the gateway's ``/v1/models`` entries (their ``thinkgate.prices``)."""
    out: dict[str, Prices] = {}
    for m in models:
        prices = (m.get("thinkgate") or {}).get("prices")
        if prices:
            out[m["id"]] = Prices(**{k: Decimal(str(v)) for k, v in prices.items()})
    return out


def run(
    tiers: list[str],
    task: str = "arith",
    n_per_level: int = 10,
    seed: int = 0,
    difficulties: list[int] | None = None,
    concurrency: int = 4,
    progress: bool = True,
) -> dict[str, Any]:
    """Send the held-out set of ``task`` through each tier of the gateway (:func:`router.probe.probe`) and return
    ``{"tiers": {NAME: {"accuracy", "mean_reasoning_tokens", "max_reasoning_tokens", "cost_usd",
    "cost_micro_usd", "requests", "by_difficulty": {LEVEL: {same keys}}}}}``.

    Raises RuntimeError when the gateway is unreachable or a tier is unknown to it.
    """
    from router.errors import require
    from router.probe import Outcome, ProbeClient, ProbeError, by_difficulty, probe
    from router.tasks import load_task

    tqdm = require("tqdm", "eval", "thinkgate eval tiers").tqdm
    try:
        client = ProbeClient.from_env(max_retries=1, headers={"cache-control": "no-store"})
    except ProbeError as exc:
        raise RuntimeError(str(exc)) from None
    with client:
        try:
            prices = tier_prices(client.models())
        except ProbeError as exc:
            raise RuntimeError(str(exc)) from exc
        unknown = [t for t in tiers if t not in prices]
        if unknown:
            raise RuntimeError(f"tiers unknown to the gateway: {unknown} (it serves {sorted(prices)})")
        problems = []
        for level in difficulties or _task_levels(task):
            problems += load_task(task, "test", n_per_level, seed=seed, difficulties=[level])
        bar = tqdm(total=len(tiers) * len(problems), disable=not progress, desc="eval tiers")
        try:
            outcomes = probe(client, problems, tiers, concurrency=concurrency, on_outcome=lambda _: bar.update(1))
        except ProbeError as exc:
            raise RuntimeError(str(exc)) from exc
        finally:
            bar.close()

    def cost(o: Outcome) -> int:
        a = o.answer
        return cost_micro_usd(prices[o.target], prompt_tokens=a.prompt_tokens, cached_tokens=a.cached_tokens,
                              completion_tokens=a.completion_tokens)

    def money(rows: Any) -> dict[str, Any]:
        micro = sum(cost(o) for o in rows)
        return {"cost_usd": float(Decimal(micro) / Decimal(1_000_000)), "cost_micro_usd": micro}

    return {"tiers": by_difficulty(outcomes, extra=money)}


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
