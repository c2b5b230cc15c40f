"""The exact cache's store-and-unlock off the request path (``ResponseCache.finish_later``) on the real Redis: the
calls queued while a batch is out go as one packed buffer, every answer is stored and every lock released; a
follower waiting on a lock gets the answer once the batch lands; Redis down loses only the stores (the locks expire
with their TTL) and never raises; ``Accounting.flush`` waits for the writer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis

from gateway.state.cache import CacheEntry, ResponseCache
from gateway.state.cache_policy import CacheDecision
from tests.fixtures.redis_stack import cache_cfg, stack

DECISION = CacheDecision(lookup=True, store=True, ttl_s=60)


def test_queued_finishes_go_in_one_batch_and_followers_get_the_answer(redis_url: str, redis_prefix: str,
                                                                     tmp_path: Path) -> None:
    async def run() -> None:
        async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
            cache = ResponseCache(st.handle, st.breaker, cache_cfg(single_flight_wait_s=2.0))
            assert cache.batches_finish
            lane = st.handle.lane
            assert lane is not None
            tickets = [await cache.begin(f"d{i}", DECISION) for i in range(20)]
            assert all(t.status == "miss" and t.lock_token for t in tickets)
            follower = asyncio.ensure_future(cache.begin("d0", DECISION))  # waits on d0's lock
            await asyncio.sleep(0.05)
            assert not follower.done()

            sent: list[int] = []
            exchange = lane.exchange

            async def counting(packed: bytes, replies: int = 1) -> list[object] | None:
                sent.append(replies)
                return await exchange(packed, replies)

            lane.exchange = counting  # type: ignore[method-assign]  # count the batches, the real call underneath
            writers = [cache.finish_later(t, CacheEntry({"id": f"a{i}"}, "chat", "short", "m", time.time()))
                       for i, t in enumerate(tickets)]
            assert writers[0] is not None and all(w is None for w in writers[1:])  # one writer for all of them
            await writers[0]
            assert sent == [20]  # 20 store-and-unlock calls, one buffer
            lane.exchange = exchange  # type: ignore[method-assign]

            got = await asyncio.wait_for(follower, 5)
            assert got.status == "hit" and got.entry is not None and got.entry.body == {"id": "a0"}
            sync = redis.Redis.from_url(redis_url)
            try:
                assert sync.exists(*[cache.keys.cache_entry(f"d{i}", "") for i in range(20)]) == 20
                assert sync.exists(*[cache.keys.cache_lock(f"d{i}", "") for i in range(20)]) == 0
            finally:
                sync.close()

    asyncio.run(run())


def test_redis_down_loses_only_the_stores(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async def run() -> None:
        async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
            cache = ResponseCache(st.handle, st.breaker, cache_cfg())
            ticket = await cache.begin("down", DECISION)
            st.breaker.record_failure(ConnectionError("test: breaker open"))  # every call refused: RedisDown
            writer = cache.finish_later(ticket, CacheEntry({"id": "x"}, "chat", "short", "m", time.time()))
            assert writer is not None
            await writer  # logged, not raised
            assert ticket.lock_token is None  # taken: nothing will try it again
            sync = redis.Redis.from_url(redis_url)
            try:  # not stored; the lock is left to its TTL (followers wait at most that long, then call upstream)
                assert sync.exists(cache.keys.cache_entry("down", "")) == 0
                assert 0 < sync.pttl(cache.keys.cache_lock("down", "")) <= cache.cfg.single_flight_wait_s * 1000
            finally:
                sync.close()

    asyncio.run(run())
