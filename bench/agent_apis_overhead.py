"""What do ``/v1/responses`` and ``/v1/messages`` add on top of ``/v1/chat/completions``? Same gateway, same
question, on loopback.

Starts ``tests/fixtures/upstream_sim.py`` and ``thinkgate serve`` (engine off, tiers on the simulator, the
length-baseline router, metering to Redis) as processes on free ports, then sends the same question to the
upstream directly and to the gateway's chat, Responses and Messages endpoints — closed loop, ``concurrency``
workers, bounded in requests and seconds, alternating targets round by round. Prints per mode (JSON /
stream) and concurrency: p50/p99 latency (ms), RPS, added p50/p99 against chat, and the gateway process's
CPU ms per request (user + system, from ``/proc``: steadier than latency on a shared machine). With
``--write-results`` it replaces the "Agent APIs overhead" section of ``bench/RESULTS.md``.

    .venv/bin/python -m bench.agent_apis_overhead [--requests 300] [--seconds 15] [--rounds 2]
                                                  [--concurrency 1 16] [--write-results]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import tempfile
from pathlib import Path

import httpx
import orjson

from bench._lib.results_md import write_section
from bench.gateway_overhead import BENCH_KEY, Samples, closed_loop, machine, start_gateway, stop_all
from tests.fixtures.upstream import start_sim

SECTION = "## Agent APIs overhead"
QUESTION = "What is the sum of the first ten odd numbers? Answer briefly."


def body_of(api: str, model: str, stream: bool) -> bytes:
    """The request body asking :data:`QUESTION` on ``api`` (``chat``, ``responses`` or ``messages``)."""
    if api == "responses":
        return orjson.dumps({"model": model, "input": QUESTION, "max_output_tokens": 64, "stream": stream})
    return orjson.dumps({"model": model, "max_tokens": 64, "stream": stream,
                         "messages": [{"role": "user", "content": QUESTION}]})


async def run_load(clients: list[httpx.AsyncClient], url: str, body: bytes, headers: dict[str, str], pid: int | None,
                   concurrency: int, n: int, seconds: float, stream: bool) -> Samples:
    return await closed_loop(clients, url, lambda: body, lambda: headers, pid, concurrency, n, seconds, stream)


async def measure(targets: list[tuple[str, str, bytes, dict[str, str], int | None]], concurrencies: list[int], n: int,
                  seconds: float, rounds: int, stream: bool) -> dict[tuple[str, int], Samples]:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) for _ in range(max(4, *concurrencies))]
    results: dict[tuple[str, int], Samples] = {}
    try:
        for _, url, body, headers, pid in targets:  # warm-up
            await run_load(clients, url, body, headers, pid, 4, 40, 10, stream)
        for c in concurrencies:
            for _ in range(rounds):
                for name, url, body, headers, pid in targets:
                    s = await run_load(clients, url, body, headers, pid, c, max(1, n // rounds), seconds / rounds,
                                       stream)
                    results.setdefault((name, c), Samples()).add(s)
    finally:
        await asyncio.gather(*(cl.aclose() for cl in clients))
    return results


def table(by_mode: dict[str, dict[tuple[str, int], Samples]], names: list[str], concurrencies: list[int]) -> str:
    lines = ["| mode | target | concurrency | requests | errors | p50 ms | p99 ms | RPS | added p50 ms vs chat "
             "| added p99 ms vs chat | gateway CPU ms/req |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, results in by_mode.items():
        for c in concurrencies:
            ref = results[("gateway chat", c)]
            for name in names:
                s = results[(name, c)]
                vs = name not in ("direct", "gateway chat")
                add50 = f"{s.pct(50) - ref.pct(50):+.2f}" if vs else "—"
                add99 = f"{s.pct(99) - ref.pct(99):+.2f}" if vs else "—"
                cpu = s.cpu_ms_per_request if name != "direct" else "—"
                lines.append(f"| {mode} | {name} | {c} | {len(s.latencies_ms)} | {s.errors} | {s.pct(50):.2f} | "
                             f"{s.pct(99):.2f} | {s.rps:.0f} | {add50} | {add99} | {cpu} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per target and concurrency")
    ap.add_argument("--seconds", type=float, default=15.0, help="time cap per target and concurrency")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    sim = start_sim()
    procs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            proc, gw = start_gateway(sim, Path(tmp))
            procs.append(proc)
            bearer = {"authorization": f"Bearer {BENCH_KEY}", "content-type": "application/json"}
            by_mode: dict[str, dict[tuple[str, int], Samples]] = {}
            for mode in ("json", "stream"):
                stream = mode == "stream"
                targets = [
                    ("direct", sim.base_url + "/chat/completions", body_of("chat", "sim-model", stream),
                     {"content-type": "application/json"}, None),
                    ("gateway chat", gw.base_url + "/chat/completions", body_of("chat", "short", stream), bearer,
                     gw.pid),
                    ("gateway responses", gw.base_url + "/responses", body_of("responses", "short", stream), bearer,
                     gw.pid),
                    ("gateway messages", gw.base_url + "/messages", body_of("messages", "short", stream),
                     {"x-api-key": BENCH_KEY, "content-type": "application/json"}, gw.pid),
                ]
                by_mode[mode] = asyncio.run(measure(targets, args.concurrency, args.requests, args.seconds,
                                                    args.rounds, stream))
            names = ["direct", "gateway chat", "gateway responses", "gateway messages"]
            text = table(by_mode, names, args.concurrency)
    finally:
        stop_all(procs, sim)
    print(text)
    if args.write_results:
        when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        write_section(SECTION, f"{SECTION}\n\n`python -m bench.agent_apis_overhead --requests {args.requests} "
                      f"--seconds {args.seconds:g} --rounds {args.rounds} --concurrency "
                      f"{' '.join(map(str, args.concurrency))}` — {when}; {machine()}. Same gateway process "
                      "(tier `short` forced, metering to Redis, cache off for these non-deterministic requests), "
                      "the same question on each API; `/v1/responses` stores each answer in Redis "
                      "(`store` defaults to true).\n\n" + text + "\n")


if __name__ == "__main__":
    main()
