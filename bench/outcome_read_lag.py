"""How long automatic retraining's read of the outcome stream stalls the serving event loop (issue 24).

At every fit and every realised-floor check (one per ``routing.retrain.realised_min // 3`` new outcomes) the
fitting replica reads the newest ``routing.retrain.max_outcomes`` outcomes (100,000 by default) from Redis, turns
them into the dicts the fit code reads and, for the check, computes the realised floor
(:meth:`gateway.control.retrain_trigger.RetrainTrigger.check_realised`). This writes ``--outcomes`` graded
outcomes under a fresh key prefix on a real Redis, marks a promoted router (``router:current`` with a previous
file, so the check runs), then runs the product's own ``check_realised`` ``--repeats`` times while a ticker on the
same event loop sleeps 1 ms at a time and records how late each tick wakes — the wait every request on that loop
sees. The prefix's keys are deleted at the end.

    python -m bench.outcome_read_lag [--outcomes 100000] [--repeats 3] [--redis-url URL] [--json OUT]

Prints per repeat: the check's seconds, the loop lag p50 / p99 / max (ms), the outcomes it read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from gateway.config import RedisConfig, Settings
from gateway.control.outcomes import OutcomeStore
from gateway.control.retrain_trigger import RetrainTrigger
from gateway.ledger.outcome import Outcome
from gateway.state.breaker import Breaker
from gateway.state.redis import connect
from router.serving import RouterService
from router.stats import percentile

WRITE_BATCH = 2000


async def _ticker(stop: asyncio.Event, lags: list[float]) -> None:
    """Sleep 1 ms at a time until ``stop``; append each wake-up's lateness (s) to ``lags``."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - t0 - 0.001)


async def _write(trigger: RetrainTrigger, n: int, rng: random.Random) -> None:
    """``n`` graded outcomes of router ``auto-x`` straight into the stream (pipelined XADD; the store's own field
    ``o``): the cheap tier right 95% of the time, so the floor holds and the check rolls nothing back."""
    key = trigger.outcomes.keys.outcomes
    for start in range(0, n, WRITE_BATCH):
        pipe = trigger.redis.pipeline(transaction=False)
        for i in range(start, min(n, start + WRITE_BATCH)):
            cheap = rng.random() < 0.5
            o = Outcome(source="feedback", request_id=f"r{i}", key_id="bench", tier="short" if cheap else "long",
                        sufficed=rng.random() < (0.95 if cheap else 0.97), judge="client", route_reason="predicted",
                        router_version="auto-x", score=rng.random(), text=f"question {i}: " + "x" * 200)
            pipe.xadd(key, {"o": o.to_json()})
        await pipe.execute()


async def run(n: int, repeats: int, redis_url: str) -> dict[str, Any]:
    prefix = f"tgbench:lag:{uuid.uuid4().hex[:8]}:"
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings.model_validate({
            "redis": {"url": redis_url, "key_prefix": prefix, "start_if_missing": False},
            "metering": {"spool_path": str(Path(tmp) / "spool.jsonl")},
            "routing": {"retrain": {"every_outcomes": 10, "state_dir": str(Path(tmp) / "routers"),
                                    "max_outcomes": max(1000, n)}}})
        handle = connect(RedisConfig(url=redis_url, key_prefix=prefix, socket_timeout_s=30.0))
        breaker = Breaker(5.0)
        store = OutcomeStore(settings.routing.outcomes, handle, breaker, Path(tmp) / "outcomes-spool.jsonl")
        trigger = RetrainTrigger(settings, RouterService.from_config(settings.routing), handle, breaker, store)
        router = str(settings.routing.router_path)
        rows: list[dict[str, Any]] = []
        try:
            t0 = time.perf_counter()
            await _write(trigger, n, random.Random(7))
            print(f"wrote {n:,} outcomes in {time.perf_counter() - t0:.1f} s")
            await handle.client.hset(prefix + "router:current", mapping={
                "path": router, "version": "auto-x", "previous": router, "previous_version": "old"})
            for r in range(repeats):
                lags: list[float] = []
                stop = asyncio.Event()
                ticker = asyncio.create_task(_ticker(stop, lags))
                await asyncio.sleep(0.05)
                t0 = time.perf_counter()
                event = await trigger.check_realised()
                took = time.perf_counter() - t0
                stop.set()
                await ticker
                real = trigger.realised_last or {}
                ms = [x * 1000 for x in lags]
                row = {"repeat": r + 1, "check_s": round(took, 3), "lag_p50_ms": round(percentile(ms, 50), 2),
                       "lag_p99_ms": round(percentile(ms, 99), 2), "lag_max_ms": round(max(ms), 1),
                       "outcomes_read": real.get("n"), "rolled_back": event is not None}
                rows.append(row)
                print(f"repeat {r + 1}: check {took:.2f} s; loop lag p50 {row['lag_p50_ms']} ms, p99 "
                      f"{row['lag_p99_ms']} ms, max {row['lag_max_ms']} ms; {real.get('n')} router answers read")
        finally:
            keys = [k async for k in handle.client.scan_iter(match=prefix + "*", count=1000)]
            if keys:
                await handle.client.delete(*keys)
            await handle.close()
    return {"outcomes": n, "repeats": rows, "redis_url": redis_url,
            "when": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outcomes", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    out = asyncio.run(run(a.outcomes, a.repeats, a.redis_url))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
