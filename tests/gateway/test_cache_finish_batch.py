"""The exact cache's store-and-unlock off the request path (``ResponseCache.finish_later``) on the real Redis: the
calls queued while a batch is out go as one packed buffer, every answer is stored and every lock released; a
follower waiting on a lock gets the answer once the batch lands; Redis down never raises, and what it stopped goes
with the next batch; ``Accounting.flush`` waits for the writer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.state.cache import CacheEntry, ResponseCache
from gateway.state.cache_policy import CacheDecision
from tests.fixtures.redis_cluster import ClusterSet
from tests.fixtures.redis_stack import cache_cfg, count_exchanges, stack

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

            finish_sha = cache._finish.sha.encode()

            async def counting(packed: bytes, replies: int = 1, **kw: str) -> list[object] | None:
                # the store-and-unlock calls only: the follower polls d0 on the lane meanwhile (10-100 ms apart),
                # and on a loaded box a poll landed inside this window ([20, 1, 1, ...])
                if finish_sha in packed:
                    sent.append(replies)
                return await exchange(packed, replies, **kw)

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


async def _sent_once_redis_answers(cache: ResponseCache, sync: Any, tenant: str) -> None:
    """The kept store-and-unlock of digest "down" (answer ``{"id": "x"}``) lands once Redis answers: the lock is
    released, the answer stored with the rest of its TTL, and the next identical request a hit without waiting."""
    lock, entry = cache.keys.cache_lock("down", tenant), cache.keys.cache_entry("down", tenant)
    deadline = time.monotonic() + 5
    while sync.exists(lock) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert sync.exists(lock) == 0  # released once Redis answered
    assert DECISION.ttl_s - 3 <= sync.ttl(entry) <= DECISION.ttl_s
    got = await asyncio.wait_for(cache.begin("down", DECISION, tenant=tenant), 5)
    assert got.status == "hit" and got.entry is not None and got.entry.body == {"id": "x"}
    assert got.waited_s == 0.0


@pytest.mark.parametrize("traffic", ["busy", "quiet"])
def test_redis_down_keeps_the_calls_until_redis_answers(redis_url: str, redis_prefix: str, tmp_path: Path,
                                                        traffic: str) -> None:
    """An outage stops a batch: nothing raises, and the store and the unlock are sent once Redis answers — with the
    next batch (busy) or by the retry every breaker cooldown (quiet: no new traffic) — so the follower gets the
    answer instead of waiting out the lock (it used to stay until its TTL, 30 s by default, for every identical
    request after the outage). The answer keeps the rest of its TTL, however many batches failed meanwhile."""
    async def run() -> None:
        async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
            cache = ResponseCache(st.handle, st.breaker, cache_cfg(single_flight_wait_s=30.0))
            ticket = await cache.begin("down", DECISION)
            assert ticket.lock_token
            st.breaker.record_failure(ConnectionError("test: breaker open"))  # every call refused: RedisDown
            writer = cache.finish_later(ticket, CacheEntry({"id": "x"}, "chat", "short", "m", time.time()))
            assert writer is not None
            await writer  # logged, not raised
            assert ticket.lock_token is None  # taken by the kept call
            for i in range(20):  # more batches fail while the breaker is open
                other = await cache.begin(f"meanwhile{i}", CacheDecision(lookup=False, store=True, ttl_s=60))
                w = cache.finish_later(other, CacheEntry({"id": i}, "chat", "short", "m", time.time()))
                if w is not None:
                    await w
                await asyncio.sleep(0.01)
            sync = redis.Redis.from_url(redis_url)
            try:
                assert sync.exists(cache.keys.cache_entry("down", "")) == 0  # not written during the outage
                assert sync.exists(cache.keys.cache_lock("down", "")) == 1
                await asyncio.sleep(st.breaker.cooldown_s + 0.05)  # Redis answers again (the breaker probes)
                if traffic == "busy":
                    other = await cache.begin("next", DECISION)
                    w = cache.finish_later(other, CacheEntry({"id": "y"}, "chat", "short", "m", time.time()))
                    assert w is not None
                    await w
                await _sent_once_redis_answers(cache, sync, "")
            finally:
                sync.close()
                await cache.close()

    asyncio.run(run())


def test_what_an_outage_keeps_is_bounded(redis_url: str, redis_prefix: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A long outage under load must not grow the kept calls without bound: beyond the byte bound a call keeps
    only its unlock, beyond the count bound the oldest go."""
    import gateway.state.cache as cache_module

    monkeypatch.setattr(cache_module, "UNSENT_MAX", 3)
    monkeypatch.setattr(cache_module, "UNSENT_MAX_BYTES", 250)

    async def run() -> None:
        async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
            cache = ResponseCache(st.handle, st.breaker, cache_cfg(single_flight_wait_s=30.0))
            tickets = [await cache.begin(f"b{i}", DECISION) for i in range(5)]
            st.breaker.record_failure(ConnectionError("test: breaker open"))
            for t in tickets:
                writer = cache.finish_later(t, CacheEntry({"id": "z" * 60}, "chat", "short", "m", time.time()))
                assert writer is not None
                await writer
            kept = list(cache._unsent)
            assert [u.keys[0].endswith(f"b{i}") for i, u in zip(range(2, 5), kept, strict=True)] == [True] * 3
            assert cache._unsent_bytes == sum(len(u.args[0]) for u in kept) <= 250
            assert all(u.args[2] for u in kept)  # every kept call still releases its lock
            # one ~140-byte answer fits: b0's, until the count bound dropped b0; then b4's (b1-b3 came while b0's
            # held the bytes: unlock only)
            assert [bool(u.args[0]) for u in kept] == [False, False, True]

    asyncio.run(run())


def test_a_kept_answer_loses_only_the_time_it_waited(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """However often the kept calls are taken out and kept again (each failed send), the answer's TTL drops by the
    time since the call was made, once: it once lost the elapsed time again at every pass (3,600 s → dropped
    within 30 s of batches)."""
    from gateway.state.cache import _Unsent

    async def run() -> None:
        async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
            cache = ResponseCache(st.handle, st.breaker, cache_cfg())
            now = time.monotonic()
            cache._keep_unsent([_Unsent(now + 30, now - 10, ["e", "l"], [b"answer", 3600, "tok"])])
            for _ in range(50):  # fifty failed sends
                cache._keep_unsent(cache._due_unsent(now))
            [u] = cache._due_unsent(now)
            assert u.call(now)[1] == [b"answer", 3590, "tok"]
            assert u.call(now + 3600)[1][1] == 1  # never below 1 s when sent; _due_unsent drops it before that

    asyncio.run(run())


def test_on_a_cluster_a_finish_stopped_by_an_outage_is_sent_once_redis_answers(redis_cluster: ClusterSet,
                                                                                tmp_path: Path) -> None:
    """Redis Cluster has no lane: the gateway awaits :meth:`ResponseCache.finish` itself. A call stopped by an
    outage is kept and sent by the retry every breaker cooldown, as the batched path's are — the lock used to stay
    until its TTL (30 s by default) and every identical request after the outage waited that long."""
    import uuid

    from redis.cluster import RedisCluster

    async def run() -> None:
        prefix = f"tgfin{uuid.uuid4().hex[:6]}:"
        async with stack(redis_cluster.url, prefix, tmp_path / "spool.jsonl") as st:
            cache = ResponseCache(st.handle, st.breaker, cache_cfg(single_flight_wait_s=30.0))
            assert not cache.batches_finish  # the Cluster's path: no lane
            ticket = await cache.begin("down", DECISION, tenant="t1")
            assert ticket.lock_token
            st.breaker.record_failure(ConnectionError("test: breaker open"))  # every call refused: RedisDown
            stored = await cache.finish(ticket, CacheEntry({"id": "x"}, "chat", "short", "m", time.time()))
            assert stored is False and ticket.lock_token is None  # not written now; kept
            sync = RedisCluster.from_url(redis_cluster.url.replace("redis+cluster://", "redis://"))
            try:
                entry, lock = cache.keys.cache_entry("down", "t1"), cache.keys.cache_lock("down", "t1")
                assert sync.exists(lock) == 1 and sync.exists(entry) == 0
                await _sent_once_redis_answers(cache, sync, "t1")  # with no new traffic
            finally:
                sync.close()
                await cache.close()

    asyncio.run(run())


def test_a_usage_event_and_a_cache_store_of_one_pass_go_as_one_exchange(redis_url: str, redis_prefix: str,
                                                                        tmp_path: Path) -> None:
    """The two background writes a finished request leaves — its usage event (the metering writer) and its cache
    store-and-unlock — were two writes and two reads; made in one pass of the loop they now leave together, and
    both land."""
    from gateway.ledger.event import UsageEvent

    async def run() -> None:
        async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
            cache = ResponseCache(st.handle, st.breaker, cache_cfg())
            lane = st.handle.lane
            assert lane is not None
            ticket = await cache.begin("one-pass", DECISION)
            event = UsageEvent(key_id="k1", requested_model="short", tier="short", upstream_model="m",
                               prompt_tokens=10, completion_tokens=5, cost_micro_usd=7)
            sent = count_exchanges(lane)  # the real exchange beneath
            writer = cache.finish_later(ticket, CacheEntry({"id": "x"}, "chat", "short", "m", time.time()))
            results, _ = await asyncio.gather(st.meter.record_many([event]), writer or asyncio.sleep(0))
            assert sent == [2], sent  # the RECORD script and the store-and-unlock: one exchange
            assert results[0].stored == "redis" and results[0].counted
            got = await cache.begin("one-pass", DECISION)
            assert got.status == "hit" and got.entry is not None and got.entry.body == {"id": "x"}

    asyncio.run(run())
