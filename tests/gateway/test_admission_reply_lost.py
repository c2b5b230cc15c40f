"""A request refused after its admission's outcome became unknown leaves nothing to bill.

On a single Redis a request's first call is admitted by one script call (``HOT_LUA``) that also reserves at every
level and writes the call's write-ahead record. When that call times out after it was sent, the script may have run
all the same; the request is then decided as with Redis down (``fail_closed``: 503 ``limits_unavailable``), is never
sent upstream, and only an audit event records it. Its reservations used to hold the budgets until their TTL, and
its write-ahead record stayed open: once this process was gone, the reconciler settled it as a lost call (status
500 ``gateway_lost``, a request counted) — for a request the client saw refused — as soon as the audit event's id
had left its seen-set (``metering.dedup_ttl_s``, 60 s at the least). Now the audit event settles both
(``gateway/state/limits.py``, "Outcome unknown"). The reply is lost for real: a proxy delivers the script to Redis
and drops its reply (``FreezingProxy`` with ``lose_replies``), so the gateway's Redis timeout fires after the script
ran."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from gateway.auth.keys import KeyInfo
from gateway.config import MeteringConfig, RedisConfig, Settings
from gateway.errors import LimitsUnavailable, RateLimited
from gateway.ledger.record import UsageRecord
from gateway.pipeline import upstream_body
from gateway.pipeline.accounting import Accounting, Ahead
from gateway.state.breaker import Breaker
from gateway.state.keys import RedisKeys
from gateway.state.limits import KeyLimits, Rider, estimate
from gateway.state.metering import Meter
from gateway.state.redis import connect
from gateway.state.spool import Spool
from gateway.state.write_ahead import WriteAhead
from tests.fixtures.crash_process import FreezingProxy
from tests.fixtures.gateway import gateway_settings

KEY = KeyInfo(id="alice", tags={"team": "a"})
BODY = {"model": "long", "max_tokens": 16, "temperature": 0.7,
        "messages": [{"role": "user", "content": "what is 2 plus 2?"}]}
HEARTBEAT_TTL_S = 0.5
SETTLE_TIMEOUT_S = 10.0


def _settings(redis_url: str, prefix: str, tmp: Path) -> Settings:
    spool = tmp / "spool.jsonl"
    # no upstream is called: the simulator's URL is never used
    return gateway_settings("http://127.0.0.1:9", redis_url, prefix, spool,
                            redis={"socket_timeout_s": 0.3, "breaker_cooldown_s": 0.2},
                            limits={"on_redis_down": "fail_closed", "global_budget": {"usd_day": "5"}},
                            metering={"spool_path": str(spool), "replay_interval_s": 0.1,
                                      "heartbeat_ttl_s": HEARTBEAT_TTL_S})


def _record() -> UsageRecord:
    return UsageRecord(key_id=KEY.id, tags=dict(KEY.tags), endpoint="chat", requested_model="long")


def _ahead(settings: Settings, body: dict[str, Any]) -> Ahead:
    tier = settings.tier("long")
    return Ahead(tier, "forced", upstream_body.build(body, tier, "chat"), {})


def _reserved_at(admin: redis.Redis, k: RedisKeys, rid: str) -> list[str]:
    """The levels (key, its tag, global) holding a reservation of ``rid``."""
    hashes = {"key": k.reservations(KEY.id), "tag": k.level_reservations("tag", "team=a"),
              "global": k.level_reservations("global", "global")}
    return [name for name, h in hashes.items() if admin.hexists(h, rid)]


def _events_of(admin: redis.Redis, k: RedisKeys, rid: str) -> list[tuple[Any, ...]]:
    events = [orjson.loads(f[b"e"]) for _, f in admin.xrange(k.events)]
    return [(e["status"], e["error_code"], e["audit"], e["cost_micro_usd"]) for e in events
            if e.get("request_id") == rid or e["event_id"] == rid]


async def _warm_up(acct: Accounting, settings: Settings) -> None:
    """One request admitted and settled first: the scripts are loaded (a fresh Redis answers NOSCRIPT)."""
    warm = _record()
    warm_body = {**BODY, "messages": [{"role": "user", "content": "warm up"}]}
    await acct.admit(KEY, warm_body, warm, [settings.tier("long")], _ahead(settings, warm_body))
    acct.abandon(warm, settings.tier("long"), 499, "client_disconnected")
    await acct.flush()


async def _written(acct: Accounting, admin: redis.Redis, k: RedisKeys, rid: str) -> None:
    """Until an event of ``rid`` is in the stream (the breaker a timeout opened closes, the spool is replayed)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not _events_of(admin, k, rid) and time.monotonic() < deadline:
        await acct.flush()
        await asyncio.sleep(0.05)
    await acct.flush()


def test_a_request_refused_after_its_admission_reply_was_lost_leaves_nothing_to_bill(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    proxy = FreezingProxy(redis_url).start()
    settings = _settings(proxy.url, redis_prefix, tmp_path)
    tier = settings.tier("long")
    admin = redis.Redis.from_url(redis_url)
    k = RedisKeys(redis_prefix)
    rec = _record()
    seen: dict[str, Any] = {}

    async def refused_after_a_lost_reply() -> None:
        acct = Accounting(settings)
        await acct.start()
        assert acct.limits.fused and acct.wal is not None and settings.limits.on_redis_down == "fail_closed"
        try:
            await _warm_up(acct, settings)
            # the hot path's script reaches Redis and runs; its reply never comes back: the call times out
            proxy.arm(acct.limits._hot.sha.encode(), lose_replies=True)
            with pytest.raises(LimitsUnavailable):
                await acct.admit(KEY, BODY, rec, [tier], _ahead(settings, BODY))
            assert proxy.frozen == 1
            # what the script wrote although the gateway refused the request
            seen["ran"] = {"write_ahead": bool(admin.hexists(k.write_ahead, rec.request_id)),
                           "reserved": _reserved_at(admin, k, rec.request_id)}
            acct.audit(rec, 503, "limits_unavailable")  # as Proxy.refused does
            # the timeout opened the breaker: the audit event went to the spool, replayed once Redis answers
            await _written(acct, admin, k, rec.request_id)
            seen["write_ahead"] = bool(admin.hexists(k.write_ahead, rec.request_id))
            seen["reserved"] = _reserved_at(admin, k, rec.request_id)
        finally:
            await acct.close()  # its heartbeat goes: to the reconciler, this process is gone

    async def reconciled() -> int:
        """The reconciler of another process, as for a dead one: a pass notes the orphans, the next (a heartbeat
        TTL later) settles them."""
        handle = connect(RedisConfig(url=redis_url, key_prefix=redis_prefix, socket_timeout_s=2.0))
        cfg = MeteringConfig(spool_path=tmp_path / "reconciler.jsonl", heartbeat_ttl_s=HEARTBEAT_TTL_S)
        breaker = Breaker(1.0)
        now = [0.0]
        wal = WriteAhead(handle, breaker, Meter(handle, breaker, Spool(cfg.spool_path), cfg), cfg,
                         {t.name: t.prices for t in settings.tiers}, owner="reconciler", clock=lambda: now[0])
        try:
            await wal.reconcile()
            await asyncio.sleep(HEARTBEAT_TTL_S + 0.2)  # the record's last write is a heartbeat TTL old
            now[0] += HEARTBEAT_TTL_S + 1
            await wal.reconcile()
            return wal.reconciled
        finally:
            await handle.close()

    try:
        asyncio.run(refused_after_a_lost_reply())
        # the scene is real: the script ran (a record, a reservation at every level) though the caller timed out
        assert seen.pop("ran") == {"write_ahead": True, "reserved": ["key", "tag", "global"]}
        # as once metering.dedup_ttl_s (60 s at the least) has passed: the request id has left its day's seen-set,
        # so only the record itself can tell the reconciler that nothing was sent
        admin.srem(k.seen(time.strftime("%Y-%m-%d", time.gmtime(rec.ts))), rec.request_id)
        seen["reconciled"] = asyncio.run(reconciled())
        seen["events"] = _events_of(admin, k, rec.request_id)
        assert seen == {
            "write_ahead": False,  # no open record once the audit event is written
            "reserved": [],  # its reservations released at once, not at their TTL
            "reconciled": 0,  # nothing of it for the reconciler to bill once the process is gone
            "events": [(503, "limits_unavailable", True, 0)],  # its audit event, once; no gateway_lost
        }
    finally:
        proxy.stop()
        admin.close()


def test_an_admission_that_reaches_redis_after_its_requests_refusal_writes_nothing(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    # The other order (``limits.py``, "Outcome unknown"): the admission call left on a connection that timed out and
    # reaches Redis only after its request's audit event (a retransmitted segment, a proxy in between). The audit
    # event found nothing to settle; the late call finds the request id settled in its day's seen-set and writes
    # neither its reservations nor its write-ahead record.
    settings = _settings(redis_url, redis_prefix, tmp_path)
    tier = settings.tier("long")
    admin = redis.Redis.from_url(redis_url)
    k = RedisKeys(redis_prefix)
    rec = _record()

    async def go() -> None:
        acct = Accounting(settings)
        await acct.start()
        assert acct.limits.fused and acct.wal is not None
        try:
            acct.audit(rec, 503, "limits_unavailable")
            await acct.flush()
            assert _events_of(admin, k, rec.request_id) == [(503, "limits_unavailable", True, 0)]
            est = estimate(BODY, [tier])
            late = Rider(k.write_ahead, acct.wal.open_record(rec, est.micro_usd, est.tokens, tier=tier.name,
                                                            upstream_model=tier.model).to_json())
            with pytest.raises(RateLimited) as refused:
                await acct.limits.admit(KeyLimits.of(KEY), rec.request_id, est, rec.ts,
                                        acct.budgets.candidates(KEY.tags), rider=late)
            assert refused.value.code == "settled"
        finally:
            await acct.close()

    try:
        asyncio.run(go())
        assert (admin.hexists(k.write_ahead, rec.request_id), _reserved_at(admin, k, rec.request_id)) == (False, [])
    finally:
        admin.close()


def test_a_request_cancelled_while_its_admission_reply_was_lost_leaves_nothing_open(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    # The client goes away while the hot-path script is out, and the script's reply is lost (it ran in Redis: a
    # record, a reservation at every level). The call was never sent upstream: it is metered as a cancelled call
    # (499, cost 0, as a cancelled admission whose reply came) and that event settles what the script wrote. It used
    # to be only logged: the record stayed open for the reconciler, the reservations held the budgets until their TTL.
    proxy = FreezingProxy(redis_url).start()
    settings = _settings(proxy.url, redis_prefix, tmp_path)
    tier = settings.tier("long")
    admin = redis.Redis.from_url(redis_url)
    k = RedisKeys(redis_prefix)
    rec = _record()
    seen: dict[str, Any] = {}

    async def go() -> None:
        acct = Accounting(settings)
        await acct.start()
        try:
            await _warm_up(acct, settings)
            proxy.arm(acct.limits._hot.sha.encode(), lose_replies=True)
            call = asyncio.ensure_future(acct.admit(KEY, BODY, rec, [tier], _ahead(settings, BODY)))
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while proxy.frozen < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert proxy.frozen == 1  # the script reached Redis; its reply will not come back
            call.cancel()  # the client went away meanwhile
            with pytest.raises(asyncio.CancelledError):
                await call
            while admin.hexists(k.write_ahead, rec.request_id) is False and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            seen["ran"] = {"write_ahead": bool(admin.hexists(k.write_ahead, rec.request_id)),
                           "reserved": _reserved_at(admin, k, rec.request_id)}
            # the exchange times out (socket_timeout_s 0.3): the caller is told the outcome is unknown; its event
            # goes to the spool while the breaker is open, replayed once Redis answers
            await _written(acct, admin, k, rec.request_id)
            seen["write_ahead"] = bool(admin.hexists(k.write_ahead, rec.request_id))
            seen["reserved"] = _reserved_at(admin, k, rec.request_id)
        finally:
            await acct.close()

    try:
        asyncio.run(go())
        assert seen.pop("ran") == {"write_ahead": True, "reserved": ["key", "tag", "global"]}
        assert seen == {"write_ahead": False, "reserved": []}
        assert _events_of(admin, k, rec.request_id) == [(499, "cancelled", False, 0)]
    finally:
        proxy.stop()
        admin.close()


@dataclass
class _RpmScene:
    """Bob (an RPM limit, so the admission script counts his requests), his request's record and the RPM window it
    is counted in, behind a :class:`FreezingProxy` in front of Redis."""

    key: KeyInfo
    proxy: FreezingProxy
    settings: Settings
    tier: Any
    admin: redis.Redis
    k: RedisKeys
    rec: UsageRecord
    rpm: str


def _rpm_scene(redis_url: str, redis_prefix: str, tmp_path: Path) -> _RpmScene:
    key = KeyInfo(id="bob", tags={"team": "a"}, rpm=100)
    proxy = FreezingProxy(redis_url).start()
    settings = _settings(proxy.url, redis_prefix, tmp_path)
    k = RedisKeys(redis_prefix)
    rec = UsageRecord(key_id=key.id, tags=dict(key.tags), endpoint="chat", requested_model="long")
    return _RpmScene(key, proxy, settings, settings.tier("long"), redis.Redis.from_url(redis_url), k, rec,
                     k.rpm(key.id, int(rec.ts * 1000) // 60_000))  # the window the script counts the request in


def test_a_refused_requests_lost_admission_leaves_neither_its_cache_lock_nor_its_rpm_count(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    # The lost script also took the exact cache's single-flight lock (a deterministic request: looked up, a miss) and
    # counted the request in the key's RPM window. Left, identical prompts waited on that lock for
    # cache.single_flight_wait_s (30 s) and the request that never ran counted against the key's RPM for up to a
    # minute. The refusal's audit event now takes both back: the lock by its token, the count only with the
    # reservation that proves this call's script ran (and so counted it: the key has an RPM limit).
    body = {**BODY, "temperature": 0}  # deterministic: the exact cache looks it up, single-flight
    sc = _rpm_scene(redis_url, redis_prefix, tmp_path)
    key, proxy, settings, tier, admin, k, rec, rpm = (sc.key, sc.proxy, sc.settings, sc.tier, sc.admin, sc.k, sc.rec,
                                                      sc.rpm)
    seen: dict[str, Any] = {}

    def state() -> dict[str, Any]:
        return {"locks": len(admin.keys(f"{redis_prefix}*cache:lock:*")), "rpm": int(admin.get(rpm) or 0)}

    async def go() -> None:
        acct = Accounting(settings)
        await acct.start()
        try:
            warm = UsageRecord(key_id=key.id, tags=dict(key.tags), endpoint="chat", requested_model="long")
            warm_body = {**body, "messages": [{"role": "user", "content": "warm up"}]}
            await acct.admit(key, warm_body, warm, [tier], _ahead(settings, warm_body))
            acct.abandon(warm, tier, 499, "client_disconnected")  # its lock released, its RPM count kept (it ran)
            await acct.flush()
            seen["before"] = state()
            proxy.arm(acct.limits._hot.sha.encode(), lose_replies=True)
            with pytest.raises(LimitsUnavailable):
                await acct.admit(key, body, rec, [tier], _ahead(settings, body))
            assert proxy.frozen == 1
            seen["ran"] = state()
            acct.audit(rec, 503, "limits_unavailable")
            await _written(acct, admin, k, rec.request_id)
            seen["settled"] = state()
        finally:
            await acct.close()

    try:
        asyncio.run(go())
        before = seen.pop("before")
        # the scene is real: the lost script took the lock and counted the request
        assert seen.pop("ran") == {"locks": before["locks"] + 1, "rpm": before["rpm"] + 1}
        assert seen == {"settled": before}
        assert _events_of(admin, k, rec.request_id) == [(503, "limits_unavailable", True, 0)]
    finally:
        proxy.stop()
        admin.close()


def test_a_refused_requests_admission_that_never_reached_redis_takes_back_no_rpm_count(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    # The other side of the RPM take-back: the call timed out without ever reaching Redis (dropped on the way), so it
    # counted nothing, and the window's count is other requests'. The audit event takes a count back only with the
    # key's reservation of this request there (the script ran and admitted: it counted it), so none is taken here.
    sc = _rpm_scene(redis_url, redis_prefix, tmp_path)
    key, proxy, settings, tier, admin, k, rec, rpm = (sc.key, sc.proxy, sc.settings, sc.tier, sc.admin, sc.k, sc.rec,
                                                      sc.rpm)
    seen: dict[str, Any] = {}

    async def go() -> None:
        acct = Accounting(settings)
        await acct.start()
        try:
            for _ in range(2):  # two requests that ran, counted in the request's window
                warm = UsageRecord(key_id=key.id, tags=dict(key.tags), endpoint="chat", requested_model="long",
                                   ts=rec.ts)
                await acct.admit(key, BODY, warm, [tier], _ahead(settings, BODY))
                acct.abandon(warm, tier, 499, "client_disconnected")
            await acct.flush()
            seen["before"] = int(admin.get(rpm) or 0)
            proxy.arm(acct.limits._hot.sha.encode())  # the script is dropped on its way: it never runs
            with pytest.raises(LimitsUnavailable):
                await acct.admit(key, BODY, rec, [tier], _ahead(settings, BODY))
            assert proxy.frozen == 1
            acct.audit(rec, 503, "limits_unavailable")
            await _written(acct, admin, k, rec.request_id)
            seen["settled"] = int(admin.get(rpm) or 0)
        finally:
            await acct.close()

    try:
        asyncio.run(go())
        assert seen == {"before": 2, "settled": 2}
        assert _events_of(admin, k, rec.request_id) == [(503, "limits_unavailable", True, 0)]
    finally:
        proxy.stop()
        admin.close()
