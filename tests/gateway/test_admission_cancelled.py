"""A call whose caller is cancelled while its admission is out releases what that admission reserved
(``Accounting.admit_estimate``): an escalation's call (the client went away), a shadow or judge call (the gateway
stopping). The admission script may already be on its way to Redis when the caller is cancelled — a coalesced
exchange is sent whatever its callers do — so the reservation it then writes used to stay at every level until
``limits.reservation_ttl_s`` (10 minutes), holding the key's, the tags' and the global budgets (and the shadow's
own) for a call that was never sent. Here the window is held open for real: on a private Redis, ``CLIENT PAUSE …
WRITE`` holds the admission script while the caller is cancelled."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
import pytest
import redis

from gateway.auth.keys import KeyInfo
from gateway.control.shadow import SHADOW_KEY
from gateway.ledger.record import UsageRecord
from gateway.pipeline.accounting import Accounting
from tests.fixtures.gateway import gateway_settings
from tests.fixtures.paused_redis import held_commands, reservations
from tests.fixtures.redis_stack import PersistentRedis
from tests.fixtures.upstream import SimProcess

PREFIX = "tgcancel:"
PAUSE_MS = 1500


@pytest.mark.parametrize("who", ["alice", SHADOW_KEY])
def test_a_call_cancelled_during_its_admission_releases_its_reservations(
        who: str, upstream_sim: SimProcess, private_redis: PersistentRedis, tmp_path: Path) -> None:
    # alice: a client key's follow-up call (an escalation's); _shadow: a shadow call, admitted hard under its cap
    settings = gateway_settings(upstream_sim.base_url, private_redis.url, PREFIX, tmp_path / "spool.jsonl",
                                redis={"socket_timeout_s": 5.0}, limits={"global_budget": {"usd_day": "5"}})
    tier = settings.tier("long")
    cap = settings.routing.shadow.max_usd_day
    key = KeyInfo(id="alice", tags={"team": "a"}) if who == "alice" else KeyInfo(id=SHADOW_KEY, budget_usd_day=cap)
    body = {"model": "long", "max_tokens": 16, "messages": [{"role": "user", "content": "what is 2 plus 2?"}]}
    admin = redis.Redis.from_url(private_redis.url)

    async def go() -> UsageRecord:
        acct = Accounting(settings)
        await acct.start()
        mode = "hard" if who == SHADOW_KEY else None
        try:
            # one call admitted and settled first: the scripts are loaded (a fresh Redis answers NOSCRIPT, and the
            # retry after loading would be the cancelled caller's), as on a gateway that has served a request
            warm = UsageRecord(key_id=key.id, tags=dict(key.tags), endpoint="chat", requested_model="long")
            await acct.admit(key, body, warm, [tier], budget_mode=mode)
            acct.abandon(warm, tier, 499, "client_disconnected")
            await acct.flush()
            record = UsageRecord(key_id=key.id, tags=dict(key.tags), endpoint="chat", requested_model="long",
                                 tier="long", upstream_model=tier.model,
                                 route_reason="escalated" if who == "alice" else "shadow")
            admin.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
            paused_at = time.monotonic()
            task = asyncio.create_task(acct.admit(key, body, record, [tier], budget_mode=mode))
            for _ in range(100):  # until the admission script is held by the pause (bounded: 1 s)
                await asyncio.sleep(0.01)
                if "evalsha" in held_commands(admin):
                    break
            assert "evalsha" in held_commands(admin)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the pause ends, the script runs and reserves; what the gateway does with it is then written
            while held_commands(admin) and time.monotonic() - paused_at < PAUSE_MS / 1000 + 5:
                await asyncio.sleep(0.05)
            assert not held_commands(admin)
            await asyncio.sleep(0.1)  # the script's reply reaches the gateway
            await acct.flush()
            return record
        finally:
            await acct.close()

    try:
        record = asyncio.run(go())
        # the admission ran once the pause ended (it reserved at the key, its tag and global) and is settled: no
        # reservation is left open at any level
        assert sum(reservations(admin, PREFIX).values()) == 0, reservations(admin, PREFIX)
        # settled by the usage event of the call that was never sent: status 499, nothing spent
        events = [orjson.loads(f[b"e"]) for _, f in admin.xrange(PREFIX + "usage:events")]
        mine = [e for e in events if e["event_id"] == record.request_id]
        assert [(e["key_id"], e["status"], e["partial"], e["error_code"], e["cost_micro_usd"], e["tier"])
                for e in mine] == [(key.id, 499, True, "cancelled", 0, "long")], events
    finally:
        admin.close()
