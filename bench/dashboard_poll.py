"""The dashboard's poll (``GET /dashboard/data``) at ``--events`` (150,000) usage events this month, over HTTP.

What runs: a private ``redis-server`` on loopback (``--redis-port``), ``--events`` events from
:func:`bench.usage_query.make_events` (20 keys, 3 tiers, 3 models, tags, cache hits, errors, 3 % refused) spread
from the start of the current UTC month to now and counted through :meth:`Meter.record_many` (the metering
script: stream, counters, cubes), then the gateway of this working tree (uvicorn on ``--gateway-port``, the
admin key logged in to the dashboard) answering ``GET /dashboard/data`` ``--repeat`` times. Per poll: wall time
(client side), CPU time of this process (the gateway runs in it, in a thread: the poll's Python work) and Redis's
own time (``INFO commandstats``, every command, delta over the poll), the stream entries the poll read
(``window.read``, absent before the bounded window) and the JSON size.

Version-agnostic (HTTP, :meth:`Meter.record_many` and the window field read with ``.get``), so *before* is this
script run from a checkout of the commit before the change:

    .venv/bin/python -m bench.dashboard_poll [--events 150000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from bench.gateway_overhead import machine
from bench.usage_query import make_events, meter_on
from gateway.app import create_app
from gateway.engine.redis_server import start_private
from tests.fixtures.gateway import ADMIN_SECRET, gateway_settings


async def seed(url: str, prefix: str, workdir: Path, n: int, rng: random.Random) -> float:
    now = time.time()
    dt = datetime.fromtimestamp(now, UTC)
    first = datetime(dt.year, dt.month, 1, tzinfo=UTC).timestamp()
    meter = meter_on(url, prefix, workdir)
    events = sorted(make_events(rng, n, first, now), key=lambda e: e.ts)
    t0 = time.perf_counter()
    for i in range(0, n, 500):
        await meter.record_many(events[i:i + 500])
    await meter.redis.aclose()
    return time.perf_counter() - t0


def redis_usec(client: Any) -> int:
    return sum(int(v["usec"]) for k, v in client.info("commandstats").items() if k.startswith("cmdstat_"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=150_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--redis-port", type=int, default=None)
    ap.add_argument("--gateway-port", type=int, default=21602)
    ap.add_argument("--seed", type=int, default=20261206)
    args = ap.parse_args()
    import redis

    proc, url = start_private(args.redis_port)
    workdir = Path(tempfile.mkdtemp(prefix="tg-bench-dash-"))
    prefix = f"tgbench:{uuid.uuid4().hex[:8]}:"
    try:
        write_s = asyncio.run(seed(url, prefix, workdir, args.events, random.Random(args.seed)))
        settings = gateway_settings("http://127.0.0.1:9", url, prefix, workdir / "spool.jsonl",
                                    dashboard={"secret_file": str(workdir / "secret")},
                                    server={"host": "127.0.0.1", "port": args.gateway_port})
        server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=args.gateway_port,
                                               log_level="warning", access_log=False, lifespan="on"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{args.gateway_port}"
        rc = redis.Redis.from_url(url)
        try:
            with httpx.Client(timeout=600) as http:
                login = http.post(base + "/dashboard/login", data={"key": ADMIN_SECRET}, follow_redirects=False)
                assert login.status_code == 303, login.text
                walls, cpus, rtimes, read, size, requests = [], [], [], None, 0, None
                for _ in range(args.repeat):
                    r0, c0, t0 = redis_usec(rc), time.process_time(), time.perf_counter()
                    resp = http.get(base + "/dashboard/data")
                    walls.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)
                    rtimes.append((redis_usec(rc) - r0) / 1e6)
                    assert resp.status_code == 200, resp.text
                    d = resp.json()
                    read, size, requests = d.get("window", {}).get("read"), len(resp.content), d["total"]["requests"]
        finally:
            server.should_exit = True
            thread.join(timeout=15)
            rc.close()
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"`python -m bench.dashboard_poll --events {args.events} --repeat {args.repeat}` — {when}: "
          f"{args.events:,} events this month (written in {write_s:.0f} s; total.requests {requests:,}); "
          f"GET /dashboard/data median of {args.repeat}: wall {statistics.median(walls) * 1000:,.0f} ms, "
          f"gateway CPU {statistics.median(cpus) * 1000:,.0f} ms, "
          f"Redis time {statistics.median(rtimes) * 1000:,.1f} ms, "
          f"stream entries read {read if read is not None else 'the whole month'}, JSON {size:,} B. "
          f"Machine: {machine()}.")


if __name__ == "__main__":
    main()
