"""The request path's raw Redis exchanges (``gateway.state.redis.FastLane`` / ``FastScript``) on a PRIVATE
redis-server: replies in order, an error reply returned (not raised) with the connection kept, a script flushed
from the server's cache reloaded, and a paused server bounded by one ``socket_timeout_s`` for the whole exchange —
the connection dropped, the next exchange fine once the server resumes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.config import RedisConfig
from gateway.state.redis import FastScript, connect, pack
from tests.fixtures.redis_stack import count_exchanges, persistent_redis

TIMEOUT_S = 0.3


def test_lane_replies_errors_scripts_and_a_paused_server(tmp_path: Path) -> None:
    with persistent_redis(tmp_path) as server:
        async def run() -> None:
            handle = connect(RedisConfig(url=server.url, socket_timeout_s=TIMEOUT_S, start_if_missing=False))
            lane = handle.lane
            assert lane is not None
            try:
                # several commands in one buffer: their replies, in order; an error reply comes back as its
                # exception and the connection stays in step (the next reply is the next command's)
                got = await lane.exchange(pack(b"SET", b"k", b"v") + pack(b"INCR", b"k") + pack(b"GET", b"k"), 3)
                assert got is not None and got[0] == b"OK" and got[2] == b"v"
                assert isinstance(got[1], ResponseError)
                assert await lane.exchange(pack(b"PING")) == [b"PONG"] and lane._live == 1

                script = FastScript(handle, "return {KEYS[1], ARGV[1]}")
                assert await script(["a"], ["b"]) == [b"a", b"b"]
                await handle.client.script_flush()
                assert await script(["c"], [7]) == [b"c", b"7"]  # NOSCRIPT → SCRIPT LOAD → again

                server.pause()
                try:
                    t0 = time.monotonic()
                    with pytest.raises(RedisTimeoutError):
                        await lane.exchange(pack(b"PING") + pack(b"PING"), 2)
                    took = time.monotonic() - t0
                    # one timer for the write and both replies, not one per step
                    assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S * 1.8, took
                    assert lane._live == 0 and not lane._idle  # the connection of unknown state is gone
                finally:
                    server.resume()
                assert await lane.exchange(pack(b"PING")) == [b"PONG"] and lane._live == 1
            finally:
                await handle.close()

        asyncio.run(run())


def test_kept_connections_to_a_restarted_server_cost_one_call(tmp_path: Path) -> None:
    """The server restarts (or Sentinel fails over: the old master gone) while the lane keeps connections to it:
    the first exchange on one fails (it is not sent again: the server may have run it) and drops them all, so the
    next ones go through on fresh connections — each stale one used to fail a call of its own and open the
    breaker again, tens of seconds after a Sentinel failover."""
    with persistent_redis(tmp_path) as server:
        async def fill_and_use(handle: object) -> None:
            lane = handle.lane  # type: ignore[attr-defined]
            # four concurrent exchanges: four kept connections
            assert await asyncio.gather(*(lane.exchange(pack(b"PING")) for _ in range(4))) == [[b"PONG"]] * 4
            assert len(lane._idle) == 4

        async def after(handle: object) -> None:
            lane = handle.lane  # type: ignore[attr-defined]
            with pytest.raises(RedisConnectionError):
                await lane.exchange(pack(b"PING"))
            assert lane._live == len(lane._idle) == 0  # every stale connection dropped with it
            for _ in range(3):  # where three more stale connections each failed a call
                assert await lane.exchange(pack(b"PING")) == [b"PONG"]
            assert lane._live == len(lane._idle) == 1

        # nothing here is timed: a generous timeout, so that a fresh connection to the restarted server is not refused
        # by a busy box (a 0.3 s connect timed out once in a full run)
        handle = connect(RedisConfig(url=server.url, socket_timeout_s=5.0, start_if_missing=False))
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(fill_and_use(handle))
            server.stop()
            server.start()
            loop.run_until_complete(after(handle))
        finally:
            loop.run_until_complete(handle.close())
            loop.close()


def test_coalesced_exchanges_share_one_write_and_each_gets_its_own_replies(tmp_path: Path) -> None:
    """``exchange(..., coalesce="background")`` calls made in one pass of the loop leave as one exchange (one write, one
    read): each caller gets its own replies in order, an error reply in place; a caller that stops waiting does
    not put the connection out of step; a timeout reaches every joined caller; a busy lane answers None to all."""
    with persistent_redis(tmp_path) as server:
        async def run() -> None:
            handle = connect(RedisConfig(url=server.url, socket_timeout_s=TIMEOUT_S, start_if_missing=False,
                                         max_connections=1))
            lane = handle.lane
            assert lane is not None and lane.size == 1
            sent = count_exchanges(lane)  # the real exchange beneath
            try:
                calls = [pack(b"SET", b"c", b"v"), pack(b"INCR", b"c") + pack(b"GET", b"c"), pack(b"PING")]
                got = await asyncio.gather(*(lane.exchange(p, n, coalesce="background")
                                             for p, n in zip(calls, [1, 2, 1], strict=True)))
                assert sent == [4]  # one exchange for the three calls
                assert got[0] == [b"OK"] and got[2] == [b"PONG"]
                assert got[1] is not None and isinstance(got[1][0], ResponseError) and got[1][1] == b"v"
                assert await lane.exchange(pack(b"PING")) == [b"PONG"] and lane._live == 1

                # a caller cancelled while its exchange is out: the others get theirs, the connection stays in step
                server.pause()
                try:
                    a = asyncio.ensure_future(lane.exchange(pack(b"INCR", b"n"), coalesce="background"))
                    b = asyncio.ensure_future(lane.exchange(pack(b"INCR", b"n"), coalesce="background"))
                    await asyncio.sleep(0.05)
                    a.cancel()
                finally:
                    server.resume()
                assert await b == [2]  # a's INCR ran first: the reply read for it was skipped, not b's
                assert await lane.exchange(pack(b"GET", b"n")) == [b"2"] and lane._live == 1

                server.pause()
                try:
                    joined = [lane.exchange(pack(b"PING"), coalesce="background") for _ in range(3)]
                    outs = await asyncio.gather(*joined, return_exceptions=True)
                    assert all(isinstance(o, RedisTimeoutError) for o in outs), outs
                    # the lane's one connection busy with a direct exchange: a coalesced call is told to use the
                    # client (None), as a direct one is
                    held = asyncio.ensure_future(lane.exchange(pack(b"PING")))
                    await asyncio.sleep(0.01)
                    assert await lane.exchange(pack(b"PING"), coalesce="background") is None
                finally:
                    server.resume()
                assert await held == [b"PONG"]
            finally:
                await handle.close()

        asyncio.run(run())


def test_coalescing_groups_and_a_flush_cancelled_before_it_ran(tmp_path: Path) -> None:
    """The request path's calls and the background writers' never share an exchange (an admission would wait
    behind a metering batch's replies and share its timeout); a flush task cancelled before its first step (a loop
    shutting down) cancels its joined calls and frees the group — its calls waited forever, and so did every later
    call of the group."""
    with persistent_redis(tmp_path) as server:
        async def run() -> None:
            handle = connect(RedisConfig(url=server.url, socket_timeout_s=TIMEOUT_S, start_if_missing=False))
            lane = handle.lane
            assert lane is not None
            sent = count_exchanges(lane)  # the real exchange beneath
            try:
                got = await asyncio.gather(lane.exchange(pack(b"PING") * 3, 3, coalesce="background"),
                                           lane.exchange(pack(b"PING"), coalesce="request"),
                                           lane.exchange(pack(b"PING"), coalesce="request"))
                assert got == [[b"PONG"] * 3, [b"PONG"], [b"PONG"]]
                assert sorted(sent) == [2, 3]  # the two admissions together, the batch apart

                joined = asyncio.ensure_future(lane.exchange(pack(b"PING"), coalesce="background"))
                await asyncio.sleep(0)  # the call joined and made the group's flush task, not yet run
                flusher = lane._flusher["background"]
                flusher.cancel()
                await asyncio.sleep(0.01)
                assert joined.cancelled() and "background" not in lane._flusher
                assert await asyncio.wait_for(lane.exchange(pack(b"PING"), coalesce="background"), 2) == [b"PONG"]
            finally:
                await handle.close()

        asyncio.run(run())
