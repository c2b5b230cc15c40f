"""``redis.cluster_placement: tenant`` on a real 3-master Redis Cluster: each API key's own metering and admission
keys (counters, cubes, reservations, RPM/TPM windows) live in the key's tenant slot, and the metering scripts run
per slot — the shared part, the key part, the finish (``gateway/state/metering.py``, ``RECORD_SHARED_LUA``).

What must hold, each checked here against the real cluster: an event is counted once everywhere (stream, key,
tier, levels, cube) and its reservations released at every level; a writer that stops between the parts (the key
part refused, or the process gone) leaves a pending key part that a replay, the orphan reconciler or the sweep
completes — once, with the amounts the stream holds, whoever completes it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path
from typing import TypeVar

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot
from redis.exceptions import ResponseError

from gateway.ledger.aggregate import DAY_S, day_start
from gateway.ledger.event import UsageEvent
from gateway.state.breaker import RedisDown
from gateway.state.keys import RedisKeys, key_tenant
from gateway.state.redis import cluster_prefix
from tests.fixtures.budget_race import CALLS, budget_race
from tests.fixtures.gateway_process import REPO, serve_config
from tests.fixtures.redis_cluster import ClusterSet, cluster_set
from tests.fixtures.redis_stack import Stack, stack
from tests.fixtures.upstream import SimProcess
from tests.fixtures.usage_events import usage_event

T = TypeVar("T")
RESERVED_TOKENS = 5000
TPM_BEFORE = 7000


def _slot(key: str) -> int:
    return int(key_slot(key.encode()))


def _event(key: str, i: int, *, tags: dict[str, str] | None = None, audit: bool = False,
           event_id: str | None = None) -> UsageEvent:
    return usage_event(key, i, tags=tags, audit=audit, event_id=event_id)


async def _open_request(st: Stack, ev: UsageEvent, request_id: str | None = None) -> None:
    """Reservations at the key, its tags and the global level, the key's TPM window and the write-ahead record."""
    r, k, rid = st.handle.client, st.meter.keys, request_id or ev.event_id
    exp = int(time.time() * 1000) + 600_000
    hashes = [k.reservations(ev.key_id), k.level_reservations("global", "global"),
              *(k.level_reservations("tag", f"{n}={v}") for n, v in ev.tags.items())]
    for i, h in enumerate(hashes):
        await r.hset(h, rid, f"9000|{RESERVED_TOKENS if i == 0 else 0}|{exp}")
        await r.pexpire(h, 600_000)
    await r.set(k.tpm(ev.key_id, ev.minute), TPM_BEFORE, px=120_000)
    await r.hset(k.write_ahead, rid, "record")


async def _stream(st: Stack) -> list[dict[str, object]]:
    return [json.loads(f[b"e"]) for _, f in await st.handle.client.xrange(st.meter.keys.events)]


def test_placement_in_the_tenant_slot_only_when_asked_on_a_cluster() -> None:
    day, month = "2026-12-01", "2026-12"
    split = RedisKeys(cluster_prefix("tg:"), "tenant")
    assert split.per_key_slots
    own = [split.key_total("alice"), split.key_day("alice", day), split.key_month("alice", month),
           split.agg_cube("alice", day), split.reservations("alice"), split.rpm("alice", 3), split.tpm("alice", 3),
           split.key_seen("alice", day), split.level_day("key", "alice", day),
           split.level_reservations("key", "alice")]
    assert {_slot(x) for x in own} == {_slot(split.tenant(key_tenant("alice")))}
    assert _slot(split.key_total("bob")) != _slot(split.key_total("alice"))
    shared = [split.events, split.seen(day), split.pending, split.tier_total("short"), split.usage_keys,
              split.level_day("tag", "team=a", day), split.level_reservations("global", "global"), split.agg_index,
              split.agg_day_keys(day), split.write_ahead]
    assert {_slot(x) for x in shared} == {_slot("{tg:}")}
    # the default placement, and one server or Sentinel whatever the setting: every name as it always was
    for k in (RedisKeys(cluster_prefix("tg:")), RedisKeys("tg:", "tenant"), RedisKeys("{app}:tg:", "tenant")):
        assert not k.per_key_slots
        assert k.key_total("alice") == f"{k.prefix}usage:key:alice"
        assert k.reservations("alice") == f"{k.prefix}lim:alice:resv"


async def test_an_event_is_counted_once_in_both_slots(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    prefix = f"tgkl{uuid.uuid4().hex[:6]}:"
    async with stack(redis_cluster.url, prefix, tmp_path / "spool.jsonl", placement="tenant") as st:
        k, r = st.meter.keys, st.handle.client
        assert st.meter.split and k.per_key_slots
        ev = _event("alice", 1, tags={"team": "a"})
        await _open_request(st, ev)
        res = await st.meter.record(ev)
        assert res.stored == "redis" and res.counted
        assert res.day_cost_micro_usd == ev.cost_micro_usd == res.month_cost_micro_usd
        assert res.levels == {"global": (ev.cost_micro_usd,) * 2, "tag:team=a": (ev.cost_micro_usd,) * 2}
        assert (await st.meter.key_counters("alice"))["requests"] == 1
        assert (await st.meter.key_counters("alice", day=ev.day))["cost_micro_usd"] == ev.cost_micro_usd
        assert (await st.meter.tier_counters("short"))["requests"] == 1
        assert [e["event_id"] for e in await _stream(st)] == [ev.event_id]
        # every reservation released, the TPM window corrected by the real tokens, the record and pending gone
        for h in (k.reservations("alice"), k.level_reservations("global", "global"),
                  k.level_reservations("tag", "team=a")):
            assert await r.hgetall(h) == {}
        assert int(await r.get(k.tpm("alice", ev.minute))) == TPM_BEFORE - RESERVED_TOKENS + ev.upstream_tokens
        assert await r.hgetall(k.write_ahead) == {} and await r.hgetall(k.pending) == {}
        # the key's keys sit on the tenant slot's master, the stream on the shared slot's
        assert redis_cluster.master_of(k.key_total("alice")) == redis_cluster.master_of(
            k.tenant(key_tenant("alice")))
        # a replay counts nothing again, anywhere
        again = await st.meter.record(ev)
        assert again.stored == "redis" and not again.counted
        assert (await st.meter.key_counters("alice"))["requests"] == 1
        assert len(await _stream(st)) == 1
        # grouped usage reads the key's cube from its slot
        start = day_start(ev.day)
        usage = await st.meter.grouped(["key"], start, start + DAY_S)
        assert usage.cube_days == [ev.day]
        assert [(row["key"], row["requests"]) for row in usage.rows] == [("alice", 1)]
        # an audit event: the stream and the key's cube, no counter
        audit = _event("alice", 2, audit=True)
        assert (await st.meter.record(audit)).counted
        assert (await st.meter.key_counters("alice"))["requests"] == 1
        cube = await r.hgetall(k.agg_cube("alice", audit.day))
        assert sum(int(v) for f, v in cube.items() if f.startswith(b"refused ")) == 1


async def test_a_key_part_refused_is_completed_once_when_retried(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    """The key part refused (its counter hash poisoned): the shared part stays counted and the key part pending; the
    event is dead-lettered; once the key is fixed the retry completes the pending part — counted once."""
    prefix = f"tgkr{uuid.uuid4().hex[:6]}:"
    async with stack(redis_cluster.url, prefix, tmp_path / "spool.jsonl", placement="tenant") as st:
        k, r = st.meter.keys, st.handle.client
        ev = _event("carol", 1, tags={"team": "b"})
        await _open_request(st, ev)
        await r.set(k.key_total("carol"), "not a hash")
        assert (await st.meter.record(ev)).stored == "dead_letter"
        assert [e["event_id"] for e in await _stream(st)] == [ev.event_id]  # the shared part is counted
        assert await r.hexists(k.pending, ev.event_id) and await r.hexists(k.write_ahead, ev.event_id)
        assert await r.hgetall(k.key_day("carol", ev.day)) == {}  # the key part wrote nothing (all or nothing)
        assert await r.hexists(k.reservations("carol"), ev.event_id)
        await r.delete(k.key_total("carol"))
        assert await st.meter.retry_dead_letters() == (1, 0)
        assert (await st.meter.key_counters("carol"))["requests"] == 1
        assert (await st.meter.key_counters("carol", day=ev.day))["cost_micro_usd"] == ev.cost_micro_usd
        assert await r.hgetall(k.pending) == {} and await r.hgetall(k.write_ahead) == {}
        assert await r.hgetall(k.reservations("carol")) == {}
        assert len(await _stream(st)) == 1


async def test_the_sweep_completes_a_stranded_key_part(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    """A writer gone between the shared and the key part (here: its key part refused, and the event then lost with
    its process): the sweep completes it once it is older than PENDING_SWEEP_S, not before; sending the event
    afterwards counts nothing more."""
    from gateway.state.metering import PENDING_SWEEP_S

    prefix = f"tgks{uuid.uuid4().hex[:6]}:"
    async with stack(redis_cluster.url, prefix, tmp_path / "spool.jsonl", placement="tenant") as st:
        k, r = st.meter.keys, st.handle.client
        ev = _event("dave", 1)
        await r.set(k.key_total("dave"), "not a hash")
        assert (await st.meter.record(ev)).stored == "dead_letter"
        st.meter.dead.path.unlink()  # the process and its files are gone: only Redis knows of the event
        await r.delete(k.key_total("dave"))
        assert await st.meter.finish_pending() == 0  # too recent: its writer may still be at it
        assert await st.meter.finish_pending(now=time.time() + PENDING_SWEEP_S + 1) == 1
        assert (await st.meter.key_counters("dave"))["requests"] == 1
        assert await r.hgetall(k.pending) == {}
        assert not (await st.meter.record(ev)).counted
        assert (await st.meter.key_counters("dave"))["requests"] == 1


async def test_the_key_counts_the_amounts_the_stream_holds(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    """Two writers of one event id with different amounts (a reconciler billing a dead owner's call at its last
    written tokens, and the owner after all): the first shared part wins the stream, and whoever completes the key
    part completes *that* writer's — the key's counters never disagree with the stream."""
    prefix = f"tgkw{uuid.uuid4().hex[:6]}:"
    async with stack(redis_cluster.url, prefix, tmp_path / "spool.jsonl", placement="tenant") as st:
        k, r = st.meter.keys, st.handle.client
        rid = "req-" + uuid.uuid4().hex[:8]
        partial = _event("erin", 1, event_id=rid)
        final = _event("erin", 400, event_id=rid)
        assert final.cost_micro_usd != partial.cost_micro_usd
        await _open_request(st, partial)
        await r.set(k.key_total("erin"), "not a hash")  # the reconciler's key part refused: left pending
        with pytest.raises(ResponseError):  # the reconciler's pass fails; the record stays for its next one
            await st.meter.settle_orphan(partial, k.heartbeat("gone-owner"))
        assert await r.hexists(k.pending, rid) and await r.hexists(k.write_ahead, rid)
        await r.delete(k.key_total("erin"))
        res = await st.meter.record(final)  # the owner's own event, same id
        assert not res.counted
        assert (await st.meter.key_counters("erin"))["cost_micro_usd"] == partial.cost_micro_usd
        assert [e["cost_micro_usd"] for e in await _stream(st)] == [partial.cost_micro_usd]
        assert await r.hgetall(k.pending) == {} and await r.hgetall(k.write_ahead) == {}


async def test_a_stale_record_of_a_counted_request_is_deleted_by_its_claim(redis_cluster: ClusterSet,
                                                                          tmp_path: Path) -> None:
    """A dead owner's write-ahead record whose request is counted already (its id in the day's seen-set, nothing
    pending): the reconciler's claim holds, counts nothing — and deletes the record, as one server's RECORD does in
    the same script. Under ``tenant`` it was left open, claimed again at every pass, for ever."""
    prefix = f"tgks{uuid.uuid4().hex[:6]}:"
    async with stack(redis_cluster.url, prefix, tmp_path / "spool.jsonl", placement="tenant") as st:
        k, r = st.meter.keys, st.handle.client
        ev = _event("gina", 3)
        assert (await st.meter.record(ev)).counted  # the request, counted and settled
        await r.hset(k.write_ahead, ev.event_id, "record")  # a stale copy of its record, its owner gone
        res = await st.meter.settle_orphan(ev, k.heartbeat("gone-owner"))
        assert not res.counted
        assert not await r.hexists(k.write_ahead, ev.event_id)
        assert (await st.meter.key_counters("gina"))["requests"] == 1 and len(await _stream(st)) == 1


async def test_an_unsent_orphan_is_released_in_both_slots(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    prefix = f"tgku{uuid.uuid4().hex[:6]}:"
    async with stack(redis_cluster.url, prefix, tmp_path / "spool.jsonl", placement="tenant") as st:
        k, r = st.meter.keys, st.handle.client
        rid = "req-" + uuid.uuid4().hex[:8]
        audit = _event("frank", 1, tags={"team": "c"}, audit=True, event_id=f"{rid}:unsent")
        audit.request_id = rid
        await _open_request(st, audit, request_id=rid)
        assert await st.meter.release_orphan(audit, k.heartbeat("gone-owner"))
        for h in (k.reservations("frank"), k.level_reservations("global", "global"),
                  k.level_reservations("tag", "team=c")):
            assert await r.hgetall(h) == {}
        assert int(await r.get(k.tpm("frank", audit.minute))) == TPM_BEFORE - RESERVED_TOKENS
        assert await r.hgetall(k.write_ahead) == {} and await r.hgetall(k.pending) == {}
        assert [e["event_id"] for e in await _stream(st)] == [audit.event_id]
        assert (await st.meter.key_counters("frank"))["requests"] == 0  # an unsent call counts nothing
        # claimed once: a second reconciler finds the record gone
        assert not await st.meter.release_orphan(audit, k.heartbeat("gone-owner"))


def test_serve_and_the_cli_refuse_a_cluster_holding_the_other_placements_keys(
        redis_cluster: ClusterSet, upstream_sim: SimProcess, tmp_path: Path) -> None:
    """A gateway switched between placements on a cluster that holds keys would find none of them (their budgets
    reading $0 spent), and a CLI command would list nothing or write a key where no gateway reads it: ``thinkgate
    serve`` and the commands exit 2 saying so, in both directions, and write nothing."""
    for written, configured in (("shared", "tenant"), ("tenant", "shared")):
        prefix = f"tgpc{uuid.uuid4().hex[:6]}:"
        asyncio.run(_create_key(redis_cluster.url, prefix, written))
        cfg = serve_config(upstream_sim.base_url, tmp_path, prefix,
                           redis={"cluster_placement": configured, "start_if_missing": False})
        path = tmp_path / f"{written}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        for command in (["serve"], ["keys", "create", "--id", "team-y"], ["keys", "list"],
                        ["usage", "export", "--format", "jsonl"]):
            run = subprocess.run([sys.executable, "-m", "gateway", *command, "--config", str(path)], cwd=REPO,
                                 env={**os.environ, "THINKGATE_CONFIG": "",
                                      "THINKGATE_REDIS__URL": redis_cluster.url},
                                 capture_output=True, text=True, timeout=60)
            assert run.returncode == 2, (command, run.stdout, run.stderr)
            assert f"redis.cluster_placement: {written}" in run.stderr and "team-x" in run.stderr, run.stderr
        assert not asyncio.run(_key_exists(redis_cluster.url, prefix, "team-y"))  # nothing written


async def _key_exists(url: str, prefix: str, key_id: str) -> bool:
    from gateway.config import RedisConfig
    from gateway.state.redis import connect

    handle = connect(RedisConfig(url=url, key_prefix=prefix, socket_timeout_s=2.0))
    try:
        return bool(await handle.client.sismember(RedisKeys.of(handle).key_ids, key_id))
    finally:
        await handle.close()


async def _after_failover(read: Callable[[], Awaitable[T]], timeout_s: float = 30.0) -> T:
    """``read()`` once the client has found the promoted master (a pooled connection to the dead one fails first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await read()
        except RedisDown:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


async def _create_key(url: str, prefix: str, placement: str) -> None:
    from gateway.auth.redis_store import RedisKeyStore
    from gateway.config import RedisConfig
    from gateway.state.breaker import Breaker
    from gateway.state.redis import connect

    handle = connect(RedisConfig(url=url, key_prefix=prefix, socket_timeout_s=2.0, cluster_placement=placement))
    try:
        await RedisKeyStore(handle, Breaker(1.0)).create("team-x")
    finally:
        await handle.close()


async def test_admission_in_two_slots_rolls_the_key_back_when_a_level_above_refuses(redis_cluster: ClusterSet,
                                                                                    tmp_path: Path) -> None:
    """Under ``tenant`` admission is two calls: the key's level (with its RPM/TPM) in its slot, then its tags and the
    global level in one call in the shared slot. A refusal above the key takes the key's reservation and RPM/TPM
    counts back; an admitted call is reserved at every level, each in its own slot."""

    from gateway.config import LimitsConfig
    from gateway.errors import RateLimited
    from gateway.state.budgets import BudgetLevels, BudgetStore
    from gateway.state.limits import Estimate, KeyLimits, Limits

    prefix = f"tgka{uuid.uuid4().hex[:6]}:"
    async with stack(redis_cluster.url, prefix, tmp_path / "s", socket_timeout_s=2.0, placement="tenant") as s:
        limits = Limits(s.handle, s.breaker, LimitsConfig())
        assert limits.grouped and not limits.fused
        calls: list[int] = []
        run = limits._run

        async def counted(*args: object, **kw: object) -> list[object]:
            calls.append(len(args[4]))  # type: ignore[arg-type]  # the levels of this call
            return await run(*args, **kw)  # type: ignore[arg-type]

        limits._run = counted  # type: ignore[method-assign]  # counts the calls; the real script runs
        store = BudgetStore(s.handle, s.breaker)
        await store.set("tag:team=b", Decimal("0.000050"), None)
        await store.set("global", Decimal("1"), None)
        lim = KeyLimits("k2", budget_day_micro=1_000_000, rpm=5, tpm=1_000)
        levels = BudgetLevels(s.handle, s.breaker, LimitsConfig()).candidates({"team": "b"})
        r, k = s.handle.client, limits.keys
        now = time.time()
        w = int(now * 1000) // 60_000
        with pytest.raises(RateLimited) as info:
            await limits.admit(lim, "too-big", Estimate(51, 10), now, levels)
        assert info.value.headers["x-thinkgate-budget-level"] == "tag:team=b"
        assert calls == [1, 2]  # the key's level alone, then the tag and global together
        assert not await r.hexists(k.reservations("k2"), "too-big")
        assert int(await r.get(k.rpm("k2", w)) or 0) == 0 and int(await r.get(k.tpm("k2", w)) or 0) == 0
        adm = await limits.admit(lim, "fits", Estimate(50, 10), now, levels)
        assert [st.level.id for st in adm.levels] == ["key:k2", "tag:team=b", "global"]
        for h in (k.reservations("k2"), k.level_reservations("tag", "team=b"),
                  k.level_reservations("global", "global")):
            assert await r.hexists(h, "fits")
        assert redis_cluster.master_of(k.reservations("k2")) == redis_cluster.master_of(k.tenant(key_tenant("k2")))


async def test_under_shared_placement_a_cluster_admits_every_level_in_one_call(redis_cluster: ClusterSet,
                                                                               tmp_path: Path) -> None:
    """Every level in the shared slot: the one admission script, atomic over all levels, as on one server (it used to
    be one call per level on any Cluster)."""
    from gateway.config import LimitsConfig
    from gateway.state.budgets import BudgetLevels
    from gateway.state.limits import Estimate, KeyLimits, Limits

    prefix = f"tgk1{uuid.uuid4().hex[:6]}:"
    async with stack(redis_cluster.url, prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        limits = Limits(s.handle, s.breaker, LimitsConfig())
        assert not limits.grouped and not limits.fused  # the script, not the single-server hot path (no lane)
        levels = BudgetLevels(s.handle, s.breaker, LimitsConfig()).candidates({"team": "b"})
        lim = KeyLimits("k3", budget_day_micro=1_000_000, rpm=5)
        adm = await limits.admit(lim, "one", Estimate(50, 10), time.time(), levels)
        assert [st.level.id for st in adm.levels] == ["key:k3", "tag:team=b", "global"]
        assert await s.handle.client.hexists(limits.keys.reservations("k3"), "one")

async def test_replica_acks_cover_the_key_part_lost_in_a_failover(tmp_path: Path) -> None:
    """``metering.replica_acks`` under ``tenant``: the key part is written on the master of the key's own slot, not
    the shared slot's. Its replicas must acknowledge it too, or the event is kept for a replay — and that replay,
    finding the shared part counted and nothing pending, must count the key part the failover lost (once: the key's
    own seen-set). Here the key's master dies with the key part on no replica (its replicas stopped), a replica
    without it is promoted: the stream holds the event, the key's counters must too."""
    with cluster_set(tmp_path / "redis", replicas_per_master=2) as c:
        prefix = "tgkra:"
        k = RedisKeys(cluster_prefix(prefix), "tenant")
        shared = c.master_of(k.events)
        key = next(f"gina{i}" for i in range(100) if c.master_of(k.key_total(f"gina{i}")) != shared)
        own = c.master_of(k.key_total(key))
        rep = c.nodes.client(own).info("replication")
        replicas = [int(v["port"]) for f, v in rep.items() if f.startswith("slave") and isinstance(v, dict)]
        assert len(replicas) == 2
        async with stack(c.url, prefix, tmp_path / "spool.jsonl", placement="tenant", socket_timeout_s=2.0,
                         replica_acks=1, replica_ack_timeout_ms=300) as st:
            first = _event(key, 1)
            assert (await st.meter.record(first)).counted
            assert st.meter.unacked.pending_bytes() == 0  # every master's replicas answer: nothing kept
            for p in replicas:  # the key's master alone will hold what is written now: its replicas stopped, and
                os.kill(c.nodes.procs[p].pid, signal.SIGSTOP)
            c.nodes.client(own).client_kill_filter(_type="replica")  # cut off (else the kernel buffers the stream)
            ev = _event(key, 2)
            try:
                assert (await st.meter.record(ev)).counted
                # the shared slot's replicas have it, the key part's do not: kept for a replay
                assert st.meter.unacked.pending_bytes() > 0, "the key part's master was never asked for acks"
                c.kill(own)  # dies before any replica has the key part
            finally:
                for p in replicas:
                    os.kill(c.nodes.procs[p].pid, signal.SIGCONT)
            await asyncio.to_thread(c.wait_failover, 60)
            assert [e["event_id"] for e in await _stream(st)] == [first.event_id, ev.event_id]
            deadline = time.monotonic() + 30
            while st.meter.unacked.pending_bytes() and time.monotonic() < deadline:
                await st.meter.replay()
                await asyncio.sleep(0.3)
            assert st.meter.unacked.pending_bytes() == 0
            counters = await _after_failover(lambda: st.meter.key_counters(key))
            assert counters["requests"] == 2, counters
            assert counters["cost_micro_usd"] == first.cost_micro_usd + ev.cost_micro_usd
            assert len(await _stream(st)) == 2
            assert await st.handle.client.hgetall(k.pending) == {}
            # replayed again: counted nowhere a second time
            await st.meter.unacked.append([ev])
            await st.meter.replay()
            assert (await st.meter.key_counters(key))["requests"] == 2


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=CALLS, budgets=st.tuples(st.integers(0, 2000), st.integers(0, 2000), st.integers(0, 4000)))
def test_property_under_tenant_placement_hard_mode_never_overspends_any_level(
        redis_cluster: ClusterSet, tmp_path: Path, calls: list[tuple[int, float, str]],
        budgets: tuple[int, int, int]) -> None:
    """The admission property test (``test_admission_script.py``) on the real cluster under ``tenant``: concurrent
    calls of two keys (tags team=x, and team=x + dept=y), each admitted with a random estimate in two calls (the key's
    slot, then the shared one) and billed a random cost up to it through the split metering; the key, tag and global
    levels never end above their budgets, the global spend is the sum billed and equals the keys' counters, and every
    reservation is settled or rolled back."""

    from gateway.config import LimitsConfig
    from gateway.state.limits import Limits

    prefix = f"tgkp{uuid.uuid4().hex[:8]}:"

    async def run() -> None:
        async with stack(redis_cluster.url, prefix, tmp_path / f"s-{uuid.uuid4().hex[:6]}", socket_timeout_s=2.0,
                         placement="tenant") as s:
            limits = Limits(s.handle, s.breaker, LimitsConfig())
            assert limits.grouped
            spent = await budget_race(s, limits, calls, budgets)
            # the keys' counters (their slots) add up to what the global level (the shared slot) counted
            assert await spent("global", "global") == await spent("key", "a") + await spent("key", "b")
            assert await s.handle.client.hlen(limits.keys.pending) == 0

    asyncio.run(run())


async def test_a_shared_part_refused_writes_nothing_and_is_counted_once_fixed(redis_cluster: ClusterSet,
                                                                              tmp_path: Path) -> None:
    """The shared part all or nothing: a tag level's day counter poisoned (a string), so its write fails after the
    stream, the seen-set, the tier and the global level were written — every one undone, the reservations put back,
    no key part pending; the event is dead-lettered and counted once when the key is fixed."""
    prefix = f"tgsu{uuid.uuid4().hex[:6]}:"
    async with stack(redis_cluster.url, prefix, tmp_path / "spool.jsonl", placement="tenant") as st:
        k, r = st.meter.keys, st.handle.client
        ev = _event("gina", 1, tags={"team": "a"})
        await _open_request(st, ev)
        await r.set(k.level_day("tag", "team=a", ev.day), "not a hash")
        before = {h: await r.hgetall(h) for h in (k.level_reservations("global", "global"),
                                                  k.level_reservations("tag", "team=a"), k.reservations("gina"))}
        assert (await st.meter.record(ev)).stored == "dead_letter"
        assert await _stream(st) == [] and not await r.sismember(k.seen(ev.day), ev.event_id)
        assert await r.hgetall(k.level_day("global", "global", ev.day)) == {}
        assert await r.hgetall(k.tier_total("short")) == {} and await r.hgetall(k.pending) == {}
        assert {h: await r.hgetall(h) for h in before} == before  # released, then put back
        await r.delete(k.level_day("tag", "team=a", ev.day))
        assert await st.meter.retry_dead_letters() == (1, 0)
        assert [e["event_id"] for e in await _stream(st)] == [ev.event_id]
        assert (await st.meter.key_counters("gina"))["requests"] == 1
        assert int(await r.hget(k.level_day("global", "global", ev.day), "cost_micro_usd")) == ev.cost_micro_usd
