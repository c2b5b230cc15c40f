"""``metering.replica_acks``: a usage event counted on a master is let go only once that many replicas hold it
(``WAIT`` after a probe write on the same connection); otherwise it is kept in the usage spool as well, and the spool
is let go only once the replicas hold what its replay counted. Real Sentinel set (1 master, 2 replicas) and real
Cluster (1 replica per master): asking for more replicas than there are is how "too few acknowledged" is made
without timing games. Why it matters (Redis replicates asynchronously: a master killed before its replicas have a
write loses it in the failover) is in ``Meter._acked``; the failover itself runs with it on in
``test_redis_failover.py`` (Sentinel)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import redis

from gateway.config import Prices
from gateway.ledger.event import UsageEvent
from tests.fixtures.redis_cluster import ClusterSet, SentinelSet
from tests.fixtures.redis_stack import stack

PRICES = Prices(input_usd_per_mtok=Decimal("0.50"), cached_input_usd_per_mtok=Decimal("0.25"),
                output_usd_per_mtok=Decimal("2.00"))


def _events(n: int) -> list[UsageEvent]:
    out = []
    for i in range(n):
        ev = UsageEvent(key_id="k1", requested_model="auto", tier="short", upstream_model="m", route_reason="predicted",
                        prompt_tokens=100 + i, completion_tokens=50 + i, ts=time.time())
        ev.price(PRICES)
        out.append(ev)
    return out


async def test_sentinel_events_fewer_replicas_acknowledge_are_spooled_until_they_do(redis_sentinel: SentinelSet,
                                                                                    tmp_path: Path) -> None:
    prefix, spool = f"tgack{uuid.uuid4().hex[:6]}:", tmp_path / "spool.jsonl"
    events = _events(3)
    async with stack(redis_sentinel.url, prefix, spool, replica_acks=2) as st:  # both replicas: acknowledged
        assert await st.meter.replica_acks() == 2
        assert [r.stored for r in await st.meter.record_many(events[:2])] == ["redis", "redis"]
        assert [r.stored for r in await st.meter.record_many(events[2:])] == ["redis"]  # the one-event path
        assert st.meter.spool.pending_bytes() == 0 and st.meter.unreplicated == 0
    more = _events(2)
    async with stack(redis_sentinel.url, prefix, spool, replica_acks=3, replica_ack_timeout_ms=50) as st:
        results = await st.meter.record_many(more)
        assert [r.stored for r in results] == ["redis", "redis"]  # counted…
        assert (await st.meter.key_counters("k1"))["requests"] == 5
        # …and kept: only 2 replicas exist, so no failover can be proven not to lose them. Beside the usage spool,
        # which an outage's events keep to themselves
        assert [e.event_id for e in st.meter.unacked.read_all()] == [e.event_id for e in more]
        assert st.meter.spool.pending_bytes() == 0 and st.meter.unreplicated == 2
        assert await st.meter.replay() == 0  # still 2 of 3: not sent, the file kept
        assert [e.event_id for e in st.meter.unacked.read_all()] == [e.event_id for e in more]
    async with stack(redis_sentinel.url, prefix, spool, replica_acks=2) as st:
        assert await st.meter.replay() == 2  # acknowledged now: let go
        assert st.meter.unacked.pending_bytes() == 0
        assert (await st.meter.key_counters("k1"))["requests"] == 5  # dropped by event_id: each counted once


async def test_an_outage_spool_replayed_while_replicas_are_short_is_let_go(redis_sentinel: SentinelSet,
                                                                           tmp_path: Path) -> None:
    """Events an outage spooled, replayed while too few replicas acknowledge: counted, and moved to the unacked
    file — the usage spool is let go. Kept there instead, it held every request's admission for its wait
    (``Accounting._replay_before_admitting`` waits for the usage spool to be in Redis) and was resent every pass."""
    prefix, spool = f"tgack{uuid.uuid4().hex[:6]}:", tmp_path / "spool.jsonl"
    async with stack(redis_sentinel.url, prefix, spool, replica_acks=3, replica_ack_timeout_ms=50) as st:
        outage = _events(3)
        await st.meter.spool.append(outage)
        assert await st.meter.replay() == 3
        assert st.meter.spool.pending_bytes() == 0 and not st.meter.spool.dirty
        assert (await st.meter.key_counters("k1"))["requests"] == 3
        assert [e.event_id for e in st.meter.unacked.read_all()] == [e.event_id for e in outage]


async def test_dead_letters_counted_while_replicas_are_short_are_kept_unacked(redis_sentinel: SentinelSet,
                                                                              tmp_path: Path) -> None:
    """A dead-letter retry that counts its events while too few replicas acknowledge them keeps them in the unacked
    file as the spool's replay does. It let them go at once: a failover losing the master's unreplicated writes lost
    them for good (the dead-letter file was already rewritten without them)."""
    prefix, spool = f"tgack{uuid.uuid4().hex[:6]}:", tmp_path / "spool.jsonl"
    async with stack(redis_sentinel.url, prefix, spool, replica_acks=3, replica_ack_timeout_ms=50) as st:
        dead = _events(3)
        await st.meter.dead.append(dead)  # events Redis once refused (a key fixed since): what the retry sends
        assert await st.meter.retry_dead_letters() == (3, 0)
        assert st.meter.dead.pending_bytes() == 0
        assert (await st.meter.key_counters("k1"))["requests"] == 3
        assert [e.event_id for e in st.meter.unacked.read_all()] == [e.event_id for e in dead]
        assert st.meter.unreplicated == 3
    async with stack(redis_sentinel.url, prefix, spool, replica_acks=2) as st:
        assert await st.meter.replay() == 3  # acknowledged now: let go, dropped by event_id
        assert st.meter.unacked.pending_bytes() == 0
        assert (await st.meter.key_counters("k1"))["requests"] == 3


async def test_a_wait_longer_than_the_socket_timeout_leaves_the_breaker_closed(redis_sentinel: SentinelSet,
                                                                               tmp_path: Path) -> None:
    """A replica slow to acknowledge says nothing about the master: a WAIT whose read times out (3 s against
    ``socket_timeout_s`` 1.0) is 0 acknowledgements, the breaker stays closed (it opened: the gateway's Redis-down
    mode for one lagging replica). After a shortfall the next batches skip the WAIT for ``ACK_BACKOFF_S``: a down
    replica held every batch for the whole timeout. (A batch that sent the WAIT takes at least the socket timeout, so
    0.9 s tells the two apart with room for a loaded box: at 0.25 s the margin was 0.2 s.)"""
    prefix, spool = f"tgack{uuid.uuid4().hex[:6]}:", tmp_path / "spool.jsonl"
    async with stack(redis_sentinel.url, prefix, spool, socket_timeout_s=1.0, replica_acks=3,
                     replica_ack_timeout_ms=3000) as st:
        t0 = time.monotonic()
        assert [r.stored for r in await st.meter.record_many(_events(2))] == ["redis", "redis"]
        assert time.monotonic() - t0 >= 0.9  # it did wait (for the socket timeout)
        assert not st.breaker.is_open
        t1 = time.monotonic()
        assert [r.stored for r in await st.meter.record_many(_events(2))] == ["redis", "redis"]
        assert time.monotonic() - t1 < 0.9  # within ACK_BACKOFF_S: no WAIT (one would take the socket timeout)
        assert len(st.meter.unacked.read_all()) == 4 and not st.breaker.is_open


async def test_cluster_acknowledgement_is_asked_of_the_metering_slots_master(redis_cluster: ClusterSet,
                                                                            tmp_path: Path) -> None:
    """One replica per master. WAIT must go to the usage keys' master (after the probe, on its connection): with
    that master's replica stopped (SIGSTOP, a few hundred ms) it answers 0 while every other master would answer
    1; with another master's replica stopped it still answers 1. Without ``target_nodes`` redis-py routes a
    keyless WAIT by its own rules (every master and their sum on a plain call; a default node)."""
    prefix, spool = f"tgack{uuid.uuid4().hex[:6]}:", tmp_path / "spool.jsonl"
    # 1 s: a replica that is up acknowledges within it even on a loaded 2-core box (50 ms once read 0 there)
    async with stack(redis_cluster.url, prefix, spool, replica_acks=1, replica_ack_timeout_ms=1000) as st:
        assert st.handle.kind == "cluster"
        # the shared cluster's replica of this slot's master may still be re-linking after an earlier test (a
        # stopped replica, a failover): the precondition, one replica that acknowledges, waited for, not assumed
        deadline = time.monotonic() + 20
        while await st.meter.replica_acks() != 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert await st.meter.replica_acks() == 1
        assert [r.stored for r in await st.meter.record_many(_events(2))] == ["redis", "redis"]
        assert st.meter.spool.pending_bytes() == 0
        master = redis_cluster.master_of(st.meter.keys.replica_probe)
        other = next(p for p in redis_cluster.masters() if p != master)
        with _stopped(redis_cluster, _replica_of(other)):  # another master's replica: not asked
            assert await st.meter.replica_acks() == 1
        proc = redis_cluster.nodes.procs[_replica_of(master)]
        proc.send_signal(signal.SIGSTOP)
        try:
            acks = await st.meter.replica_acks()
            events = _events(2)
            results = await st.meter.record_many(events)
        finally:
            proc.send_signal(signal.SIGCONT)
        assert acks == 0
        assert [r.stored for r in results] == ["redis", "redis"]
        assert [e.event_id for e in st.meter.unacked.read_all()] == [e.event_id for e in events]
        assert (await st.meter.key_counters("k1"))["requests"] == 4
        deadline = time.monotonic() + 10  # the replica catches up once it runs again: the spool is let go
        while await st.meter.replay() == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert st.meter.unacked.pending_bytes() == 0
        assert (await st.meter.key_counters("k1"))["requests"] == 4


def _replica_of(master: int) -> int:
    return int(redis.Redis(port=master).info("replication")["slave0"]["port"])


@contextlib.contextmanager
def _stopped(cluster: ClusterSet, port: int) -> Iterator[None]:
    proc = cluster.nodes.procs[port]
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


async def test_off_by_default_no_wait(redis_url: str, tmp_path: Path) -> None:
    """replica_acks 0 (the default): no probe, no WAIT, nothing spooled on a master without replicas."""
    prefix = f"tgack{uuid.uuid4().hex[:6]}:"
    async with stack(redis_url, prefix, tmp_path / "spool.jsonl") as st:
        assert st.metering_cfg.replica_acks == 0
        assert [r.stored for r in await st.meter.record_many(_events(2))] == ["redis", "redis"]
        assert st.meter.spool.pending_bytes() == 0
        assert not await st.handle.client.exists(st.meter.keys.replica_probe)
