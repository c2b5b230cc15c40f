"""What automatic retraining reads of the outcome stream, on the real Redis: the newest ``routing.retrain.max_outcomes``
outcomes, for a fit and for a realised-floor check — not the whole stream (up to ``routing.outcomes.stream_maxlen``, a
million by default), which each of them read into the gateway's memory and parsed on its event loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.ledger.outcome import Outcome
from router.fit import promote
from tests.fixtures.gateway import gateway_settings
from tests.fixtures.outcomes import retrain_replica, serving_router, write_outcomes
from tests.gateway.test_router_transitions import _text

WRITTEN = 1200
MAX_OUTCOMES = 1000


def test_a_fit_and_a_realised_check_read_the_newest_max_outcomes(redis_url: str, redis_prefix: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    before = serving_router(tmp_path / "before.skops", False, _text)
    # the promoted router's answers, all graded right (its floor holds: no rollback), oldest first
    write_outcomes(redis_url, redis_prefix, [
        Outcome(source="feedback", request_id=f"r{i}", key_id="alice", tier="short" if i % 2 else "long",
                sufficed=True, judge="client", router_version="auto-x") for i in range(WRITTEN)], tmp_path)
    settings = gateway_settings("http://127.0.0.1:1", redis_url, redis_prefix, tmp_path / "spool.jsonl", routing={
        "router_path": str(before), "routed_tiers": ["short", "long"],
        "retrain": {"every_outcomes": 10, "fit_in": "thread", "state_dir": str(tmp_path / "routers"),
                    "max_outcomes": MAX_OUTCOMES}})
    rdb = redis.Redis.from_url(redis_url)
    rdb.hset(redis_prefix + "router:current", mapping={"path": str(before), "version": "auto-x",
                                                       "previous": str(before), "previous_version": "old-noise"})
    fit = promote.fit_and_save
    fitted: list[list[str]] = []

    def recording_fit(old: Any, outcomes: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        fitted.append([o["request_id"] for o in outcomes])
        return fit(old, outcomes, *args, **kwargs)

    monkeypatch.setattr(promote, "fit_and_save", recording_fit)
    newest = [f"r{i}" for i in range(WRITTEN - MAX_OUTCOMES, WRITTEN)]

    async def go() -> None:
        trigger = retrain_replica(settings, redis_url, redis_prefix)
        try:
            assert await trigger.check_realised() is None
            assert trigger.realised_last is not None and trigger.realised_last["n"] == MAX_OUTCOMES  # read 1,200
            assert await trigger.fit_once(WRITTEN) is not None
            assert fitted == [newest]  # the whole stream, 1,200
            # read newest first in pages: across page boundaries, oldest first, and all of a shorter stream
            assert [o.request_id for o in await trigger.outcomes.newest(250, page=100)] == newest[-250:]
            assert len(await trigger.outcomes.newest(5000, page=700)) == WRITTEN
        finally:
            await trigger.handle.close()

    try:
        asyncio.run(go())
    finally:
        rdb.close()
