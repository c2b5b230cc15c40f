"""An admission script that fails partway writes nothing, and the request is decided as with Redis down: real Redis.

A ThinkGate key of the wrong type (a string SET at the write-ahead hash, a hash at a cache entry, a string at a tag
level's spend hash) or a window counter that is no integer makes a command of the admission script fail after it
reserved the call at some levels and counted it in the RPM window; Redis does not roll those back, and nothing
released them: the reservations refused the tenant's requests until their TTL, the window counted a request that
never ran. The scripts (``ADMIT``, the hot path's ``HOT``, the grouped path's ``ROLLBACK``) now undo their own writes
(``gateway/state/undo.py``), grouped admission rolls back the groups before a refused one, and ``Limits.admit``
decides the request as with Redis down (``limits.on_redis_down``), logging the key at fault.
"""

from __future__ import annotations

import logging
import time
import uuid
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import redis
from redis.exceptions import ResponseError

from gateway.config import LimitsConfig
from gateway.errors import LimitsUnavailable, RateLimited
from gateway.state.budgets import BudgetLevels, BudgetStore
from gateway.state.cache import Lookup
from gateway.state.cache_policy import CacheDecision
from gateway.state.keys import RedisKeys
from gateway.state.limits import Estimate, KeyLimits, Limits, Rider
from gateway.state.redis import FastScript
from gateway.state.reservations import ROLLBACK_LUA
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, accounting_gateway, cleanup, keys_config
from tests.fixtures.redis_stack import Stack, snapshot, stack
from tests.fixtures.upstream import SimProcess

TAGS = {"team": "a"}
LIM = KeyLimits("k1", budget_day_micro=50_000_000, rpm=1000, tpm=10_000_000)


def _limits(s: Stack, mode: str, on_redis_down: str = "fail_closed") -> Limits:
    limits = Limits(s.handle, s.breaker, LimitsConfig(admission_script=mode, on_redis_down=on_redis_down))
    assert limits.grouped is (mode == "grouped")
    return limits


def _rider(k: RedisKeys, rid: str) -> Rider:
    """A hot-path rider as a request's first call has it: its write-ahead record and an exact-cache lookup with a
    single-flight lock."""
    look = Lookup("d" * 16, CacheDecision(lookup=True, store=True, ttl_s=60), "t", k.cache_entry("d" * 16, "t"),
                  k.cache_lock("d" * 16, "t"), token=f"tok-{rid}", wait_ms=5000)
    return Rider(k.write_ahead, b'{"request_id": "%s"}' % rid.encode(), look)


async def _levels(s: Stack) -> BudgetLevels:
    await BudgetStore(s.handle, s.breaker).set("tag:team=a", Decimal("100"), None)  # a definition to read
    levels = BudgetLevels(s.handle, s.breaker, LimitsConfig())
    await levels.refresh(force=True)
    return levels


async def _admit(limits: Limits, levels: BudgetLevels, rid: str, rider: bool) -> object:
    return await limits.admit(LIM, rid, Estimate(20_000, 3000), time.time(), levels.candidates(TAGS),
                              levels.above_key(TAGS), _rider(limits.keys, rid) if rider else None)


def _poison(k: RedisKeys, case: str) -> tuple[str, str]:
    """The key of ``case`` and what is SET there, as (key, kind): every one fails the script after its first write."""
    w = int(time.time() * 1000) // 60_000
    return {
        "write_ahead": (k.write_ahead, "string"),  # the rider's HSET, after the reservations and the windows
        "cache_entry": (k.cache_entry("d" * 16, "t"), "hash"),  # the lookup's GET, after the write-ahead record too
        "tpm_window": (k.tpm("k1", w), "1.5"),  # read as a number, then INCRBY refuses it: after the reservations
    }[case]


async def _break(s: Stack, key: str, kind: str) -> None:
    r = s.handle.client
    await r.delete(key)
    if kind == "hash":
        await r.hset(key, "not", "a string")
    elif kind == "string":
        await r.set(key, "not a hash")
    else:
        await r.set(key, kind, px=120_000)


@pytest.mark.parametrize(("case", "rider", "earlier"), [
    ("write_ahead", True, True), ("write_ahead", True, False), ("cache_entry", True, True),
    ("tpm_window", True, True), ("tpm_window", False, True)])
async def test_a_refused_admission_script_writes_nothing_and_is_refused_with_503(
        redis_url: str, redis_prefix: str, tmp_path: Path, case: str, rider: bool, earlier: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    """Single Redis, ``HOT`` (with the rider) or ``ADMIT``: the script fails at its last writes; nothing of the call
    is left (reservations at the key, the tag and global; the RPM/TPM counts; the write-ahead record) — with an
    ``earlier`` call's hashes and windows there, or none (the hashes and windows the failed call made are gone
    again) —, the client gets 503 ``limits_unavailable`` (``fail_closed``) and one ERROR line names the key. Fixed,
    the next admission counts once."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        limits = _limits(s, "single")
        assert limits.fused
        levels = await _levels(s)
        r, k = s.handle.client, limits.keys
        if earlier:
            await _admit(limits, levels, "earlier", rider)  # the hashes and windows exist, with TTLs
        poisoned, kind = _poison(k, case)
        await _break(s, poisoned, kind)
        before = await snapshot(s)
        caplog.set_level(logging.ERROR, logger="thinkgate.limits")
        for _ in range(3):
            with pytest.raises(LimitsUnavailable) as info:
                await _admit(limits, levels, "refused", rider)
            assert info.value.status == 503 and info.value.code == "limits_unavailable"
            assert info.value.to_dict()["error"]["type"] == "server_error" and "retry-after" in info.value.headers
        assert await snapshot(s) == before
        lines = [rec.getMessage() for rec in caplog.records if rec.name == "thinkgate.limits"]
        assert len(lines) == 1 and poisoned in lines[0] and "ThinkGate admission" in lines[0]  # once, not thrice

        await r.delete(poisoned)
        await _admit(limits, levels, "fixed", rider)
        for h in (k.reservations("k1"), k.level_reservations("tag", "team=a"),
                  k.level_reservations("global", "global")):
            assert sorted(await r.hkeys(h)) == [b"earlier", b"fixed"][1 - earlier:]
        w = int(time.time() * 1000) // 60_000
        assert int(await r.get(k.rpm("k1", w))) == 1 + earlier  # the refused calls counted no request


async def test_fail_open_decides_a_refused_admission_on_the_local_counters(redis_url: str, redis_prefix: str,
                                                                           tmp_path: Path) -> None:
    """``fail_open``: a refused script is not an unchecked admission — the key's budget still holds, on this process's
    counters (as with Redis down); the breaker stays closed (Redis answers: metering and other keys go on)."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        limits = _limits(s, "single", on_redis_down="fail_open")
        levels = await _levels(s)
        await s.handle.client.set(limits.keys.write_ahead, "not a hash")
        adm = await _admit(limits, levels, "local", True)
        assert adm.where == "local" and not adm.rode  # type: ignore[attr-defined]
        with pytest.raises(RateLimited):  # over the key's $50 a day on the local counters
            await limits.admit(LIM, "too-big", Estimate(60_000_000, 10), time.time(), levels.candidates(TAGS),
                               levels.above_key(TAGS), _rider(limits.keys, "too-big"))
        assert s.breaker.closed and await s.handle.client.hlen(limits.keys.reservations("k1")) == 0


@pytest.mark.parametrize("on_redis_down", ["fail_closed", "fail_open"])
async def test_grouped_admission_rolls_back_the_groups_before_a_refused_one(redis_url: str, redis_prefix: str,
                                                                            tmp_path: Path, on_redis_down: str) -> None:
    """Grouped (Redis Cluster): the key's group reserves and counts, the tag's script is refused (a string at its day
    spend hash): the key's group is rolled back, nothing of the call is left; decided as with Redis down."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        limits = _limits(s, "grouped", on_redis_down)
        levels = await _levels(s)
        r, k = s.handle.client, limits.keys
        await _admit(limits, levels, "earlier", False)
        day = time.strftime("%Y-%m-%d", time.gmtime())
        await r.delete(k.level_day("tag", "team=a", day))
        await r.set(k.level_day("tag", "team=a", day), "not a hash")
        before = await snapshot(s)
        if on_redis_down == "fail_closed":
            with pytest.raises(LimitsUnavailable):
                await _admit(limits, levels, "refused", False)
        else:
            assert (await _admit(limits, levels, "refused", False)).where == "local"  # type: ignore[attr-defined]
        assert await snapshot(s) == before
        assert limits.refused_scripts == {"admit": 1, "rollback": 0, "renew": 0}  # the key group's rollback went


async def test_a_rollback_that_fails_partway_writes_nothing_and_can_be_sent_again(redis_url: str, redis_prefix: str,
                                                                                  tmp_path: Path) -> None:
    """``ROLLBACK``: the key group's reservation deleted, then its TPM count refused (no integer): undone — the
    reservation is still there, so the rollback sent again once the key is fixed takes everything back (it used to
    delete the reservation, and the counts were then never taken back: a rollback sent again finds none)."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        r, k = s.handle.client, RedisKeys(s.handle.prefix)
        rollback = FastScript(s.handle, ROLLBACK_LUA)
        exp = int(time.time() * 1000) + 600_000
        await r.hset(k.reservations("k1"), mapping={"rid": f"9000|300|{exp}", "other": f"1|1|{exp}"})
        await r.set(k.rpm("k1", 7), 2)
        await r.set(k.tpm("k1", 7), "1.5")
        keys, args = [k.reservations("k1"), k.rpm("k1", 7), k.tpm("k1", 7)], ["rid", 1, 1, 300]
        before = await snapshot(s)
        with pytest.raises(ResponseError, match=r"ThinkGate admission rollback: INCRBY .*:tpm:7 failed"):
            await rollback(keys=keys, args=args)
        assert await snapshot(s) == before
        await r.set(k.tpm("k1", 7), 1000)
        assert await rollback(keys=keys, args=args) == 1
        assert await r.hkeys(k.reservations("k1")) == [b"other"]
        assert (int(await r.get(k.rpm("k1", 7))), int(await r.get(k.tpm("k1", 7)))) == (1, 700)
        assert await rollback(keys=keys, args=args) == 0  # sent again: nothing twice
        assert (int(await r.get(k.rpm("k1", 7))), int(await r.get(k.tpm("k1", 7)))) == (1, 700)


def test_the_client_gets_an_openai_error_through_a_real_gateway(
        upstream_sim: SimProcess, redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A string SET at the global budget definition: every admission script is refused. ``fail_closed``: alice (under
    a budget) gets 503 with OpenAI's error JSON (``server_error`` / ``limits_unavailable``, Retry-After) — it was a
    500 ``internal_error`` —, bob (under nothing this process knows of) is served; one ERROR line names the key; once
    it is deleted alice is served again."""
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    k = RedisKeys(prefix)
    client = redis.Redis.from_url(redis_url)
    client.set(k.level_budget("global", "global"), "not a hash")
    caplog.set_level(logging.ERROR, logger="thinkgate.limits")
    body = {"model": "short", "messages": [{"role": "user", "content": "admit me"}]}
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix,
                                limits={"on_redis_down": "fail_closed"},
                                auth=keys_config(alice={"budget_usd_day": "5"})) as gw:
            def post(who: str) -> httpx.Response:
                return httpx.post(gw.base_url + "/chat/completions", json=body, timeout=30,
                                  headers={"authorization": f"Bearer {SECRETS[who]}", "cache-control": "no-store"})

            refused = post("alice")
            assert refused.status_code == 503, refused.text
            err = refused.json()["error"]
            assert (err["type"], err["code"]) == ("server_error", "limits_unavailable")
            assert "Redis refused the admission script" in err["message"] and "retry-after" in refused.headers
            assert prefix not in refused.text  # the key is for the operator's log, not the client
            assert post("bob").status_code == 200
            lines = [rec.getMessage() for rec in caplog.records if rec.name == "thinkgate.limits"]
            assert len(lines) == 1 and k.level_budget("global", "global") in lines[0]
            client.delete(k.level_budget("global", "global"))
            assert post("alice").status_code == 200
    finally:
        cleanup(redis_url, prefix)
        client.close()


@pytest.mark.parametrize("alone", [False, True])
async def test_a_renewal_refused_partway_renews_no_level(redis_url: str, redis_prefix: str, tmp_path: Path,
                                                         alone: bool) -> None:
    """``RENEW`` over the key, the tag and global: a string SET at the global level's reservation hash (the last one)
    fails the call after the key's and the tag's fields were rewritten — they were left renewed and global not; now
    every field is as it was (a hash that held only this reservation with its old expiry) and the error names the
    key. The script itself, as ``Limits.renew`` sends it on a single Redis (what ``Limits.renew`` does next:
    :func:`test_a_single_redis_renewal_refused_renews_the_other_levels_one_by_one`)."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        limits = _limits(s, "single")
        levels = await _levels(s)
        r, k = s.handle.client, limits.keys
        await _admit(limits, levels, "streaming", False)
        if not alone:
            await _admit(limits, levels, "other", False)
        glob = k.level_reservations("global", "global")
        await r.delete(glob)
        await r.set(glob, "not a hash")
        key_hash = k.reservations("k1")
        hashes = [key_hash, k.level_reservations("tag", "team=a"), glob]
        ttl_before = await r.pttl(key_hash)
        before = await snapshot(s)
        later = time.time() + 100
        ttl = int(limits.cfg.reservation_ttl_s * 1000)
        args: list[str | int] = ["streaming", int(later * 1000) + ttl, ttl]
        with pytest.raises(ResponseError) as info:
            await limits._renew(keys=hashes, args=args)
        assert await snapshot(s) == before
        if alone:  # its hash's TTL too (a renewed TTL is not undone where the hash holds other reservations)
            assert 0 < await r.pttl(key_hash) <= ttl_before
        assert f"ThinkGate reservation renewal: HGET {glob} failed, nothing written (undone)" in str(info.value)

        await r.delete(glob)
        assert await limits._renew(keys=hashes, args=args) == 2
        exp = int(later * 1000) + int(limits.cfg.reservation_ttl_s * 1000)
        for h in (key_hash, k.level_reservations("tag", "team=a")):
            assert (await r.hget(h, "streaming")).endswith(b"|%d" % exp)


async def test_a_single_redis_renewal_refused_renews_the_other_levels_one_by_one(redis_url: str, redis_prefix: str,
                                                                                 tmp_path: Path) -> None:
    """A single Redis, a string SET at the global level's reservation hash: the one call for every level is refused
    and renews nothing (above); ``Limits.renew`` then renews each level on its own, as grouped admission does — the
    key's and the tag's reservations are extended (they used to lapse with the broken level's under the live
    stream), global is left as it was, the refusal is raised once naming its key, and both refused calls (the whole
    call, then global's) are counted."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        limits = _limits(s, "single")
        levels = await _levels(s)
        r, k = s.handle.client, limits.keys
        await _admit(limits, levels, "streaming", False)
        glob = k.level_reservations("global", "global")
        await r.delete(glob)
        await r.set(glob, "not a hash")
        later = time.time() + 100
        with pytest.raises(ResponseError) as info:
            await limits.renew("k1", TAGS, "streaming", later)
        assert f"ThinkGate reservation renewal: HGET {glob} failed, nothing written (undone)" in str(info.value)
        assert limits.refused_scripts == {"admit": 0, "rollback": 0, "renew": 2}  # thinkgate_admission_refused_…
        exp = int(later * 1000) + int(limits.cfg.reservation_ttl_s * 1000)
        for h in (k.reservations("k1"), k.level_reservations("tag", "team=a")):
            assert (await r.hget(h, "streaming")).endswith(b"|%d" % exp)
        assert await r.get(glob) == b"not a hash"

        await r.delete(glob)
        assert await limits.renew("k1", TAGS, "streaming", later) == 2  # fixed: no error, one call again
        assert limits.refused_scripts["renew"] == 2


@pytest.mark.parametrize("broken", [("key",), ("tag",), ("key", "global")])
async def test_a_grouped_renewal_renews_every_level_redis_does_not_refuse(redis_url: str, redis_prefix: str,
                                                                          tmp_path: Path,
                                                                          broken: tuple[str, ...]) -> None:
    """Grouped (Redis Cluster: one ``RENEW`` call per level): a string SET at the ``broken`` levels' reservation hashes
    refuses their calls; every other level is renewed all the same — the levels after the first refused one used to
    be left to lapse at their TTL under the live stream — and the first refusal is raised once, after the last level,
    naming its key; each refused call is counted (``thinkgate_admission_refused_scripts_total{script="renew"}``)."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        limits = _limits(s, "grouped")
        levels = await _levels(s)
        r, k = s.handle.client, limits.keys
        await _admit(limits, levels, "streaming", False)
        hashes = {"key": k.reservations("k1"), "tag": k.level_reservations("tag", "team=a"),
                  "global": k.level_reservations("global", "global")}
        for level in broken:
            await r.delete(hashes[level])
            await r.set(hashes[level], "not a hash")
        later = time.time() + 100
        with pytest.raises(ResponseError) as info:
            await limits.renew("k1", TAGS, "streaming", later)
        first = hashes[broken[0]]
        assert f"ThinkGate reservation renewal: HGET {first} failed, nothing written (undone)" in str(info.value)
        assert limits.refused_scripts == {"admit": 0, "rollback": 0, "renew": len(broken)}
        exp = int(later * 1000) + int(limits.cfg.reservation_ttl_s * 1000)
        renewed = {level: (await r.hget(h, "streaming")).endswith(b"|%d" % exp)
                   for level, h in hashes.items() if level not in broken}
        assert renewed == dict.fromkeys(renewed, True)
        for level in broken:
            assert await r.get(hashes[level]) == b"not a hash"  # a refused level: left as it was

        for level in broken:
            await r.delete(hashes[level])
        assert await limits.renew("k1", TAGS, "streaming", later) == 3 - len(broken)  # fixed: no error


def _refused_series(metrics: str) -> dict[str, float]:
    """``thinkgate_admission_refused_scripts_total`` by ``script``, from an exposition text."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith("thinkgate_admission_refused_scripts_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('script="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def test_refused_admission_scripts_are_counted_in_metrics_under_fail_open(
        upstream_sim: SimProcess, redis_url: str, tmp_path: Path) -> None:
    """``fail_open``, a string SET at the global budget definition: alice's admissions are refused by Redis and
    decided on the local counters — served, so no limit rejection counts them, and the ERROR line is once a minute:
    only ``thinkgate_admission_refused_scripts_total{script="admit"}`` says how many (exposed at 0 before)."""
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    k = RedisKeys(prefix)
    client = redis.Redis.from_url(redis_url)
    body = {"model": "short", "messages": [{"role": "user", "content": "count me"}]}
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix,
                                limits={"on_redis_down": "fail_open"},
                                auth=keys_config(alice={"budget_usd_day": "5"})) as gw:
            def metrics() -> str:
                got = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {ADMIN_SECRET}"}, timeout=10)
                assert got.status_code == 200, got.text
                return got.text

            assert _refused_series(metrics()) == {"admit": 0.0, "rollback": 0.0, "renew": 0.0}
            client.set(k.level_budget("global", "global"), "not a hash")
            def post() -> httpx.Response:
                return httpx.post(gw.base_url + "/chat/completions", json=body, timeout=30, headers={
                    "authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store"})

            for _ in range(3):
                served = post()
                assert served.status_code == 200, served.text
            text = metrics()
            assert _refused_series(text) == {"admit": 3.0, "rollback": 0.0, "renew": 0.0}
            assert "thinkgate_limit_rejections_total{" not in text  # served on the local counters: no rejection
            client.delete(k.level_budget("global", "global"))
            assert post().status_code == 200
            assert _refused_series(metrics())["admit"] == 3.0  # decided in Redis again: not counted
    finally:
        cleanup(redis_url, prefix)
        client.close()


async def test_a_rollback_that_brings_a_window_to_zero_deletes_it(redis_url: str, redis_prefix: str,
                                                                  tmp_path: Path) -> None:
    """``ROLLBACK`` of the window's only call: its RPM and TPM counters are deleted, not left as "0" until their TTL
    (as the undo of an admission's own INCR does); one that still counts other calls is decremented. And a rollback
    that fails after bringing the RPM window to 0 leaves it as it was, TTL included (the DEL comes last: an undone
    decrement would re-create a deleted window without one)."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        r, k = s.handle.client, RedisKeys(s.handle.prefix)
        rollback = FastScript(s.handle, ROLLBACK_LUA)
        exp = int(time.time() * 1000) + 600_000
        keys, args = [k.reservations("k1"), k.rpm("k1", 7), k.tpm("k1", 7)], ["rid", 1, 1, 300]
        await r.hset(k.reservations("k1"), "rid", f"9000|300|{exp}")
        await r.set(k.rpm("k1", 7), 1, px=120_000)
        await r.set(k.tpm("k1", 7), 300, px=120_000)
        assert await rollback(keys=keys, args=args) == 1
        assert await r.exists(k.rpm("k1", 7), k.tpm("k1", 7), k.reservations("k1")) == 0

        await r.hset(k.reservations("k1"), "rid", f"9000|300|{exp}")
        await r.set(k.rpm("k1", 7), 2, px=120_000)
        await r.set(k.tpm("k1", 7), 300, px=120_000)
        assert await rollback(keys=keys, args=args) == 1
        assert int(await r.get(k.rpm("k1", 7))) == 1 and 0 < await r.pttl(k.rpm("k1", 7)) <= 120_000
        assert await r.exists(k.tpm("k1", 7)) == 0

        await r.hset(k.reservations("k1"), "rid", f"9000|300|{exp}")
        await r.pexpire(k.reservations("k1"), 600_000)  # as admission leaves it (the undo puts its expiry back)
        await r.set(k.tpm("k1", 7), "1.5", px=120_000)
        before = await snapshot(s)
        with pytest.raises(ResponseError, match="ThinkGate admission rollback: INCRBY"):
            await rollback(keys=keys, args=args)
        assert await snapshot(s) == before
        assert int(await r.get(k.rpm("k1", 7))) == 1 and await r.pttl(k.rpm("k1", 7)) > 0


def test_a_refused_renewal_is_one_warning_per_stream_and_counted_every_round(
        upstream_sim: SimProcess, redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A running stream whose renewal Redis refuses (a string SET at the global level's reservation hash once it was
    admitted): the stream goes on, ``thinkgate.relay`` says so in one WARNING line naming the request, the key and the
    broken Redis key, without a traceback — it logged an ERROR with a traceback every round (a third of
    ``limits.reservation_ttl_s``) —, and every refused round is counted in
    ``thinkgate_admission_refused_scripts_total{script="renew"}``."""
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    glob = RedisKeys(prefix).level_reservations("global", "global")
    client = redis.Redis.from_url(redis_url)
    body = {"model": "long", "stream": True, "messages": [{"role": "user", "content": "a slow stream of words"}],
            "sim": {"chunk_delay_ms": 150}}  # ~25 chunks: ~3.7 s, a renewal round every 0.2 s
    caplog.set_level(logging.DEBUG, logger="thinkgate.relay")
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix,
                                limits={"reservation_ttl_s": 0.6},
                                auth=keys_config(alice={"budget_usd_day": "5"})) as gw:
            def renew_refused() -> float:
                got = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {ADMIN_SECRET}"}, timeout=10)
                return _refused_series(got.text)["renew"]

            with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, timeout=30, headers={
                    "authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store"}) as r:
                assert r.status_code == 200
                rid = r.headers["x-request-id"]
                client.delete(glob)  # admitted: its reservation there is replaced by a key of the wrong type
                client.set(glob, "not a hash")
                lines = r.iter_lines()
                for _ in lines:
                    if renew_refused() >= 3:
                        break
                refused_rounds = renew_refused()
                client.delete(glob)  # fixed before the end: the stream's usage event is metered as usual
                rest = [line for line in lines if line]
        assert refused_rounds >= 3, refused_rounds
        assert rest and rest[-1] == "data: [DONE]"  # the stream went on to its end
        said = [rec for rec in caplog.records if rec.name == "thinkgate.relay"]
        assert len(said) == 1, [rec.getMessage() for rec in said]
        line = said[0]
        assert line.levelno == logging.WARNING and line.exc_info is None
        assert rid in line.getMessage() and "key alice" in line.getMessage() and glob in line.getMessage()
    finally:
        cleanup(redis_url, prefix)
        client.close()
