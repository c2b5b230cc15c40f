"""``kill -9`` of a real gateway between the two parts of an event's metering on a Redis Cluster under
``redis.cluster_placement: tenant`` (``gateway/state/metering.py``, ``RECORD_SHARED_LUA``).

There an event is counted in three calls: the shared part (stream, tier and level counters, and the key part's call
stored in ``usage:pending``), the key part in the API key's own slot (its counters, cube, reservation, TPM window),
then the finish (the write-ahead record and the pending entry deleted). A process that dies after the first call
leaves the stream counting the event and the key's counters not; a restarted gateway must complete the key part
from what the dead one stored — once, with the amounts the stream holds — and leave no reservation, write-ahead
record or pending entry behind.

How the gap is made real: the key's master is paused for writes (``CLIENT PAUSE … WRITE``) while the requests are
at the upstream, so the gateway's metering writer counts the shared part on the shared slot's master and then hangs
on the key part; the gateway is killed there, the pause lifted, and the key part checked not to have run (a killed
client's queued command is dropped with it). A new gateway on the same state then completes it (the orphan
reconciler, through the dead process's write-ahead record; or the sweep of ``usage:pending``)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.config import RedisConfig
from gateway.ledger.event import UsageEvent
from gateway.state.keys import RedisKeys
from gateway.state.redis import connect
from tests.fixtures.crash_process import GatewayProcess
from tests.fixtures.gateway import SECRETS, keys_config
from tests.fixtures.redis_cluster import ClusterSet
from tests.fixtures.upstream import SimProcess, sim_tiers, start_sim, wait_for

UPSTREAM_DELAY_MS = 2500  # the requests wait at the upstream while the key's master is paused
PAUSE_MS = 60_000  # longer than the test needs: lifted by CLIENT UNPAUSE once the gateway is dead
REQUESTS = 1  # one: a second answer could land in a later metering batch, queued behind the hung one


@pytest.fixture
def slow_sim() -> Iterator[SimProcess]:
    sim = start_sim("--delay-ms", str(UPSTREAM_DELAY_MS))
    try:
        yield sim
    finally:
        sim.stop()


def _names(url: str, prefix: str) -> RedisKeys:
    """The key names a ``tenant`` gateway on this cluster and prefix uses (the prefix gets its hash tag there)."""
    async def of() -> RedisKeys:
        handle = connect(RedisConfig(url=url, key_prefix=prefix, cluster_placement="tenant"))
        try:
            return RedisKeys.of(handle)
        finally:
            await handle.close()
    return asyncio.run(of())


def _config(sim: SimProcess, url: str, prefix: str, tmp: Path) -> dict[str, Any]:
    return {
        "engine": {"enabled": False},
        "server": {"log_level": "warning"},
        "redis": {"url": url, "key_prefix": prefix, "start_if_missing": False, "breaker_cooldown_s": 0.5,
                  "cluster_placement": "tenant"},
        "metering": {"spool_path": str(tmp / "usage-spool.jsonl"), "replay_interval_s": 0.2,
                     "write_ahead_interval_s": 0.2, "heartbeat_ttl_s": 2.0, "reconcile_interval_s": 0.5},
        "cache": {"mode": "off"},  # nothing but admission and metering writes to the key's slot
        "tiers": [{**t, "read_timeout_s": 30.0, "prices": {k: str(v) for k, v in t["prices"].items()}}
                  for t in sim_tiers(sim.base_url)],
        "routing": {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5]},
        # a budget: admission reserves at the key (its slot) and the levels above (the shared slot)
        "auth": keys_config(alice={"budget_usd_day": "1000"}, bob={"budget_usd_day": "1000"}),
    }


def _post(base_url: str, secret: str, i: int, out: dict[int, str]) -> None:
    try:
        r = httpx.post(f"{base_url}/chat/completions", timeout=60.0,
                       headers={"authorization": f"Bearer {secret}"},
                       json={"model": "long", "messages": [{"role": "user", "content": f"question {i}"}]})
        if r.status_code == 200:
            out[i] = r.headers["x-request-id"]
    except httpx.HTTPError:
        pass  # the gateway was killed under it


def _events(shared_master: redis.Redis, names: RedisKeys) -> list[UsageEvent]:
    rows: Any = shared_master.xrange(names.events)
    return [UsageEvent.from_json(f[b"e"]) for _, f in rows]


def _ints(client: redis.Redis, name: str) -> dict[str, int]:
    """A counter hash as ``{field: int}``."""
    h: Any = client.hgetall(name)
    return {(f.decode() if isinstance(f, bytes) else f): int(v) for f, v in h.items()}


@pytest.mark.slow
def test_kill_9_between_the_shared_and_the_key_part_the_restart_completes_the_key_part_once(
        redis_cluster: ClusterSet, slow_sim: SimProcess, tmp_path: Path) -> None:
    key_id = "alice"
    for _ in range(20):  # a prefix whose shared slot is on another master than the key's (the pause must not stop
        prefix = f"tgkb{uuid.uuid4().hex[:6]}:"  # the shared part)
        names = _names(redis_cluster.url, prefix)
        shared_port = redis_cluster.master_of(names.events)
        key_port = redis_cluster.master_of(names.key_total(key_id))
        if key_port != shared_port:
            break
    assert key_port != shared_port, "no prefix put the shared slot and the key's slot on different masters"
    shared_master = redis.Redis(host="127.0.0.1", port=shared_port)
    key_master = redis.Redis(host="127.0.0.1", port=key_port)
    cfg = _config(slow_sim, redis_cluster.url, prefix, tmp_path)
    gw = GatewayProcess(cfg, tmp_path, "killed")
    after = GatewayProcess(cfg, tmp_path, "after")
    paused = False
    try:
        gw.start()
        ids: dict[int, str] = {}
        posts = [threading.Thread(target=_post, args=(gw.base_url, SECRETS[key_id], i, ids)) for i in range(REQUESTS)]
        for t in posts:
            t.start()
        # every request admitted (its reservation in the key's slot) and waiting at the upstream: pause the key's
        # master for writes — the metering writer's key parts will hang there
        assert wait_for(lambda: key_master.hlen(names.reservations(key_id)) == REQUESTS, 10.0)
        key_master.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        paused = True
        for t in posts:
            t.join(timeout=30.0)
        assert len(ids) == REQUESTS, "the paused key slot must not hold up the answers (metering is off their path)"
        # the shared parts counted, the key parts stored as pending and not run
        assert wait_for(lambda: {e.event_id for e in _events(shared_master, names)} >= set(ids.values())
                        and shared_master.hlen(names.pending) == REQUESTS, 15.0)
        gw.kill()
        key_master.execute_command("CLIENT", "UNPAUSE")
        paused = False
        time.sleep(0.5)  # a key part queued on the killed connection would run now, if it were not dropped
        assert key_master.hgetall(names.key_total(key_id)) == {}, "the key part ran: no gap was made"
        assert shared_master.hlen(names.write_ahead) == REQUESTS
        # a new gateway on the same state completes the key parts the dead one left
        after.start()
        assert wait_for(lambda: shared_master.hlen(names.pending) == 0
                        and shared_master.hlen(names.write_ahead) == 0, 45.0), \
            (shared_master.hlen(names.pending), shared_master.hlen(names.write_ahead))
        events = [e for e in _events(shared_master, names) if not e.audit]
        assert sorted(e.event_id for e in events) == sorted(ids.values()), "an event counted twice, or lost"
        assert all(not e.partial for e in events), "the answered requests are billed as the answers were"
        counters = _ints(key_master, names.key_total(key_id))
        assert counters.get("requests", 0) == REQUESTS, "the key part was never completed"
        assert counters["cost_micro_usd"] == sum(e.cost_micro_usd for e in events)
        assert counters["prompt_tokens"] == sum(e.prompt_tokens for e in events)
        assert counters["completion_tokens"] == sum(e.completion_tokens for e in events)
        day = _ints(key_master, names.key_day(key_id, events[0].day))
        assert day["cost_micro_usd"] == counters["cost_micro_usd"]
        assert key_master.hlen(names.reservations(key_id)) == 0
        assert shared_master.hlen(names.level_reservations("global", "global")) == 0
    finally:
        if paused:
            key_master.execute_command("CLIENT", "UNPAUSE")
        gw.kill()
        after.stop()
        shared_master.close()
        key_master.close()
