"""Pools of upstream replicas: which replica of a tier gets each call (``tier.base_urls``, ``tier.pool``).

The gateway picks the model and its reasoning setting (the tier); this module only spreads one tier's calls
over identical engine replicas. When an inference scheduler (llm-d, the Gateway API Inference Extension)
already picks the pod, point ``base_url`` at it instead and leave pools out (docs/gateway.md).

Per call (:meth:`TierPool.pick`):

1. **in rotation**: replicas neither ejected nor failing their active health check; none → all of them (a
   pool that refuses every call helps no one; the call may still succeed or fall back to another tier);
2. **affinity** (``pool.affinity: prefix``): a conversation's key (:func:`conversation_key`, a digest of its
   first system and user messages: what every later turn repeats, so the engine's prefix cache holds it) ranks
   the replicas by rendezvous hashing (highest ``blake2b(key ‖ url)`` first; adding or losing a replica moves
   only the conversations that preferred it). The top replica is taken when it is in rotation and has at
   most ``pool.affinity_max_skew`` more outstanding requests than the least loaded one;
3. else **least outstanding requests**, ties broken in rendezvous order (with a key: the same conversation
   lands on the same fallback) or in turn (without one: sequential calls spread evenly).

Every gateway replica computes the same ranking from the request alone, so replicas behind a load balancer
agree without sharing state, and a session kept on its tier (:mod:`gateway.pipeline.sessions`) keeps its
engine replica too. The key of the request being served is a context variable (:func:`affinity`), set once by
the request path, so every upstream call made for the request — the two phases of budget forcing included —
goes to the same replica.

Passive ejection: ``pool.allowed_fails`` consecutive failed calls (connection refused or reset, connect or read
timeout, 5xx, a stream broken mid-body) take a replica out for ``pool.cooldown_s``; then it is probed
(``probe``: ``GET /health``, else ``/v1/models``) and readmitted on success with one failure left (the next
failure ejects it again), else ejected again for twice as long, up to ``pool.max_cooldown_s``; a successful
call resets both. Active checks (``pool.health_check_interval_s`` > 0): each replica URL is probed on that
interval, one probe at a time, each bounded by ``pool.health_check_timeout_s``. A tier with one upstream is
neither ejected nor probed. State is per URL: tiers that share a replica share its load and health.

Metrics (:meth:`Balancer.collector`, Prometheus, label ``upstream`` = the configured URL):
``thinkgate_upstream_outstanding_requests``, ``thinkgate_upstream_in_rotation`` (1/0),
``thinkgate_upstream_requests_total``, ``thinkgate_upstream_ejections_total``,
``thinkgate_upstream_health_check_failures_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.config import TierConfig, UpstreamPoolConfig

log = logging.getLogger("thinkgate.upstream")

#: How much of a completion prompt keys its affinity (characters; a chat keys on its first turns instead).
PREFIX_CHARS = 1024
#: Cap on the text hashed for one key (characters), so a huge first message costs a bounded hash.
MAX_KEY_CHARS = 65_536

_AFFINITY: ContextVar[bytes | None] = ContextVar("thinkgate_upstream_affinity", default=None)

#: ``probe(replica, timeout_s)`` → the replica answers its health check.
Probe = Callable[["Replica", float], Awaitable[bool]]


def key_text(content: Any) -> str:
    """The text a key is made of (the affinity key here, the session key in :mod:`gateway.pipeline.sessions`): a
    message ``content`` string as is, a list of parts their ``text`` concatenated whatever their type, else "".
    Not the text the router reads (:func:`router.window.message_text`: text parts only, newline-joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return ""


def conversation_key(body: dict[str, Any]) -> bytes | None:
    """The affinity key of a chat or completions ``body`` (16 bytes), None when it has nothing to key on.

    Chat: the messages up to and including the first ``user`` one (role and text): every later turn of the
    conversation starts with them. Completions: the first :data:`PREFIX_CHARS` characters of the prompt (the
    first prompt of a batch; token-id prompts by their first 256 ids)."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        parts: list[str] = []
        for m in msgs:
            if isinstance(m, dict):
                parts.append(f"{m.get('role')}\x00{key_text(m.get('content'))}")
                if m.get("role") == "user":
                    break
        text = "\x01".join(parts)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch: its first prompt
        if isinstance(prompt, str):
            text = prompt[:PREFIX_CHARS]
        elif isinstance(prompt, list):
            text = repr(prompt[:256])  # token ids
        else:
            text = ""
    if not text:
        return None
    return hashlib.blake2b(text[:MAX_KEY_CHARS].encode("utf-8", "replace"), digest_size=16).digest()


@contextlib.contextmanager
def affinity(key: bytes | None) -> Iterator[None]:
    """Upstream calls made inside the block (this task and tasks it starts) prefer the replica of ``key``."""
    token = _AFFINITY.set(key)
    try:
        yield
    finally:
        _AFFINITY.reset(token)


@contextlib.contextmanager
def conversation_affinity(body: dict[str, Any], tiers: Sequence[TierConfig]) -> Iterator[None]:
    """An :func:`affinity` block for a request ``body`` that may call any of ``tiers``: keyed by the
    conversation (:func:`conversation_key`) when one of them has several replicas — computed only then —,
    else a block that prefers nothing."""
    key = conversation_key(body) if any(len(t.upstream_urls) > 1 for t in tiers) else None
    with affinity(key):
        yield


def current_affinity() -> bytes | None:
    """The affinity key set by the innermost :func:`affinity` block, if any."""
    return _AFFINITY.get()


@dataclass(eq=False, slots=True)
class Replica:
    """One upstream URL's live state (shared by every tier that lists it).

    ``outstanding``: calls sent and not finished (a stream until it is closed); ``fails``: consecutive failed
    calls; ``ejected`` (until a probe succeeds; ``ejected_until`` monotonic s, the earliest probe);
    ``healthy``: the last active health check passed; counters ``requests``, ``ejections``, ``health_failures``."""

    url: str
    seed: bytes
    outstanding: int = 0
    requests: int = 0
    fails: int = 0
    ejected: bool = False
    ejected_until: float = 0.0
    cooldown_s: float = 0.0
    ejections: int = 0
    healthy: bool = True
    health_failures: int = 0
    probing: bool = False

    @property
    def in_rotation(self) -> bool:
        return self.healthy and not self.ejected


def _score(key: bytes, r: Replica) -> int:
    return int.from_bytes(hashlib.blake2b(key + r.seed, digest_size=8).digest(), "big")


class TierPool:
    """One tier's replicas and its ``pool`` settings; every method runs on the event loop (no locks)."""

    def __init__(self, name: str, cfg: UpstreamPoolConfig, replicas: list[Replica], balancer: Balancer) -> None:
        self.name = name
        self.cfg = cfg
        self.replicas = replicas
        self._balancer = balancer
        self._turn = 0

    def rank(self, key: bytes) -> list[Replica]:
        """All replicas in ``key``'s rendezvous order (preferred first)."""
        return sorted(self.replicas, key=lambda r: _score(key, r), reverse=True)

    def _choose(self, live: list[Replica], key: bytes | None) -> Replica:
        if key is not None and self.cfg.affinity == "prefix":
            ranked = self.rank(key)
            low = min(r.outstanding for r in live)
            top = ranked[0]
            if top in live and top.outstanding <= low + self.cfg.affinity_max_skew:
                return top
            return min((r for r in ranked if r in live), key=lambda r: r.outstanding)  # min keeps the first tie
        n = len(live)
        start = self._turn % n
        self._turn += 1
        return min((live[(start + i) % n] for i in range(n)), key=lambda r: r.outstanding)

    def pick(self, key: bytes | None = None, exclude: Collection[Replica] = ()) -> Replica:
        """The replica for the next call (counted outstanding: pair it with :meth:`end`). ``exclude``: replicas
        this call already tried (used again only when nothing else is left)."""
        reps = self.replicas
        if len(reps) == 1:
            r = reps[0]
        else:
            live = [r for r in reps if r.in_rotation and r not in exclude]
            if not live:
                live = [r for r in reps if r not in exclude] or list(reps)
            r = self._choose(live, key)
        r.outstanding += 1
        r.requests += 1
        return r

    def peek(self) -> Replica:
        """A replica for a side call (tokenize): the least loaded in rotation; nothing is counted."""
        live = [r for r in self.replicas if r.in_rotation] or self.replicas
        return min(live, key=lambda r: r.outstanding)

    def end(self, r: Replica, ok: bool | None) -> None:
        """A call on ``r`` finished: ``ok`` True (answered: 2xx or 4xx), False (failed: counts towards
        ejection), None (cancelled by the client: neither)."""
        r.outstanding -= 1
        if ok is True:
            r.fails = 0
            r.cooldown_s = 0.0
        elif ok is False and len(self.replicas) > 1:
            r.fails += 1
            if r.fails >= self.cfg.allowed_fails and not r.ejected:
                self._balancer.eject(r, self.cfg, f"{r.fails} consecutive failures on tier {self.name}")


class Balancer:
    """The replicas of every tier (by URL) and their probe tasks. ``probe`` makes the health check's HTTP
    call; :meth:`start` (inside the event loop) starts the active checks, :meth:`aclose` stops everything."""

    def __init__(self, tiers: Iterable[TierConfig], probe: Probe,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.probe = probe
        self.clock = clock
        self.replicas: dict[str, Replica] = {}
        self.pools: dict[str, TierPool] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False
        for t in tiers:
            self.tier(t)

    def tier(self, tier: TierConfig) -> TierPool:
        """The pool of ``tier`` (made on first use for a tier the balancer was not built with)."""
        pool = self.pools.get(tier.name)
        if pool is None:
            reps = [self.replicas.setdefault(u, Replica(u, u.encode())) for u in tier.upstream_urls]
            pool = self.pools[tier.name] = TierPool(tier.name, tier.pool, reps, self)
        return pool

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> None:
        """Start one active health-check loop per replica URL of a pooled tier (interval: the shortest such
        tier's ``health_check_interval_s``). Idempotent; needs a running event loop."""
        if self._started:
            return
        self._started = True
        checks: dict[str, tuple[float, float]] = {}
        for pool in self.pools.values():
            cfg = pool.cfg
            if len(pool.replicas) < 2 or cfg.health_check_interval_s <= 0:
                continue
            for r in pool.replicas:
                interval, timeout = checks.get(r.url, (cfg.health_check_interval_s, cfg.health_check_timeout_s))
                checks[r.url] = (min(interval, cfg.health_check_interval_s), min(timeout, cfg.health_check_timeout_s))
        for url, (interval, timeout) in checks.items():
            self._spawn(self._watch(self.replicas[url], interval, timeout))

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._started = False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, r: Replica, timeout_s: float) -> bool:
        try:
            return await asyncio.wait_for(self.probe(r, timeout_s), timeout_s + 1.0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a probe that breaks is a failed probe, never a dead loop
            log.debug("probe of %s failed: %r", r.url, exc)
            return False

    async def _watch(self, r: Replica, interval_s: float, timeout_s: float) -> None:
        while True:
            ok = await self._check(r, timeout_s)
            if ok != r.healthy:
                log.warning("upstream %s %s its health check", r.url, "passes" if ok else "fails")
            if not ok:
                r.health_failures += 1
            r.healthy = ok
            await asyncio.sleep(interval_s)

    def eject(self, r: Replica, cfg: UpstreamPoolConfig, why: str) -> None:
        """Take ``r`` out of rotation for its cool-down (doubled when it failed again without a success in
        between), then probe it back (a task)."""
        r.cooldown_s = cfg.cooldown_s if r.cooldown_s <= 0 else min(r.cooldown_s * 2, cfg.max_cooldown_s)
        r.ejected = True
        r.ejections += 1
        r.fails = 0
        r.ejected_until = self.clock() + r.cooldown_s
        log.warning("upstream %s ejected for %.1f s (%s)", r.url, r.cooldown_s, why)
        if not r.probing:
            r.probing = True
            self._spawn(self._probe_back(r, cfg))

    async def _probe_back(self, r: Replica, cfg: UpstreamPoolConfig) -> None:
        try:
            while r.ejected:
                await asyncio.sleep(max(0.0, r.ejected_until - self.clock()))
                if await self._check(r, cfg.health_check_timeout_s):
                    r.ejected = False
                    r.healthy = True
                    r.fails = cfg.allowed_fails - 1  # on probation: the next failure ejects it again
                    log.warning("upstream %s readmitted after a successful probe", r.url)
                    return
                r.cooldown_s = min(r.cooldown_s * 2, cfg.max_cooldown_s)
                r.ejected_until = self.clock() + r.cooldown_s
        finally:
            r.probing = False

    def collector(self) -> Collector:
        """A Prometheus collector of the replicas' state (register it on the app's registry)."""
        return _PoolCollector(self)


def label_url(url: str) -> str:
    """A replica's URL as a metric label: scheme, host, port and path — no userinfo (``user:token@``) or query,
    where credentials live (``/metrics`` is the operator's by default, but ``metrics.access`` may open it)."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname or ''}{port}{parts.path}"


class _PoolCollector(Collector):
    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer

    def collect(self) -> Iterable[Metric]:
        reps = list(self.balancer.replicas.values())
        outstanding = GaugeMetricFamily("thinkgate_upstream_outstanding_requests",
                                        "Upstream calls sent and not finished, by replica URL.", labels=["upstream"])
        rotation = GaugeMetricFamily("thinkgate_upstream_in_rotation", "1 while the replica takes calls (not "
                                     "ejected, passing its health check).", labels=["upstream"])
        requests = CounterMetricFamily("thinkgate_upstream_requests", "Upstream calls sent (retries included).",
                                       labels=["upstream"])
        ejections = CounterMetricFamily("thinkgate_upstream_ejections", "Times the replica was ejected after "
                                        "consecutive failures.", labels=["upstream"])
        health = CounterMetricFamily("thinkgate_upstream_health_check_failures", "Failed active health checks.",
                                     labels=["upstream"])
        for r in reps:
            url = label_url(r.url)
            outstanding.add_metric([url], r.outstanding)
            rotation.add_metric([url], 1 if r.in_rotation else 0)
            requests.add_metric([url], r.requests)
            ejections.add_metric([url], r.ejections)
            health.add_metric([url], r.health_failures)
        return [outstanding, rotation, requests, ejections, health]
