"""What does ThinkGate add on top of the upstream? Direct-to-upstream vs through-the-gateway, on loopback.

Starts ``tests/upstream_sim.py`` (the deterministic upstream) and ``thinkgate serve`` (engine off, tiers on
the simulator, Redis off the request path) as processes on free loopback ports, then sends the same chat
request to each *target* — closed loop, ``concurrency`` workers, a bounded number of requests and seconds —
alternating targets round by round so that background load hits all of them alike. Prints per target and
concurrency: p50/p99 latency (ms), RPS, and the added p50/p99 against the direct target; with
``--write-results`` it replaces the "Gateway overhead" section of ``bench/RESULTS.md``.

Targets are a list of :class:`Target` (name, OpenAI base URL, key, model). Another OpenAI-compatible proxy
in front of the same simulator (e.g. LiteLLM for issue 7) is one more target: ``--extra NAME=URL[,KEY[,MODEL[,PID]]]``
(PID: its process, for the CPU column). "proxy CPU ms/req" is the proxy process's user+system CPU time per
request — steadier than latency on a busy machine.

    .venv/bin/python bench/gateway_overhead.py [--requests 400] [--seconds 20] [--rounds 2]
                                               [--modes json stream] [--concurrency 1 32] [--write-results]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from fixtures_upstream import SimProcess, start_sim, wait_http_ok  # noqa: E402

from gateway.redis_server import free_port  # noqa: E402

BENCH_KEY = "tg-bench-key"
RESULTS = REPO / "bench" / "RESULTS.md"
SECTION = "## Gateway overhead"
MESSAGES = [{"role": "user", "content": "What is the sum of the first ten odd numbers? Answer briefly."}]


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint to measure: ``base_url`` ends in ``/v1``."""

    name: str
    base_url: str
    api_key: str
    model: str
    pid: int | None = None  # the proxy's process, to report its CPU time per request


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``), None when unknown."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Samples:
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0
    cpu_s: float | None = None

    def add(self, other: Samples) -> None:
        self.latencies_ms += other.latencies_ms
        self.errors += other.errors
        self.wall_s += other.wall_s
        if other.cpu_s is not None:
            self.cpu_s = (self.cpu_s or 0.0) + other.cpu_s

    @property
    def cpu_ms_per_request(self) -> str:
        n = len(self.latencies_ms) + self.errors
        return f"{1000 * self.cpu_s / n:.2f}" if self.cpu_s is not None and n else "—"

    @property
    def rps(self) -> float:
        return len(self.latencies_ms) / self.wall_s if self.wall_s else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


async def run_load(clients: list[httpx.AsyncClient], target: Target, concurrency: int, n: int, seconds: float,
                   stream: bool) -> Samples:
    """Closed loop: ``concurrency`` workers send until ``n`` requests are done or ``seconds`` passed."""
    body = orjson.dumps({"model": target.model, "messages": MESSAGES, "stream": stream, "max_tokens": 64})
    headers = {"authorization": f"Bearer {target.api_key}", "content-type": "application/json"}
    url = target.base_url + "/chat/completions"
    out = Samples()
    left = n
    deadline = time.perf_counter() + seconds

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal left
        while left > 0 and time.perf_counter() < deadline:
            left -= 1
            t0 = time.perf_counter()
            try:
                if stream:
                    async with client.stream("POST", url, content=body, headers=headers) as r:
                        async for _ in r.aiter_raw():
                            pass
                        ok = r.status_code == 200
                else:
                    r = await client.post(url, content=body, headers=headers)
                    ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                out.latencies_ms.append((time.perf_counter() - t0) * 1000)
            else:
                out.errors += 1

    cpu0 = cpu_seconds(target.pid)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(clients[i]) for i in range(concurrency)))
    out.wall_s = time.perf_counter() - t0
    cpu1 = cpu_seconds(target.pid)
    if cpu0 is not None and cpu1 is not None:
        out.cpu_s = cpu1 - cpu0
    return out


async def measure(targets: list[Target], concurrencies: list[int], n: int, seconds: float, rounds: int,
                  stream: bool) -> dict[tuple[str, int], Samples]:
    results: dict[tuple[str, int], Samples] = {}
    # One single-connection client per worker: httpcore's pool bookkeeping grows with its connection count,
    # and the load generator must not be the bottleneck it measures.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) for _ in range(max(concurrencies))]
    try:
        for t in targets:  # warm-up: connections, imports, caches
            await run_load(clients, t, 4, 40, 10, stream)
        for c in concurrencies:
            for _ in range(rounds):
                for t in targets:
                    s = await run_load(clients, t, c, max(1, n // rounds), seconds / rounds, stream)
                    results.setdefault((t.name, c), Samples()).add(s)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return results


def table(by_mode: dict[str, dict[tuple[str, int], Samples]], targets: list[Target], concurrencies: list[int]) -> str:
    """Markdown table; "added" columns are against the first target (direct)."""
    base = targets[0].name
    lines = [
        "| mode | target | concurrency | requests | errors | p50 ms | p99 ms | RPS | added p50 ms | added p99 ms "
        "| proxy CPU ms/req |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, results in by_mode.items():
        for c in concurrencies:
            ref = results[(base, c)]
            for t in targets:
                s = results[(t.name, c)]
                add50 = "—" if t.name == base else f"{s.pct(50) - ref.pct(50):+.2f}"
                add99 = "—" if t.name == base else f"{s.pct(99) - ref.pct(99):+.2f}"
                lines.append(f"| {mode} | {t.name} | {c} | {len(s.latencies_ms)} | {s.errors} | {s.pct(50):.2f} | "
                             f"{s.pct(99):.2f} | {s.rps:.0f} | {add50} | {add99} | {s.cpu_ms_per_request} |")
    return "\n".join(lines)


def machine() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return (f"{platform.node() or 'host'}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"Linux {platform.release()}, Python {platform.python_version()}; load average before the run "
            f"{load[0]:.2f}; commit {commit}")


def start_gateway(sim: SimProcess, workdir: Path) -> tuple[subprocess.Popen[bytes], Target]:
    port = free_port()
    cfg = {
        "engine": {"enabled": False},
        "redis": {"url": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), "start_if_missing": False},
        "server": {"log_level": "info"},  # as deployed: one usage line per request
        "tiers": [{"name": "short", "base_url": sim.base_url, "model": "sim-model", "thinking_budget": 8,
                   "max_tokens": 64},
                  {"name": "long", "base_url": sim.base_url, "model": "sim-model", "max_tokens": 512}],
        "routing": {"router_path": None, "effort_tiers": {"low": "short", "high": "long"}},
        "auth": {"keys": [{"id": "bench", "secret": BENCH_KEY}]},
    }
    path = workdir / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=(workdir / "gateway.log").open("w"))
    wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=60, proc=proc)
    return proc, Target("thinkgate", f"http://127.0.0.1:{port}/v1", BENCH_KEY, "auto", proc.pid)


def write_results(text: str) -> None:
    """Replace (or append) the "Gateway overhead" section of bench/RESULTS.md; other sections are kept."""
    current = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    start = current.find(SECTION)
    if start < 0:
        new = current.rstrip("\n") + "\n\n" + text
    else:
        end = current.find("\n## ", start + len(SECTION))
        new = current[:start] + text + (current[end:] if end >= 0 else "")
    RESULTS.write_text(new.rstrip("\n") + "\n")


def parse_extra(spec: str) -> Target:
    name, _, rest = spec.partition("=")
    url, key, model, pid = ([*rest.split(","), "", "", ""])[:4]
    return Target(name, url.rstrip("/"), key or "none", model or "sim-model", int(pid) if pid else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per target and concurrency")
    ap.add_argument("--seconds", type=float, default=20.0, help="time cap per target and concurrency")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the targets")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--modes", nargs="+", choices=["json", "stream"], default=["json", "stream"],
                    help="json: non-streamed; stream: SSE (latency = last byte)")
    ap.add_argument("--extra", action="append", default=[], help="NAME=BASE_URL[,KEY[,MODEL[,PID]]] another target")
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()

    env_line = machine()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    sim = start_sim()
    gw = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gw, gw_target = start_gateway(sim, Path(tmp))
            targets = [Target("direct", sim.base_url, "none", "sim-model"), gw_target,
                       *(parse_extra(e) for e in args.extra)]
            by_mode = {
                mode: asyncio.run(measure(targets, args.concurrency, args.requests, args.seconds, args.rounds,
                                          mode == "stream"))
                for mode in args.modes
            }
    finally:
        if gw is not None:
            gw.terminate()
            gw.wait(timeout=15)
        sim.stop()
    out = table(by_mode, targets, args.concurrency)
    print(out)
    if args.write_results:
        write_results(
            f"{SECTION}\n\n"
            f"`bench/gateway_overhead.py` — {started}. Chat requests (`model: auto`, ~30 output tokens; `json` "
            f"= non-streamed, `stream` = SSE with latency to the last byte) against `tests/upstream_sim.py`, "
            f"directly and through "
            f"`thinkgate serve` (one uvicorn worker, engine off; the whole request path of the commit below: key "
            f"auth, length-baseline routing, limit and cache checks — the cache is bypassed, these requests are not "
            f"deterministic — and the usage record logged and metered to Redis), closed loop on loopback, "
            f"{args.requests} requests or {args.seconds:.0f} s per target and "
            f"concurrency in {args.rounds} alternating rounds after a warm-up. Client, simulator and gateway share "
            f"the machine's CPUs (and other jobs' load: see the load average), so latency at concurrency 32 is "
            f"mostly queueing for CPU; the proxy CPU per request is the steadier figure. "
            f"Machine: {env_line}.\n\n{out}\n"
        )


if __name__ == "__main__":
    main()
