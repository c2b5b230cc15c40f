"""``/ready``'s ``redis_synced`` after an outage a replica started in (``gateway/api/ops.py``): read again once
Redis answers — by the probe itself, and in the background — not only when a request is admitted.

A new user started a replica (keys only in the Redis store) while Redis was down: ``/ready`` 503 as documented;
Redis started: ``{"status": "ready", "redis_synced": false}`` for 30 s and more without traffic; Redis stopped
again: 503 ``not_ready``, although the replica had reached Redis meanwhile."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.gateway import ADMIN_SECRET, accounting_gateway
from tests.fixtures.redis_stack import PersistentRedis
from tests.fixtures.upstream import GatewayServer, SimProcess

# the admin key only: every client key would live in the Redis store, so a replica that never read it is not ready
ADMIN_ONLY = {"admin_key_sha256": hashlib.sha256(ADMIN_SECRET.encode()).hexdigest()}


@pytest.fixture
def down_redis(tmp_path: Path) -> Iterator[PersistentRedis]:
    """A private Redis not started yet (its port chosen): the outage the replica starts in."""
    (tmp_path / "redis").mkdir()
    server = PersistentRedis(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


def _replica(sim: SimProcess, server: PersistentRedis, tmp: Path, refresh_s: float) -> Any:
    return accounting_gateway(sim.base_url, server.url, tmp, "tgready:", auth=ADMIN_ONLY,
                              redis={"socket_timeout_s": 0.25}, limits={"budget_refresh_s": refresh_s})


def _ready(gw: GatewayServer) -> httpx.Response:
    return httpx.get(gw.url + "/ready", timeout=10)


def _started_during_the_outage(gw: GatewayServer) -> None:
    r = _ready(gw)
    assert r.status_code == 503 and r.json()["status"] == "not_ready", r.text
    assert r.json()["redis_synced"] is False


@pytest.mark.slow
def test_the_probe_reads_the_budgets_once_redis_answers(upstream_sim: SimProcess, tmp_path: Path,
                                                        down_redis: PersistentRedis) -> None:
    # the background read is a minute away: only the probe can have read them
    with _replica(upstream_sim, down_redis, tmp_path, refresh_s=60.0) as gw:
        _started_during_the_outage(gw)
        down_redis.start()
        # a probe within the breaker's cooldown of the last failure (0.5 s) does not try Redis yet: the next does
        deadline = time.monotonic() + 10
        while not (r := _ready(gw)).json()["redis_synced"]:
            # it stayed {"status": "ready", "redis": true, "redis_synced": false} until a request was admitted
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert r.status_code == 200 and r.json() | {"upstreams": None} == {
            "status": "ready", "redis": True, "redis_synced": True, "upstreams": None}, r.text


@pytest.mark.slow
def test_a_replica_reads_the_budgets_in_the_background_once_redis_answers(
        upstream_sim: SimProcess, tmp_path: Path, down_redis: PersistentRedis) -> None:
    with _replica(upstream_sim, down_redis, tmp_path, refresh_s=0.5) as gw:
        _started_during_the_outage(gw)
        down_redis.start()
        time.sleep(2.5)  # no probe, no request: only the background read can reach Redis meanwhile
        down_redis.stop()
        r = _ready(gw)
        # it was 503 not_ready: the replica had never read Redis, for want of an admitted request
        assert r.status_code == 200, r.text
        assert r.json() | {"upstreams": None} == {"status": "degraded", "redis": False, "redis_synced": True,
                                                  "upstreams": None}
