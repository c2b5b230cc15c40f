"""Write-ahead records with ``metering.replica_acks``: each beat of the heartbeat, a process re-asserts the records of
its own open calls (``WriteAhead.reassert``) and asks that many replicas to acknowledge them, so a record a failover
lost — the promoted replica had not received it — is back while its owner lives, and a gateway killed after that
still has its call billed. Real servers only: a Sentinel set (1 master, 2 replicas), the 3 + 3 Cluster, a plain
Redis, real ``thinkgate serve`` processes over the upstream simulator. The failover's loss is made by deleting the
record on the master (the deletion replicates: no replica has it either, as after promoting one that never had
it); "too few replicas" by asking for more replicas than there are, or a replica stopped (SIGSTOP)."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis
from redis.cluster import key_slot

from gateway.config import MetricsConfig, Prices
from gateway.ledger.record import UsageRecord
from gateway.observability.metrics import Metrics
from gateway.state.keys import RedisKeys
from gateway.state.redis import as_bytes, cluster_prefix
from gateway.state.write_ahead import PUT_LUA, WalRecord, WriteAhead
from tests.fixtures.redis_cluster import ClusterSet, SentinelSet
from tests.fixtures.redis_stack import PersistentRedis, Stack, stack
from tests.fixtures.upstream import SimProcess, start_sim, wait_for
from tests.gateway.test_write_ahead import SETTLE_TIMEOUT_S, Stream, crash_scene

PRICES = Prices(input_usd_per_mtok=Decimal("0.50"), cached_input_usd_per_mtok=Decimal("0.25"),
                output_usd_per_mtok=Decimal("2.00"))
BEAT_TTL_S = 0.6  # heartbeat_ttl_s of the component tests: a beat (WriteAhead.beat_s) of 0.2 s


def _wal(st: Stack) -> WriteAhead:
    return WriteAhead(st.handle, st.breaker, st.meter, st.metering_cfg, {"long": PRICES})


async def _open_old(wal: WriteAhead) -> str:
    """Begin one call's record and let a beat pass (a younger one is left to the next beat); its request id."""
    rec = UsageRecord(key_id="alice", tier="long", stream=True)
    await wal.begin(rec, 1234, 600)
    assert await wal.reassert() == 0  # younger than a beat
    await asyncio.sleep(wal.beat_s + 0.05)
    return rec.request_id


def _node(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)


async def test_a_record_the_master_lost_is_written_again_and_acknowledged(redis_sentinel: SentinelSet,
                                                                        tmp_path: Path) -> None:
    """The record back on the master and on both replicas (WAIT 2 answered 2), byte for byte as it was; a record
    whose request was settled meanwhile (its usage event counted, this process not told yet) is not reopened; with
    more replicas asked for than exist, the shortfall is counted."""
    prefix, spool = f"tgwr{uuid.uuid4().hex[:6]}:", tmp_path / "spool.jsonl"
    master = _node(redis_sentinel.current_master())
    async with stack(redis_sentinel.url, prefix, spool, replica_acks=2, heartbeat_ttl_s=BEAT_TTL_S) as st:
        wal = _wal(st)
        rid = await _open_old(wal)
        key = wal.keys.write_ahead
        raw = master.hget(key, rid)
        assert raw is not None
        master.hdel(key, rid)  # what a failover to a replica that never had it leaves
        assert await wal.reassert() == 1
        assert master.hget(key, rid) == raw, "the record the master lost was not written again"
        assert [_node(p).hget(key, rid) for p in redis_sentinel.replica_ports] == [raw, raw]
        assert (wal.reasserted, wal.unreplicated) == (1, 0)
        final = WalRecord.from_json(raw).event(PRICES)  # its request finishes: the event deletes the record
        final.partial, final.status, final.error_code = False, 200, None
        assert (await st.meter.record(final)).counted
        assert await wal.reassert() == 1  # still open here (settled() not called yet): sent…
        assert not master.hexists(key, rid), "a settled request's record was reopened"  # …and skipped
    async with stack(redis_sentinel.url, prefix, spool, replica_acks=3, replica_ack_timeout_ms=50,
                     heartbeat_ttl_s=BEAT_TTL_S) as st:
        wal = _wal(st)
        rid = await _open_old(wal)
        assert await wal.reassert() == 1
        assert master.hexists(wal.keys.write_ahead, rid)  # written: only 2 replicas can acknowledge it
        assert (wal.reasserted, wal.unreplicated) == (1, 1)
        wal.settled(rid)
        assert await wal.reassert() == 0  # settled here: no longer this process's to write


async def test_cluster_records_are_acknowledged_by_the_write_ahead_slots_master(redis_cluster: ClusterSet,
                                                                               tmp_path: Path) -> None:
    """``wal:open`` shares the probe's slot (both shared keys, ``{prefix}``): the WAIT ``Meter.replica_acks`` asks
    goes to the master holding the records. That master's replica stopped (SIGSTOP): not acknowledged."""
    keys = RedisKeys(cluster_prefix("tg:"))
    assert key_slot(keys.write_ahead.encode()) == key_slot(keys.replica_probe.encode())
    prefix, spool = f"tgwr{uuid.uuid4().hex[:6]}:", tmp_path / "spool.jsonl"
    # 1 s: a replica that is up acknowledges within it even on a loaded 2-core box (50 ms once read 0 in a
    # fresh-clone CI run, as test_replica_acks' cluster test did)
    async with stack(redis_cluster.url, prefix, spool, replica_acks=1, replica_ack_timeout_ms=1000,
                     heartbeat_ttl_s=BEAT_TTL_S) as st:
        assert st.handle.kind == "cluster"
        # the shared cluster's replica of this slot's master may still be re-linking after an earlier test (a
        # stopped replica, a failover): the precondition, one replica that acknowledges, waited for, not assumed
        deadline = time.monotonic() + 20
        while await st.meter.replica_acks() != 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert await st.meter.replica_acks() == 1
        wal = _wal(st)
        key = wal.keys.write_ahead
        rid = await _open_old(wal)
        port = redis_cluster.master_of(key)
        master = _node(port)
        raw = master.hget(key, rid)
        assert raw is not None
        master.hdel(key, rid)
        assert await wal.reassert() == 1
        assert master.hget(key, rid) == raw
        assert wal.unreplicated == 0
        replica = int(master.info("replication")["slave0"]["port"])
        proc = redis_cluster.nodes.procs[replica]
        proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(wal.beat_s + 0.05)  # written a beat ago now: due again
            assert await wal.reassert() == 1
        finally:
            proc.send_signal(signal.SIGCONT)
        assert wal.unreplicated == 1
        wal.settled(rid)
        master.hdel(key, rid)


async def _commands(url: str, prefix: str, spool: Path, run_s: float, **metering: Any) -> tuple[Counter[str],
                                                                                                 WriteAhead]:
    """What ``WriteAhead.run`` sends Redis in ``run_s`` with one record open from the start (MONITOR: top-level
    commands naming ``prefix``, and WAIT), by command and key (prefix and owner id cut off); and the component."""
    seen: Counter[str] = Counter()
    async with stack(url, prefix, spool, heartbeat_ttl_s=BEAT_TTL_S, **metering) as st:
        wal = _wal(st)
        await wal.begin(UsageRecord(key_id="alice", tier="long", stream=True), 1234, 600)
        await st.handle.client.script_load(PUT_LUA)  # a first call's NOSCRIPT and its retry are not what is counted
        monitor = AsyncRedis.from_url(url)

        async def watch(ready: asyncio.Event) -> None:
            async with monitor.monitor() as m:
                ready.set()
                async for info in m.listen():
                    parts = str(info["command"]).split()
                    named = [p for p in parts[1:] if p.startswith(prefix)]
                    if info.get("client_type") == "lua" or not (named or parts[0] == "WAIT"):
                        continue
                    where = named[0][len(prefix):].split(":" + wal.owner)[0] if named else ""
                    seen[f"{parts[0]} {where}".strip()] += 1

        ready, stop = asyncio.Event(), asyncio.Event()
        watcher = asyncio.create_task(watch(ready))
        await ready.wait()
        await asyncio.sleep(0.1)  # MONITOR is on once its OK came back
        runner = asyncio.create_task(wal.run(stop))
        await asyncio.sleep(run_s)
        stop.set()
        await runner
        await asyncio.sleep(0.1)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await monitor.aclose()
        await wal.close()
    return seen, wal


async def test_off_by_default_no_reassertion_no_wait(private_redis: PersistentRedis, tmp_path: Path) -> None:
    """``replica_acks`` 0: a record open for several beats costs the heartbeat and the reconcile scan, nothing more —
    no record write, no probe, no WAIT. With 1 (on this server without replicas: never acknowledged), each beat
    adds one update script call (the record written again) and the probe + WAIT: three commands, two round trips.
    On a Redis of its own: MONITOR on the shared one streams every other test's commands into this event loop, which
    then ran one beat in 1.1 s, not three (a CI run with 3 workers)."""
    redis_url, redis_prefix = private_redis.url, "tgwal:"
    off, wal = await _commands(redis_url, redis_prefix + "off:", tmp_path / "off.jsonl", 1.1)
    assert wal.cfg.replica_acks == 0 and wal.reasserted == 0
    assert set(off) == {"SET wal:hb", "HSCAN wal:open"}, off  # the heartbeat and one reconcile pass
    on, wal = await _commands(redis_url, redis_prefix + "on:", tmp_path / "on.jsonl", 1.1, replica_acks=1,
                              replica_ack_timeout_ms=20)
    extra = on - off
    beats = extra["EVALSHA wal:open"]
    print(f"\nreplica_acks 1: {dict(on)} in {on['SET wal:hb']} beats; extra: {dict(extra)}")
    assert beats >= 3 and wal.reasserted == beats and wal.unreplicated == beats
    assert extra == Counter({"EVALSHA wal:open": beats, "SET usage:replica:probe": beats, "WAIT": beats}), extra


def test_unacknowledged_records_are_in_the_metrics() -> None:
    metrics = Metrics(MetricsConfig(), [])
    assert "thinkgate_write_ahead_unreplicated_records_total 0.0" in metrics.render(False, 0, 0).decode()
    text = metrics.render(False, 0, 0, wal_unreplicated=4).decode()
    assert "thinkgate_write_ahead_unreplicated_records_total 4.0" in text
    text = metrics.render(False, 0, 0, wal_unreplicated=5).decode()  # the running count: the counter adds what is new
    assert "thinkgate_write_ahead_unreplicated_records_total 5.0" in text


@pytest.fixture
def stall_sim() -> Iterator[SimProcess]:
    sim = start_sim()
    try:
        yield sim
    finally:
        sim.stop()


def _when_stalled(client: redis.Redis, key: str, rid: str, quiet_s: float, timeout_s: float) -> bytes:
    """The record once it holds tokens and has not changed for ``quiet_s`` (the stream stalled: no more progress
    writes — which would write a lost record again themselves)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        first = client.hget(key, rid)
        if first is not None and WalRecord.from_json(first).completion_tokens > 0:
            time.sleep(quiet_s)
            if client.hget(key, rid) == first:
                return as_bytes(first)
        time.sleep(0.1)
    raise AssertionError(f"the record of {rid} did not hold tokens and then stall within {timeout_s} s")


@pytest.mark.slow
def test_a_killed_gateways_call_whose_record_a_failover_lost_is_billed(redis_sentinel: SentinelSet,
                                                                       stall_sim: SimProcess, tmp_path: Path) -> None:
    """A gateway on the Sentinel set (``replica_acks`` 1) relays a stream that stalls halfway (no more progress
    writes); its record is lost on the master (and so on the replicas); the gateway writes it again within a beat;
    then it is killed (SIGKILL) — and another gateway's reconcile bills the call as lost, at the tokens it had."""
    master_url = f"redis://127.0.0.1:{redis_sentinel.current_master()}/0"
    with crash_scene(master_url, tmp_path) as crash:
        cfg = crash.config(stall_sim)
        cfg["redis"]["url"] = redis_sentinel.url  # the gateways go through the sentinels; the test reads the master
        cfg["metering"]["replica_acks"] = 1
        gw = crash.gateway(cfg)
        s = Stream(gw.base_url, 0, 20, {"sim": {"chunk_delay_ms": 20, "fail": "stall"}})
        assert wait_for(lambda: s.request_id is not None and s.events >= 3, 30), (s.status, s.events)
        rid, key = s.request_id or "", crash.keys.write_ahead
        raw = _when_stalled(crash.client, key, rid, 0.6, 20)
        crash.client.hdel(key, rid)  # the failover's loss
        replicas = [_node(p) for p in redis_sentinel.replica_ports]
        assert wait_for(lambda: not any(r.hexists(key, rid) for r in replicas), 5)
        assert wait_for(lambda: crash.client.hget(key, rid) == raw, 5), "the lost record was not written again"
        assert wait_for(lambda: all(r.hget(key, rid) == raw for r in replicas), 5)
        assert not s.done
        gw.kill()
        crash.replica(cfg)
        billed = wait_for(lambda: rid in crash.settled_ids(), SETTLE_TIMEOUT_S)
        assert billed, "the killed gateway's call was not billed"
        (event,) = [e for e in crash.ledger() if e.event_id == rid]
        rec = WalRecord.from_json(raw)
        assert (event.partial, event.error_code, event.tier) == (True, "gateway_lost", "long")
        assert event.completion_tokens == rec.completion_tokens > 0 and event.cost_micro_usd > 0
        assert not crash.client.hexists(key, rid)
