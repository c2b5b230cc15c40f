"""How much an automatic-retraining fit stalls the serving event loop: in a worker thread vs the fit process.

Builds an outcome set from the shipped FRAMES traces (Qwen3-14B no_think / exd0: each question three times,
served on a random tier, graded by the recorded outcome — the feedback a gateway would collect), a serving router
fitted on 80 of the questions, then runs :func:`router.fit.promote.fit_and_save` exactly as
``gateway/control/retrain_trigger.py`` does — ``asyncio.to_thread`` (``routing.retrain.fit_in: thread``) and the
spawned child at nice +10 (``fit_in: process``, cold = its first fit, warm = the next) — while a ticker on the
same loop sleeps 1 ms at a time and records how late each tick wakes (the lag every request on that loop sees).

    python -m bench.retrain_lag [--repeats 3] [--copies 3] [--json OUT]

Prints per mode: fit seconds, loop lag p50 / p99 / max (ms), the fit's verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import os
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from router.fit import promote
from router.fit.fitter import fit_router
from router.fit.labels import LabelledItem
from router.fit.traces import load_ladder
from router.model import ModelConfig, TrainedRouter
from router.stats import percentile

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO / "data" / "traces"
LADDER = "Qwen3-14B:no_think,exd0"


def outcome_set(copies: int, seed: int = 0) -> list[dict[str, Any]]:
    """Feedback outcomes (dicts of ``gateway.ledger.outcome.Outcome``) from the FRAMES traces."""
    data = load_ladder(TRACES, "frames", LADDER)
    rng = random.Random(seed)
    out = []
    for i, question in enumerate(data.questions):
        for k in range(copies):
            j = int(rng.random() >= 0.5)  # 0: the cheap setting ("short"), 1: the top one ("long")
            out.append({"source": "feedback", "request_id": f"r{i}-{k}", "key_id": "bench",
                        "tier": ("short", "long")[j], "sufficed": bool(data.correct[i, j]), "judge": "client",
                        "window_digest": f"w{i}", "text": question, "router_version": "v0", "ts": time.time()})
    return out


def serving_router() -> TrainedRouter:
    """The router in service before the fit: 80 questions, labels alternating (it knows nothing)."""
    questions = load_ladder(TRACES, "frames", LADDER).questions[:80]
    items = [LabelledItem(id=f"b{i}", text=q, label=i % 2 == 0, source="base", group=f"b{i}")
             for i, q in enumerate(questions)]
    router, _ = fit_router(items, ModelConfig(min_df=1), val_frac=0.0)
    router.thresholds = [0.5]
    router.metadata["version"] = "v0"
    return router


async def lag_during(start: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
    """Run ``start()`` while a 1 ms ticker measures the loop's lag; seconds, lag percentiles (ms), the result."""
    lags: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append((time.perf_counter() - t - 0.001) * 1000)

    task = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    result = await start()
    seconds = time.perf_counter() - t0
    done = True
    await task
    return {"fit_s": round(seconds, 3), "lag_p50_ms": round(percentile(lags, 50), 2),
            "lag_p99_ms": round(percentile(lags, 99), 2), "lag_max_ms": round(max(lags), 1),
            "better": result[1]["better"]}


async def run(repeats: int, copies: int) -> list[dict[str, Any]]:
    outcomes = outcome_set(copies)
    old = serving_router()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            job = functools.partial(promote.fit_and_save, old, outcomes, "long", tmp, f"bench-{r}")
            rows.append({"mode": "thread", "repeat": r, **await lag_during(lambda j=job: asyncio.to_thread(j))})
            pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=os.nice,
                                       initargs=(10,))
            loop = asyncio.get_running_loop()
            for warm in ("cold", "warm"):
                got = await lag_during(functools.partial(loop.run_in_executor, pool, job))
                rows.append({"mode": f"process ({warm})", "repeat": r, **got})
            pool.shutdown()
    for row in rows:
        row["outcomes"] = len(outcomes)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copies", type=int, default=3, help="outcomes per trace question")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = asyncio.run(run(args.repeats, args.copies))
    print(f"{'mode':<16} {'fit s':>6} {'lag p50':>8} {'p99':>7} {'max':>7}  better  "
          f"(ms; {rows[0]['outcomes']} outcomes, load {os.getloadavg()[0]:.1f})")
    for r in rows:
        print(f"{r['mode']:<16} {r['fit_s']:>6.2f} {r['lag_p50_ms']:>8.2f} {r['lag_p99_ms']:>7.2f} "
              f"{r['lag_max_ms']:>7.1f}  {r['better']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
