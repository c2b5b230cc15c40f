"""The breaker against a real Redis when the event loop, not Redis, is what stalled (gateway/state/breaker.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.state.breaker import Breaker, LoopWatch, RedisDown
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, accounting_gateway, create_key
from tests.fixtures.redis_stack import persistent_redis
from tests.fixtures.upstream import SimProcess


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


async def test_real_outage_still_opens_the_breaker(port_lease: Callable[[], int]) -> None:

    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port_lease()}/0", socket_timeout=0.2,
                                     socket_connect_timeout=0.2)
    breaker = Breaker(5.0, stall_s=0.1)
    try:
        with pytest.raises(RedisDown):
            await breaker.call(client.ping)
        assert breaker.is_open and breaker.failures == 1
    finally:
        await client.aclose()


@pytest.mark.slow
def test_a_stall_during_a_new_keys_lookup_is_retried_counted_and_logged(
        upstream_sim: SimProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real gateway whose event loop stalls (a blocking call on it, as a starved host does) while the first lookup
    of a key from the Redis store is out: the lookup's timeout is the loop's fault, and the read is tried again.
    A new user saw that request answered 503 ``key_store_unavailable`` with Redis healthy, nothing logged and no
    metric saying why."""
    (tmp_path / "redis").mkdir()
    prefix = "tgstall:"
    with persistent_redis(tmp_path / "redis") as server, accounting_gateway(
            upstream_sim.base_url, server.url, tmp_path, prefix, redis={"socket_timeout_s": 0.5}) as gw, \
            httpx.Client(timeout=30) as client:
        secret = create_key(server.url, prefix, "newcomer")  # in the store; this gateway has not looked it up
        body = {"model": "short", "max_tokens": 8, "messages": [{"role": "user", "content": "first request"}]}

        def ask(key: str) -> httpx.Response:
            return client.post(gw.base_url + "/chat/completions", json=body,
                               headers={"authorization": f"Bearer {key}", "cache-control": "no-store"})

        assert ask(SECRETS["alice"]).status_code == 200  # connected; the loop watch runs
        loop = gw.server.servers[0].get_loop()  # the gateway's own event loop (uvicorn's thread)
        caplog.set_level(logging.WARNING, logger="thinkgate.redis")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            server.pause()  # the lookup's GET waits on Redis…
            try:
                fut = pool.submit(ask, secret)
                time.sleep(0.15)
                loop.call_soon_threadsafe(time.sleep, 1.0)  # …while the loop is blocked past the socket timeout
                time.sleep(0.05)
            finally:
                server.resume()  # Redis answers at once; the loop sees it only when it runs again, after the timeout
            r = fut.result()
        breaker = gw.app.state.accounting.breaker
        assert breaker.stall_timeouts >= 1 and breaker.failures == 0  # the stall happened; Redis not marked down
        assert r.status_code == 200, r.text  # it was 503 key_store_unavailable
        metrics = client.get(gw.base_url.removesuffix("/v1") + "/metrics",
                             headers={"authorization": f"Bearer {ADMIN_SECRET}"}).text
        [line] = [m for m in metrics.splitlines() if m.startswith("thinkgate_redis_stall_timeouts_total ")]
        assert float(line.split()[1]) == breaker.stall_timeouts
        stall_lines = [rec.getMessage() for rec in caplog.records if "event loop stalled" in rec.getMessage()]
        assert len(stall_lines) == 1, stall_lines  # said once (at most once a minute), with the metric's name
        assert "thinkgate_redis_stall_timeouts_total" in stall_lines[0]
