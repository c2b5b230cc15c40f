"""Requests per second of 1, 2 and 3 ThinkGate replicas behind HAProxy on this machine.

Starts the deterministic upstream (``tests/fixtures/upstream_sim.py``), three ``thinkgate serve`` processes (engine
off, one Redis key prefix of their own: key auth, the length-baseline router on ``model: auto``, metering to
Redis — the request path as deployed; the cache at its default, ``deterministic``, and these requests are not
temperature 0, so every one reaches the upstream) and three ``haproxy``
processes (Debian's package) in front of the first 1, 2 and 3 replicas (round robin, health checks on
``/ready``). The same closed loop (``bench.gateway_overhead.closed_loop``: ``--concurrency`` workers, at most
``--requests`` requests or ``--seconds`` seconds per cell) goes to each HAProxy, alternating round by round so
background load hits all three alike. Prints per replica count: requests, errors, RPS, p50/p99 ms and the CPU
ms per request of all gateway processes together; ``--write-results`` replaces the "Replicas behind HAProxy"
section of ``bench/RESULTS.md``.

On a box with C cores the gateways, HAProxy, the simulator, Redis and the load generator share those C cores,
so replicas scale RPS only until the cores are busy: the ceiling is C × (1 / gateway CPU per request) minus
what the other processes take.

    .venv/bin/python -m bench.replicas [--requests 600] [--seconds 15] [--rounds 3] [--concurrency 32]
                                       [--write-results]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import orjson

from bench._lib.haproxy import write_haproxy_cfg
from bench._lib.redis_keys import delete_prefix
from bench._lib.results_md import write_section
from bench.gateway_overhead import BENCH_KEY, Samples, closed_loop, cpu_seconds, machine, start_gateway, stop_all
from gateway.engine.redis_server import free_port
from tests.fixtures.upstream import start_sim, wait_http_ok

SECTION = "## Replicas behind HAProxy"
REPLICAS = (1, 2, 3)



def start_haproxy(exe: str, ports: list[int], workdir: Path, name: str) -> tuple[subprocess.Popen[bytes], str]:
    """HAProxy in front of the gateways on ``ports``; returns the process and its ``…/v1`` base URL."""
    port = free_port()
    cfg = write_haproxy_cfg(workdir / f"{name}.cfg", port, ports)
    proc = subprocess.Popen([exe, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=60, proc=proc)
    return proc, f"http://127.0.0.1:{port}/v1"


def body_factory() -> bytes:
    """A fresh short chat request (the length baseline routes it to ``short``)."""
    return orjson.dumps({"model": "auto", "max_tokens": 16,
                         "messages": [{"role": "user", "content": f"replica bench {uuid.uuid4().hex}"}]})


async def measure(lbs: dict[int, str], pids: list[int], concurrency: int, n: int, seconds: float,
                  rounds: int) -> dict[int, Samples]:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) for _ in range(concurrency)]
    headers = {"authorization": f"Bearer {BENCH_KEY}", "content-type": "application/json"}
    results: dict[int, Samples] = {}

    def gateways_cpu() -> float:
        return sum(cpu_seconds(p) or 0.0 for p in pids)

    try:
        for base in lbs.values():  # warm-up: connections, imports
            await closed_loop(clients, base + "/chat/completions", body_factory, lambda: headers, None,
                              min(4, concurrency), 40, 10, False)
        for _ in range(rounds):
            for k, base in lbs.items():
                cpu0 = gateways_cpu()
                s = await closed_loop(clients, base + "/chat/completions", body_factory, lambda: headers, None,
                                      concurrency, max(1, n // rounds), seconds / rounds, False)
                s.cpu_s = gateways_cpu() - cpu0
                results.setdefault(k, Samples()).add(s)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return results


def table(results: dict[int, Samples], concurrency: int) -> str:
    base = results[1].rps or float("nan")
    lines = ["| replicas | concurrency | requests | errors | RPS | × 1 replica | p50 ms | p99 ms "
             "| gateways' CPU ms/req |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, s in results.items():
        lines.append(f"| {k} | {concurrency} | {len(s.latencies_ms)} | {s.errors} | {s.rps:.0f} | "
                     f"{s.rps / base:.2f} | {s.pct(50):.1f} | {s.pct(99):.1f} | {s.cpu_ms_per_request} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600, help="at most this many requests per replica count")
    ap.add_argument("--seconds", type=float, default=15.0, help="at most this long per replica count")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    exe = shutil.which("haproxy")
    if exe is None:
        sys.exit("haproxy is not installed (apt-get install -y haproxy)")
    load_before = machine()
    prefix = f"bench:replicas:{uuid.uuid4().hex[:8]}:"
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    sim = start_sim()
    procs: list[subprocess.Popen[bytes]] = []
    lbs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="tg-replicas-") as tmp:
        work = Path(tmp)
        try:
            ports, pids = [], []
            for i in range(max(REPLICAS)):
                extra = {"redis": {"url": redis_url, "key_prefix": prefix, "start_if_missing": False},
                         "server": {"log_level": "warning"},
                         "metering": {"spool_path": str(work / f"spool-{i}.jsonl")}}
                proc, target = start_gateway(sim, work, name=f"gw{i}", extra=extra)
                procs.append(proc)
                pids.append(proc.pid)
                ports.append(int(target.base_url.rsplit(":", 1)[1].split("/")[0]))
            urls = {}
            for k in REPLICAS:
                lb, url = start_haproxy(exe, ports[:k], work, f"haproxy-{k}")
                lbs.append(lb)
                urls[k] = url
            t0 = time.perf_counter()
            results = asyncio.run(measure(urls, pids, args.concurrency, args.requests, args.seconds, args.rounds))
            wall = time.perf_counter() - t0
        finally:
            stop_all(lbs)
            stop_all(procs, sim)
            delete_prefix(redis_url, prefix)
    text = table(results, args.concurrency)
    print(text)
    if args.write_results:
        cores = os.cpu_count() or 0
        best = max(results.values(), key=lambda s: s.rps)
        write_section(SECTION, f"""{SECTION}

`python -m bench.replicas --requests {args.requests} --seconds {args.seconds:g} --rounds {args.rounds} \
--concurrency {args.concurrency}` ({dt.date.today().isoformat()}, {wall:.0f} s): {len(REPLICAS)} `thinkgate serve`
processes (one uvicorn worker each; key auth, the length-baseline router on `model: auto`, metering to Redis,
every request to the upstream) on one Redis prefix, behind HAProxy 2.6 (round robin, health checks on
`/ready`) in front of the first 1, 2 and 3 of them; one simulator upstream; a closed loop of
{args.concurrency} workers, replica counts alternating round by round. {load_before}.

{text}

The ceiling: this machine has {cores} cores, shared by the gateways, HAProxy, the simulator, Redis and the load
generator (and by whatever else runs on the box: see the load average above). Each replica is one Python process,
so replicas can add RPS only while idle cores are left; past {cores} replicas (here: at once, when the box is
already busy) they add processes that compete for the same cores and RPS stays flat or drops. Best measured:
{best.rps:.0f} RPS. Compare the ratios within one run, not absolute figures across runs.
""")


if __name__ == "__main__":
    main()
