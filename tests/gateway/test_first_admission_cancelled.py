"""A request whose client goes away while its FIRST call's admission is out (``Accounting.admit`` with an
:class:`~gateway.pipeline.accounting.Ahead`: on a single Redis one script call, ``HOT_LUA``, that reserves at the
key, its tags and global, writes the call's write-ahead record and takes the exact cache's single-flight lock).
The script may reach Redis after its caller is cancelled (a coalesced exchange is sent whatever its callers do), so
it used to leave (a) its reservations at every level until ``limits.reservation_ttl_s``, (b) an open write-ahead
record of a call never sent — which the reconciler bills as a partial call once this process is gone — and (c) the
single-flight lock, which makes identical requests wait up to ``cache.single_flight_wait_s``. Now the call is
metered as never sent (status 499, cost 0, ``cancelled``) as soon as the script's reply comes back, which settles
all three. The window is held open for real: on a private Redis, ``CLIENT PAUSE … WRITE`` holds the admission
script while the caller is cancelled (as ``tests/gateway/test_admission_cancelled.py``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
import pytest
import redis

from gateway.auth.keys import KeyInfo
from gateway.ledger.record import UsageRecord
from gateway.pipeline import upstream_body
from gateway.pipeline.accounting import Accounting, Ahead
from tests.fixtures.gateway import gateway_settings
from tests.fixtures.paused_redis import held_commands, reservations
from tests.fixtures.redis_stack import PersistentRedis
from tests.fixtures.upstream import SimProcess

PREFIX = "tgfirst:"
PAUSE_MS = 1500


@pytest.mark.parametrize("cached", [True, False], ids=["single-flight", "bypass"])
def test_a_first_call_cancelled_during_its_admission_is_settled_as_never_sent(
        cached: bool, upstream_sim: SimProcess, private_redis: PersistentRedis, tmp_path: Path) -> None:
    settings = gateway_settings(upstream_sim.base_url, private_redis.url, PREFIX, tmp_path / "spool.jsonl",
                                redis={"socket_timeout_s": 5.0}, limits={"global_budget": {"usd_day": "5"}})
    assert settings.metering.write_ahead and settings.cache.mode == "deterministic"
    tier = settings.tier("long")
    key = KeyInfo(id="alice", tags={"team": "a"})
    # temperature 0: the exact cache looks it up and takes its single-flight lock on a miss; 0.7: bypassed
    body = {"model": "long", "max_tokens": 16, "temperature": 0 if cached else 0.7,
            "messages": [{"role": "user", "content": "what is 2 plus 2?"}]}
    admin = redis.Redis.from_url(private_redis.url)

    def record() -> UsageRecord:
        return UsageRecord(key_id=key.id, tags=dict(key.tags), endpoint="chat", requested_model="long")

    async def go() -> tuple[UsageRecord, Accounting]:
        acct = Accounting(settings)
        await acct.start()
        assert acct.limits.fused and acct.wal is not None
        try:
            # one request admitted and settled first: the scripts are loaded (a fresh Redis answers NOSCRIPT, and the
            # retry after loading would be the cancelled caller's), as on a gateway that has served a request
            warm = record()
            warm_body = {**body, "messages": [{"role": "user", "content": "warm up"}]}
            await acct.admit(key, warm_body, warm, [tier],
                             Ahead(tier, "forced", upstream_body.build(warm_body, tier, "chat"), {}))
            acct.abandon(warm, tier, 499, "client_disconnected")
            await acct.flush()
            assert not admin.keys(PREFIX + "*cache:lock:*") and not admin.hlen(PREFIX + "wal:open")
            rec = record()
            ahead = Ahead(tier, "forced", upstream_body.build(body, tier, "chat"), {})
            admin.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
            paused_at = time.monotonic()
            task = asyncio.create_task(acct.admit(key, body, rec, [tier], ahead))
            for _ in range(100):  # until the admission script is held by the pause (bounded: 1 s)
                await asyncio.sleep(0.01)
                if "evalsha" in held_commands(admin):
                    break
            assert "evalsha" in held_commands(admin)
            task.cancel()  # the client went away
            with pytest.raises(asyncio.CancelledError):
                await task
            # the pause ends, the script runs: reserves, writes the write-ahead record, takes the lock
            while held_commands(admin) and time.monotonic() - paused_at < PAUSE_MS / 1000 + 5:
                await asyncio.sleep(0.05)
            assert not held_commands(admin)
            await acct.flush()  # waits for the script's reply, then for what the gateway does with it
            return rec, acct
        finally:
            await acct.close()

    try:
        rec, acct = asyncio.run(go())
        left = {
            # (a) reservations open at a level (key, tag, global)
            "reserved": {k: n for k, n in reservations(admin, PREFIX).items() if n},
            # (b) write-ahead records the reconciler would bill (a partial call, up to its prompt bound) once this
            # process is gone, though the call was never sent
            "write_ahead": {k.decode(): orjson.loads(v).get("bound_prompt")
                            for k, v in admin.hgetall(PREFIX + "wal:open").items()},
            # (c) single-flight locks identical requests would wait on (up to cache.single_flight_wait_s)
            "locks": sorted(k.decode() for k in admin.keys(PREFIX + "*cache:lock:*")),
        }
        assert left == {"reserved": {}, "write_ahead": {}, "locks": []}
        # settled by the usage event of a call never sent, once: status 499, nothing spent, on the routed tier
        events = [orjson.loads(f[b"e"]) for _, f in admin.xrange(PREFIX + "usage:events")]
        mine = [e for e in events if e["event_id"] == rec.request_id]
        assert [(e["key_id"], e["status"], e["partial"], e["error_code"], e["cost_micro_usd"], e["prompt_tokens"],
                 e["tier"]) for e in mine] == [(key.id, 499, True, "cancelled", 0, 0, "long")], events
        assert not acct._open and not acct._looked  # nothing of it left in the process either
    finally:
        admin.close()
