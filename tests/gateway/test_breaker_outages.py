"""What the breaker counts as an outage on Redis Cluster: failover replies and a connection torn down under a
command inside redis-py, on a real Redis; a bug in the caller's own code still propagates."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.exceptions as rexc

from gateway.state.breaker import Breaker, RedisDown, is_outage


def test_cluster_failover_errors_are_outages() -> None:
    assert is_outage(rexc.ClusterDownError("CLUSTERDOWN The cluster is down"))
    assert is_outage(rexc.MasterDownError("MASTERDOWN Link with MASTER is down"))
    assert is_outage(rexc.TryAgainError("TRYAGAIN"))
    assert is_outage(rexc.SlotNotCoveredError('Slot "1" is not covered by the cluster.'))
    assert is_outage(rexc.RedisClusterException("Redis Cluster cannot be connected. Please provide at least one "
                                                "reachable node: Connection refused"))
    # a client-side cross-slot mistake is a bug: it must not be hidden behind the degraded mode
    assert not is_outage(rexc.RedisClusterException("Keys in request don't hash to the same slot"))
    assert not is_outage(rexc.ResponseError("ERR wrong number of arguments"))


def test_a_connection_torn_down_inside_redis_py_is_an_outage(redis_url: str) -> None:
    # redis-py 8.1's cluster client disconnects a node's free connections in a background task after a
    # connection error; a command that picked one up meanwhile writes to a closed transport, and under uvloop
    # (what uvicorn serves on) that is a RuntimeError, not a ConnectionError. Reproduced on a real connection
    # to a real Redis by aborting its transport the way that task does, then sending on it.
    uvloop = pytest.importorskip("uvloop")

    async def go() -> None:
        client = aioredis.Redis.from_url(redis_url, socket_timeout=2)
        conn = await client.connection_pool.get_connection()
        try:
            await conn.connect()
            assert conn._writer is not None
            conn._writer.transport.abort()
            await asyncio.sleep(0.01)
            breaker = Breaker(5.0)
            with pytest.raises(RedisDown):
                await breaker.call(lambda: conn.send_packed_command(conn.pack_command("PING")))
            assert breaker.is_open and breaker.failures == 1
        finally:
            await client.connection_pool.release(conn)
            await client.aclose()

    uvloop.run(go())


def test_a_bug_in_the_callers_code_still_propagates() -> None:
    async def buggy() -> None:
        none: dict[str, int] | None = None
        none.get("x")  # type: ignore[union-attr]  # AttributeError outside redis-py

    breaker = Breaker(5.0)
    with pytest.raises(AttributeError):
        asyncio.run(breaker.call(buggy))
    assert not breaker.is_open
