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

**Telemetry on vs off** (``--telemetry``): the same gateway twice, OpenTelemetry traces off and on (OTLP/HTTP to
a loopback sink), interleaved; prints the table and CPU ms per request on / off; ``--write-results`` replaces
the "Telemetry overhead" section.

    .venv/bin/python bench/gateway_overhead.py --telemetry [--requests 400] [--concurrency 1 32] [--write-results]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from bench._lib.results_md import write_section
from gateway.engine.redis_server import free_port
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


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint to measure: ``base_url`` ends in ``/v1``."""

    name: str
    base_url: str
    api_key: str
    model: str
    pid: int | None = None  # the proxy's process, to report its CPU time per request
    startup_s: float | None = None  # process start → its health endpoint answered 200



def stop_all(procs: list[subprocess.Popen[bytes]], sim: Any) -> None:
    """Terminate the proxies (SIGTERM, then SIGKILL after 30 s) and stop the simulator."""
    for p in procs:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
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
        if not self.latencies_ms:
            return float("nan")
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def unique_body(model: str, stream: bool) -> bytes:
    """A temperature-0 request with a prompt never sent before (a cache miss every time, also across runs)."""
    content = f"{MESSAGES[0]['content']} (run {_RUN_NONCE}, request {next(_PROMPT_IDS)})"
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}], "stream": stream,
                         "max_tokens": 64, "temperature": 0})


async def run_load(clients: list[httpx.AsyncClient], target: Target, concurrency: int, n: int, seconds: float,
                   stream: bool, unique: bool = False) -> Samples:
    """Closed loop: ``concurrency`` workers send until ``n`` requests are done or ``seconds`` passed.

    ``unique``: every request gets a fresh prompt at temperature 0 (:func:`unique_body`)."""
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
            data = unique_body(target.model, stream) if unique else body
            t0 = time.perf_counter()
            try:
                if stream:
                    async with client.stream("POST", url, content=data, headers=headers) as r:
                        async for _ in r.aiter_raw():
                            pass
                        ok = r.status_code == 200
                else:
                    r = await client.post(url, content=data, headers=headers)
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
                  stream: bool, unique: bool = False) -> dict[tuple[str, int], Samples]:
    results: dict[tuple[str, int], Samples] = {}
    # One single-connection client per worker: httpcore's pool bookkeeping grows with its connection count,
    # and the load generator must not be the bottleneck it measures.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    n_clients = max(4, *concurrencies)  # 4: the warm-up
    clients = [httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) for _ in range(n_clients)]
    try:
        for t in targets:  # warm-up: connections, imports, caches
            await run_load(clients, t, 4, 40, 10, stream, unique)
        for c in concurrencies:
            for _ in range(rounds):
                for t in targets:
                    s = await run_load(clients, t, c, max(1, n // rounds), seconds / rounds, stream, unique)
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
# routing, cache, metering or logging). argv: port, upstream base URL, server, client.
FLOOR_APP = """
import sys
port, base, server, client_kind = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
HEADERS = {"content-type": "application/json"}
_client = None

async def forward(path, body):
    global _client
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
          "floor-granian-aiohttp": ("granian", "aiohttp")}


def start_floor(sim: SimProcess, name: str = "floor") -> tuple[subprocess.Popen[bytes], Target]:
    """A bare forwarder (:data:`FLOORS`) in front of the simulator (non-streamed only): the floor of what a proxy
    written on that stack adds, to read ThinkGate's own share of the added latency and CPU against."""
    server, client = FLOORS[name]
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", FLOOR_APP, str(port), sim.base_url, server, client], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
            f"client, simulator, all proxies and Redis share the machine's CPUs. Peak RSS: VmHWM summed over the "
            f"proxy's process tree at the end. Startup (process start → health endpoint answered, started one "
            f"after another before the load): {startup}. Ratios < 1× favour ThinkGate for latency, CPU and "
            f"memory; > 1× for RPS. Machine: {env_line}.\n\n{out}\n",
        )


class OtlpSink:
    """A loopback OTLP/HTTP traces endpoint for ``--telemetry``: answers 200 to every export, counts the bytes."""

    def __init__(self) -> None:
        import http.server
        import threading

        outer = self
        self.posts = 0
        self.bytes = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers["content-length"])
                self.rfile.read(n)
                outer.posts += 1
                outer.bytes += n
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


TELEMETRY_SECTION = "## Telemetry overhead"


def run_telemetry(args: argparse.Namespace) -> None:
    """``--telemetry``: the same gateway with traces off, on, and on at a 10 % sample ratio (OTLP/HTTP to a loopback
    sink), interleaved."""
    env_line = machine()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    sim = start_sim()
    sink = OtlpSink()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            off, off_t = start_gateway(sim, Path(tmp), name="otel-off")
            procs.append(off)
            on, on_t = start_gateway(sim, Path(tmp), name="otel-on",
                                     extra={"telemetry": {"otlp_endpoint": sink.url}})
            procs.append(on)
            sampled, sampled_t = start_gateway(sim, Path(tmp), name="otel-on-10%", extra={
                "telemetry": {"otlp_endpoint": sink.url, "sample_ratio": 0.1}})
            procs.append(sampled)
            targets = [Target("direct", sim.base_url, "none", "sim-model"), off_t, on_t, sampled_t]
            by_mode = {mode: asyncio.run(measure(targets, args.concurrency, args.requests, args.seconds, args.rounds,
                                                 mode == "stream"))
                       for mode in args.modes}
    finally:
        stop_all(procs, sim)  # SIGTERM: the on-gateway exports what its batch still holds
        sink.close()
    out = table(by_mode, targets, args.concurrency)
    lines = ["| mode | concurrency | CPU ms/req off | on | on / off | on, 10 % sampled | 10 % / off |",
             "|---|---:|---:|---:|---:|---:|---:|"]

    def per_req(x: Samples) -> float | None:
        n = len(x.latencies_ms) + x.errors
        return 1000 * x.cpu_s / n if x.cpu_s and n else None

    for mode, results in by_mode.items():
        for c in args.concurrency:
            x, y, z = (per_req(results[(t, c)]) for t in ("otel-off", "otel-on", "otel-on-10%"))
            if x and y and z:
                lines.append(f"| {mode} | {c} | {x:.2f} | {y:.2f} | {y / x:.3f} | {z:.2f} | {z / x:.3f} |")
    ratio = "\n".join(lines)
    exported = f"OTLP sink received {sink.posts} export POSTs, {sink.bytes} bytes of protobuf."
    print(out, "", ratio, "", exported, sep="\n")
    if args.write_results:
        write_section(
            TELEMETRY_SECTION,
            f"{TELEMETRY_SECTION}\n\n`bench/gateway_overhead.py --telemetry` — {started}. Three `thinkgate serve` "
            f"processes of this commit on the same simulator, interleaved round by round: `otel-off` (default: no "
            f"`telemetry.otlp_endpoint`), `otel-on-10%` (`sample_ratio: 0.1`) and `otel-on` (every request: one "
            f"request span with route, limits, cache, upstream and "
            f"metering child spans, GenAI attributes, `traceparent` to the upstream, batch-exported over OTLP/HTTP "
            f"protobuf to a loopback sink in the bench process). {args.requests} requests or {args.seconds:.0f} s per "
            f"target and concurrency in {args.rounds} rounds after a warm-up; `model: auto`. The CPU column is the "
            f"gateway process's user+system CPU per request (the export thread included). Target: on ≤ 1.10 × off. "
            f"{exported} Machine: {env_line}.\n\n{out}\n\n{ratio}\n")


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
    ap.add_argument("--floor", action="store_true",
                    help="add a bare uvicorn + httpx forwarder as a target (json mode only): the stack's floor")
    ap.add_argument("--floors", nargs="*", choices=sorted(FLOORS), default=None,
                    help="floor forwarders to add (with --floor and no --floors: floor)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="also run thinkgate from checkout DIR as target NAME (e.g. a worktree of the parent "
                         "commit), interleaved with the others; repeatable")
    ap.add_argument("--telemetry", action="store_true",
                    help="the gateway with OpenTelemetry traces off vs on (OTLP/HTTP to a loopback sink)")
    ap.add_argument("--litellm", action="store_true",
                    help="ThinkGate (router + cache + metering) vs LiteLLM's proxy; default concurrency 1 8 32 64")
    args = ap.parse_args()
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
