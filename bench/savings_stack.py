"""``thinkgate bench savings``: the whole stack, one workload, five policies, numbers from the metering ledger.

What runs. Unless ``--url`` names a running gateway, the bench starts the stack itself: Redis (the configured
one, or a private ``redis-server``), the local vLLM engine with the shipped model (:class:`LocalEngine`), and
two ``thinkgate serve`` processes with the shipped router on that engine — gateway A with no tier escalating
(``escalate_on: []`` everywhere), gateway B identical except that the ``short`` tier has ``escalate_on:
[empty_answer, length_in_thought]``. Each policy replays the same workload:

=================  =====================================  ==========
policy             request                                gateway
=================  =====================================  ==========
``none``           ``model: "none"`` (forced tier)        A
``short``          ``model: "short"``                     A
``long``           ``model: "long"``                      A
``auto``           ``model: "auto"`` (router picks)       A
``auto+escalation`` ``model: "auto"``                     B
=================  =====================================  ==========

Workload (deterministic per ``seed``): ``n`` requests, a ``real_fraction`` of them real questions (GSM8K and
MATH test splits, half each: traffic the router must classify; the tiny model cannot solve them, so their
accuracy is reported apart, as ``real.accuracy``) and the rest the synthetic arithmetic task's held-out split
(levels 1–6, evenly; verifiable by the local model: ``accuracy``). A ``repeat_fraction`` of each subset's
requests repeat an earlier question of it (placed after its first occurrence), every request at temperature
0, so the deterministic cache serves the repeats. ``concurrency`` requests are in flight (closed loop).

Where the numbers come from. Every request of a (policy, subset) segment carries that segment's own API key
(``savings-<run>-<policy>-<subset>``), and its window of time is recorded; after the segment the bench reads
the ledger (the Redis usage stream, :meth:`gateway.state.metering.Meter.events`) for those key ids and that window.
Tokens, ``cost_usd`` (Σ ``cost_micro_usd`` / 10⁶, exact), cache hits and tiers are the events' — escalated
first attempts included — never recomputed. Token sums are upstream tokens (cache hits excluded: nothing was
generated). Latencies are client-side, request sent → full response read (ms), so they include queueing at
``concurrency``. With ``--url`` (an existing gateway, ``THINKGATE_API_KEY``), segments run one after
another with the one key; the window separates them (keep other traffic off that key meanwhile), and
``auto+escalation`` needs ``--escalation-url`` (a second gateway configured with escalation) or is skipped.

JSON (``--json``)::

    {"policies": {NAME: {"accuracy", "requests", "prompt_tokens", "reasoning_tokens", "completion_tokens",
                         "cost_usd", "p50_ms", "p99_ms", "cache_hit_rate", …extras}},
     "targets": {…}, "workload": {…}, "stack": {…}}

``stack``: ``run``, ``gateways``, ``router`` (the router file's path), ``router_sha256`` (its content's SHA-256, first
12 hex) and ``router_version`` (what ``thinkgate router info`` calls it) — a rerun with another file at the same path
is another router, not nondeterminism —, ``tiers``; with the local engine ``engine_startup_s`` and ``model_sha256``;
with ``--url`` only ``run`` and ``url``.

Extras per policy: ``cost_micro_usd``, ``events``, ``errors``, ``mean_*_tokens`` (per request), ``tiers``
(answered requests per tier, from the ledger), ``escalations``, ``cache_results`` (the ``x-thinkgate-cache``
headers seen: hit/miss/bypass), and ``synthetic`` / ``real`` sub-reports. The bench gateways get
``redis.socket_timeout_s`` ≥ 2 s: on a box shared with other jobs a slower Redis call would otherwise open the
breaker and bypass the cache for a while.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import typer
import yaml

from bench._lib.process import stop_process
from gateway.config import Settings
from gateway.ledger.event import UsageEvent, micro_to_usd
from gateway.ledger.report import counts_as_request
from router.errors import ThinkGateError
from router.probe import ProbeClient
from router.stats import percentile

REPO = Path(__file__).resolve().parents[1]

POLICIES = ("none", "short", "long", "auto", "auto+escalation")
REQUIRED_KEYS = ("accuracy", "requests", "prompt_tokens", "reasoning_tokens", "completion_tokens", "cost_usd",
                 "p50_ms", "p99_ms", "cache_hit_rate")
SUBSETS = ("synthetic", "real")
ESCALATE_ON = ["empty_answer", "length_in_thought"]
REQUEST_TIMEOUT_S = 300.0
REDIS_TIMEOUT_S = 2.0  # bench gateways' redis.socket_timeout_s floor (s)
WINDOW_PAD_S = 0.01  # event ts (gateway receive time) lies inside the client's send..last-answer window


class BenchError(ThinkGateError, RuntimeError):
    """The bench could not run (stack failed to start, gateway unreachable, bad arguments)."""


# ------------------------------------------------------------------------------------------------ workload


@dataclass(frozen=True)
class Item:
    """One request of the workload: ``qid`` identifies the question (repeats share it)."""

    qid: int
    subset: str  # synthetic | real
    source: str  # arith | gsm8k | math
    question: str
    problem: Any  # router.tasks.Problem


def workload(n: int, repeat_fraction: float, real_fraction: float, seed: int = 0) -> list[Item]:
    """``n`` requests (see the module doc): synthetic arith held-out + GSM8K/MATH test questions, with repeats."""
    from router.tasks import load_task

    if not 0 <= repeat_fraction < 1 or not 0 <= real_fraction <= 1:
        raise BenchError("repeat_fraction must be in [0, 1) and real_fraction in [0, 1]")
    rng = random.Random(seed)
    n_real = round(n * real_fraction)
    n_syn = n - n_real
    items: list[Item] = []
    qid = 0
    for subset, count in (("synthetic", n_syn), ("real", n_real)):
        if count == 0:
            continue
        repeats = round(count * repeat_fraction)
        unique = count - repeats
        if subset == "synthetic":
            levels = [1, 2, 3, 4, 5, 6]
            per = [unique // 6 + (1 if i < unique % 6 else 0) for i in range(6)]
            problems = [p for lvl, k in zip(levels, per, strict=True) if k
                        for p in load_task("arith", "test", k, seed=seed, difficulties=[lvl])]
        else:
            n_math = unique // 2
            problems = (load_task("gsm8k", "test", unique - n_math, seed=seed)
                        + (load_task("math", "test", n_math, seed=seed) if n_math else []))
        rng.shuffle(problems)
        firsts = []
        for p in problems:
            firsts.append(Item(qid, subset, p.source, p.question, p))
            qid += 1
        seq = list(firsts)
        for _ in range(repeats):  # a repeat goes somewhere after its original
            orig = rng.randrange(len(firsts))
            pos = seq.index(firsts[orig])
            seq.insert(rng.randint(pos + 1, len(seq)), firsts[orig])
        items += seq
    return items


# ----------------------------------------------------------------------------------------------- requests


@dataclass
class Outcome:
    """One client request: verified or not, latency (ms), HTTP status, response headers we use."""

    item: Item
    correct: bool
    latency_ms: float
    status: int
    tier: str | None = None
    cache: str | None = None
    request_id: str | None = None


@dataclass
class Segment:
    """One (policy, subset) run: its key, its window of time (epoch s) and outcomes; events read afterwards."""

    policy: str
    subset: str
    key_id: str | None
    t_start: float = 0.0
    t_end: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    events: list[UsageEvent] = field(default_factory=list)
    skipped: int = 0  # requests not sent: the run's time budget was spent

    @property
    def wall_s(self) -> float:
        return self.t_end - self.t_start


@dataclass(frozen=True)
class Endpoint:
    """Where a policy's requests go: gateway root URL, API key secret, ``model`` field."""

    url: str
    secret: str
    model: str


def send(client: ProbeClient, ep: Endpoint, item: Item) -> Outcome:
    """One chat request at temperature 0 (:class:`router.probe.ProbeClient`, no retries: a failure is an
    outcome); verifies the answer with the task's exact verifier."""
    from router.tasks import verify

    answer = client.chat(ep.model, [{"role": "user", "content": item.question}], check=False, temperature=0)
    try:
        correct = answer.ok and bool(verify(item.problem, answer.content))
    except ValueError:  # math-verify refuses some inputs off the main thread (its signal-based timeout)
        correct = False
    return Outcome(item, correct, answer.latency_ms, answer.status, answer.headers.get("x-thinkgate-tier"),
                   answer.headers.get("x-thinkgate-cache"), answer.headers.get("x-request-id"))


def run_segment(seg: Segment, ep: Endpoint, items: list[Item], concurrency: int,
                tick: Callable[[], None] = lambda: None, deadline: float = float("inf")) -> None:
    """Send ``items`` (in order, ``concurrency`` in flight) and record the window. Items not yet sent when
    ``time.monotonic()`` passes ``deadline`` are skipped (status -1, left out of every figure)."""
    with ProbeClient(ep.url, ep.secret, timeout_s=REQUEST_TIMEOUT_S, max_retries=0,
                     max_connections=concurrency) as client, ThreadPoolExecutor(concurrency) as pool:
        seg.t_start = time.time()

        def one(item: Item) -> Outcome:
            out = send(client, ep, item) if time.monotonic() < deadline else Outcome(item, False, 0.0, -1)
            tick()
            return out

        seg.outcomes = list(pool.map(one, items))
        seg.t_end = time.time()
        seg.skipped = sum(1 for o in seg.outcomes if o.status == -1)
        seg.outcomes = [o for o in seg.outcomes if o.status != -1]


# ------------------------------------------------------------------------------------------------- ledger


class Ledger:
    """Reads usage events from the metering ledger (Redis stream) with the gateway's own reader."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def events(self, since: float, until: float, key_ids: set[str] | None) -> list[UsageEvent]:
        """Events with ``since <= ts < until`` (epoch s) of ``key_ids`` (all keys when None)."""
        import asyncio

        from gateway.state.breaker import Breaker
        from gateway.state.metering import Meter
        from gateway.state.redis import connect
        from gateway.state.spool import Spool

        rcfg = self.settings.redis.model_copy(update={"socket_timeout_s": 5.0})

        async def collect() -> list[UsageEvent]:
            handle = connect(rcfg)
            try:
                meter = Meter(handle, Breaker(1.0), Spool(Path(tempfile.gettempdir()) / "tg-bench-unused.jsonl"),
                              self.settings.metering)
                return [e async for e in meter.events(since, until) if key_ids is None or e.key_id in key_ids]
            finally:
                await handle.close()

        return asyncio.run(collect())

    def settle(self, seg: Segment, timeout_s: float = 20.0) -> None:
        """Read the segment's events once metering has written them all (it writes after the response)."""
        want = sum(1 for o in seg.outcomes if o.status)  # every answered request has ≥ 1 event
        keys = {seg.key_id} if seg.key_id else None
        deadline = time.monotonic() + timeout_s
        last = -1
        while True:
            evs = self.events(seg.t_start - WINDOW_PAD_S, seg.t_end + WINDOW_PAD_S, keys)
            if (len(evs) >= want and len(evs) == last) or time.monotonic() > deadline:
                seg.events = evs
                return
            last = len(evs)
            time.sleep(0.3)


# ---------------------------------------------------------------------------------------------- summaries


def summarize(segments: list[Segment]) -> dict[str, Any]:
    """The per-policy (or per-subset) entry: ledger sums + client-side accuracy and latency."""
    outcomes = [o for s in segments for o in s.outcomes]
    events = [e for s in segments for e in s.events]
    upstream = [e for e in events if not e.cached]
    requests_ev = [e for e in events if counts_as_request(e)]
    micro = sum(e.cost_micro_usd for e in events)
    n = len(outcomes)
    verifiable = [o for o in outcomes if o.item.subset == "synthetic"]
    lat = [o.latency_ms for o in outcomes if o.status == 200]
    sums = {k: sum(getattr(e, k) for e in upstream) for k in ("prompt_tokens", "reasoning_tokens",
                                                               "completion_tokens")}
    return {
        "accuracy": (sum(o.correct for o in verifiable) / len(verifiable)) if verifiable else None,
        "requests": n,
        **sums,
        "cost_usd": float(micro_to_usd(micro)),
        "cost_micro_usd": micro,
        "p50_ms": round(percentile(lat, 50, math.nan), 2),
        "p99_ms": round(percentile(lat, 99, math.nan), 2),
        "cache_hit_rate": (sum(e.cached for e in requests_ev) / len(requests_ev)) if requests_ev else 0.0,
        "events": len(events),
        "errors": sum(1 for o in outcomes if o.status != 200),
        **{f"mean_{k}": (v / n if n else 0.0) for k, v in sums.items()},
        "tiers": dict(sorted(Counter(e.tier or "_unrouted" for e in requests_ev).items())),
        "escalations": sum(1 for e in events if (e.error_code or "").startswith("escalated_")),
        "saved_micro_usd": sum(e.saved_micro_usd for e in events),
        "cache_results": dict(sorted(Counter(o.cache or "none" for o in outcomes).items())),
        "skipped": sum(s.skipped for s in segments),
        "wall_s": round(sum(s.wall_s for s in segments), 1),
    }


def policy_report(segments: list[Segment]) -> dict[str, Any]:
    """A policy's entry with ``synthetic`` and ``real`` sub-entries (real: accuracy of GSM8K/MATH answers)."""
    entry = summarize(segments)
    for subset in SUBSETS:
        segs = [s for s in segments if s.subset == subset]
        if not segs:
            continue
        sub = summarize(segs)
        if subset == "real":
            outs = [o for s in segs for o in s.outcomes]
            sub["accuracy"] = sum(o.correct for o in outs) / len(outs) if outs else None
        entry[subset] = sub
    return entry


def targets(policies: dict[str, Any], long_policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """Routed serving vs always-long on the synthetic task: reasoning-token share (target ≤ 40%) at accuracy
    share (target ≥ 98%), for ``auto`` and ``auto+escalation``. ``long_policy``: the always-long entry to compare
    against (default: this run's own ``long``; :func:`targets_vs_baseline` passes another run's)."""
    out: dict[str, Any] = {}
    long = (long_policy if long_policy is not None else policies.get("long") or {}).get("synthetic")
    if not long:
        return out
    for name in ("auto", "auto+escalation"):
        sub = (policies.get(name) or {}).get("synthetic")
        if not sub:
            continue
        tok = sub["reasoning_tokens"] / long["reasoning_tokens"] if long["reasoning_tokens"] else None
        acc = sub["accuracy"] / long["accuracy"] if long["accuracy"] else None
        out[name] = {
            "reasoning_tokens_vs_long": tok,
            "accuracy_vs_long": acc,
            "met": bool(tok is not None and acc is not None and tok <= 0.40 and acc >= 0.98),
        }
    return out


def targets_vs_baseline(result: dict[str, Any], baseline: dict[str, Any], source: str) -> dict[str, Any]:
    """The targets of ``result``'s routed policies against the always-long policy of ``baseline`` (another run's
    JSON on the same workload, e.g. the SFT model's, when ``result`` served the length-penalised model).

    Raises :class:`BenchError` when the workloads differ or the baseline has no ``long`` policy."""
    if baseline.get("workload") != result.get("workload"):
        raise BenchError(f"baseline {source}: different workload ({baseline.get('workload')} vs "
                         f"{result.get('workload')}); rerun both with the same --n/--seed/fractions")
    long = (baseline.get("policies") or {}).get("long")
    if not long or not long.get("synthetic"):
        raise BenchError(f"baseline {source}: no always-long policy with synthetic results")
    return {"baseline": source, "baseline_model_sha256": (baseline.get("stack") or {}).get("model_sha256"),
            "targets": targets(result["policies"], long)}


# ---------------------------------------------------------------------------------------------- the stack


def _key_id(run: str, policy: str, subset: str) -> str:
    return f"savings-{run}-{policy.replace('+', '-')}-{subset}"


def gateway_config(base: Settings, tiers_url: str | None, escalation: bool, keys: list[dict[str, Any]],
                   state_dir: Path) -> dict[str, Any]:
    """The YAML dict of one bench gateway: ``base`` with engine off, tiers on ``tiers_url`` (when given), the
    escalation switch on ``short``, the bench keys, logs quiet, its own spool."""
    data = base.model_dump(mode="json")
    data["engine"]["enabled"] = False
    data["redis"]["start_if_missing"] = False
    # On a box shared with training jobs one Redis call can exceed the default 0.25 s; the breaker would then
    # bypass the cache for breaker_cooldown_s and the run would measure the box, not the policies.
    data["redis"]["socket_timeout_s"] = max(float(data["redis"]["socket_timeout_s"]), REDIS_TIMEOUT_S)
    for tier in data["tiers"]:
        if tiers_url is not None:
            tier["base_url"] = tiers_url
        tier["escalate_on"] = list(ESCALATE_ON) if escalation and tier["name"] == "short" else []
    data["auth"] = {**data["auth"], "keys": keys, "admin_key_sha256": None}
    data["server"] = {**data["server"], "log_level": "warning"}
    data["metering"] = {**data["metering"], "spool_path": str(state_dir / f"spool-{uuid.uuid4().hex[:6]}.jsonl")}
    return data


def _free_port() -> int:
    from gateway.engine.redis_server import free_port

    return free_port()


@contextmanager
def serve_gateway(cfg: dict[str, Any], state_dir: Path, name: str) -> Iterator[str]:
    """``thinkgate serve`` as a subprocess with ``cfg`` on a free loopback port; yields its root URL."""
    port = _free_port()
    path = state_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = (state_dir / f"{name}.log").open("w")
    env = {**os.environ, "THINKGATE_CONFIG": ""}
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path), "--host",
                             "127.0.0.1", "--port", str(port)], cwd=REPO, stdout=log, stderr=log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise BenchError(f"gateway {name} exited with {proc.returncode}; log: {state_dir / (name + '.log')}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"gateway {name} did not answer within 120 s")
            time.sleep(0.2)
        yield url
    finally:
        stop_process(proc)
        log.close()


@dataclass
class BenchConfig:
    """Arguments of one bench run (see the module doc)."""

    n: int = 100
    repeat_fraction: float = 0.2
    real_fraction: float = 0.08
    policies: tuple[str, ...] = POLICIES
    concurrency: int = 4
    seed: int = 0
    url: str | None = None
    escalation_url: str | None = None
    api_key: str | None = None
    progress: bool = True
    time_budget_s: float = 840.0  # the whole run, start-up included; unsent requests are skipped after it


Endpoints = dict[str, tuple[Endpoint, str | None]]  # policy -> (endpoint template, key_id or None)


def _start_stack(cfg: BenchConfig, settings: Settings, stack: ExitStack, state_dir: Path, run_id: str,
                 start_engine: bool, log: Callable[[str], None],
                 stack_info: dict[str, Any]) -> tuple[Settings, Endpoints, dict[str, str]]:
    """Start Redis, the local engine (``start_engine``) and one gateway per escalation setting, all closed by
    ``stack``; one key per policy and subset. Returns ``(settings with the Redis URL used, endpoints,
    {key id: secret})`` and records what it started in ``stack_info``."""
    from gateway.engine.redis_server import ensure

    proc, redis_url = ensure(settings.redis.url)
    settings = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": redis_url})})
    if proc is not None:
        stack.callback(proc.terminate)
    tiers_url = None
    if start_engine:
        from gateway.engine.vllm import LocalEngine

        ecfg = settings.engine.model_copy(update={"port": _free_port()})
        log(f"savings: starting the local vLLM engine ({ecfg.model_path.name}) …")
        engine = LocalEngine(ecfg, state_dir=state_dir)
        engine.start()
        stack.callback(engine.stop)
        tiers_url = engine.base_url
        stack_info["engine_startup_s"] = round(engine.startup_s or 0.0, 1)
        stack_info["model_sha256"] = _weights_sha256(Path(ecfg.model_path))
    keys = []
    secrets_by_key: dict[str, str] = {}
    for p in cfg.policies:
        for s in SUBSETS:
            kid = _key_id(run_id, p, s)
            secrets_by_key[kid] = "tg-" + secrets.token_hex(16)
            keys.append({"id": kid, "secret": secrets_by_key[kid], "tags": {"bench": "savings",
                                                                             "policy": p, "subset": s}})
    urls: dict[bool, str] = {}
    for esc in sorted({p == "auto+escalation" for p in cfg.policies}):
        name = "gateway-escalation" if esc else "gateway"
        urls[esc] = stack.enter_context(
            serve_gateway(gateway_config(settings, tiers_url, esc, keys, state_dir), state_dir, name))
    endpoints: Endpoints = {}
    for p in cfg.policies:
        model = "auto" if p.startswith("auto") else p
        endpoints[p] = (Endpoint(urls[p == "auto+escalation"], "", model), None)
    stack_info.update({"gateways": len(urls), "router": str(settings.routing.router_path),
                       **router_identity(settings.routing.router_path),
                       "tiers": {t.name: {"thinking_budget": t.thinking_budget, "max_tokens": t.max_tokens}
                                 for t in settings.tiers}})
    return settings, endpoints, secrets_by_key


def router_identity(path: Path | None) -> dict[str, str | None]:
    """What the stack block says of the router file beside its path: ``router_sha256`` (the first 12 hex digits of
    its content's SHA-256) and ``router_version`` (:func:`router.serving.file_version`, the version ``thinkgate
    router info`` and ``router:current`` name it by). The path alone named two runs the same though another router
    was saved there between them (the auto policy's figures moved and read as nondeterminism). None for each when
    no router is configured or its file cannot be read or loaded."""
    from router.persistence import RouterFileError, load_router
    from router.serving import file_sha256, file_version

    digest = file_sha256(path) if path is not None else None
    version = None
    if path is not None and digest is not None:
        try:
            version = file_version(load_router(path, pipeline=False), digest) or None
        except RouterFileError:  # the gateways say why they did not serve it; the bench still names its bytes
            version = None
    return {"router_sha256": digest[:12] if digest else None, "router_version": version}


def _external_endpoints(cfg: BenchConfig, log: Callable[[str], None], stack_info: dict[str, Any]) -> Endpoints:
    """The endpoints of a running gateway (``cfg.url``, and ``cfg.escalation_url`` for auto+escalation, skipped
    without one), all called with ``cfg.api_key``. Raises BenchError without a key."""
    if not cfg.api_key:
        raise BenchError("--url needs THINKGATE_API_KEY")
    key_id = _own_key_id(cfg.url or "", cfg.api_key)
    endpoints: Endpoints = {}
    for p in cfg.policies:
        url = cfg.escalation_url if p == "auto+escalation" else cfg.url
        if url is None:
            log("savings: auto+escalation skipped (give --escalation-url: a gateway with escalate_on on short)")
            continue
        endpoints[p] = (Endpoint(url.rstrip("/").removesuffix("/v1"), cfg.api_key,
                                 "auto" if p.startswith("auto") else p), key_id)
    stack_info["url"] = cfg.url
    return endpoints


def run(cfg: BenchConfig, settings: Settings, *, start_engine: bool = True,
        log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> dict[str, Any]:
    """Run the bench (starting the stack unless ``cfg.url``) and return the JSON report (module doc)."""
    from tqdm import tqdm

    unknown = [p for p in cfg.policies if p not in POLICIES]
    if unknown:
        raise BenchError(f"unknown policies {unknown} (choose from {', '.join(POLICIES)})")
    items = workload(cfg.n, cfg.repeat_fraction, cfg.real_fraction, cfg.seed)
    by_subset = {s: [i for i in items if i.subset == s] for s in SUBSETS}
    run_id = uuid.uuid4().hex[:8]
    started = time.time()
    deadline = time.monotonic() + cfg.time_budget_s
    stack_info: dict[str, Any] = {"run": run_id}
    with ExitStack() as stack:
        state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tg-savings-")))
        secrets_by_key: dict[str, str] = {}
        if cfg.url is None:
            settings, endpoints, secrets_by_key = _start_stack(cfg, settings, stack, state_dir, run_id, start_engine,
                                                               log, stack_info)
        else:
            endpoints = _external_endpoints(cfg, log, stack_info)
        ledger = Ledger(settings)
        total = sum(len(v) for v in by_subset.values()) * len(endpoints)
        bar = tqdm(total=total, desc="bench savings", disable=not cfg.progress, file=sys.stderr)
        segments: dict[str, list[Segment]] = {}
        for p, (ep, url_key) in endpoints.items():
            for s in SUBSETS:
                if not by_subset[s]:
                    continue
                kid = url_key if cfg.url else _key_id(run_id, p, s)
                secret = cfg.api_key if cfg.url else secrets_by_key[kid or ""]
                seg = Segment(p, s, kid)
                run_segment(seg, Endpoint(ep.url, secret or "", ep.model), by_subset[s], cfg.concurrency,
                            bar.update, deadline)
                ledger.settle(seg)
                segments.setdefault(p, []).append(seg)
        bar.close()
    policies = {p: policy_report(segs) for p, segs in segments.items()}
    skipped = sum(e["skipped"] for e in policies.values())
    if skipped:
        log(f"savings: time budget of {cfg.time_budget_s:.0f} s spent: {skipped} requests not sent "
            "(see 'skipped' per policy; compare policies on equal requests only)")
    return {
        "complete": skipped == 0,
        "policies": policies,
        "targets": targets(policies),
        "workload": {"n": cfg.n, "synthetic": len(by_subset["synthetic"]), "real": len(by_subset["real"]),
                     "repeat_fraction": cfg.repeat_fraction, "real_fraction": cfg.real_fraction,
                     "unique_questions": len({i.qid for i in items}), "concurrency": cfg.concurrency,
                     "seed": cfg.seed},
        "stack": stack_info,
        "wall_s": round(time.time() - started, 1),
    }


def _weights_sha256(model_dir: Path) -> str:
    """SHA-256 (first 12 hex) of the model's ``*.safetensors`` files: names the weights a run used."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def _own_key_id(url: str, secret: str) -> str | None:
    """The key id of ``secret`` from the gateway's ``GET /v1/usage`` (None when it does not say)."""
    root = url.rstrip("/").removesuffix("/v1")
    try:
        r = httpx.get(root + "/v1/usage", headers={"authorization": f"Bearer {secret}"}, timeout=10)
    except httpx.HTTPError as exc:
        raise BenchError(f"gateway at {root} not reachable: {exc}") from exc
    if r.status_code != 200:
        raise BenchError(f"gateway at {root} answered {r.status_code} to GET /v1/usage: {r.text[:200]}")
    return r.json().get("key_id")


# ------------------------------------------------------------------------------------------------ outputs


def _fmt(v: Any, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def markdown(result: dict[str, Any]) -> str:
    """The per-policy table as Markdown (accuracy on the synthetic task; real = GSM8K/MATH)."""
    lines = ["| policy | requests | errors | accuracy (synthetic) | accuracy (real) | prompt tok | reasoning tok | "
             "completion tok | reasoning tok (synthetic) | cost USD (ledger) | p50 ms | p99 ms | cache hit rate | "
             "tiers (answered) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, e in result["policies"].items():
        real = (e.get("real") or {}).get("accuracy")
        syn_tok = (e.get("synthetic") or {}).get("reasoning_tokens")
        tiers = ", ".join(f"{k} {v}" for k, v in e["tiers"].items())
        lines.append(f"| {name} | {e['requests']} | {e['errors']} | {_fmt(e['accuracy'], '.1%')} | "
                     f"{_fmt(real, '.1%')} | "
                     f"{e['prompt_tokens']} | {e['reasoning_tokens']} | {e['completion_tokens']} | "
                     f"{_fmt(syn_tok, 'd')} | {Decimal(e['cost_micro_usd']) / 1_000_000:.6f} | {e['p50_ms']:.0f} | "
                     f"{e['p99_ms']:.0f} | {e['cache_hit_rate']:.1%} | {tiers} |")
    return "\n".join(lines)


def render(result: dict[str, Any]) -> Any:
    """A rich Table of the policies plus the target lines."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title="ThinkGate savings: one workload, five policies (cost from the metering ledger)")
    cols = ("policy", "requests", "acc synth", "acc real", "prompt tok", "reasoning tok", "completion tok",
            "cost USD", "p50 ms", "p99 ms", "cache hits", "tiers")
    for c in cols:
        table.add_column(c, justify="left" if c in ("policy", "tiers") else "right")
    for name, e in result["policies"].items():
        table.add_row(name, str(e["requests"]), _fmt(e["accuracy"], ".1%"),
                      _fmt((e.get("real") or {}).get("accuracy"), ".1%"), str(e["prompt_tokens"]),
                      str(e["reasoning_tokens"]), str(e["completion_tokens"]),
                      f"{Decimal(e['cost_micro_usd']) / 1_000_000:.6f}", f"{e['p50_ms']:.0f}", f"{e['p99_ms']:.0f}",
                      f"{e['cache_hit_rate']:.1%}", ", ".join(f"{k}:{v}" for k, v in e["tiers"].items()))
    parts: list[Any] = [table]
    for name, t in result["targets"].items():
        tok, acc = t["reasoning_tokens_vs_long"], t["accuracy_vs_long"]
        parts.append(Text(f"{name} vs long (synthetic): reasoning tokens {_fmt(tok, '.1%')} (target ≤ 40%), "
                          f"accuracy {_fmt(acc, '.1%')} (target ≥ 98%): {'met' if t['met'] else 'not met'}"))
    base = result.get("vs_baseline")
    for name, t in (base or {}).get("targets", {}).items():
        tok, acc = t["reasoning_tokens_vs_long"], t["accuracy_vs_long"]
        parts.append(Text(f"{name} vs the baseline's long ({base['baseline']}, model {base['baseline_model_sha256']}):"
                          f" reasoning tokens {_fmt(tok, '.1%')} (target ≤ 40%), accuracy {_fmt(acc, '.1%')} "
                          f"(target ≥ 98%): {'met' if t['met'] else 'not met'}"))
    return Group(*parts)


def plot(result: dict[str, Any], path: Path) -> None:
    """PNG of the cost–accuracy frontier: x = ledger cost (USD), y = synthetic accuracy, one point per policy;
    the Pareto-optimal policies are joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(name, e["cost_usd"], e["accuracy"]) for name, e in result["policies"].items()
           if e["accuracy"] is not None]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    seen: Counter[tuple[float, float]] = Counter()
    for name, x, y in pts:
        ax.scatter([x], [y], s=50)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5 - 12 * seen[(x, y)]), fontsize=9)
        seen[(x, y)] += 1  # policies on the same point (e.g. escalation never fired) get stacked labels
    front = []
    for name, x, y in sorted(pts, key=lambda p: (p[1], -p[2])):
        if not front or y > front[-1][2]:
            front.append((name, x, y))
    if len(front) > 1:
        ax.plot([p[1] for p in front], [p[2] for p in front], "--", color="gray", lw=1, label="frontier")
        ax.legend()
    w = result.get("workload", {})
    ax.set_xlabel(f"cost, USD (metering ledger; {w.get('n', '?')} requests per policy)")
    ax.set_ylabel("accuracy on the synthetic task (held-out)")
    ax.set_title("Cost–accuracy frontier per policy", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write the report as JSON (NaN latencies become null)."""
    def clean(v: Any) -> Any:
        if isinstance(v, float) and v != v:
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    path.write_text(json.dumps(clean(result), indent=2))


# ---------------------------------------------------------------------------------------------------- CLI

def savings(
    n: int = typer.Option(BenchConfig.n, "--n", min=1, help="Requests per policy (synthetic + real)."),
    repeat_fraction: float = typer.Option(BenchConfig.repeat_fraction, help="Share of repeated questions."),
    real_fraction: float = typer.Option(BenchConfig.real_fraction, help="Share of GSM8K/MATH questions."),
    policies: str = typer.Option(",".join(POLICIES), help="Comma list of: " + ", ".join(POLICIES) + "."),
    concurrency: int = typer.Option(BenchConfig.concurrency, min=1, max=64, help="Requests in flight."),
    time_budget_s: float = typer.Option(BenchConfig.time_budget_s, min=10, help="Whole-run budget (s); "
                                        "requests not sent by then are skipped and reported."),
    seed: int = typer.Option(0, help="Workload seed."),
    url: str | None = typer.Option(None, help="A running gateway (else the bench starts the stack)."),
    escalation_url: str | None = typer.Option(None, help="With --url: a gateway with escalation on short."),
    engine_url: str | None = typer.Option(None, help="Use this running vLLM server (…/v1) for every tier "
                                          "instead of starting the local engine."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the report as JSON here."),
    png_path: Path | None = typer.Option(None, "--png", help="Write the cost-accuracy frontier PNG here."),
    md_path: Path | None = typer.Option(None, "--markdown", help="Write the table as Markdown here."),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML config (default: $THINKGATE_CONFIG)."),
    model_dir: Path | None = typer.Option(None, "--model-dir", help="Serve this model directory with the local "
                                          "engine instead of engine.model_path (e.g. the length-penalised "
                                          "models/thinkgate-tiny-short); same served name and tiers."),
    baseline: Path | None = typer.Option(None, "--baseline", help="Another run's --json on the same workload: "
                                         "also report the targets against its always-long policy."),
) -> None:
    """Replay one workload under none/short/long/auto/auto+escalation; cost from the metering ledger."""
    from gateway.cli.common import load_settings
    from router.console import console

    settings = load_settings(config, model_dir)
    cfg = BenchConfig(n=n, repeat_fraction=repeat_fraction, real_fraction=real_fraction,
                      policies=tuple(p.strip() for p in policies.split(",") if p.strip()), concurrency=concurrency,
                      seed=seed, url=url, escalation_url=escalation_url, time_budget_s=time_budget_s,
                      api_key=os.environ.get("THINKGATE_API_KEY"))
    if engine_url:
        settings = settings.model_copy(update={"tiers": [
            t.model_copy(update={"base_url": engine_url.rstrip("/")}) for t in settings.tiers]})
    base = None
    if baseline is not None:
        try:
            base = json.loads(baseline.read_text())
        except (OSError, ValueError) as exc:
            typer.echo(f"thinkgate: --baseline {baseline}: {exc}", err=True)
            raise typer.Exit(2) from None
    try:
        result = run(cfg, settings, start_engine=settings.engine.enabled and not engine_url)
    except BenchError as exc:
        typer.echo(f"thinkgate: {exc}", err=True)
        raise typer.Exit(2) from None
    baseline_error = None
    if base is not None:
        try:
            result["vs_baseline"] = targets_vs_baseline(result, base, str(baseline))
        except BenchError as exc:  # the run's own results are still written below
            baseline_error = str(exc)
    console().print(render(result))
    if json_path:
        write_json(result, json_path)
    if png_path:
        plot(result, png_path)
    if md_path:
        md_path.write_text(markdown(result) + "\n")
    typer.echo(f"thinkgate: bench savings took {result['wall_s']:.0f} s", err=True)
    if baseline_error:
        typer.echo(f"thinkgate: {baseline_error}", err=True)
        raise typer.Exit(2)
