"""Grouped usage queries: the stream scan (before) against the per-day usage cubes (after), and what the cubes cost
the metering script per event.

1. **Queries.** ``--events`` (150,000) usage events spread over 30 whole UTC days and today (20 keys with team /
   project tags, 3 tiers, 3 models, cache hits, errors, 3 % refused requests) are counted through
   :meth:`Meter.record_many` into a private ``redis-server`` (``--redis-port``). Each query runs ``--repeat`` times
   both ways and the rows are checked equal: *scan* is what ``GET /v1/usage?group_by=…`` did before (every
   event of the period from :meth:`Meter.events`, filtered by key, :func:`gateway.ledger.export.group`); *cubes*
   is :meth:`Meter.grouped`, which ``GET /v1/usage`` and ``thinkgate usage export --since`` now call. The period is
   the default one's shape (since a UTC midnight, open end), 31 days. One row has a sub-day ``since``: the leading
   edge is only in the stream, so that query still reads the stream from ``since`` on (the honest fallback).
2. **Hot path.** ``--hot-events`` fresh events counted by the metering script of ``--base`` (the commit before the
   cubes, its ``gateway/state/metering.py`` loaded from git) and by the current one, on fresh prefixes, in
   alternating rounds, batches of 50 (the background writer's pipeline): Redis's own time per script call
   (``INFO commandstats`` ``cmdstat_evalsha``, deltas per round) and the client's wall time per event.

    .venv/bin/python -m bench.usage_query [--events 150000] [--repeat 3] [--hot-events 20000] [--write-results]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

from bench._lib.results_md import write_section
from bench.gateway_overhead import machine
from gateway.config import MeteringConfig, RedisConfig
from gateway.engine.redis_server import start_private
from gateway.ledger.aggregate import DAY_S, day_of, day_start
from gateway.ledger.event import UsageEvent
from gateway.ledger.export import group
from gateway.state.breaker import Breaker
from gateway.state.metering import Meter
from gateway.state.redis import connect
from gateway.state.spool import Spool

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Usage queries: stream scan vs per-day cubes"
BASE = "8120cc4"  # the commit before the usage cubes
KEYS = [f"key-{i:02d}" for i in range(20)]
QUERIES: list[tuple[str, list[str], str | None, float]] = [  # name, group_by, key filter, since offset (s)
    ("group_by=key (admin)", ["key"], None, 0.0),
    ("group_by=tier (admin)", ["tier"], None, 0.0),
    ("group_by=model (admin)", ["model"], None, 0.0),
    ("group_by=day (admin)", ["day"], None, 0.0),
    ("group_by=tag (admin)", ["tag"], None, 0.0),
    ("group_by=key,tier,model,day,tag (admin)", ["key", "tier", "model", "day", "tag"], None, 0.0),
    ("group_by=day,tier (one key's own)", ["day", "tier"], "key-07", 0.0),
    ("group_by=key, since 06:00 of day 1 (sub-day edge)", ["key"], None, 6 * 3600.0),
]


def make_events(rng: random.Random, n: int, first: float, now: float) -> list[UsageEvent]:
    out = []
    for _ in range(n):
        key = rng.choice(KEYS)
        tags = {"team": f"t{int(key[-2:]) % 4}"} | ({"project": "p1"} if key < "key-05" else {})
        ev = UsageEvent(key_id=key, requested_model="auto", ts=rng.uniform(first, now), tags=tags,
                        tier=rng.choice(["short", "mid", "long"]), upstream_model=rng.choice(["m1", "m2", "m3"]),
                        route_reason="predicted", audit=rng.random() < 0.03)
        if ev.audit:
            ev.status, ev.error_code = 429, "budget_exceeded"
        else:
            ev.prompt_tokens, ev.completion_tokens = rng.randrange(20, 4000), rng.randrange(1, 3000)
            ev.reasoning_tokens = rng.randrange(0, ev.completion_tokens + 1)
            ev.cached = rng.random() < 0.1
            if ev.cached:
                ev.saved_micro_usd = rng.randrange(1, 20_000)
            else:
                ev.cost_micro_usd = rng.randrange(1, 20_000)
            ev.status = rng.choice([200] * 18 + [499, 502])
            ev.partial = ev.status == 499
        out.append(ev)
    return out


def meter_on(url: str, prefix: str, workdir: Path, module: ModuleType | None = None) -> Any:
    handle = connect(RedisConfig(url=url, key_prefix=prefix, socket_timeout_s=30.0))
    cls = module.Meter if module is not None else Meter
    return cls(handle, Breaker(1.0), Spool(workdir / f"{uuid.uuid4().hex}.jsonl"),
               MeteringConfig(spool_path=workdir / "spool.jsonl"))


def meter_module_at(commit: str) -> ModuleType:
    """``gateway/state/metering.py`` as of ``commit``, loaded as a module of its own (its imports: today's)."""
    source = subprocess.run(["git", "show", f"{commit}:gateway/state/metering.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("bench_metering_before", loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    exec(compile(source, f"{commit}:gateway/state/metering.py", "exec"), mod.__dict__)
    return mod


async def timed(fn: Any, repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000, out


async def queries(url: str, workdir: Path, n: int, repeat: int, rng: random.Random) -> dict[str, Any]:
    now = time.time()
    first = day_start(day_of(now)) - 30 * DAY_S
    meter = meter_on(url, f"tgbench:{uuid.uuid4().hex[:8]}:", workdir)
    events = make_events(rng, n, first, now)
    t0 = time.perf_counter()
    for i in range(0, n, 500):
        await meter.record_many(events[i:i + 500])
    write_s = time.perf_counter() - t0
    rows = []
    for name, group_by, key, offset in QUERIES:
        since = first + offset

        async def scan(group_by: list[str] = group_by, key: str | None = key, since: float = since) -> Any:
            return group([e async for e in meter.events(since, None) if key is None or e.key_id == key], group_by)

        async def cubes(group_by: list[str] = group_by, key: str | None = key, since: float = since) -> Any:
            return await meter.grouped(group_by, since, None, key, time.time())

        before_ms, want = await timed(scan, repeat)
        after_ms, got = await timed(cubes, repeat)
        assert got.rows == want, name
        rows.append({"query": name, "rows": len(want), "scan_ms": before_ms, "cube_ms": after_ms,
                     "cube_days": len(got.cube_days), "scanned": got.events_scanned})
    info = await meter.redis.info("memory")
    await meter.redis.aclose()
    return {"rows": rows, "write_s": write_s, "days": 31, "used_memory": info.get("used_memory_human")}


async def hot_path(url: str, workdir: Path, n: int, rng: random.Random, base: str) -> dict[str, Any]:
    old_mod = meter_module_at(base)
    meters = {"before": meter_on(url, f"tgbench:{uuid.uuid4().hex[:8]}:", workdir, old_mod),
              "after": meter_on(url, f"tgbench:{uuid.uuid4().hex[:8]}:", workdir)}
    now = time.time()
    stats: dict[str, dict[str, float]] = {k: {"calls": 0, "usec": 0.0, "wall": 0.0} for k in meters}
    per_round = 1000
    for m in meters.values():  # load the scripts and open the connections before anything is counted
        await m.record_many(make_events(rng, 50, now - DAY_S, now))
    for r in range(n // per_round):
        for kind in (("before", "after") if r % 2 == 0 else ("after", "before")):
            m = meters[kind]
            evs = make_events(rng, per_round, now - DAY_S, now)
            s0 = (await m.redis.info("commandstats"))["cmdstat_evalsha"]
            t0 = time.perf_counter()
            for i in range(0, per_round, 50):
                await m.record_many(evs[i:i + 50])
            stats[kind]["wall"] += time.perf_counter() - t0
            s1 = (await m.redis.info("commandstats"))["cmdstat_evalsha"]
            stats[kind]["calls"] += s1["calls"] - s0["calls"]
            stats[kind]["usec"] += s1["usec"] - s0["usec"]
    for m in meters.values():
        await m.redis.aclose()
    return {k: {"server_us": v["usec"] / v["calls"], "wall_us": v["wall"] / (n // per_round // 2 * per_round) * 1e6,
                "calls": v["calls"]} for k, v in stats.items()}


def render(q: dict[str, Any], hot: dict[str, Any], args: argparse.Namespace) -> str:
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION, "",
        f"`python -m bench.usage_query --events {args.events} --repeat {args.repeat} --hot-events {args.hot_events}` "
        f"— {when}. A private `redis-server` on loopback (no persistence); {args.events:,} events over "
        f"{q['days']} UTC days (30 whole days and today), 20 keys, 3 tiers, 3 models, team/project tags, 3 % refused "
        f"requests, counted by the metering script in {q['write_s']:.0f} s (Redis memory after: {q['used_memory']}). "
        "*scan*: what `GET /v1/usage?group_by=…` did before (read the period's events from the stream, filter, "
        "group); *cubes*: `Meter.grouped` (what it does now). Median of the repeats, in-process (the HTTP layer and "
        "JSON encoding come on top of both); the rows of both were checked equal for every query. "
        f"Machine: {machine()}.", "",
        "| query (since a UTC midnight 30 days ago, open end) | rows | scan ms | cubes ms | scan / cubes | "
        "days from cubes | events scanned by cubes |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in q["rows"]:
        lines.append(f"| {r['query']} | {r['rows']} | {r['scan_ms']:,.0f} | {r['cube_ms']:,.1f} | "
                     f"{r['scan_ms'] / r['cube_ms']:,.0f}× | {r['cube_days']} | {r['scanned']:,} |")
    b, a = hot["before"], hot["after"]
    lines += [
        "",
        f"Hot path: the metering script of {args.base} (*before*) and of this commit (*after*), {args.hot_events:,} "
        "fresh events each in alternating rounds of 1,000, batches of 50 (the writer's pipeline):", "",
        "| | Redis µs per script call (`cmdstat_evalsha`) | client wall µs per event | calls |",
        "|---|---:|---:|---:|",
        f"| before | {b['server_us']:.1f} | {b['wall_us']:.1f} | {b['calls']:,.0f} |",
        f"| after | {a['server_us']:.1f} | {a['wall_us']:.1f} | {a['calls']:,.0f} |",
        f"| after − before | {a['server_us'] - b['server_us']:+.1f} ({a['server_us'] / b['server_us'] - 1:+.0%}) | "
        f"{a['wall_us'] - b['wall_us']:+.1f} ({a['wall_us'] / b['wall_us'] - 1:+.0%}) | |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=150_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hot-events", type=int, default=20_000, help="events per script version (hot path)")
    ap.add_argument("--base", default=BASE, help="the commit whose metering script is 'before'")
    ap.add_argument("--redis-port", type=int, default=None, help="port of the private redis-server (default: free)")
    ap.add_argument("--seed", type=int, default=20261206)
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    proc, url = start_private(args.redis_port)
    workdir = Path(tempfile.mkdtemp(prefix="tg-bench-usage-"))
    try:
        rng = random.Random(args.seed)
        q = asyncio.run(queries(url, workdir, args.events, args.repeat, rng))
        hot = asyncio.run(hot_path(url, workdir, args.hot_events, rng, args.base))
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    text = render(q, hot, args)
    print(text)
    if args.write_results:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
