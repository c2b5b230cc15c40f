"""The breaker against a real Redis when the event loop, not Redis, is what stalled (gateway/state/breaker.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gateway.state.breaker import Breaker, LoopWatch, RedisDown


async def _get_while_the_loop_is_blocked(client: aioredis.Redis, breaker: Breaker, block_s: float) -> None:
    # Redis answers after 50 ms (a BLPOP on a key nobody pushes to), well inside the 0.2 s socket timeout, but
    # from 10 ms on the loop is blocked (as by a long garbage collection or a process starved of CPU) past the
    # timeout: the read "times out" when the loop resumes although the answer is waiting in the socket.
    asyncio.get_running_loop().call_later(0.01, time.sleep, block_s)
    await breaker.call(lambda: client.blpop(["tgtest:breaker:never-pushed"], timeout=0.05))


async def test_a_timeout_caused_by_a_loop_stall_leaves_the_breaker_closed(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=0.2, socket_connect_timeout=0.2)
    breaker = Breaker(5.0, stall_s=0.1)
    try:
        await breaker.call(client.ping)  # connected, watch started
        await asyncio.sleep(0.12)
        with pytest.raises(RedisDown):  # this call fails (the caller degrades), but Redis is not declared down
            await _get_while_the_loop_is_blocked(client, breaker, 0.6)
        assert not breaker.is_open and breaker.failures == 0 and breaker.stall_timeouts == 1
        assert await breaker.call(client.ping)  # and the next call goes through
    finally:
        await client.aclose()


async def test_without_stall_detection_the_same_stall_opens_the_breaker(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=0.2, socket_connect_timeout=0.2)
    breaker = Breaker(5.0)
    try:
        await breaker.call(client.ping)
        with pytest.raises(RedisDown):
            await _get_while_the_loop_is_blocked(client, breaker, 0.6)
        assert breaker.is_open and breaker.failures == 1
    finally:
        await client.aclose()


async def test_loop_watch_reports_a_stall_under_way_and_past_ones() -> None:
    watch = LoopWatch(period_s=0.02)
    watch.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await asyncio.sleep(0.05)
    assert watch.stalled_since(t0) < 0.1
    time.sleep(0.3)  # blocks the loop: the watch's callback is now overdue
    assert watch.stalled_since(t0) >= 0.25
    await asyncio.sleep(0.05)  # the callback ran late and recorded it
    assert watch.stalled_since(t0) >= 0.25
    assert watch.stalled_since(loop.time() + 1) < 0.1


async def test_real_outage_still_opens_the_breaker() -> None:
    from gateway.engine.redis_server import free_port

    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=0.2,
                                     socket_connect_timeout=0.2)
    breaker = Breaker(5.0, stall_s=0.1)
    try:
        with pytest.raises(RedisDown):
            await breaker.call(client.ping)
        assert breaker.is_open and breaker.failures == 1
    finally:
        await client.aclose()
