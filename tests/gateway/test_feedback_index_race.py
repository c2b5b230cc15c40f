"""Feedback sent at once to the replica that answered finds its request at every instant (``POST /v1/feedback``,
``gateway/control/outcomes.py``): while the request index's write is out, and after that write failed.

A new user saw 7 in 2,000 immediate feedbacks answered 404 ``request_not_found`` at 16 concurrent clients: the
flush took the queued entries out of the queue before their write reached Redis, and a lookup meanwhile found them
in neither place. Here that window is held open for real — on a private Redis, ``CLIENT PAUSE … WRITE`` holds
every write (the index's SET) while reads (the feedback's lookup) are served — instead of waiting for the race."""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.fixtures.gateway import SECRETS, accounting_gateway
from tests.fixtures.redis_stack import PersistentRedis, persistent_redis
from tests.fixtures.upstream import SimProcess, wait_for

AUTH = {"authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store"}


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PersistentRedis]:
    """Pausing or stopping it touches no other test's Redis."""
    (tmp_path / "redis").mkdir()
    with persistent_redis(tmp_path / "redis") as server:
        yield server


def _ask_slowly(client: httpx.Client, base_url: str, delay_ms: int, tag: str | None = None) -> httpx.Response:
    # the upstream takes delay_ms: the request is admitted (its Redis writes done) well before it is answered
    sim: dict[str, Any] = {"delay_ms": delay_ms, **({"tag": tag} if tag else {})}
    return client.post(base_url + "/chat/completions", headers=AUTH, json={
        "model": "short", "max_tokens": 8, "sim": sim,
        "messages": [{"role": "user", "content": "grade me " + uuid.uuid4().hex}]})


def _held_writes(admin: redis.Redis) -> list[str]:
    """The commands of the clients CLIENT PAUSE is holding now (``flags=b``)."""
    rows = admin.client_list()
    return [str(c.get("cmd")) for c in rows if "b" in str(c.get("flags", ""))]


def _during_a_write_pause(client: httpx.Client, base_url: str, sim: SimProcess, admin: redis.Redis,
                          pause_ms: int, delay_ms: int = 1200) -> tuple[httpx.Response, float]:
    """A request whose answer comes while every write is held: the pause begins while the upstream is still
    thinking, so the index entry is queued — and flushed — only after it. Returns the answer and when the pause
    began (``time.monotonic()``, seconds)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        t = uuid.uuid4().hex
        fut = pool.submit(_ask_slowly, client, base_url, delay_ms, t)
        # paused once the upstream has the call: admission's writes are done (a fixed delay_ms / 3 held them too
        # when a loaded box was slower to admit, and the answer came after the pause)
        assert wait_for(lambda: sim.tag(t) is not None, timeout_s=30)
        admin.execute_command("CLIENT", "PAUSE", pause_ms, "WRITE")
        paused_at = time.monotonic()
        return fut.result(), paused_at


@pytest.mark.slow
def test_feedback_finds_a_request_whose_index_write_is_in_flight(upstream_sim: SimProcess, tmp_path: Path,
                                                                 private_redis: PersistentRedis) -> None:
    server = private_redis
    admin = redis.Redis.from_url(server.url)
    prefix = "tgrace:"
    # a socket timeout longer than the pause: the held writes complete when it ends, nothing fails
    with accounting_gateway(upstream_sim.base_url, server.url, tmp_path, prefix,
                            redis={"socket_timeout_s": 6.0}) as gw, httpx.Client(timeout=30) as client:
        r, paused_at = _during_a_write_pause(client, gw.base_url, upstream_sim, admin, pause_ms=4000)
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        # the flush (every 0.2 s) has sent the entry's SET, and Redis holds it: the write is in flight
        assert wait_for(lambda: "set" in _held_writes(admin), timeout_s=2), _held_writes(admin)
        assert admin.exists(prefix + "req:" + rid) == 0
        assert time.monotonic() - paused_at < 3.0  # still inside the pause
        fb = client.post(gw.base_url + "/feedback", headers=AUTH, json={"request_id": rid, "correct": True})
        # it was a 404 request_not_found: the entry was out of the queue and not yet in Redis
        assert fb.status_code == 200, fb.text
        assert fb.json()["stored"] == "redis"  # recorded once the pause ended (the socket timeout is longer)
        assert admin.exists(prefix + "req:" + rid) == 1
    admin.close()


@pytest.mark.slow
def test_a_failed_index_write_keeps_its_entries(upstream_sim: SimProcess, tmp_path: Path,
                                                private_redis: PersistentRedis) -> None:
    """Redis gone while the index is written: the entries wait for the next flush (they were dropped, and feedback
    on them answered 503 meanwhile and 404 after Redis came back)."""
    server = private_redis
    prefix = "tgrace:"
    settings: dict[str, Any] = {"redis": {"socket_timeout_s": 0.25}}
    with accounting_gateway(upstream_sim.base_url, server.url, tmp_path, prefix, **settings) as gw, \
            httpx.Client(timeout=30) as client:
        assert _ask_slowly(client, gw.base_url, 0).status_code == 200  # connected, breaker closed
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            t = uuid.uuid4().hex
            fut = pool.submit(_ask_slowly, client, gw.base_url, 1200, t)
            # admitted once the upstream has it (a fixed 0.4 s could stop Redis before admission on a loaded box);
            # Redis goes before the answer, so before its index entry is written
            assert wait_for(lambda: upstream_sim.tag(t) is not None, timeout_s=30)
            server.stop()
            r = fut.result()
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        store = gw.app.state.outcomes
        assert wait_for(lambda: store.breaker.failures > 0, timeout_s=3)  # the outage was seen
        time.sleep(0.5)  # flushes have failed meanwhile
        fb = client.post(gw.base_url + "/feedback", headers=AUTH, json={"request_id": rid, "correct": False})
        assert fb.status_code == 200, fb.text
        assert fb.json()["stored"] == "spool"  # graded on this replica during the outage, replayed later
        server.start()
        admin = redis.Redis.from_url(server.url)
        try:  # written by a later flush once Redis answers; the graded outcome replayed from its spool
            assert wait_for(lambda: admin.exists(prefix + "req:" + rid) == 1, timeout_s=10)
            assert wait_for(lambda: any(b"fb:" + rid.encode() in f[b"o"]
                                        for _, f in admin.xrange(prefix + "outcomes")), timeout_s=10)
        finally:
            admin.close()
