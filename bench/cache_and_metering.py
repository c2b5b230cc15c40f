"""What do the response cache and metering cost, and what does a cache hit save? Two measurements:

1. **Through the gateway** (``thinkgate serve`` as a process, engine off, tiers on ``tests/fixtures/upstream_sim.py``,
   Redis at ``$REDIS_URL`` under a throw-away key prefix): closed loop, one worker, a bounded number of
   requests and seconds per case, cases alternated round by round. Cases: ``bypass`` (temperature 0.7: not
   cacheable, no cache I/O), ``miss`` (temperature 0, a new prompt every time: lookup + single-flight lock +
   upstream + store), ``hit`` (temperature 0, one prompt: answered from Redis, upstream untouched), each
   non-streamed (``json``) and streamed (``stream``, latency to the last byte). The simulator answers at once,
   so ``miss`` is a lower bound; a real reasoning upstream takes seconds. Reports p50/p99 ms and the gateway's
   CPU ms per request.
2. **In-process primitives** against the same Redis: one metering write (the Lua script: stream + counters +
   settle), one budget admission (Lua), one cache lookup (hit), one spool append (fsync, the Redis-down path);
   sequential latency p50/p99 in µs, and metering throughput with 32 writes in flight.

    .venv/bin/python bench/cache_and_metering.py [--requests 300] [--seconds 15] [--rounds 2] [--write-results]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path

import httpx
import orjson
import yaml

from bench._lib.load import send
from bench._lib.redis_keys import delete_prefix
from bench._lib.results_md import write_section
from bench.gateway_overhead import Samples, cpu_seconds, machine
from gateway.engine.redis_server import free_port
from router.stats import percentile
from tests.fixtures.upstream import SimProcess, sim_tiers, start_sim, wait_http_ok

REPO = Path(__file__).resolve().parents[1]
KEY = "tg-bench-cache-key"

SECTION = "## Cache and metering"
CASES = ("bypass", "miss", "hit")


def start_gateway(sim: SimProcess, workdir: Path, redis_url: str, prefix: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cfg = {
        "engine": {"enabled": False},
        "server": {"log_level": "warning"},
        "redis": {"url": redis_url, "key_prefix": prefix, "start_if_missing": False},
        "metering": {"spool_path": str(workdir / "spool.jsonl")},
        "tiers": [{**t, "prices": {k: str(v) for k, v in t["prices"].items()}} for t in sim_tiers(sim.base_url)],
        "routing": {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5]},
        "auth": {"keys": [{"id": "bench", "secret": KEY, "budget_usd_day": "1000000"}]},
    }
    path = workdir / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", str(port)],
                            cwd=REPO, env={**os.environ, "THINKGATE_CONFIG": ""}, stdout=subprocess.DEVNULL,
                            stderr=(workdir / "gateway.log").open("w"))
    wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=60, proc=proc)
    return proc, f"http://127.0.0.1:{port}/v1"


def body_for(case: str, stream: bool, i: int) -> bytes:
    if case == "hit":
        text, temperature = "What is the sum of the first ten odd numbers?", 0
    elif case == "miss":
        text, temperature = f"What is the sum of the first ten odd numbers? ({uuid.uuid4().hex})", 0
    else:
        text, temperature = "What is the sum of the first ten odd numbers?", 0.7
    return orjson.dumps({"model": "short", "messages": [{"role": "user", "content": text}],
                         "temperature": temperature, "stream": stream})


async def run_case(client: httpx.AsyncClient, url: str, case: str, stream: bool, n: int, seconds: float,
                   pid: int) -> Samples:
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    out = Samples()
    deadline = time.perf_counter() + seconds
    cpu0 = cpu_seconds(pid)
    t_start = time.perf_counter()
    for i in range(n):
        if time.perf_counter() > deadline:
            break
        body = body_for(case, stream, i)
        t0 = time.perf_counter()
        r = await send(client, url, body, headers, stream)
        got = r.headers.get("x-thinkgate-cache")
        if r.status_code == 200 and got == case:
            out.latencies_ms.append((time.perf_counter() - t0) * 1000)
        else:
            out.errors += 1
    out.wall_s = time.perf_counter() - t_start
    cpu1 = cpu_seconds(pid)
    if cpu0 is not None and cpu1 is not None:
        out.cpu_s = cpu1 - cpu0
    return out


async def gateway_cases(url: str, pid: int, n: int, seconds: float, rounds: int) -> dict[tuple[str, str], Samples]:
    results: dict[tuple[str, str], Samples] = {}
    endpoint = url + "/chat/completions"
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        for stream in (False, True):  # warm-up, and the "hit" entry for both forms
            for case in CASES:
                await run_case(client, endpoint, case, stream, 20, 10, pid)
        for _ in range(rounds):
            for stream in (False, True):
                for case in CASES:
                    s = await run_case(client, endpoint, case, stream, max(1, n // rounds), seconds / rounds, pid)
                    results.setdefault(("stream" if stream else "json", case), Samples()).add(s)
    return results


def p50_p99(xs: list[float]) -> tuple[float, float]:
    """:func:`router.stats.percentile` 50 and 99 of ``xs`` (NaN when empty)."""
    return percentile(xs, 50, math.nan), percentile(xs, 99, math.nan)


async def primitives(redis_url: str, prefix: str, workdir: Path, n: int) -> dict[str, tuple[float, float]]:
    """µs p50/p99 of each primitive, plus ("metering 32 in flight", (events/s, 0))."""
    from gateway.config import CacheConfig, LimitsConfig, MeteringConfig, Prices, RedisConfig
    from gateway.ledger.event import UsageEvent
    from gateway.state.breaker import Breaker
    from gateway.state.cache import CacheEntry, ResponseCache
    from gateway.state.cache_policy import CacheDecision
    from gateway.state.limits import Estimate, KeyLimits, Limits
    from gateway.state.metering import Meter
    from gateway.state.redis import connect
    from gateway.state.spool import Spool

    handle = connect(RedisConfig(url=redis_url, key_prefix=prefix, socket_timeout_s=2.0))
    breaker = Breaker(1.0)
    spool = Spool(workdir / "bench-spool.jsonl")
    meter = Meter(handle, breaker, spool, MeteringConfig(spool_path=workdir / "bench-spool.jsonl"))
    limits = Limits(handle, breaker, LimitsConfig())
    cache = ResponseCache(handle, breaker, CacheConfig())
    prices = Prices(input_usd_per_mtok=Decimal("0.5"), output_usd_per_mtok=Decimal("2"))

    def event(i: int) -> UsageEvent:
        ev = UsageEvent(key_id=f"k{i % 8}", requested_model="auto", tier="short", upstream_model="m",
                        route_reason="predicted", prompt_tokens=40 + i % 10, completion_tokens=120, reasoning_tokens=80)
        ev.price(prices)
        return ev

    async def timed(fn: object, count: int) -> list[float]:
        out = []
        for i in range(count):
            t0 = time.perf_counter()
            await fn(i)  # type: ignore[operator]
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    res: dict[str, tuple[float, float]] = {}
    try:
        await meter.record(event(0))
        xs = await timed(lambda i: meter.record(event(i)), n)
        res["metering write (Lua: XADD + 5 counter hashes + settle)"] = p50_p99(xs)
        lim = KeyLimits("bench", budget_day_micro=10**15, budget_month_micro=10**15, rpm=10**9, tpm=10**12)
        xs = []
        for i in range(n):  # admit (timed), then settle it through metering as the gateway does (untimed)
            ev = event(i)
            ev.key_id = "bench"
            t0 = time.perf_counter()
            await limits.admit(lim, ev.event_id, Estimate(500, 200), ev.ts)
            xs.append((time.perf_counter() - t0) * 1e6)
            await meter.record(ev)
        res["budget/RPM/TPM admission (Lua; 1 request in flight)"] = p50_p99(xs)
        body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "word " * 200},
                             "finish_reason": "stop"}], "usage": {"prompt_tokens": 10, "completion_tokens": 200}}
        dec = CacheDecision(True, True, 600)
        t = await cache.begin("bench-digest", dec)
        await cache.finish(t, CacheEntry(body, "chat", "short", "m", time.time()))
        xs = await timed(lambda i: cache.begin("bench-digest", dec), n)
        res["cache lookup, hit (GET + parse ~1 KB entry)"] = p50_p99(xs)
        xs = await timed(lambda i: spool.append([event(i)]), min(n, 300))
        res["spool append (write + fsync; Redis-down path)"] = p50_p99(xs)
        sem = asyncio.Semaphore(32)

        async def one(i: int) -> None:
            async with sem:
                await meter.record(event(i))

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        res["metering throughput, 32 writes in flight (events/s)"] = (n / (time.perf_counter() - t0), 0.0)
    finally:
        delete_prefix(redis_url, prefix)
        await handle.close()
    return res


def render(gw: dict[tuple[str, str], Samples], prim: dict[str, tuple[float, float]], args: argparse.Namespace) -> str:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION, "",
        f"`bench/cache_and_metering.py` — {now}. Through `thinkgate serve` (one uvicorn worker, engine off, tiers "
        "on `tests/fixtures/upstream_sim.py`, which answers at once; Redis on loopback; the full request path: "
        "key auth, routing, budget admission in Redis, cache, upstream, metering), one closed-loop client, "
        f"{args.requests} requests or {args.seconds:.0f} s per case in {args.rounds} alternating rounds. "
        "`bypass`: temperature 0.7, not cacheable; `miss`: temperature 0 with a new prompt each time (lookup, "
        "single-flight lock, upstream, store); `hit`: served from Redis, the upstream untouched (cost 0; the "
        "usage event records `saved_micro_usd`). `stream` latency is to the last byte. Client, simulator, "
        f"gateway and Redis share the machine's CPUs. Machine: {machine()}.", "",
        "| mode | case | requests | errors | p50 ms | p99 ms | gateway CPU ms/req |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (mode, case), s in gw.items():
        lines.append(f"| {mode} | {case} | {len(s.latencies_ms)} | {s.errors} | {s.pct(50):.2f} | {s.pct(99):.2f} | "
                     f"{s.cpu_ms_per_request} |")
    lines += ["", f"In-process primitives against the same Redis ({args.primitives} sequential calls each; µs):", "",
              "| primitive | p50 µs | p99 µs |", "|---|---:|---:|"]
    for name, (p50, p99) in prim.items():
        if "throughput" in name:
            lines.append(f"| {name} | {p50:,.0f} | — |")
        else:
            lines.append(f"| {name} | {p50:.0f} | {p99:.0f} |")
    hit_p50 = statistics.median([gw[(m, "hit")].pct(50) for m in ("json", "stream")])
    miss_p50 = statistics.median([gw[(m, "miss")].pct(50) for m in ("json", "stream")])
    lines += ["", f"Reading: a hit answers in ~{hit_p50:.1f} ms p50 through the gateway against ~{miss_p50:.1f} ms "
              "for a miss on an upstream that answers instantly — against a real reasoning upstream (seconds) a hit "
              "saves the whole generation and its cost. Metering adds one Lua call per request, written after the "
              "response (off the latency path)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per case and mode")
    ap.add_argument("--seconds", type=float, default=15.0, help="time cap per case and mode")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--primitives", type=int, default=2000, help="calls per in-process primitive")
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"tgbench:{uuid.uuid4().hex[:8]}:"
    workdir = Path(tempfile.mkdtemp(prefix="tg-bench-cache-"))
    sim = start_sim()
    proc = None
    try:
        proc, url = start_gateway(sim, workdir, redis_url, prefix)
        gw = asyncio.run(gateway_cases(url, proc.pid, args.requests, args.seconds, args.rounds))
        proc.terminate()
        proc.wait(timeout=15)
        proc = None
        prim = asyncio.run(primitives(redis_url, prefix + "prim:", workdir, args.primitives))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=15)
        sim.stop()
        delete_prefix(redis_url, prefix)
        shutil.rmtree(workdir, ignore_errors=True)
    text = render(gw, prim, args)
    print(text)
    if args.write_results:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
