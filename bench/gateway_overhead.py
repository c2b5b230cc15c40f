"""What does ThinkGate add on top of the upstream? Direct-to-upstream vs through-the-gateway, on loopback.

Starts ``tests/fixtures/upstream_sim.py`` (the deterministic upstream) and ``thinkgate serve`` (engine off, tiers on
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

**ThinkGate vs LiteLLM** (``--litellm``; environment: ``make bench-litellm-env``): starts LiteLLM's proxy from
``bench/.venv-litellm`` (its own process; ``openai/`` provider on the same simulator, offline and quiet:
``LITELLM_LOCAL_MODEL_COST_MAP=True``, ``LITELLM_TELEMETRY_DISABLED=true``, ``LITELLM_MODE=PRODUCTION``,
``LITELLM_LOG=ERROR``; readiness ``/health/liveliness``) and ThinkGate with its request path fully on — the
shipped router scores every request (``model: auto``), the cache looks up, locks and stores every request
(temperature 0 and a fresh prompt each time, so every request is a miss: the cache does all its work and
answers nothing for free), metering writes every event to Redis. Same requests to direct, ThinkGate and
LiteLLM, alternating, at concurrency 1 8 32 64 by default; adds errors, peak RSS (VmHWM of the process tree,
MiB) and the ThinkGate/LiteLLM ratios; ``--write-results`` replaces the "ThinkGate vs LiteLLM" section.

    .venv/bin/python bench/gateway_overhead.py --litellm [--requests 300] [--seconds 15] [--write-results]

**Telemetry on vs off** (``--telemetry``): the same gateway with OpenTelemetry traces off, on, and on at a 10 %
sample ratio (OTLP/HTTP to a loopback sink), ``--processes`` (2) gateways of each, all interleaved round by
round; prints the table, CPU ms per request on / off, the median of the per-round on / off ratios and the A/A
ratio of two identical off gateways (what the machine's noise alone moves); ``--write-results`` replaces the
"Telemetry overhead" section.

    .venv/bin/python -m bench.gateway_overhead --telemetry [--requests 2400] [--rounds 12] [--concurrency 1 32]
                                                          [--processes 2] [--write-results]

**Write-ahead metering on vs off** (``--write-ahead``): the same gateway with ``metering.write_ahead`` off and on,
``--processes`` of each on a throw-away Redis prefix, interleaved round by round; CPU ms/request on / off per
round, the A/A ratio, p50/p99 off → on; ``--write-results`` replaces the "Write-ahead metering overhead" section.
With ``--tree NAME=DIR``: this checkout against checkout DIR instead, write-ahead on in both (DIR's gateways are the
baseline, and their A/A the noise). With ``--budget-usd``: the bench key has a daily budget, so admission runs in
Redis and, on a single Redis, writes the write-ahead record inside the admission script (without a budget the
record is one ``HSET`` of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from bench._lib.load import Client, make_clients, send
from bench._lib.redis_keys import delete_prefix
from bench._lib.results_md import write_section
from gateway.engine.redis_server import free_port
from router.stats import percentile
from tests.fixtures.otlp import OtlpReceiver
from tests.fixtures.upstream import SimProcess, start_sim, wait_http_ok

REPO = Path(__file__).resolve().parents[1]
BENCH_KEY = "tg-bench-key"

SECTION = "## Gateway overhead"
LITELLM_SECTION = "## ThinkGate vs LiteLLM"
LITELLM_VENV = REPO / "bench" / ".venv-litellm"
LITELLM_KEY = "sk-bench-litellm"
_PROMPT_IDS = itertools.count()
# Per process: the cache keeps entries for an hour (cache.ttl_s), so without it a rerun would send the prompts of
# the previous run again and be served hits instead of the misses it claims to measure.
_RUN_NONCE = uuid.uuid4().hex[:12]
MESSAGES = [{"role": "user", "content": "What is the sum of the first ten odd numbers? Answer briefly."}]
#: the load generator's HTTP client (``--client``; bench/_lib/load.py says why aiohttp)
CLIENT_KIND = "aiohttp"


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint to measure: ``base_url`` ends in ``/v1``."""

    name: str
    base_url: str
    api_key: str
    model: str
    pid: int | None = None  # the proxy's process, to report its CPU time per request
    startup_s: float | None = None  # process start → its health endpoint answered 200



def stop_all(procs: list[subprocess.Popen[bytes]], sim: Any = None) -> None:
    """Terminate the proxies (SIGTERM, then SIGKILL after 30 s) and stop the simulator (when given)."""
    for p in procs:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    if sim is not None:
        sim.stop()

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
        """:func:`router.stats.percentile` ``q`` of the latencies (ms); NaN when there are none."""
        return percentile(self.latencies_ms, q, math.nan)


def unique_body(model: str, stream: bool) -> bytes:
    """A temperature-0 request with a prompt never sent before (a cache miss every time, also across runs)."""
    content = f"{MESSAGES[0]['content']} (run {_RUN_NONCE}, request {next(_PROMPT_IDS)})"
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}], "stream": stream,
                         "max_tokens": 64, "temperature": 0})


async def closed_loop(clients: list[Client], url: str, body: Callable[[], bytes],
                      headers: Callable[[], Mapping[str, str]], pid: int | None, concurrency: int, n: int,
                      seconds: float, stream: bool) -> Samples:
    """``concurrency`` workers (one client each) POST ``body()`` with ``headers()`` to ``url`` until ``n``
    requests are done or ``seconds`` passed; latencies (ms, to the last byte) of the 200s, errors, wall time and
    the CPU seconds process ``pid`` spent meanwhile."""
    out = Samples()
    left = n
    deadline = time.perf_counter() + seconds

    async def worker(client: Client) -> None:
        nonlocal left
        while left > 0 and time.perf_counter() < deadline:
            left -= 1
            data, hdrs = body(), headers()
            t0 = time.perf_counter()
            try:
                ok = (await send(client, url, data, hdrs, stream)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                out.latencies_ms.append((time.perf_counter() - t0) * 1000)
            else:
                out.errors += 1

    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(clients[i]) for i in range(concurrency)))
    out.wall_s = time.perf_counter() - t0
    cpu1 = cpu_seconds(pid)
    if cpu0 is not None and cpu1 is not None:
        out.cpu_s = cpu1 - cpu0
    return out


async def run_load(clients: list[Client], target: Target, concurrency: int, n: int, seconds: float,
                   stream: bool, unique: bool = False) -> Samples:
    """Closed loop (:func:`closed_loop`) of the bench's chat request to ``target``.

    ``unique``: every request gets a fresh prompt at temperature 0 (:func:`unique_body`)."""
    body = orjson.dumps({"model": target.model, "messages": MESSAGES, "stream": stream, "max_tokens": 64})
    headers = {"authorization": f"Bearer {target.api_key}", "content-type": "application/json"}
    return await closed_loop(clients, target.base_url + "/chat/completions",
                             (lambda: unique_body(target.model, stream)) if unique else (lambda: body),
                             lambda: headers, target.pid, concurrency, n, seconds, stream)


async def measure(targets: list[Target], concurrencies: list[int], n: int, seconds: float, rounds: int,
                  stream: bool, unique: bool = False,
                  per_round: dict[tuple[str, int], list[Samples]] | None = None) -> dict[tuple[str, int], Samples]:
    """Samples per (target, concurrency), summed over ``rounds``; ``per_round`` (when given) gets each round's."""
    results: dict[tuple[str, int], Samples] = {}
    # One single-connection client per worker, aiohttp by default: the load generator must not be the bottleneck
    # it measures (bench/_lib/load.py: httpx cost 0.7-0.9 ms of CPU per request here, aiohttp 0.16 ms).
    n_clients = max(4, *concurrencies)  # 4: the warm-up
    clients = make_clients(n_clients, CLIENT_KIND)
    try:
        for t in targets:  # warm-up: connections, imports, caches
            await run_load(clients, t, 4, 40, 10, stream, unique)
        for c in concurrencies:
            for _ in range(rounds):
                for t in targets:
                    s = await run_load(clients, t, c, max(1, n // rounds), seconds / rounds, stream, unique)
                    results.setdefault((t.name, c), Samples()).add(s)
                    if per_round is not None:
                        per_round.setdefault((t.name, c), []).append(s)
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
                if (t.name, c) not in results:  # a target measured in some modes only (floor: json)
                    continue
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


def tree_commit(tree: Path) -> str:
    """Short commit of the checkout at ``tree`` ("?" when unknown)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True,
                              timeout=5).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def start_gateway(sim: SimProcess, workdir: Path, full: bool = False, *, tree: Path = REPO, name: str = "thinkgate",
                  extra: dict[str, Any] | None = None) -> tuple[subprocess.Popen[bytes], Target]:
    """``thinkgate serve`` on the simulator. ``full``: the shipped router scores every ``auto`` request (instead
    of the length baseline) and the cache is on (``deterministic``; see :func:`unique_body`). ``tree``: the
    checkout to run (another commit's worktree, for before/after in one run); ``extra``: config sections to set."""
    port = free_port()
    cfg: dict[str, Any] = {
        "engine": {"enabled": False},
        "redis": {"url": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), "start_if_missing": False},
        "server": {"log_level": "info"},  # as deployed: one usage line per request
        "tiers": [{"name": "short", "base_url": sim.base_url, "model": "sim-model", "thinking_budget": 8,
                   "max_tokens": 64},
                  {"name": "long", "base_url": sim.base_url, "model": "sim-model", "max_tokens": 512}],
        "routing": {"router_path": None, "effort_tiers": {"low": "short", "high": "long"}},
        "auth": {"keys": [{"id": "bench", "secret": BENCH_KEY}]},
    }
    if full:
        cfg["routing"] = {"effort_tiers": {"low": "short", "high": "long"}, "on_router_error": "refuse_start"}
        cfg["cache"] = {"mode": "deterministic"}
    cfg.update(extra or {})
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", str(port)]
    # cwd first on sys.path (python -m): the tree's packages win over the installed ones
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=(workdir / f"{name}.log").open("w"))
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=120, proc=proc)
    except BaseException:
        proc.kill()  # do not leave a half-started gateway behind
        raise
    return proc, Target(name, f"http://127.0.0.1:{port}/v1", BENCH_KEY, "auto", proc.pid, time.perf_counter() - t0)


# The least any Python proxy on a given stack can add: an ASGI server (uvicorn with httptools + uvloop, or granian)
# + one pooled upstream client (httpx, or aiohttp), reading the body and forwarding it, nothing else (no auth,
# routing, cache, metering or logging). argv: port, upstream base URL, server, client, Redis URL or "".
# With a Redis URL (floor-aiohttp-redis) it also makes one Redis round trip per request before forwarding (an INCR
# on a raw pooled connection, hiredis parsing the reply): the cost of the one shared-state call ThinkGate's
# request path must make (admission), to tell it apart from the rest of the gateway's work.
FLOOR_APP = """
import asyncio, sys
port, base, server, client_kind, redis_url = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
HEADERS = {"content-type": "application/json"}
_client = None
_lane = []

if redis_url:  # imported and packed once, not per request: the floor counts only the round trip
    import hiredis
    from urllib.parse import urlsplit
    REDIS_ADDR = (urlsplit(redis_url).hostname or "127.0.0.1", urlsplit(redis_url).port or 6379)
    INCR = hiredis.pack_command((b"INCR", b"thinkgate-bench:floor-redis"))

async def redis_round_trip():
    if _lane:
        reader, writer, parser = _lane.pop()
    else:
        reader, writer = await asyncio.open_connection(*REDIS_ADDR)
        parser = hiredis.Reader()
    writer.write(INCR)
    reply = parser.gets()
    while reply is False:
        parser.feed(await reader.read(65536))
        reply = parser.gets()
    _lane.append((reader, writer, parser))

async def forward(path, body):
    global _client
    if redis_url:
        await redis_round_trip()
    if client_kind == "aiohttp":
        import aiohttp
        if _client is None:
            _client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=128), trust_env=False)
        async with _client.post(base + path, data=body, headers=HEADERS) as r:
            return r.status, await r.read()
    import httpx
    if _client is None:
        _client = httpx.AsyncClient(base_url=base, trust_env=False)
    r = await _client.post(path, content=body, headers=HEADERS)
    return r.status_code, r.content

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            await send({"type": m["type"] + ".complete"})
            if m["type"] == "lifespan.shutdown":
                return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    if scope["path"] == "/health":
        r_status, r_body = 200, b"{}"
    else:
        r_status, r_body = await forward(scope["path"][3:], body)
    await send({"type": "http.response.start", "status": r_status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": r_body})

if server == "granian":
    import uvloop
    from granian.constants import Interfaces
    from granian.server.embed import Server
    uvloop.run(Server(app, address="127.0.0.1", port=port, interface=Interfaces.ASGI, log_enabled=False).serve())
else:
    import uvicorn
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
"""
#: name → (server, client) of the floor forwarders; ``floor`` is the stack ThinkGate runs on.
FLOORS = {"floor": ("uvicorn", "httpx"), "floor-aiohttp": ("uvicorn", "aiohttp"), "floor-granian": ("granian", "httpx"),
          "floor-granian-aiohttp": ("granian", "aiohttp"), "floor-aiohttp-redis": ("uvicorn", "aiohttp")}


def start_floor(sim: SimProcess, name: str = "floor") -> tuple[subprocess.Popen[bytes], Target]:
    """A bare forwarder (:data:`FLOORS`) in front of the simulator (non-streamed only): the floor of what a proxy
    written on that stack adds, to read ThinkGate's own share of the added latency and CPU against."""
    server, client = FLOORS[name]
    port = free_port()
    t0 = time.perf_counter()
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0") if name.endswith("-redis") else ""
    proc = subprocess.Popen([sys.executable, "-c", FLOOR_APP, str(port), sim.base_url, server, client, redis_url],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=60, proc=proc)
    except BaseException:
        proc.kill()
        raise
    return proc, Target(name, f"http://127.0.0.1:{port}/v1", "none", "sim-model", proc.pid,
                        time.perf_counter() - t0)


def proc_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux ``/proc/PID/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError, ValueError):
                todo += [int(c) for c in task.read_text().split()]
    return out


def peak_rss_mib(pid: int | None) -> float | None:
    """Sum over the process tree of ``pid`` of each process's peak resident set (VmHWM), MiB."""
    if pid is None:
        return None
    total = 0
    for p in proc_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def start_litellm(sim: SimProcess, workdir: Path) -> tuple[subprocess.Popen[bytes], Target]:
    """LiteLLM's proxy from ``bench/.venv-litellm`` in front of the simulator; raises RuntimeError when the
    environment is missing (``make bench-litellm-env``) or the proxy does not get ready in 120 s."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        raise RuntimeError(f"{exe} not found: run `make bench-litellm-env` first")
    port = free_port()
    cfg = {"model_list": [{"model_name": "sim-model",
                           "litellm_params": {"model": "openai/sim-model", "api_base": sim.base_url,
                                              "api_key": "none"}}],
           "general_settings": {"master_key": LITELLM_KEY}}
    path = workdir / "litellm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY_DISABLED": "true",
           "LITELLM_MODE": "PRODUCTION", "LITELLM_LOG": "ERROR", "NO_PROXY": "127.0.0.1,localhost"}
    env.pop("DATABASE_URL", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(exe), "--config", str(path), "--host", "127.0.0.1", "--port", str(port),
                             "--num_workers", "1"], cwd=workdir, env=env, stdout=subprocess.DEVNULL,
                            stderr=(workdir / "litellm.log").open("w"))
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health/liveliness", timeout_s=120, proc=proc)
    except RuntimeError as exc:
        proc.terminate()
        tail = (workdir / "litellm.log").read_text()[-2000:]
        raise RuntimeError(f"LiteLLM proxy did not start: {exc}\n{tail}") from None
    return proc, Target("litellm", f"http://127.0.0.1:{port}/v1", LITELLM_KEY, "sim-model", proc.pid,
                        time.perf_counter() - t0)


def litellm_version() -> str:
    try:
        return subprocess.run([str(LITELLM_VENV / "bin" / "python"), "-c",
                               "import importlib.metadata as m; print(m.version('litellm'))"],
                              capture_output=True, text=True, timeout=60).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def litellm_table(results: dict[tuple[str, int], Samples], targets: list[Target], rss: dict[str, float | None],
                  concurrencies: list[int]) -> str:
    """Markdown: per concurrency, one row per target (direct first), then ThinkGate/LiteLLM and, when a ``floor``
    ran, ThinkGate/floor ratio rows (CPU per request is the figure the floor ratio is about)."""
    lines = ["| concurrency | target | requests | errors | p50 ms | p99 ms | RPS | added p50 ms | added p99 ms "
             "| proxy CPU ms/req | peak RSS MiB |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    names = [t.name for t in targets]

    def ratio(a: float | None, b: float | None) -> str:
        return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}×"

    def cpu(s: Samples) -> float | None:
        return 1000 * s.cpu_s / max(1, len(s.latencies_ms) + s.errors) if s.cpu_s is not None else None

    for c in concurrencies:
        ref = results[("direct", c)]
        added: dict[str, tuple[float, float]] = {}
        for name in names:
            s = results[(name, c)]
            a50, a99 = s.pct(50) - ref.pct(50), s.pct(99) - ref.pct(99)
            added[name] = (a50, a99)
            mem = rss.get(name)
            lines.append(f"| {c} | {name} | {len(s.latencies_ms)} | {s.errors} | {s.pct(50):.2f} | {s.pct(99):.2f} | "
                         f"{s.rps:.0f} | {'—' if name == 'direct' else f'{a50:+.2f}'} | "
                         f"{'—' if name == 'direct' else f'{a99:+.2f}'} | {s.cpu_ms_per_request} | "
                         f"{'—' if mem is None else f'{mem:.0f}'} |")
        tg = results[("thinkgate", c)]
        for other in ("litellm", "floor"):
            if other not in names:
                continue
            o = results[(other, c)]
            label = "LiteLLM" if other == "litellm" else "floor"
            lines.append(f"| {c} | **ThinkGate / {label}** | | | {ratio(tg.pct(50), o.pct(50))} | "
                         f"{ratio(tg.pct(99), o.pct(99))} | {ratio(tg.rps, o.rps)} | "
                         f"{ratio(added['thinkgate'][0], added[other][0])} | "
                         f"{ratio(added['thinkgate'][1], added[other][1])} | {ratio(cpu(tg), cpu(o))} | "
                         f"{ratio(rss.get('thinkgate'), rss.get(other))} |")
    return "\n".join(lines)


def startup_line(targets: list[Target]) -> str:
    """``name s`` per proxy: process start → its health endpoint answered (each started once, in sequence)."""
    return ", ".join(f"{t.name} {t.startup_s:.2f} s" for t in targets if t.startup_s is not None)


def run_litellm(args: argparse.Namespace) -> None:
    """The ThinkGate vs LiteLLM comparison (see the module doc)."""
    env_line = machine()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    version = litellm_version()
    sim = start_sim()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            targets = [Target("direct", sim.base_url, "none", "sim-model")]
            gw, tg_target = start_gateway(sim, Path(tmp), full=True)
            procs.append(gw)
            targets.append(tg_target)
            for spec in args.tree:
                name, _, tree = spec.partition("=")
                bp, before = start_gateway(sim, Path(tmp), full=True, tree=Path(tree).resolve(), name=name)
                procs.append(bp)
                targets.append(before)
            ll, ll_target = start_litellm(sim, Path(tmp))
            procs.append(ll)
            targets.append(ll_target)
            for name in args.floors:
                fp, floor = start_floor(sim, name)
                procs.append(fp)
                targets.append(floor)
            results = asyncio.run(measure(targets, args.concurrency, args.requests, args.seconds, args.rounds,
                                          stream=False, unique=True))
            rss = {t.name: peak_rss_mib(t.pid) for t in targets if t.pid is not None}
    finally:
        stop_all(procs, sim)
    out = litellm_table(results, targets, rss, args.concurrency)
    startup = startup_line(targets)
    print(out)
    print(f"\nstartup (process start → health answered): {startup}")
    if args.write_results:
        extra = ""
        for spec in args.tree:
            name, _, tree = spec.partition("=")
            extra += (f"`{name}`: the same gateway from another checkout (commit {tree_commit(Path(tree))}), "
                      "measured interleaved in the same rounds. ")
        if args.floors:
            extra += (f"Floors ({', '.join(args.floors)}): bare forwarders on the simulator (`FLOOR_APP`: "
                      + "; ".join(f"`{n}` = {FLOORS[n][0]} + {FLOORS[n][1]}" for n in args.floors)
                      + "), the least a proxy on that stack adds. ")
        write_section(
            LITELLM_SECTION,
            f"{LITELLM_SECTION}\n\n"
            f"`bench/gateway_overhead.py --litellm` — {started}. Non-streamed chat requests (~30 output tokens, "
            f"temperature 0, a fresh prompt each time) against `tests/fixtures/upstream_sim.py`: directly, through "
            f"`thinkgate serve` (one uvicorn worker, engine off; key auth, the shipped "
            f"router scoring every `model: auto` request, cache lookup + single-flight lock + store on every "
            f"request — all misses —, metering of every event to Redis, usage log line) and through LiteLLM's "
            f"proxy {version} (`bench/.venv-litellm`, one worker, no database, master key, `openai/` provider, "
            f"offline and quiet env). {extra}Closed loop on loopback, {args.requests} requests or "
            f"{args.seconds:.0f} s per target and concurrency in {args.rounds} alternating rounds after a warm-up; "
            f"client ({CLIENT_KIND}, one connection per worker: bench/_lib/load.py), simulator, all proxies and "
            f"Redis share the machine's CPUs. Peak RSS: VmHWM summed over the "
            f"proxy's process tree at the end. Startup (process start → health endpoint answered, started one "
            f"after another before the load): {startup}. Ratios < 1× favour ThinkGate for latency, CPU and "
            f"memory; > 1× for RPS. Machine: {env_line}.\n\n{out}\n",
            keep_history=True,
        )


TELEMETRY_SECTION = "## Telemetry overhead"


TELEMETRY_VARIANTS = ("otel-off", "otel-on", "otel-on-10%")


def _per_request_ms(x: Samples) -> float | None:
    n = len(x.latencies_ms) + x.errors
    return 1000 * x.cpu_s / n if x.cpu_s and n else None


def _pin_hash_seed() -> str | None:
    """Set ``PYTHONHASHSEED=0`` for the gateways started next; returns the previous value for
    :func:`_restore_hash_seed`."""
    seed = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = "0"
    return seed


def _restore_hash_seed(seed: str | None) -> None:
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed


def _spread(xs: list[float]) -> str:
    """Median of per-round ratios with their range, ``"—"`` when there are none."""
    import statistics

    return f"{statistics.median(xs):.3f} ({min(xs):.2f} … {max(xs):.2f})" if xs else "—"


def _variant_samples(results: dict[tuple[str, int], Samples], variants: tuple[str, ...], processes: int,
                     c: int) -> dict[str, Samples]:
    """Each variant's samples at concurrency ``c``, summed over its ``processes`` gateways (``NAME#1`` …)."""
    acc = {v: Samples() for v in variants}
    for v in variants:
        for k in range(processes):
            acc[v].add(results[(f"{v}#{k + 1}", c)])
    return acc


def telemetry_ratios(per_round: dict[tuple[str, int], list[Samples]], processes: int, c: int,
                     rounds: int, variants: tuple[str, ...] = TELEMETRY_VARIANTS) -> dict[str, list[float]]:
    """Per round, each variant's CPU ms/request (the mean over its processes) over the first variant's (off) in
    the same round — paired in time, so a slow moment of the shared machine hits both sides — and the A/A ratio
    (the second off process over the first: what identical gateways differ by)."""
    off_name = variants[0]
    out: dict[str, list[float]] = {v: [] for v in (*variants[1:], "A/A")}
    for r in range(rounds):
        mean: dict[str, float] = {}
        for v in variants:
            xs = [_per_request_ms(per_round[(f"{v}#{k + 1}", c)][r]) for k in range(processes)]
            if any(x is None for x in xs):
                break
            mean[v] = sum(x for x in xs if x is not None) / processes
        else:
            for v in variants[1:]:
                out[v].append(mean[v] / mean[off_name])
            if processes > 1:
                a, b = (_per_request_ms(per_round[(f"{off_name}#{k}", c)][r]) for k in (1, 2))
                if a and b:
                    out["A/A"].append(b / a)
    return out


async def traced_vs_untraced(target: Target, concurrency: int, stream: bool, block: int,
                             blocks: int) -> tuple[list[float], list[float], int]:
    """One gateway (telemetry on, ``sample_ratio: 0``), ``blocks`` pairs of blocks of ``block`` requests each:
    every request of a traced block carries a sampled W3C ``traceparent`` of its own (so the gateway records and
    exports every step, as at ``sample_ratio: 1``), an untraced block none (one sampling decision, nothing
    recorded). The order alternates pair by pair. Returns each block's CPU ms/request (traced, untraced) and
    the errors. Same process, same moment: what the machine's noise does to separate processes cancels."""
    import random

    body = orjson.dumps({"model": target.model, "messages": MESSAGES, "stream": stream, "max_tokens": 64})
    url = target.base_url + "/chat/completions"
    plain = {"authorization": f"Bearer {target.api_key}", "content-type": "application/json"}
    clients = make_clients(concurrency, CLIENT_KIND)
    errors = 0

    def traced_headers() -> dict[str, str]:
        return {**plain, "traceparent": f"00-{random.getrandbits(128):032x}-{random.getrandbits(64):016x}-01"}

    async def run(traced: bool, n: int) -> float:
        nonlocal errors
        s = await closed_loop(clients, url, lambda: body, traced_headers if traced else (lambda: plain),
                              target.pid, concurrency, n, 3600.0, stream)
        errors += s.errors
        return 1000 * (s.cpu_s or 0.0) / n

    traced_ms: list[float] = []
    untraced_ms: list[float] = []
    try:
        await run(True, 100)  # warm-up of both paths
        await run(False, 100)
        for i in range(blocks):
            for traced in ((True, False) if i % 2 == 0 else (False, True)):
                (traced_ms if traced else untraced_ms).append(await run(traced, block))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return traced_ms, untraced_ms, errors


def same_process_table(args: argparse.Namespace, sim: SimProcess, sink: OtlpReceiver,
                       workdir: Path) -> tuple[str, list[float]]:
    """The traced-vs-untraced measurement for each mode and concurrency: a markdown table and the ratios."""
    import statistics

    proc, target = start_gateway(sim, workdir, name="otel-same-process", extra={
        "telemetry": {"otlp_endpoint": sink.url, "sample_ratio": 0.0}})
    lines = ["| mode | concurrency | blocks × requests | errors | CPU ms/req untraced | traced | traced / untraced "
             "(ratio of means) | median per-pair ratio (min … max) | added µs/req |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    ratios: list[float] = []
    try:
        for mode in args.modes:
            for c in args.concurrency:
                on, off, errors = asyncio.run(traced_vs_untraced(target, c, mode == "stream", args.block,
                                                                 args.blocks))
                mon, moff = statistics.mean(on), statistics.mean(off)
                pairs = [a / b for a, b in zip(on, off, strict=True) if b]
                ratios.append(mon / moff)
                lines.append(f"| {mode} | {c} | 2 × {args.blocks} × {args.block} | {errors} | {moff:.3f} | {mon:.3f} "
                             f"| {mon / moff:.3f} | {statistics.median(pairs):.3f} ({min(pairs):.2f} … "
                             f"{max(pairs):.2f}) | {1000 * (mon - moff):+.0f} |")
    finally:
        stop_all([proc])
    return "\n".join(lines), ratios


def run_telemetry(args: argparse.Namespace) -> None:
    """``--telemetry``: the same gateway with traces off, on, and on at a 10 % sample ratio (OTLP/HTTP to a loopback
    sink), ``--processes`` gateways of each, interleaved round by round."""
    import statistics

    env_line = machine()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    sim = start_sim()
    sink = OtlpReceiver(decode=False)  # counts what arrives; decoding would take CPU from the gateways
    procs: list[subprocess.Popen[bytes]] = []
    extras: dict[str, dict[str, Any]] = {
        "otel-off": {}, "otel-on": {"telemetry": {"otlp_endpoint": sink.url}},
        "otel-on-10%": {"telemetry": {"otlp_endpoint": sink.url, "sample_ratio": 0.1}}}
    # one hash seed for every gateway: string hashing, hence dict layouts, the same in all of them
    seed = _pin_hash_seed()
    targets = [Target("direct", sim.base_url, "none", "sim-model")]
    per_round: dict[str, dict[tuple[str, int], list[Samples]]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.processes):
                for v in TELEMETRY_VARIANTS:
                    proc, target = start_gateway(sim, Path(tmp), name=f"{v}#{k + 1}", extra=extras[v])
                    procs.append(proc)
                    targets.append(target)
            by_mode = {mode: asyncio.run(measure(targets, args.concurrency, args.requests, args.seconds, args.rounds,
                                                 mode == "stream", per_round=per_round.setdefault(mode, {})))
                       for mode in args.modes}
            stop_all(procs)  # the cross-process gateways are done: nothing else competes for the CPUs
            procs = []
            same, same_ratios = same_process_table(args, sim, sink, Path(tmp))
    finally:
        _restore_hash_seed(seed)
        stop_all(procs, sim)  # SIGTERM: the on-gateways export what they still hold
        sink.close()
    out = table(by_mode, targets, args.concurrency)
    lines = ["| mode | concurrency | CPU ms/req off | on | on / off | median per-round on / off (min … max) "
             "| on 10 % / off | A/A: off / off (min … max) |",
             "|---|---:|---:|---:|---:|---|---:|---|"]
    verdicts: list[float] = []
    for mode, results in by_mode.items():
        for c in args.concurrency:
            acc = _variant_samples(results, TELEMETRY_VARIANTS, args.processes, c)
            off, on, tenth = (_per_request_ms(acc[v]) for v in TELEMETRY_VARIANTS)
            if not (off and on and tenth):
                continue
            ratios = telemetry_ratios(per_round[mode], args.processes, c, args.rounds)
            if ratios["otel-on"]:
                verdicts.append(statistics.median(ratios["otel-on"]))
            lines.append(f"| {mode} | {c} | {off:.3f} | {on:.3f} | {on / off:.3f} | {_spread(ratios['otel-on'])} "
                         f"| {tenth / off:.3f} | {_spread(ratios['A/A'])} |")
    ratio = "\n".join(lines)
    exported = f"OTLP sink received {sink.posts} export POSTs, {sink.bytes} bytes of protobuf."
    worst_cross = max(verdicts) if verdicts else float("nan")
    worst = max(same_ratios) if same_ratios else float("nan")
    verdict = (f"Target on ≤ 1.10 × off: **{'met' if worst <= 1.10 else 'not met'}** — traced / untraced in one "
               f"process {', '.join(f'{r:.3f}' for r in same_ratios)} (worst {worst:.3f}); across processes the "
               f"median per-round on / off is at worst {worst_cross:.3f}, where two identical off gateways differ "
               f"by the A/A column.")
    print(out, "", ratio, "", same, "", exported, verdict, sep="\n")
    if args.write_results:
        write_section(
            TELEMETRY_SECTION,
            f"{TELEMETRY_SECTION}\n\n`python -m bench.gateway_overhead --telemetry` — {started}. "
            f"{args.processes} `thinkgate serve` processes of each kind on the same simulator (hash seed 0 in all), "
            f"all interleaved round by round: `otel-off` (default: no `telemetry.otlp_endpoint`), `otel-on` (every "
            f"request: one request span with route, limits, cache, upstream and metering child spans, GenAI "
            f"attributes, `traceparent` to the upstream, batch-exported over OTLP/HTTP protobuf to a loopback sink "
            f"in the bench process) and `otel-on-10%` (`sample_ratio: 0.1`). {args.requests} requests or "
            f"{args.seconds:.0f} s per process and concurrency in {args.rounds} rounds after a warm-up; "
            f"`model: auto`. The CPU columns are each gateway process's user+system CPU per request (its export "
            f"thread included), summed over the processes of a kind; the per-round ratio pairs a kind's mean with "
            f"`otel-off`'s in the same round, and A/A is the second off process over the first (the noise floor: "
            f"identical gateways). Then, alone on the machine, one gateway with `sample_ratio: 0` serves blocks of "
            f"{args.block} requests alternately with a sampled client `traceparent` on every request (each request "
            f"traced and exported, as at ratio 1; the client header also costs its parse) and without (one sampling "
            f"decision): the traced / untraced CPU of the same process in adjacent blocks, {args.blocks} pairs per "
            f"row — the measurement that can resolve a few percent on this machine. {exported} "
            f"Machine: {env_line}.\n\n{verdict}\n\nAcross processes:\n\n{out}\n\n{ratio}\n\n"
            f"One process, traced vs untraced requests:\n\n{same}\n")


WRITE_AHEAD_SECTION = "## Write-ahead metering overhead"
WRITE_AHEAD_VARIANTS = ("wal-off", "wal-on")


def run_write_ahead(args: argparse.Namespace) -> None:
    """``--write-ahead``: the same gateway with ``metering.write_ahead`` off and on (the default), ``--processes``
    gateways of each on a throw-away Redis prefix, interleaved round by round; CPU ms/request on / off, the median
    per-round ratio and the A/A ratio of the two off gateways, and p50/p99 added on vs off."""
    import statistics

    env_line = machine()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    sim = start_sim()
    procs: list[subprocess.Popen[bytes]] = []
    prefix = f"tgbench:{uuid.uuid4().hex[:8]}:"
    redis_section = {"url": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), "key_prefix": prefix,
                     "start_if_missing": False}
    seed = _pin_hash_seed()
    targets = [Target("direct", sim.base_url, "none", "sim-model")]
    per_round: dict[str, dict[tuple[str, int], list[Samples]]] = {}
    # --tree: the other checkout is the baseline (first), both with write-ahead on; else this one off vs on
    trees = {name: Path(d).resolve() for name, _, d in (spec.partition("=") for spec in args.tree)}
    variants = (*trees, "wal-on") if trees else WRITE_AHEAD_VARIANTS
    base, label = variants[0], ("this" if trees else "on")
    auth = ({"auth": {"keys": [{"id": "bench", "secret": BENCH_KEY, "budget_usd_day": args.budget_usd}]}}
            if args.budget_usd else {})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.processes):
                for v in variants:
                    metering = {"spool_path": str(Path(tmp) / f"spool-{v}-{k}.jsonl"),
                                "write_ahead": v != "wal-off"}
                    proc, target = start_gateway(sim, Path(tmp), name=f"{v}#{k + 1}", tree=trees.get(v, REPO),
                                                 extra={"redis": redis_section, "metering": metering, **auth})
                    procs.append(proc)
                    targets.append(target)
            by_mode = {mode: asyncio.run(measure(targets, args.concurrency, args.requests, args.seconds, args.rounds,
                                                 mode == "stream", per_round=per_round.setdefault(mode, {})))
                       for mode in args.modes}
    finally:
        _restore_hash_seed(seed)
        stop_all(procs, sim)
        with contextlib.suppress(Exception):
            delete_prefix(str(redis_section["url"]), prefix)
    out = table(by_mode, targets, args.concurrency)
    lines = [f"| mode | concurrency | CPU ms/req {base} | {label} | {label} / {base} | median per-round {label} / "
             f"{base} (min … max) | A/A: {base} / {base} (min … max) | p50 ms {base} → {label} "
             f"| p99 ms {base} → {label} |",
             "|---|---:|---:|---:|---:|---|---|---:|---:|"]
    verdicts: list[float] = []
    for mode, results in by_mode.items():
        for c in args.concurrency:
            acc = _variant_samples(results, variants, args.processes, c)
            off, on = (_per_request_ms(acc[v]) for v in (base, "wal-on"))
            if not (off and on):
                continue
            ratios = telemetry_ratios(per_round[mode], args.processes, c, args.rounds, variants)
            if ratios["wal-on"]:
                verdicts.append(statistics.median(ratios["wal-on"]))
            a, b = acc[base], acc["wal-on"]
            lines.append(f"| {mode} | {c} | {off:.3f} | {on:.3f} | {on / off:.3f} | {_spread(ratios['wal-on'])} "
                         f"| {_spread(ratios['A/A'])} "
                         f"| {a.pct(50):.2f} → {b.pct(50):.2f} ({b.pct(50) - a.pct(50):+.2f}) "
                         f"| {a.pct(99):.2f} → {b.pct(99):.2f} ({b.pct(99) - a.pct(99):+.2f}) |")
    ratio = "\n".join(lines)
    worst = max(verdicts) if verdicts else float("nan")
    verdict = (f"Target {label} ≤ 1.10 × {base} (CPU per request): **{'met' if worst <= 1.10 else 'not met'}** — "
               f"median per-round {label} / {base} at worst {worst:.3f}; compare with the A/A column (two identical "
               f"{base} gateways).")
    print(out, "", ratio, "", verdict, sep="\n")
    if args.write_results and not trees and not args.budget_usd:  # the section describes that run only
        write_section(
            WRITE_AHEAD_SECTION,
            f"{WRITE_AHEAD_SECTION}\n\n`python -m bench.gateway_overhead --write-ahead` — {started}. "
            f"{args.processes} `thinkgate serve` processes with `metering.write_ahead: false` (`wal-off`) and "
            f"{args.processes} with the default `true` (`wal-on`: one `HSET` of the request's record before its "
            f"upstream call, deleted inside the metering script that counts its event; a heartbeat every 5 s and a "
            f"reconcile pass every 30 s; these ~30-token streams end before the first progress write, due after "
            f"1 s), the same simulator and Redis (throw-away prefix), hash seed 0, all interleaved round by round; "
            f"{args.requests} requests or {args.seconds:.0f} s per process and concurrency in {args.rounds} rounds "
            f"after a warm-up; `model: auto`, a key without budget. CPU = each gateway process's user+system CPU "
            f"per request, summed over the processes of a kind; the per-round ratio pairs the kinds in the same "
            f"round; A/A = the second off process over the first (the machine's noise). Machine: {env_line}."
            f"\n\n{verdict}\n\n{ratio}\n\n{out}\n")


def parse_extra(spec: str) -> Target:
    name, _, rest = spec.partition("=")
    url, key, model, pid = ([*rest.split(","), "", "", ""])[:4]
    return Target(name, url.rstrip("/"), key or "none", model or "sim-model", int(pid) if pid else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per target and concurrency")
    ap.add_argument("--seconds", type=float, default=20.0, help="time cap per target and concurrency")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the targets")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None,
                    help="default: 1 32; with --litellm: 1 8 32 64")
    ap.add_argument("--modes", nargs="+", choices=["json", "stream"], default=["json", "stream"],
                    help="json: non-streamed; stream: SSE (latency = last byte)")
    ap.add_argument("--extra", action="append", default=[], help="NAME=BASE_URL[,KEY[,MODEL[,PID]]] another target")
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    ap.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp",
                    help="the load generator's client (aiohttp: ~0.16 ms CPU/request; httpx: ~0.8, earlier runs)")
    ap.add_argument("--floor", action="store_true",
                    help="add a bare uvicorn + httpx forwarder as a target (json mode only): the stack's floor")
    ap.add_argument("--floors", nargs="*", choices=sorted(FLOORS), default=None,
                    help="floor forwarders to add (with --floor and no --floors: floor)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="also run thinkgate from checkout DIR as target NAME (e.g. a worktree of the parent "
                         "commit), interleaved with the others; repeatable")
    ap.add_argument("--telemetry", action="store_true",
                    help="the gateway with OpenTelemetry traces off vs on (OTLP/HTTP to a loopback sink)")
    ap.add_argument("--processes", type=int, default=2,
                    help="with --telemetry / --write-ahead: gateway processes of each kind (off, on, on 10 %%)")
    ap.add_argument("--block", type=int, default=1024,
                    help="with --telemetry: requests per block of the one-process traced/untraced comparison "
                         "(1024 = 3 export batches of 2048 spans)")
    ap.add_argument("--blocks", type=int, default=8, help="with --telemetry: traced/untraced block pairs per row")
    ap.add_argument("--write-ahead", action="store_true",
                    help="the gateway with write-ahead metering records off vs on (metering.write_ahead); with "
                         "--tree: this checkout vs that one, write-ahead on in both")
    ap.add_argument("--budget-usd", default=None, metavar="USD",
                    help="with --write-ahead: the bench key's daily budget (admission then runs in Redis and writes "
                         "the write-ahead record in its script, as for any budgeted key)")
    ap.add_argument("--litellm", action="store_true",
                    help="ThinkGate (router + cache + metering) vs LiteLLM's proxy; default concurrency 1 8 32 64")
    args = ap.parse_args()
    global CLIENT_KIND
    CLIENT_KIND = args.client
    if args.concurrency is None and not args.litellm:
        args.concurrency = [1, 32]
    if args.floors is None:
        args.floors = ["floor"] if args.floor else []
    if args.litellm:
        args.concurrency = args.concurrency or [1, 8, 32, 64]
        run_litellm(args)
        return
    if args.telemetry:
        run_telemetry(args)
        return
    if args.write_ahead:
        run_write_ahead(args)
        return

    env_line = machine()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    sim = start_sim()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gw, gw_target = start_gateway(sim, Path(tmp))
            procs.append(gw)
            targets = [Target("direct", sim.base_url, "none", "sim-model"), gw_target,
                       *(parse_extra(e) for e in args.extra)]
            for spec in args.tree:  # the same gateway from another checkout, interleaved (before/after)
                name, _, tree = spec.partition("=")
                bp, before = start_gateway(sim, Path(tmp), tree=Path(tree).resolve(), name=name)
                procs.append(bp)
                targets.append(before)
            floors: list[Target] = []
            for name in args.floors:
                fp, floor = start_floor(sim, name)
                procs.append(fp)
                floors.append(floor)
            by_mode = {
                mode: asyncio.run(measure([*targets, *floors] if mode == "json" else targets,
                                          args.concurrency, args.requests, args.seconds, args.rounds,
                                          mode == "stream"))
                for mode in args.modes
            }
    finally:
        stop_all(procs, sim)
    out = table(by_mode, [*targets, *floors], args.concurrency)
    print(out)
    if args.write_results:
        write_section(
            SECTION,
            f"{SECTION}\n\n"
            f"`bench/gateway_overhead.py` — {started}. Chat requests (`model: auto`, ~30 output tokens; `json` "
            f"= non-streamed, `stream` = SSE with latency to the last byte) against `tests/fixtures/upstream_sim.py`, "
            f"directly and through "
            f"`thinkgate serve` (one uvicorn worker, engine off; the whole request path of the commit below: key "
            f"auth, length-baseline routing, limit and cache checks — the cache is bypassed, these requests are not "
            f"deterministic — and the usage record logged and metered to Redis), closed loop on loopback, "
            f"{args.requests} requests or {args.seconds:.0f} s per target and "
            f"concurrency in {args.rounds} alternating rounds after a warm-up. Client, simulator and gateway share "
            f"the machine's CPUs (and other jobs' load: see the load average), so latency at concurrency 32 is "
            f"mostly queueing for CPU; the proxy CPU per request is the steadier figure. "
            + (f"Floors (json only; {', '.join(args.floors)}): bare forwarders (no auth, routing, cache, metering "
               "or logging; `FLOOR_APP` in the script: "
               + "; ".join(f"`{n}` = {FLOORS[n][0]} + {FLOORS[n][1]}" for n in args.floors)
               + "), the least a proxy on that stack adds. " if args.floors else "")
            + f"Machine: {env_line}.\n\n{out}\n"
        )


if __name__ == "__main__":
    main()
