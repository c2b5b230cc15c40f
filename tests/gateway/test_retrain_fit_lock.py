"""The fit lock of automatic retraining (``p router:lock``) on the real Redis: one replica fits at a time however long
its fit runs, and a fit that lost the lock all the same writes no verdict.

The fits here run in a worker thread (``fit_in: thread``), made slow or made to lose the lock by a wrapper around
``router.fit.promote.fit_and_save`` — the fit is the lock's workload, not what is tested."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.ledger.outcome import Outcome
from router.fit import promote
from tests.fixtures.gateway import gateway_settings
from tests.fixtures.outcomes import retrain_replica, serving_router, write_outcomes
from tests.gateway.test_retrain_auto import _graded
from tests.gateway.test_retrain_auto import _router as _retrain_router
from tests.gateway.test_router_transitions import _text

LOCK_TTL_S = 1
FIT_S = 3.5  # the slow fit: past three TTLs


def _settings(redis_url: str, prefix: str, tmp: Path, router: Path, **retrain: Any) -> Any:
    return gateway_settings("http://127.0.0.1:1", redis_url, prefix, tmp / "spool.jsonl", routing={
        "router_path": str(router), "routed_tiers": ["short", "long"],
        "retrain": {"every_outcomes": 10, "fit_in": "thread", "state_dir": str(tmp / "routers"), **retrain}})


def test_a_fit_longer_than_the_lock_ttl_keeps_the_lock(redis_url: str, redis_prefix: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock was set once with its TTL (then 10 minutes) and never renewed: a fit that ran longer (a large
    outcome stream) let the second replica take it and fit the same outcomes beside the first. Renewed while the
    fit runs, the lock is still the first replica's past three TTLs, the second replica's tick fits nothing, and the
    lock is gone once the verdict is written."""
    before = serving_router(tmp_path / "before.skops", False, _text)
    write_outcomes(redis_url, redis_prefix, [
        Outcome(source="feedback", request_id=f"r{i}", key_id="alice", tier="short", sufficed=i % 2 == 1,
                judge="client", window_digest=f"{i:016x}", text=_text(i % 2 == 0, i)) for i in range(20)], tmp_path)
    settings = _settings(redis_url, redis_prefix, tmp_path, before, lock_ttl_s=LOCK_TTL_S)
    fit = promote.fit_and_save

    def slow_fit(*args: Any, **kwargs: Any) -> Any:  # in the fit's worker thread
        time.sleep(FIT_S)
        return fit(*args, **kwargs)

    monkeypatch.setattr(promote, "fit_and_save", slow_fit)
    rdb = redis.Redis.from_url(redis_url)
    lock = redis_prefix + "router:lock"

    async def go() -> None:
        first, second = (retrain_replica(settings, redis_url, redis_prefix) for _ in range(2))
        try:
            fitting = asyncio.create_task(first.fit_once(20))
            deadline = time.monotonic() + 20.0
            while not first.fitting:
                assert time.monotonic() < deadline, "the fit never started"
                await asyncio.sleep(0.01)
            await asyncio.sleep(2.5 * LOCK_TTL_S)  # the TTL it was taken with is long gone
            assert rdb.get(lock) == first._token.encode()
            assert await second.fit_once(20) is None  # took it and fitted beside the first before
            assert first.fitting
            event = await fitting
            assert event is not None and event["outcomes"] == 20
            assert rdb.get(lock) is None
            assert rdb.get(redis_prefix + "router:fitted_at") == b"20"
            assert rdb.xlen(redis_prefix + "router:history") == 1
        finally:
            for t in (first, second):
                await t.handle.close()

    try:
        asyncio.run(go())
    finally:
        rdb.close()


def test_a_fit_that_lost_the_lock_drops_its_promotion(redis_url: str, redis_prefix: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock is lost during a fit that would promote (another replica holds it now: Redis lost the key, or an
    outage outlived its TTL). The fit promoted all the same, beside the replica fitting now. It drops its verdict:
    ``router:current``, the history and ``router:fitted_at`` unchanged, its candidate file removed, the other's
    lock left; once it holds the lock again, the same outcomes promote."""
    before = _retrain_router(tmp_path / "serving.skops", informative=False)
    write_outcomes(redis_url, redis_prefix, _graded(invert_training=False), tmp_path)  # 1,460: a promotion
    settings = _settings(redis_url, redis_prefix, tmp_path, before, every_outcomes=1400, spot_check=0.0)
    fit = promote.fit_and_save
    rdb = redis.Redis.from_url(redis_url)
    lock = redis_prefix + "router:lock"
    steal = [True]

    def losing_fit(*args: Any, **kwargs: Any) -> Any:  # in the fit's worker thread
        if steal:
            steal.clear()
            rdb.set(lock, "another-replica")  # what its expiry and another replica's SET NX come to
        return fit(*args, **kwargs)

    monkeypatch.setattr(promote, "fit_and_save", losing_fit)

    async def go() -> None:
        trigger = retrain_replica(settings, redis_url, redis_prefix)
        try:
            assert await trigger.fit_once(1460) is None
            assert rdb.get(lock) == b"another-replica"
            assert not rdb.exists(redis_prefix + "router:current")
            assert rdb.xlen(redis_prefix + "router:history") == 0
            assert rdb.get(redis_prefix + "router:fitted_at") is None
            assert not list((tmp_path / "routers").glob("router-*.skops"))
            assert trigger.service.version == "old-noise"
            rdb.delete(lock)  # the other replica is done (it died, say): this one fits again
            event = await trigger.fit_once(1460)
            assert event is not None and event["event"] == "promote", event
            assert trigger.service.version == event["version"]
        finally:
            await trigger.handle.close()

    try:
        asyncio.run(go())
    finally:
        rdb.close()
