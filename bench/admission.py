"""What does budget admission cost per request with three budget levels (key, tag, global) against one (key)?

In-process against the Redis at ``$REDIS_URL`` (default 127.0.0.1:6379) under a throw-away key prefix: each
case admits a request (``Limits.admit``: the one ``ADMIT`` Lua script — spend and open reservations at every
level, RPM/TPM, the reservations written) — timed — then meters its usage event as the gateway does (the
``RECORD`` script settles the reservation at every level; untimed, reported separately). Cases, alternated in
rounds so drift on a shared machine hits both alike:

- ``1 level``: a key with a daily and monthly budget, RPM and TPM;
- ``3 levels``: the same key, tagged ``team=bench``, with a tag budget and a global budget;
- ``3 levels, 16 in flight``: as above with 16 other reservations open at every level (admission reads them).

Hard budget mode, budgets large enough never to refuse. Latency p50/p99 in µs (``time.perf_counter`` around the
awaited call: client encode + round trip + script). ``--write-results`` rewrites the section of bench/RESULTS.md.

    .venv/bin/python -m bench.admission [--requests 2000] [--rounds 4] [--write-results]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench._lib.redis_keys import delete_prefix
from bench._lib.results_md import write_section
from bench.gateway_overhead import machine
from gateway.config import LimitsConfig, MeteringConfig, Prices, RedisConfig
from gateway.ledger.event import UsageEvent
from gateway.state.breaker import Breaker
from gateway.state.budgets import Level
from gateway.state.limits import Estimate, KeyLimits, Limits
from gateway.state.metering import Meter
from gateway.state.redis import connect
from gateway.state.spool import Spool
from router.stats import percentile

SECTION = "## Budget admission"
PRICES = Prices(input_usd_per_mtok=Decimal("0.5"), cached_input_usd_per_mtok=Decimal("0.25"),
                output_usd_per_mtok=Decimal("2"))
BIG = 10**15  # micro-USD: never refuses
CASES = ("1 level", "3 levels", "3 levels, 16 in flight")


async def run(requests: int, rounds: int, redis_url: str) -> dict[str, dict[str, list[float]]]:
    prefix = f"tgbench:{uuid.uuid4().hex[:10]}:"
    handle = connect(RedisConfig(url=redis_url, key_prefix=prefix, socket_timeout_s=5.0))
    breaker = Breaker(1.0)
    limits = Limits(handle, breaker, LimitsConfig(budget_mode="hard"))
    spool = Spool(Path(tempfile.gettempdir()) / f"{prefix.replace(':', '_')}spool.jsonl")
    meter = Meter(handle, breaker, spool, MeteringConfig(spool_path=spool.path))
    lim = KeyLimits("bench", budget_day_micro=BIG, budget_month_micro=BIG, rpm=10**9, tpm=10**12)
    levels = [Level("tag", "team=bench", BIG, BIG), Level("global", "global", BIG, BIG)]
    tags = {"team": "bench"}
    out: dict[str, dict[str, list[float]]] = {c: {"admit": [], "settle": []} for c in CASES}

    def event(rid: str, ts: float, tagged: bool) -> UsageEvent:
        ev = UsageEvent(key_id="bench", requested_model="short", event_id=rid, request_id=rid, ts=ts, tier="short",
                        upstream_model="m", prompt_tokens=40, completion_tokens=120, tags=tags if tagged else {})
        ev.price(PRICES)
        return ev

    async def one(case: str) -> None:
        rid, ts = uuid.uuid4().hex, time.time()
        lv = levels if case != "1 level" else []
        t0 = time.perf_counter()
        await limits.admit(lim, rid, Estimate(5000, 600), ts, lv)
        t1 = time.perf_counter()
        await meter.record(event(rid, ts, bool(lv)))
        t2 = time.perf_counter()
        out[case]["admit"].append((t1 - t0) * 1e6)
        out[case]["settle"].append((t2 - t1) * 1e6)

    try:
        for case in CASES:  # warm-up: script load, connections
            for _ in range(20):
                await one(case)
            out[case] = {"admit": [], "settle": []}
        held = [uuid.uuid4().hex for _ in range(16)]  # the open reservations of the "in flight" case
        per_round = max(1, requests // rounds)
        for _ in range(rounds):
            for case in CASES:
                if case.endswith("in flight"):
                    for rid in held:
                        await limits.admit(lim, rid, Estimate(5000, 600), time.time(), levels)
                for _ in range(per_round):
                    await one(case)
                if case.endswith("in flight"):
                    for rid in held:
                        await meter.record(event(rid, time.time(), True))
    finally:
        delete_prefix(redis_url, prefix)
        await handle.close()
        spool.path.unlink(missing_ok=True)
    return out


def table(res: dict[str, dict[str, list[float]]]) -> str:
    base = percentile(res["1 level"]["admit"], 50, 0.0)
    lines = ["| case | admissions | admit p50 µs | admit p99 µs | p50 vs 1 level | settle (metering write) p50 µs | "
             "settle p99 µs |", "|---|---:|---:|---:|---:|---:|---:|"]
    for case, xs in res.items():
        a, s = xs["admit"], xs["settle"]
        a50, a99, s50, s99 = (percentile(v, q, 0.0) for v, q in ((a, 50), (a, 99), (s, 50), (s, 99)))
        lines.append(f"| {case} | {len(a)} | {a50:.0f} | {a99:.0f} | {a50 / base:.2f}× | {s50:.0f} | {s99:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="admissions per case (all rounds)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--write-results", action="store_true", help="rewrite the section of bench/RESULTS.md")
    args = ap.parse_args(argv)
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    header = machine()
    res = asyncio.run(run(args.requests, args.rounds, url))
    text = table(res)
    print(text)
    if args.write_results:
        when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        body: Any = (
            f"{SECTION}\n\n`python -m bench.admission --requests {args.requests} --rounds {args.rounds}` — {when}. "
            "In-process against Redis on loopback (throw-away prefix), hard budget mode, budgets that never refuse. "
            "`admit` is one `Limits.admit` call (the one ADMIT Lua script: spend + open reservations at every level, "
            "RPM/TPM, reservations written at every level); `settle` is the usage event's metering write that "
            "follows (RECORD Lua: stream, counters, every level's counters and reservations). Cases alternated in "
            f"rounds. Machine: {header}.\n\n{text}\n\n"
            "Reading: the levels cost one more spend read, reservation scan and reservation write each inside the "
            "same script and round trip, so three levels stay within the same round trip as one; open "
            "reservations are scanned at every level (the in-flight case).\n")
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
