"""Write-ahead metering with real processes: ``kill -9`` of a gateway (and of Redis) under streamed load loses no usage.

Every test: a real ``thinkgate serve`` process over the upstream simulator (streams slowed per request), 8 streamed
``long`` requests in flight, a SIGKILL, a restart — then every admitted request id (each 200's ``x-request-id``)
has exactly one settled event in the ledger, the key's spend counters equal the sum of its events, no write-ahead
record and no reservation is left open. With ``metering.write_ahead: false`` (``THINKGATE_METERING__WRITE_AHEAD``)
the killed requests have no event at all and these tests fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import MeteringConfig, Prices, RedisConfig
from gateway.ledger.event import UsageEvent
from gateway.ledger.pricing import cost_micro_usd
from gateway.ledger.record import UsageRecord
from gateway.state.breaker import Breaker
from gateway.state.keys import RedisKeys
from gateway.state.metering import AUDIT_LUA, Meter
from gateway.state.redis import connect
from gateway.state.spool import Spool
from gateway.state.write_ahead import WalRecord, WriteAhead
from tests.fixtures.crash_process import DurableRedis, FreezingProxy, GatewayProcess
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, cleanup, keys_config
from tests.fixtures.upstream import SimProcess, hang_up_when, sim_tiers, start_sim, wait_for

SLOW_CHUNK_MS = 250  # ~48 chunks per answer: ~12 s of streaming, long enough to be killed mid-stream
FAST_CHUNK_MS = 5
HEARTBEAT_TTL_S = 2.0
SETTLE_TIMEOUT_S = 45.0


@pytest.fixture
def slow_sim() -> Iterator[SimProcess]:
    sim = start_sim()
    try:
        yield sim
    finally:
        sim.stop()


def gateway_config(sim: SimProcess, redis_url: str, prefix: str, tmp: Path) -> dict[str, Any]:
    return {
        "engine": {"enabled": False},
        "server": {"log_level": "warning"},
        "redis": {"url": redis_url, "key_prefix": prefix, "start_if_missing": False, "breaker_cooldown_s": 0.5},
        "metering": {"spool_path": str(tmp / "usage-spool.jsonl"), "replay_interval_s": 0.2,
                     "write_ahead_interval_s": 0.2, "heartbeat_ttl_s": HEARTBEAT_TTL_S, "reconcile_interval_s": 0.5},
        "tiers": [{**t, "read_timeout_s": 30.0, "prices": {k: str(v) for k, v in t["prices"].items()}}
                  for t in sim_tiers(sim.base_url)],
        "routing": {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5]},
        # alice has a budget (so admission reserves in Redis, and settlement must release it) that never refuses
        "auth": keys_config(alice={"budget_usd_day": "1000"}),
    }


class Stream:
    """One streamed ``long`` request in a thread: its status, request id, SSE events received, whether it ended and
    the usage it was told (``extra``: more body fields, e.g. ``stream_options``; ``text``: its prompt)."""

    def __init__(self, base_url: str, i: int, chunk_ms: int, extra: dict[str, Any] | None = None,
                 text: str | None = None) -> None:
        self.status: int | None = None
        self.request_id: str | None = None
        self.events = 0
        self.done = False
        self.usage: dict[str, Any] | None = None
        words = " ".join(f"w{i}x{j}" for j in range(20))
        self.body = {"model": "long", "stream": True, "max_tokens": 256,
                     "messages": [{"role": "user", "content": text or f"write-ahead {uuid.uuid4().hex[:6]} {words}"}],
                     "sim": {"chunk_delay_ms": chunk_ms}, **(extra or {})}
        self.url = base_url + "/chat/completions"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=30,
                              headers={"authorization": f"Bearer {SECRETS['alice']}"}) as r:
                self.status, self.request_id = r.status_code, r.headers.get("x-request-id")
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events += 1
                        self.done = self.done or line == "data: [DONE]"
                        if not self.done and '"usage"' in line:
                            self.usage = json.loads(line[6:]).get("usage") or self.usage
        except httpx.HTTPError:
            pass  # the gateway was killed under it


def ledger(redis_url: str, prefix: str) -> list[UsageEvent]:
    client = redis.Redis.from_url(redis_url)
    try:
        return [UsageEvent.from_json(fields[b"e"]) for _, fields in client.xrange(RedisKeys(prefix).events)]
    finally:
        client.close()


def settled_ids(redis_url: str, prefix: str) -> list[str]:
    return [e.event_id for e in ledger(redis_url, prefix) if not e.audit]


def assert_exactly_once(redis_url: str, prefix: str, admitted: list[str], killed: list[str]) -> None:
    """Each admitted id once in the ledger; the killed ones partial with the tokens of their last update; the key's
    counters = the sum of its events; no open write-ahead record or reservation."""
    ok = wait_for(lambda: set(admitted) <= set(settled_ids(redis_url, prefix)), SETTLE_TIMEOUT_S)
    events = [e for e in ledger(redis_url, prefix) if not e.audit]
    ids = [e.event_id for e in events]
    missing = [i for i in admitted if i not in ids]
    assert ok and not missing, f"no settled event for {len(missing)} of {len(admitted)} admitted requests"
    assert sorted(ids) == sorted(admitted), "an event counted twice, or one for a request never admitted"
    by_id = {e.event_id: e for e in events}
    for rid in killed:
        e = by_id[rid]
        assert e.partial and e.error_code == "gateway_lost" and e.tier == "long"
        assert e.completion_tokens > 0, "the write-ahead record was not updated as the stream relayed tokens"
        assert e.cost_micro_usd > 0
    k = RedisKeys(prefix)
    client = redis.Redis.from_url(redis_url)
    try:
        counters = {f.decode(): int(v) for f, v in client.hgetall(k.key_total("alice")).items()}
        assert counters["cost_micro_usd"] == sum(e.cost_micro_usd for e in events)
        assert counters["requests"] == len(events)
        assert counters["completion_tokens"] == sum(e.completion_tokens for e in events)
        assert client.hlen(k.write_ahead) == 0
        assert client.hlen(k.reservations("alice")) == 0
    finally:
        client.close()


def scrape(url: str) -> dict[tuple[str, str], float]:
    """``/metrics`` of the gateway at ``url`` (the admin key), summed by (sample name, its ``outcome`` or ``tier``
    label)."""
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {ADMIN_SECRET}"}, timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, s.labels.get("outcome") or s.labels.get("tier") or "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def _wait_streaming(streams: list[Stream], min_events: int, timeout_s: float = 30.0) -> None:
    assert wait_for(lambda: all(s.events >= min_events or s.done for s in streams), timeout_s), \
        [(s.status, s.events) for s in streams]


class Crash:
    """What every SIGKILL test sets up: a fresh key prefix on ``redis_url`` (:attr:`keys`), a client on it
    (:attr:`client`), the gateway processes it starts through :meth:`gateway` and :meth:`replica`, and whatever
    else it hands to :meth:`defer`. :meth:`close` — at the end of :func:`crash_scene`, however the test ends —
    SIGKILLs the gateways (those the test has not killed itself), stops the replicas, closes the client, runs the
    deferred stops and deletes the prefix's keys: the teardown each test used to write out in its own copy."""

    def __init__(self, redis_url: str, tmp: Path) -> None:
        self.redis_url = redis_url
        self.tmp = tmp
        self.prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
        self.keys = RedisKeys(self.prefix)
        self.client = redis.Redis.from_url(redis_url)  # connects on its first command
        self._killed: list[GatewayProcess] = []
        self._stopped: list[GatewayProcess] = []
        self._deferred: list[Callable[[], None]] = []

    def config(self, sim: SimProcess) -> dict[str, Any]:
        """:func:`gateway_config` over ``sim`` on this scene's Redis, prefix and directory."""
        return gateway_config(sim, self.redis_url, self.prefix, self.tmp)

    def gateway(self, cfg: dict[str, Any], name: str = "gw") -> GatewayProcess:
        """Start the gateway under test (SIGKILLed at the end, should the test not have killed it)."""
        gw = GatewayProcess(cfg, self.tmp, name)
        self._killed.append(gw)
        return gw.start()

    def replica(self, cfg: dict[str, Any], name: str = "replica") -> GatewayProcess:
        """Start a gateway that comes after the kill (stopped, SIGTERM, at the end)."""
        r = GatewayProcess(cfg, self.tmp, name)
        self._stopped.append(r)
        return r.start()

    def defer(self, stop: Callable[[], None]) -> None:
        """Run ``stop`` at the end, after the gateways are down (a simulator, a proxy)."""
        self._deferred.append(stop)

    def ledger(self) -> list[UsageEvent]:
        return ledger(self.redis_url, self.prefix)

    def settled_ids(self) -> list[str]:
        return settled_ids(self.redis_url, self.prefix)

    def close(self, delete_keys: bool = True) -> None:
        for gw in self._killed:
            gw.kill()
        for r in self._stopped:
            r.stop()
        self.client.close()
        for stop in self._deferred:
            stop()
        if delete_keys:
            cleanup(self.redis_url, self.prefix)


@contextlib.contextmanager
def crash_scene(redis_url: str, tmp: Path, *, delete_keys: bool = True) -> Iterator[Crash]:
    """A :class:`Crash` on ``redis_url``, closed on the way out (``delete_keys``: False for a private Redis the test
    kills itself)."""
    scene = Crash(redis_url, tmp)
    try:
        yield scene
    finally:
        scene.close(delete_keys)


@pytest.fixture
def crash(redis_url: str, tmp_path: Path) -> Iterator[Crash]:
    """:func:`crash_scene` on the suite's Redis."""
    with crash_scene(redis_url, tmp_path) as scene:
        yield scene


@pytest.mark.slow
def test_kill_9_gateway_mid_stream_every_admitted_request_settled_once(slow_sim: SimProcess, crash: Crash) -> None:
    cfg = crash.config(slow_sim)
    gw = crash.gateway(cfg)
    streams = [Stream(gw.base_url, i, FAST_CHUNK_MS if i < 2 else SLOW_CHUNK_MS) for i in range(8)]
    assert wait_for(lambda: all(s.done for s in streams[:2]), 30)
    _wait_streaming(streams, 8)  # ≥ 2 s into each slow stream: several write-ahead updates
    assert wait_for(lambda: len(crash.settled_ids()) >= 2, 10)  # the 2 complete ones are metered
    time.sleep(0.5)
    gw.kill()
    admitted = [s.request_id for s in streams if s.status == 200 and s.request_id]
    killed = [s.request_id for s in streams[2:] if s.request_id and not s.done]
    assert len(admitted) == 8 and len(killed) == 6
    # two replicas start at once on the same Redis: both reconcile the dead process's records
    replicas = [crash.replica(cfg, f"replica-{i}") for i in range(2)]
    assert_exactly_once(crash.redis_url, crash.prefix, admitted, killed)
    # the replicas' Prometheus series count what they metered for the dead process as it would have (its cost was in
    # the ledger and in no counter), and say how many records they settled
    cost = sum(e.cost_micro_usd for e in crash.ledger() if e.event_id in killed)
    scraped = [scrape(r.url) for r in replicas]
    assert sum(s.get(("thinkgate_write_ahead_reconciled_records_total", "metered"), 0) for s in scraped) == len(killed)
    assert sum(s.get(("thinkgate_cost_micro_usd_total", "long"), 0) for s in scraped) == cost > 0
    # a request on a restarted gateway is settled normally, once, and leaves no record behind
    after = Stream(replicas[0].base_url, 99, FAST_CHUNK_MS)
    after.thread.join(30)
    assert after.done and after.request_id
    assert_exactly_once(crash.redis_url, crash.prefix, [*admitted, after.request_id], killed)


@pytest.mark.slow
def test_a_stalled_gateway_whose_calls_were_reconciled_counts_them_in_no_metric(slow_sim: SimProcess,
                                                                                crash: Crash) -> None:
    # A gateway stopped (SIGSTOP) past its heartbeat TTL mid-stream is taken for dead: a replica meters its 3 calls as
    # lost and counts them in its Prometheus series. Then it resumes and finishes them: the ledger keeps the
    # replica's events (the script counts a request id once), so the resumed gateway must count them in no series
    # either — it counted each again (requests, tokens, cost: the fleet's sums above the ledger's).
    cfg = crash.config(slow_sim)
    gw = crash.gateway(cfg)
    replica = crash.replica(cfg)
    streams = [Stream(gw.base_url, i, SLOW_CHUNK_MS) for i in range(3)]
    _wait_streaming(streams, 6)
    assert gw.proc is not None
    gw.proc.send_signal(signal.SIGSTOP)
    try:
        ids = [s.request_id for s in streams if s.request_id]
        assert len(ids) == 3
        assert wait_for(lambda: set(ids) <= set(crash.settled_ids()), SETTLE_TIMEOUT_S)
    finally:
        gw.proc.send_signal(signal.SIGCONT)
    assert wait_for(lambda: all(s.done for s in streams), 30), [(s.status, s.events) for s in streams]
    # the resumed gateway's own events reach Redis (as duplicates) within milliseconds of their streams' end
    time.sleep(1.0)
    events = [e for e in crash.ledger() if not e.audit]
    assert sorted(e.event_id for e in events) == sorted(ids)
    assert all(e.error_code == "gateway_lost" for e in events)
    cost = sum(e.cost_micro_usd for e in events)
    ours, theirs = scrape(gw.url), scrape(replica.url)
    assert theirs.get(("thinkgate_write_ahead_reconciled_records_total", "metered"), 0) == 3
    assert theirs.get(("thinkgate_cost_micro_usd_total", "long"), 0) == cost > 0
    assert ours.get(("thinkgate_cost_micro_usd_total", "long"), 0) == 0, ours
    assert ours.get(("thinkgate_requests_total", "long"), 0) == 0, ours
    # a request after the stall is the gateway's own again: metered and counted by it, once
    after = Stream(gw.base_url, 99, FAST_CHUNK_MS)
    after.thread.join(30)
    assert after.done and after.request_id
    assert wait_for(lambda: after.request_id in crash.settled_ids(), 10)
    assert wait_for(lambda: scrape(gw.url).get(("thinkgate_requests_total", "long"), 0) == 1, 10)
    # stalled past its heartbeat again with no replica left to take it for dead: the ledger counts its own events,
    # and so do its metrics (held to the write's answer, not dropped)
    replica.stop()
    more = [Stream(gw.base_url, 10 + i, SLOW_CHUNK_MS) for i in range(2)]
    _wait_streaming(more, 4)
    gw.proc.send_signal(signal.SIGSTOP)
    time.sleep(HEARTBEAT_TTL_S * 1.5)
    gw.proc.send_signal(signal.SIGCONT)
    assert wait_for(lambda: all(s.done for s in more), 30), [(s.status, s.events) for s in more]
    own = [s.request_id for s in more if s.request_id]
    assert wait_for(lambda: set(own) <= set(crash.settled_ids()), 10)
    assert all(e.error_code is None for e in crash.ledger() if e.event_id in own)
    assert wait_for(lambda: scrape(gw.url).get(("thinkgate_requests_total", "long"), 0) == 3, 10), scrape(gw.url)


@pytest.mark.slow
def test_kill_9_redis_then_gateway_mid_stream_nothing_lost(slow_sim: SimProcess, tmp_path: Path) -> None:
    # Redis dies under 8 streams (records written before), 2 more are admitted while it is down (records spooled),
    # the progress of all goes to the spool, then the gateway is killed too; both restart on their data
    store = DurableRedis(tmp_path / "redis").start()
    try:
        with crash_scene(store.url, tmp_path, delete_keys=False) as crash:  # the store goes with the test
            gw = crash.gateway(crash.config(slow_sim))
            streams = [Stream(gw.base_url, i, FAST_CHUNK_MS if i < 2 else SLOW_CHUNK_MS) for i in range(8)]
            assert wait_for(lambda: all(s.done for s in streams[:2]), 30)
            _wait_streaming(streams, 6)
            assert wait_for(lambda: len(crash.settled_ids()) >= 2, 10)
            store.kill()
            during = [Stream(gw.base_url, 10 + i, SLOW_CHUNK_MS) for i in range(2)]
            _wait_streaming(during, 6)
            time.sleep(0.5)
            gw.kill()
            streams += during
            admitted = [s.request_id for s in streams if s.status == 200 and s.request_id]
            killed = [s.request_id for s in streams[2:] if s.request_id and not s.done]
            assert len(admitted) == 10 and len(killed) == 8
            spool = tmp_path / "usage-spool.wal.jsonl"
            spooled = spool.stat().st_size if spool.exists() else 0
            store.start()
            gw.start()
            assert_exactly_once(crash.redis_url, crash.prefix, admitted, killed)
            assert spooled > 0  # the outage's records waited on disk (then were replayed: nothing is left open)
            # the requests admitted during the outage were metered from their spooled records
            by_id = {e.event_id: e for e in crash.ledger()}
            assert all(by_id[s.request_id].completion_tokens > 0 for s in during if s.request_id)
    finally:
        store.kill()


@pytest.mark.slow
def test_kill_9_with_finished_streams_still_queued_meters_them_at_their_own_usage(slow_sim: SimProcess,
                                                                                   crash: Crash) -> None:
    # Streams shorter than a write-ahead interval (no progress write) finish while the metering writer waits on a
    # call to Redis — here its first, an audit event, frozen on its way by a proxy, as a batch held up by a slow
    # Redis — so their usage events wait in the process's queue; then the gateway is killed. Each must be settled
    # as what it was, a 200 with the usage its client was told — not as a 0-token `gateway_lost`.
    proxy = FreezingProxy(crash.redis_url).start()
    crash.defer(proxy.stop)
    cfg = crash.config(slow_sim)
    cfg["metering"]["write_ahead_interval_s"] = 60.0
    # through the proxy, with a socket timeout the frozen call cannot reach before the kill (timed out, its batch
    # and the events after it would go to the usage spool, which the next gateway replays)
    gw = crash.gateway({**cfg, "redis": {**cfg["redis"], "url": proxy.url, "socket_timeout_s": 60.0}})
    proxy.arm(hashlib.sha1(AUDIT_LUA.encode()).hexdigest().encode())
    refused = httpx.post(gw.base_url + "/chat/completions", headers={"authorization": "Bearer sk-nobody"},
                         json={"model": "long", "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert refused.status_code == 401
    assert wait_for(lambda: proxy.frozen == 1, 10)  # the metering writer now waits on it
    streams = [Stream(gw.base_url, i, FAST_CHUNK_MS, {"stream_options": {"include_usage": True}})
               for i in range(6)]
    assert wait_for(lambda: all(s.done for s in streams), 30), [(s.status, s.events) for s in streams]
    time.sleep(1.0)  # what the gateway writes in the background lands in milliseconds
    gw.kill()
    ids = [s.request_id for s in streams if s.request_id]
    assert len(ids) == 6 and all(s.usage for s in streams)
    assert not crash.settled_ids()  # none of their events reached Redis
    crash.replica(cfg)
    assert wait_for(lambda: set(ids) <= set(crash.settled_ids()), SETTLE_TIMEOUT_S)
    events = [e for e in crash.ledger() if not e.audit]
    assert sorted(e.event_id for e in events) == sorted(ids)
    long_prices = Prices(**next(t for t in sim_tiers(slow_sim.base_url) if t["name"] == "long")["prices"])
    by_id = {e.event_id: e for e in events}
    for s in streams:
        e, usage = by_id[s.request_id or ""], s.usage or {}
        assert (e.status, e.error_code, e.partial, e.tier) == (200, None, False, "long"), e
        assert (e.prompt_tokens, e.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert e.completion_tokens > 0
        assert e.cost_micro_usd == cost_micro_usd(long_prices, prompt_tokens=e.prompt_tokens, cached_tokens=0,
                                                  completion_tokens=e.completion_tokens)
    k, client = crash.keys, crash.client
    counters = {f.decode(): int(v) for f, v in client.hgetall(k.key_total("alice")).items()}
    assert counters["requests"] == 6 and counters.get("errors", 0) == 0
    assert counters["cost_micro_usd"] == sum(e.cost_micro_usd for e in events)
    assert counters["completion_tokens"] == sum(e.completion_tokens for e in events)
    assert client.hlen(k.write_ahead) == 0 and client.hlen(k.reservations("alice")) == 0


@pytest.mark.slow
def test_kill_9_before_the_upstream_call_releases_without_counting_a_request(slow_sim: SimProcess,
                                                                             crash: Crash) -> None:
    # Killed while 3 admitted requests wait for an identical request's answer (the cache's single-flight: their
    # write-ahead records written by admission, marked waiting, nothing sent upstream) and 2 calls are upstream (a
    # stream, and a non-streamed call, which has no progress write). The 2 sent are settled as lost — requests,
    # errors; the 3 never sent are no request: reservations released, one audit event each (in the stream and the
    # usage cube's refused count, exactly once), nothing counted.
    cfg = crash.config(slow_sim)
    # every event here is settled seconds after its ts, past this: each must be in the late index, or a read of its
    # period by id range (usage exports with an end, a period's sub-day edges) misses it
    cfg["metering"]["late_after_s"] = 1
    gw = crash.gateway(cfg)
    k, client = crash.keys, crash.client
    same, text = {"temperature": 0}, f"single flight {uuid.uuid4().hex[:8]}"  # cacheable, identical
    # the leader streams ~48 s (1 s a chunk): its followers must still be waiting at the kill, which comes after two
    # waits a loaded box stretched past the ~12 s of SLOW_CHUNK_MS (the leader ended, a follower was answered from the
    # cache, and the test failed at "still waiting"); now bounded by the followers' 30 s wait and the slow call's 25 s
    leader = Stream(gw.base_url, 0, 1000, same, text)
    _wait_streaming([leader], 4)
    followers = [Stream(gw.base_url, 0, 1000, same, text) for _ in range(3)]
    tag = uuid.uuid4().hex
    slow_call = {"model": "long", "max_tokens": 16, "sim": {"delay_ms": 25_000, "tag": tag},
                 "messages": [{"role": "user", "content": f"non-streamed {uuid.uuid4().hex[:8]}"}]}
    threading.Thread(target=lambda: _post_quietly(gw.base_url, slow_call), daemon=True).start()
    assert wait_for(lambda: client.hlen(k.write_ahead) == 5, 15), client.hlen(k.write_ahead)
    # the non-streamed call is upstream (a fixed 1 s assumed it; a loaded box can take longer)
    assert wait_for(lambda: slow_sim.tag(tag) is not None, 30)
    records = [WalRecord.from_json(raw) for raw in client.hvals(k.write_ahead)]
    gw.kill()
    assert leader.request_id and not any(f.status for f in followers)  # still waiting: no answer begun
    sent = [leader.request_id, next(r.request_id for r in records if not r.stream)]
    waiting = sorted({r.request_id for r in records} - set(sent))
    assert len(waiting) == 3
    assert sorted(r.request_id for r in records if r.waiting) == waiting  # only the waits wrote a mark
    crash.replica(cfg)
    assert wait_for(lambda: client.hlen(k.write_ahead) == 0, SETTLE_TIMEOUT_S)
    events = crash.ledger()
    counted = {e.event_id: e for e in events if not e.audit}
    assert sorted(counted) == sorted(sent)
    assert all((e.status, e.error_code, e.partial) == (500, "gateway_lost", True) for e in counted.values())
    assert counted[leader.request_id].completion_tokens > 0
    audited = [e for e in events if e.audit and e.request_id in waiting]
    assert sorted(e.request_id for e in audited) == waiting and len(events) == 5
    # an id of its own: the request id stays free for the request's own event (its owner alive after all)
    assert all(e.event_id == f"{e.request_id}:unsent" for e in audited)
    assert all(e.error_code == "gateway_lost_unsent" and e.cost_micro_usd == 0 for e in audited)
    counters = {f.decode(): int(v) for f, v in client.hgetall(k.key_total("alice")).items()}
    assert (counters["requests"], counters["errors"]) == (2, 2)
    assert counters["cost_micro_usd"] == sum(e.cost_micro_usd for e in counted.values())
    day = counted[leader.request_id].day
    assert int(client.hget(k.level_day("global", "global", day), "requests") or 0) == 2
    for resv in (k.reservations("alice"), k.level_reservations("global", "global"),
                 k.level_reservations("tag", "team=a")):
        assert client.hlen(resv) == 0, resv
    # the usage cube: each event once (the index's count = the seen-set's, so grouped queries trust the cube)
    cube = {f.decode(): int(v) for f, v in client.hgetall(k.agg_cube("alice", day)).items()}
    assert sum(v for f, v in cube.items() if f.startswith("refused ")) == 3
    assert sum(v for f, v in cube.items() if f.startswith("requests ")) == 2
    assert int(client.hget(k.agg_index, f"n:{day}") or 0) == client.scard(k.seen(day)) == 5
    stream_ids = {i.decode() for i, _ in client.xrange(k.events)}
    assert {m.decode() for m in client.zrange(k.late_events, 0, -1)} == stream_ids and len(stream_ids) == 5


@pytest.mark.slow
def test_kill_9_after_a_wait_that_ended_upstream_settles_the_calls_as_lost(slow_sim: SimProcess,
                                                                           crash: Crash) -> None:
    # 3 requests wait on a leader's single-flight lock (marked waiting); the leader's client hangs up, so the lock
    # goes without an answer and each calls the upstream itself. Killed while those calls are upstream: they were
    # sent, so each is a lost request (500 gateway_lost), not a release — the mark was cleared before each call.
    cfg = crash.config(slow_sim)
    gw = crash.gateway(cfg)
    k, client = crash.keys, crash.client
    body = {"model": "long", "max_tokens": 16, "temperature": 0, "sim": {"delay_ms": 12_000},
            "messages": [{"role": "user", "content": f"single flight {uuid.uuid4().hex[:8]}"}]}
    all_waiting = threading.Event()

    def three_wait() -> bool:
        if sum(WalRecord.from_json(raw).waiting for raw in client.hvals(k.write_ahead)) == 3:
            all_waiting.set()
        return all_waiting.is_set()

    # the leader hangs up once the 3 wait on its lock (the marks go as each then calls the upstream itself): at a
    # fixed 2 s client timeout a loaded box had not marked all 3 yet, and the window closed unseen (a CI run)
    leader = threading.Thread(target=hang_up_when, daemon=True, args=(
        gw, "/chat/completions", body, {"authorization": f"Bearer {SECRETS['alice']}"}, three_wait))
    leader.start()
    assert wait_for(lambda: client.hlen(k.write_ahead) == 1, 15)
    for _ in range(3):
        threading.Thread(target=lambda: _post_quietly(gw.base_url, body), daemon=True).start()
    leader.join(40)  # hung up: its call is cancelled, its lock released without an answer
    assert all_waiting.is_set(), "the 3 never waited on the leader's lock together"
    assert wait_for(lambda: any(not e.audit for e in crash.ledger()), 10)  # the leader's, 499
    assert wait_for(lambda: client.hlen(k.write_ahead) == 3
                    and not any(WalRecord.from_json(raw).waiting for raw in client.hvals(k.write_ahead)), 10)
    time.sleep(0.5)  # upstream by now (each waits 6 s for its answer)
    followers = sorted(r.decode() for r in client.hkeys(k.write_ahead))
    gw.kill()
    crash.replica(cfg)
    assert wait_for(lambda: client.hlen(k.write_ahead) == 0, SETTLE_TIMEOUT_S)
    events = {e.event_id: e for e in crash.ledger() if e.request_id in followers}
    assert sorted(events) == followers, sorted(events)
    assert all((e.audit, e.status, e.error_code) == (False, 500, "gateway_lost") for e in events.values())
    for resv in (k.reservations("alice"), k.level_reservations("global", "global")):
        assert client.hlen(resv) == 0, resv


@pytest.mark.slow
def test_kill_9_meters_a_stream_past_its_bound_at_the_bound(slow_sim: SimProcess, crash: Crash) -> None:
    # An upstream that ignores max_tokens (8) streams on: the relayed deltas, written to the write-ahead record as
    # progress, claim more completion tokens than the call was admitted to generate. A finished call is metered
    # at the bound (UsageRecord.set_usage / set_counted); the orphan of a killed process was billed the claim.
    # Beside it, a stream within its bound is metered at its progress, as before.
    cfg = crash.config(slow_sim)
    gw = crash.gateway(cfg)
    k, client = crash.keys, crash.client
    over = Stream(gw.base_url, 0, SLOW_CHUNK_MS, {"max_tokens": 8, "sim": {
        "chunk_delay_ms": SLOW_CHUNK_MS, "ignore_max_tokens": True}})
    within = Stream(gw.base_url, 1, SLOW_CHUNK_MS)
    _wait_streaming([over, within], 16)  # 16 deltas relayed, twice the bound

    def stored(s: Stream) -> WalRecord:
        return WalRecord.from_json(client.hget(k.write_ahead, s.request_id or "") or b"{}")

    assert wait_for(lambda: stored(over).completion_tokens >= 12 and stored(within).completion_tokens > 0, 10)
    gw.kill()
    time.sleep(0.2)  # a write on the wire at the kill has landed
    assert not over.done and not within.done and over.request_id and within.request_id
    claimed, kept = stored(over), stored(within)
    assert claimed.completion_tokens > 8  # the record claims more than the call could generate
    assert 0 < kept.completion_tokens <= 256
    crash.replica(cfg)
    assert wait_for(lambda: client.hlen(k.write_ahead) == 0, SETTLE_TIMEOUT_S)
    by_id = {e.event_id: e for e in crash.ledger() if not e.audit}
    long_prices = Prices(**next(t for t in sim_tiers(slow_sim.base_url) if t["name"] == "long")["prices"])
    e = by_id[over.request_id]
    assert e.completion_tokens == 8 and e.reasoning_tokens <= 8  # billed at the bound, not the claim
    assert e.cost_micro_usd == cost_micro_usd(long_prices, prompt_tokens=e.prompt_tokens, cached_tokens=0,
                                              completion_tokens=8)
    assert (e.status, e.partial, e.error_code, e.tier) == (500, True, "gateway_lost_over_bound", "long")
    assert e.over_bound  # the mark a finished call held to its bound carries too
    assert (claimed.bound_completion, kept.bound_completion) == (8, 256)  # max_tokens × 1 choice, each
    e = by_id[within.request_id]
    assert (e.status, e.partial, e.error_code) == (500, True, "gateway_lost")
    assert e.completion_tokens == kept.completion_tokens and not e.over_bound
    counters = {f.decode(): int(v) for f, v in client.hgetall(k.key_total("alice")).items()}
    assert counters["completion_tokens"] == sum(e.completion_tokens for e in by_id.values())
    assert counters["cost_micro_usd"] == sum(e.cost_micro_usd for e in by_id.values())
    assert client.hlen(k.reservations("alice")) == 0


def _running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A stream chunk with a delta and the upstream's running usage (vLLM's continuous usage stats), for the
    simulator's ``inject``: the write-ahead record takes its counts."""
    return {"id": "chatcmpl-running", "object": "chat.completion.chunk", "created": 0, "model": "sim-model",
            "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


@pytest.mark.slow
def test_kill_9_meters_a_prompt_count_past_its_bound_at_the_bound(slow_sim: SimProcess, crash: Crash) -> None:
    # A stream's write-ahead record takes its prompt count from the upstream's running usage — the only source of a
    # lost call's prompt count. One that claims 50,000 prompt tokens for a prompt of a few dozen bytes (a
    # misreporting upstream) was billed as written after a kill, though admission reserved the prompt at its bound:
    # its UTF-8 bytes + 8 per message + 16 (a byte-level token covers at least one byte). It is metered at that
    # bound, marked like a completion count past its bound; beside it, an honest running count is kept as written.
    cfg = crash.config(slow_sim)
    gw = crash.gateway(cfg)
    k, client = crash.keys, crash.client
    texts = [f"prompt bound {uuid.uuid4().hex[:8]}" for _ in range(2)]
    over = Stream(gw.base_url, 0, SLOW_CHUNK_MS, {"sim": {"chunk_delay_ms": SLOW_CHUNK_MS,
                                                          "inject": _running_usage(50_000, 3)}}, texts[0])
    within = Stream(gw.base_url, 1, SLOW_CHUNK_MS, {"sim": {"chunk_delay_ms": SLOW_CHUNK_MS,
                                                            "inject": _running_usage(20, 2)}}, texts[1])

    def stored(s: Stream) -> WalRecord:
        return WalRecord.from_json(client.hget(k.write_ahead, s.request_id or "") or b"{}")

    assert wait_for(lambda: over.request_id is not None and within.request_id is not None
                    and stored(over).prompt_tokens == 50_000 and stored(within).prompt_tokens == 20, 15)
    gw.kill()
    time.sleep(0.2)  # a write on the wire at the kill has landed
    assert not over.done and not within.done and over.request_id and within.request_id
    claimed, kept = stored(over), stored(within)
    # what admission knew of each prompt: "user" + the text, in bytes, + 8 for the message + 16 for the request
    bounds = [len(b"user") + len(t.encode()) + 8 + 16 for t in texts]
    assert (claimed.bound_prompt, kept.bound_prompt) == tuple(bounds)
    assert claimed.prompt_tokens > bounds[0] and kept.prompt_tokens == 20 < bounds[1]
    crash.replica(cfg)
    assert wait_for(lambda: client.hlen(k.write_ahead) == 0, SETTLE_TIMEOUT_S)
    by_id = {e.event_id: e for e in crash.ledger() if not e.audit}
    long_prices = Prices(**next(t for t in sim_tiers(slow_sim.base_url) if t["name"] == "long")["prices"])
    e = by_id[over.request_id]
    assert (e.prompt_tokens, e.completion_tokens) == (bounds[0], 3)  # billed at the bound, not the claim
    assert e.cost_micro_usd == cost_micro_usd(long_prices, prompt_tokens=bounds[0], cached_tokens=0,
                                              completion_tokens=3)
    assert (e.status, e.partial, e.error_code, e.over_bound) == (500, True, "gateway_lost_over_bound", True)
    e = by_id[within.request_id]
    assert (e.prompt_tokens, e.completion_tokens) == (20, 2)
    assert (e.status, e.partial, e.error_code, e.over_bound) == (500, True, "gateway_lost", False)
    counters = {f.decode(): int(v) for f, v in client.hgetall(k.key_total("alice")).items()}
    assert counters["prompt_tokens"] == sum(e.prompt_tokens for e in by_id.values())
    assert counters["cost_micro_usd"] == sum(e.cost_micro_usd for e in by_id.values())
    assert client.hlen(k.reservations("alice")) == 0


@pytest.mark.slow
def test_kill_9_during_a_fallback_meters_the_call_on_the_fallback_tier(crash: Crash) -> None:
    # The routed tier's upstream refuses (503), the non-streamed call falls back to a dearer tier whose upstream is
    # slow, and the gateway is killed while that call runs. Its write-ahead record named the routed tier (a
    # non-streamed call has no progress write to correct it), so the reconciler settled it on the tier that
    # refused, at that tier's prices. The record names the fallback before the fallback call is sent.
    failing = start_sim("--fail-mode", "503", "--model", "cheap-model")
    crash.defer(failing.stop)
    slow = start_sim("--delay-ms", "25000", "--model", "dear-model")
    crash.defer(slow.stop)
    common = {"read_timeout_s": 30.0, "connect_timeout_s": 2.0, "max_retries": 0}
    dear_prices = {"input_usd_per_mtok": "3.00", "cached_input_usd_per_mtok": "1.50", "output_usd_per_mtok": "12.00"}
    cfg = {**crash.config(slow),
           "tiers": [{**common, "name": "cheap", "base_url": failing.base_url, "model": "cheap-model",
                      "prices": {"input_usd_per_mtok": "0.10", "cached_input_usd_per_mtok": "0.05",
                                 "output_usd_per_mtok": "0.40"}},
                     {**common, "name": "dear", "base_url": slow.base_url, "model": "dear-model",
                      "prices": dear_prices}],
           "routing": {"router_path": None, "routed_tiers": ["cheap", "dear"], "thresholds": [0.5],
                       "default_tier": "dear", "fallback": True}}
    gw = crash.gateway(cfg)
    k, client = crash.keys, crash.client
    t = uuid.uuid4().hex
    body = {"model": "cheap", "max_tokens": 16, "sim": {"tag": t},
            "messages": [{"role": "user", "content": f"fallback {uuid.uuid4().hex[:8]}"}]}
    threading.Thread(target=lambda: _post_quietly(gw.base_url, body), daemon=True).start()
    rec = slow.wait_tag_status(t, {"running"}, timeout_s=15)
    assert rec is not None and rec["status"] == "running", rec  # the fallback call is in flight
    failed = failing.tag(t)
    assert failed is not None and failed["status"] == "failed"  # the routed tier refused it
    time.sleep(0.3)
    gw.kill()
    (raw,) = client.hvals(k.write_ahead)
    in_flight = WalRecord.from_json(raw)
    crash.replica(cfg)
    assert wait_for(lambda: client.hlen(k.write_ahead) == 0, SETTLE_TIMEOUT_S)
    (e,) = [e for e in crash.ledger() if not e.audit]
    assert (e.event_id, e.status, e.partial, e.error_code) == (in_flight.request_id, 500, True, "gateway_lost")
    assert (e.tier, e.upstream_model, e.route_reason) == ("dear", "dear-model", "fallback")
    # named in the record before the kill: the fallback call was not the routed tier's
    assert (in_flight.tier, in_flight.upstream_model, in_flight.route_reason) == ("dear", "dear-model",
                                                                                 "fallback")
    dear = Prices(**{f: Decimal(v) for f, v in dear_prices.items()})
    assert e.cost_micro_usd == cost_micro_usd(dear, prompt_tokens=e.prompt_tokens, cached_tokens=e.cached_tokens,
                                              completion_tokens=e.completion_tokens)
    for resv in (k.reservations("alice"), k.level_reservations("global", "global")):
        assert client.hlen(resv) == 0, resv


def _post_quietly(base_url: str, body: dict[str, Any], timeout_s: float = 60.0) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the gateway is killed under it (or the client gives up first)
        httpx.post(base_url + "/chat/completions", json=body, timeout=timeout_s,
                   headers={"authorization": f"Bearer {SECRETS['alice']}"})


def test_reconcile_claim_counts_an_orphan_once_and_never_a_settled_request(redis_url: str, redis_prefix: str,
                                                                          tmp_path: Path) -> None:
    # The atomic claim of Meter.settle_orphan, driven directly: a record whose owner is alive is not claimed; one
    # whose owner is dead is counted by exactly one of 16 concurrent claims; a settled request is never reclaimed.
    prices = Prices(input_usd_per_mtok=Decimal("0.5"), cached_input_usd_per_mtok=Decimal("0.25"),
                    output_usd_per_mtok=Decimal("2"))

    async def go() -> None:
        handle = connect(RedisConfig(url=redis_url, key_prefix=redis_prefix, socket_timeout_s=2.0))
        cfg = MeteringConfig(spool_path=tmp_path / "spool.jsonl")
        meter = Meter(handle, Breaker(1.0), Spool(cfg.spool_path), cfg)
        k = RedisKeys(redis_prefix)
        try:
            rec = WalRecord(request_id=uuid.uuid4().hex, key_id="alice", owner="dead:1:x", ts=time.time(),
                            updated_ms=0, tags={"team": "a"}, tier="long", completion_tokens=40)
            await handle.client.hset(k.write_ahead, rec.request_id, rec.to_json())
            await handle.client.set(k.heartbeat(rec.owner), b"1")
            alive = await meter.settle_orphan(rec.event(prices), k.heartbeat(rec.owner))
            assert not alive.counted
            await handle.client.delete(k.heartbeat(rec.owner))
            results = await asyncio.gather(*(meter.settle_orphan(rec.event(prices), k.heartbeat(rec.owner))
                                             for _ in range(16)))
            assert sum(r.counted for r in results) == 1
            assert not await handle.client.hexists(k.write_ahead, rec.request_id)
            # settled normally first (its usage event deletes the record): a stale copy is never counted again
            done = WalRecord(request_id=uuid.uuid4().hex, key_id="alice", owner="dead:1:x", ts=time.time(),
                             updated_ms=0, tags={}, tier="long", completion_tokens=5)
            await handle.client.hset(k.write_ahead, done.request_id, done.to_json())
            final = done.event(prices)
            final.partial, final.status, final.error_code = False, 200, None
            assert (await meter.record(final)).counted
            assert not await handle.client.hexists(k.write_ahead, done.request_id)
            await handle.client.hset(k.write_ahead, done.request_id, done.to_json())  # a late stale write
            assert not (await meter.settle_orphan(done.event(prices), k.heartbeat(done.owner))).counted
            events = [e async for e in meter.events()]
            assert sorted(e.event_id for e in events) == sorted([rec.request_id, done.request_id])
        finally:
            await handle.close()

    asyncio.run(go())


def test_a_lost_calls_prompt_is_held_to_its_admitted_bound() -> None:
    # WalRecord.event alone (the SIGKILL test above drives it through a real gateway): the prompt and its cached
    # part held to bound_prompt; a record without one (written before that field, or a request with media parts,
    # whose tokens are not its bytes) is taken as written — not held to bound_tokens, no bound for such a request.
    prices = Prices(input_usd_per_mtok=Decimal("0.5"), cached_input_usd_per_mtok=Decimal("0.25"),
                    output_usd_per_mtok=Decimal("2"))
    rec = WalRecord(request_id="r", key_id="alice", owner="dead:1:x", ts=time.time(), updated_ms=0, tags={},
                    tier="long", bound_tokens=300, bound_completion=256, bound_prompt=40, prompt_tokens=100,
                    cached_tokens=60, completion_tokens=5)
    e = rec.event(prices)
    assert (e.prompt_tokens, e.cached_tokens, e.completion_tokens) == (40, 40, 5)
    assert (e.error_code, e.over_bound) == ("gateway_lost_over_bound", True)
    assert e.cost_micro_usd == cost_micro_usd(prices, prompt_tokens=40, cached_tokens=40, completion_tokens=5)
    older = WalRecord.from_json(orjson.dumps({k: v for k, v in orjson.loads(rec.to_json()).items()
                                              if k != "bound_prompt"}))
    assert older.bound_prompt is None and older.event(prices).prompt_tokens == 100
    assert replace(older, prompt_tokens=1200).event(prices).prompt_tokens == 1200  # an image's tokens, as claimed
    unbounded = replace(rec, bound_tokens=0, bound_completion=None, bound_prompt=None, prompt_tokens=10**6)
    assert (unbounded.event(prices).prompt_tokens, unbounded.event(prices).error_code) == (10**6, "gateway_lost")


def test_a_dead_owners_records_are_reached_behind_more_live_calls_than_a_batch(redis_url: str, redis_prefix: str,
                                                                               tmp_path: Path) -> None:
    # A busy fleet: 3,000 open calls of live replicas (heartbeats present), 6 of a process that died, a reconcile
    # batch of 100. Every dead record is metered within two passes (the suspicion, then the claim). The pass used to
    # stop after 100 records *scanned* from the start of the hash each time: the live records filled every pass and
    # the dead ones further on were never reached.
    now = [1000.0]

    async def go() -> None:
        handle = connect(RedisConfig(url=redis_url, key_prefix=redis_prefix, socket_timeout_s=5.0))
        cfg = MeteringConfig(spool_path=tmp_path / "spool.jsonl", reconcile_batch=100, heartbeat_ttl_s=1.0)
        breaker = Breaker(1.0)
        meter = Meter(handle, breaker, Spool(cfg.spool_path), cfg)
        wal = WriteAhead(handle, breaker, meter, cfg, {}, owner="me", clock=lambda: now[0])
        k = RedisKeys(redis_prefix)
        try:
            live = [f"live:{i}:x" for i in range(3)]
            for owner in live:
                await handle.client.set(k.heartbeat(owner), b"1", px=600_000)
            pipe = handle.client.pipeline(transaction=False)
            for i in range(3000):
                rec = WalRecord(request_id=uuid.uuid4().hex, key_id="alice", owner=live[i % 3], ts=time.time(),
                                updated_ms=0, tags={}, tier="long", completion_tokens=3)
                pipe.hset(k.write_ahead, rec.request_id, rec.to_json())
            dead = [WalRecord(request_id=uuid.uuid4().hex, key_id="bob", owner="dead:1:x", ts=time.time(),
                              updated_ms=0, tags={}, tier="long", completion_tokens=7) for _ in range(6)]
            for rec in dead:
                pipe.hset(k.write_ahead, rec.request_id, rec.to_json())
            await pipe.execute()
            assert await wal.reconcile() == 0  # first seen dead: suspected for a heartbeat TTL
            now[0] += 2.0
            assert await wal.reconcile() == len(dead)
            left = await handle.client.hmget(k.write_ahead, [r.request_id for r in dead])
            assert left == [None] * len(dead)
            assert await handle.client.hlen(k.write_ahead) == 3000  # the live ones untouched
        finally:
            await handle.close()

    asyncio.run(go())


def test_progress_writes_are_rate_bounded_and_stop_at_settlement(redis_url: str, redis_prefix: str,
                                                                  tmp_path: Path) -> None:
    # One stream relaying 1000 batches inside one write-ahead interval writes its record once; the next write is
    # due only when the interval has passed; none after its usage event settled it.
    now = [1000.0]

    async def go() -> None:
        handle = connect(RedisConfig(url=redis_url, key_prefix=redis_prefix, socket_timeout_s=2.0))
        cfg = MeteringConfig(spool_path=tmp_path / "spool.jsonl", write_ahead_interval_s=1.0)
        breaker = Breaker(1.0)
        meter = Meter(handle, breaker, Spool(cfg.spool_path), cfg)
        wal = WriteAhead(handle, breaker, meter, cfg, {}, owner="me", clock=lambda: now[0])
        k = RedisKeys(redis_prefix)

        async def stored() -> WalRecord:
            await asyncio.gather(*list(wal._tasks))
            return WalRecord.from_json(await handle.client.hget(k.write_ahead, rec.request_id))

        try:
            rec = UsageRecord(key_id="alice", tier="long", stream=True)
            await wal.begin(rec, 1234, 600)
            first = await stored()
            assert (first.bound_micro_usd, first.bound_tokens, first.completion_tokens) == (1234, 600, 0)
            writes = 0
            for i in range(1, 1001):
                now[0] += 0.0009  # 1000 batches in 0.9 s: inside one interval
                before = len(wal._tasks)
                wal.progress(rec.request_id, i, i // 2)
                writes += len(wal._tasks) > before
            assert writes == 0 and (await stored()).completion_tokens == 0
            now[0] += 0.2
            wal.progress(rec.request_id, 1001, 500)
            wal.progress(rec.request_id, 1002, 500)  # a write in flight: skipped, not queued
            assert (await stored()).completion_tokens == 1001
            wal.progress(rec.request_id, 1003, 500)  # due only after another interval
            assert (await stored()).completion_tokens == 1001
            final = (await stored()).event(None)
            final.partial, final.status, final.error_code = False, 200, None
            assert (await meter.record(final)).counted
            now[0] += 5
            wal.progress(rec.request_id, 2000, 900)  # this process still tracks it: the write finds it settled
            await asyncio.gather(*list(wal._tasks))
            assert not await handle.client.hexists(k.write_ahead, rec.request_id)
        finally:
            await handle.close()

    asyncio.run(go())


def test_progress_takes_no_running_usage_the_gateway_would_not_meter(redis_url: str, redis_prefix: str,
                                                                     tmp_path: Path) -> None:
    # A stream's running usage goes into its write-ahead record, and a dead process's record is billed at it. Usage
    # the gateway refuses to meter anywhere else (5cf5346: a count above the call's bound — 1e12 completion tokens
    # booked $2,000,000 — or no count at all) was written as it came: billed in full after a kill, or, not a dict,
    # raised out of the relay's progress hook mid-stream. It is the relayed count instead.
    now = [1000.0]
    prices = Prices(input_usd_per_mtok=Decimal("0.5"), cached_input_usd_per_mtok=Decimal("0.25"),
                    output_usd_per_mtok=Decimal("2"))

    async def go() -> None:
        handle = connect(RedisConfig(url=redis_url, key_prefix=redis_prefix, socket_timeout_s=2.0))
        cfg = MeteringConfig(spool_path=tmp_path / "spool.jsonl", write_ahead_interval_s=1.0)
        breaker = Breaker(1.0)
        meter = Meter(handle, breaker, Spool(cfg.spool_path), cfg)
        wal = WriteAhead(handle, breaker, meter, cfg, {"long": prices}, owner="me", clock=lambda: now[0])
        k = RedisKeys(redis_prefix)

        async def stored(rid: str) -> WalRecord:
            await asyncio.gather(*list(wal._tasks))
            return WalRecord.from_json(await handle.client.hget(k.write_ahead, rid))

        try:
            huge = UsageRecord(key_id="alice", tier="long", stream=True)
            await wal.begin(huge, 1234, 600)
            now[0] += 2
            wal.progress(huge.request_id, 30, 0, {"prompt_tokens": 12, "completion_tokens": 10**12})
            rec = await stored(huge.request_id)
            assert rec.completion_tokens == 30 and rec.event(prices).cost_micro_usd < 1000
            odd = UsageRecord(key_id="alice", tier="long", stream=True)
            await wal.begin(odd, 1234, 600)
            now[0] += 2
            for running in (["not", "usage"], {"prompt_tokens": "many", "completion_tokens": 3}):
                now[0] += 2
                wal.progress(odd.request_id, 40, 0, running)  # type: ignore[arg-type]
                assert (await stored(odd.request_id)).completion_tokens == 40
            # usage it meters is still taken as it comes (prompt and cached included)
            now[0] += 2
            wal.progress(odd.request_id, 41, 0, {"prompt_tokens": 12, "completion_tokens": 50,
                                                 "prompt_tokens_details": {"cached_tokens": 4}})
            rec = await stored(odd.request_id)
            assert (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens, rec.usage_source) == \
                (12, 4, 50, "upstream")
        finally:
            await handle.close()

    asyncio.run(go())
