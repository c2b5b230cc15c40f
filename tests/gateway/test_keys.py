"""The Redis key store: hashed at rest, create/list/revoke/lookup, caching and outage behaviour."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from pathlib import Path

import orjson
import pytest
from redis.crc import key_slot

from gateway.auth.keys import KeyStore
from gateway.auth.redis_store import KeyCreateRolledBack, KeyExists, KeyRecord, KeyStoreUnavailable, RedisKeyStore
from gateway.config import AuthConfig
from gateway.errors import AuthError
from gateway.state.breaker import Breaker
from gateway.state.keys import key_tenant, tenant_tag
from gateway.state.redis import connect
from tests.fixtures.redis_cluster import ClusterSet
from tests.fixtures.redis_stack import Stack, stack

REPO = Path(__file__).resolve().parents[2]


async def test_create_lookup_list_revoke(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "s") as st:
        store = RedisKeyStore(st.handle, st.breaker, cache_s=0)
        secret = await store.create("team-a", tags={"project": "p1", "team": "a"}, budget_usd_day=Decimal("1.5"),
                                    budget_usd_month=Decimal("20"), rpm=60, tpm=10_000)
        assert secret.startswith("tg-") and len(secret) > 40
        digest = hashlib.sha256(secret.encode()).hexdigest()
        # at rest: no value anywhere in Redis contains the secret
        for key in [k async for k in st.handle.client.scan_iter(match=redis_prefix + "*")]:
            if await st.handle.client.type(key) == b"string":
                assert secret.encode() not in await st.handle.client.get(key)
        info = await store.lookup(digest)
        assert info is not None and info.id == "team-a" and info.tags == {"project": "p1", "team": "a"}
        assert (info.budget_usd_day, info.budget_usd_month, info.rpm, info.tpm) == (Decimal("1.5"), Decimal("20"),
                                                                                  60, 10_000)
        with pytest.raises(KeyExists):
            await store.create("team-a")
        await store.create("team-b")
        listed = await store.list()
        assert [r.id for r in listed] == ["team-a", "team-b"]
        assert "secret_sha256" not in listed[0].public() and listed[0].revoked is None
        assert await store.revoke("team-a") is True
        assert await store.revoke("team-a") is False
        with pytest.raises(KeyError):
            await store.revoke("nobody")
        assert await store.lookup(digest) is None
        assert (await store.list())[0].revoked is not None
        with pytest.raises(KeyExists):  # ids are never reused
            await store.create("team-a")


async def test_a_record_left_active_without_its_lookup_copy_can_still_be_revoked(redis_url: str, redis_prefix: str,
                                                                                  tmp_path: Path) -> None:
    """A tenant-placement revoke deletes the lookup copy, then marks the record; stopped between the two and the
    cluster then moved to ``shared``, the record is listed active though the key no longer authenticates. Revoking it
    must mark it revoked (the shared script decided on the copy and answered "already revoked", writing nothing)."""
    async with stack(redis_url, redis_prefix, tmp_path / "s") as st:
        store = RedisKeyStore(st.handle, st.breaker, cache_s=0)
        secret = await store.create("half-revoked")
        digest = hashlib.sha256(secret.encode()).hexdigest()
        await st.handle.client.delete(st.meter.keys.key_by_hash(digest))  # the revoke's first step only
        assert await store.lookup(digest) is None and (await store.list())[0].revoked is None
        assert await store.revoke("half-revoked") is True
        assert (await store.list())[0].revoked is not None
        assert await store.revoke("half-revoked") is False


async def test_auth_keystore_uses_config_keys_then_redis(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "s") as st:
        store = RedisKeyStore(st.handle, st.breaker, cache_s=0)
        auth = KeyStore(AuthConfig(keys=[{"id": "cfg", "secret": "config-secret"}]), redis_store=store)
        assert (await auth.authenticate("Bearer config-secret")).id == "cfg"
        secret = await store.create("cli-made", tags={"env": "dev"})
        assert (await auth.authenticate(f"Bearer {secret}")).id == "cli-made"
        with pytest.raises(AuthError):
            await auth.authenticate("Bearer tg-not-a-key")
        await store.revoke("cli-made")
        with pytest.raises(AuthError):
            await auth.authenticate(f"Bearer {secret}")


async def test_lookup_cache_and_outage(redis_url: str, redis_prefix: str, tmp_path: Path,
        port_lease: Callable[[], int]) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "s") as st:
        now = [1000.0]
        store = RedisKeyStore(st.handle, st.breaker, cache_s=5, stale_s=60, clock=lambda: now[0])
        secret = await store.create("k")
        digest = hashlib.sha256(secret.encode()).hexdigest()
        assert (await store.lookup(digest)) is not None
        # the same store object, but Redis now unreachable (a client on a dead port)
        dead = connect(st.redis_cfg.model_copy(update={"url": f"redis://127.0.0.1:{port_lease()}/0"}))
        store.redis = dead.client
        store.breaker = Breaker(30)
        now[0] += 10  # past key_cache_s: it tries Redis, fails, serves the stale entry
        t0 = time.monotonic()
        assert (await store.lookup(digest)) is not None
        with pytest.raises(KeyStoreUnavailable) as info:
            await store.lookup("0" * 64)
        assert info.value.status == 503
        now[0] += 100  # past key_stale_s: no longer trusted
        with pytest.raises(KeyStoreUnavailable):
            await store.lookup(digest)
        assert time.monotonic() - t0 < 1.0
        await dead.close()


def _keys_cli(*args: str, redis_url: str, prefix: str) -> subprocess.CompletedProcess[str]:
    """``thinkgate keys …`` as a user runs it, on the test Redis under ``prefix``."""
    env = {**os.environ, "THINKGATE_CONFIG": "", "THINKGATE_REDIS__URL": redis_url,
           "THINKGATE_REDIS__KEY_PREFIX": prefix, "THINKGATE_REDIS__START_IF_MISSING": "false"}
    return subprocess.run([sys.executable, "-m", "gateway", "keys", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=env)


def test_keys_take_the_id_as_argument_or_as_id_option(redis_url: str, redis_prefix: str) -> None:
    """``create``, ``update`` and ``revoke`` take the key id alike: first argument or ``--id`` (scripts use it).
    ``keys update team-a --rpm 2`` failed with "Missing option '--id'" while ``keys revoke team-a`` took it so."""
    pos, opt = f"pos-{uuid.uuid4().hex[:8]}", f"opt-{uuid.uuid4().hex[:8]}"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return _keys_cli(*args, redis_url=redis_url, prefix=redis_prefix)

    for made in (cli("create", pos), cli("create", "--id", opt)):
        assert made.returncode == 0 and made.stdout.strip(), made.stderr
    up = cli("update", pos, "--rpm", "2")
    assert up.returncode == 0 and '"rpm":2' in up.stderr, up.stderr
    up = cli("update", "--id", pos, "--rpm", "3")
    assert up.returncode == 0 and '"rpm":3' in up.stderr, up.stderr
    both = cli("update", pos, "--id", opt, "--rpm", "4")
    assert both.returncode == 2 and "two key ids" in both.stderr, both.stderr
    neither = cli("update", "--rpm", "4")
    assert neither.returncode == 2 and "give the key id" in neither.stderr, neither.stderr
    assert cli("update", pos, "--id", pos, "--rpm", "5").returncode == 0  # the same id twice is one id
    for gone in (cli("revoke", "--id", opt), cli("revoke", pos)):
        assert gone.returncode == 0 and "revoked" in gone.stderr, gone.stderr
    listed = {r["id"]: r for r in map(json.loads, cli("list", "--json").stdout.splitlines())}
    assert listed[pos]["rpm"] == 5 and listed[pos]["revoked"] and listed[opt]["revoked"], listed  # revoked: a time


# --- on a real Redis Cluster: the key store's three keys in three slots, written in ordered steps ---------------


def _slot(key: str) -> int:
    return int(key_slot(key.encode()))


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@contextlib.asynccontextmanager
async def _cluster_store(cluster: ClusterSet, tmp_path: Path) -> AsyncIterator[tuple[Stack, RedisKeyStore]]:
    prefix = f"tgk{uuid.uuid4().hex[:6]}:"
    async with stack(cluster.url, prefix, tmp_path / "s", socket_timeout_s=2.0, placement="tenant") as st:
        assert st.handle.kind == "cluster" and st.handle.prefix == "{" + prefix + "}"
        yield st, RedisKeyStore(st.handle, st.breaker, cache_s=0)


async def test_on_a_cluster_create_list_get_update_revoke_lookup(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    async with _cluster_store(redis_cluster, tmp_path) as (st, store):
        r, k = st.handle.client, store.keys
        secret = await store.create("team-a", tags={"team": "a"}, budget_usd_day=Decimal("1.5"), rpm=60)
        digest = _digest(secret)
        # the record in the key's tenant slot, the lookup copy in the digest's own, the id set shared
        rec_key, h_key = k.key_record("team-a"), k.key_by_hash(digest)
        assert _slot(rec_key) == _slot(k.tenant(key_tenant("team-a")))
        assert _slot(h_key) == _slot(k.tenant(tenant_tag("secret:" + digest)))
        assert len({_slot(rec_key), _slot(h_key), _slot(k.key_ids)}) == 3
        assert await r.get(rec_key) == await r.get(h_key) and await r.sismember(k.key_ids, "team-a")
        info = await store.lookup(digest)
        assert info is not None and (info.id, info.tags, info.rpm) == ("team-a", {"team": "a"}, 60)
        with pytest.raises(KeyExists):
            await store.create("team-a")
        secret_b = await store.create("team-b")
        assert [x.id for x in await store.list()] == ["team-a", "team-b"]
        got = await store.get("team-a")
        assert got is not None and got.budget_usd_day == "1.5" and got.revoked is None
        new = await store.update("team-a", rpm=5, budget_usd_day=None)
        assert (new.rpm, new.budget_usd_day) == (5, None)
        info = await store.lookup(digest)
        assert info is not None and (info.rpm, info.budget_usd_day) == (5, None)
        got = await store.get("team-a")
        assert got is not None and got.rpm == 5
        with pytest.raises(KeyError):
            await store.update("nobody", rpm=1)
        assert await store.revoke("team-a") is True
        assert await store.revoke("team-a") is False
        with pytest.raises(KeyError):
            await store.revoke("nobody")
        assert await store.lookup(digest) is None and await r.exists(h_key) == 0
        with pytest.raises(ValueError, match="revoked"):
            await store.update("team-a", rpm=7)
        listed = {x.id: x for x in await store.list()}
        assert listed["team-a"].revoked is not None and listed["team-a"].rpm == 5 and listed["team-b"].revoked is None
        assert (await store.lookup(_digest(secret_b))) is not None
        with pytest.raises(KeyExists):  # ids are never reused
            await store.create("team-a")


async def test_on_a_cluster_a_hundred_keys_spread_over_the_masters(redis_cluster: ClusterSet,
                                                                   tmp_path: Path) -> None:
    async with _cluster_store(redis_cluster, tmp_path) as (st, store):
        k = store.keys
        names = [k.key_ids]
        for i in range(100):
            key_id = f"tenant{i:03d}"
            secret = await store.create(key_id)
            names += [k.key_record(key_id), k.key_by_hash(_digest(secret))]
        assert len(await store.list()) == 100
        assert [await st.handle.client.exists(n) for n in names] == [1] * len(names)
        counts = redis_cluster.slot_counts(names)
        print(f"\nthe key store's {len(names)} keys per master: {counts}")
        assert len(counts) == 3 and sum(counts.values()) == len(names)
        assert max(counts.values()) <= 0.5 * len(names), counts


async def test_on_a_cluster_each_half_done_step_is_harmless(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    """The states a crash between the ordered steps leaves (module doc of ``gateway/auth/redis_store.py``), written
    by hand: how lookup, list, get, update, revoke and create treat each."""
    async with _cluster_store(redis_cluster, tmp_path) as (st, store):
        r, k = st.handle.client, store.keys
        await store.create("whole")
        # create, crashed after the claim: an id without a record — skipped, unknown, and taken for good
        await r.sadd(k.key_ids, "claimed")
        # create, crashed after the lookup copy too: a copy whose secret was never returned (nor printed)
        never_printed = _digest("tg-never-printed")
        half = KeyRecord("copied", never_printed, created=time.time())
        await r.sadd(k.key_ids, "copied")
        await r.set(k.key_by_hash(never_printed), half.to_json())
        assert [x.id for x in await store.list()] == ["whole"]
        for key_id in ("claimed", "copied"):
            assert await store.get(key_id) is None
            with pytest.raises(KeyError):
                await store.revoke(key_id)
            with pytest.raises(KeyError):
                await store.update(key_id, rpm=1)
            with pytest.raises(KeyExists):
                await store.create(key_id)
        assert [x.id for x in await store.list()] == ["whole"]

        # revoke, crashed after deleting the lookup copy: no longer authenticates, listed active, update refuses
        secret = await store.create("revoking")
        digest = _digest(secret)
        await r.delete(k.key_by_hash(digest))
        assert await store.lookup(digest) is None
        listed = {x.id: x for x in await store.list()}
        assert listed["revoking"].revoked is None
        with pytest.raises(ValueError, match="revoked"):
            await store.update("revoking", rpm=3)
        # ... and a rerun of revoke finishes it
        assert await store.revoke("revoking") is True
        got = await store.get("revoking")
        assert got is not None and got.revoked is not None and got.rpm is None
        assert await store.revoke("revoking") is False
        assert await store.lookup(digest) is None and await r.exists(k.key_by_hash(digest)) == 0

        # update, crashed after the lookup copy: the new limits are in force, the old ones listed; a rerun converges
        secret = await store.create("updating", rpm=10)
        digest = _digest(secret)
        rec = await store.get("updating")
        assert rec is not None
        await r.set(k.key_by_hash(digest), dataclasses.replace(rec, rpm=20).to_json(), xx=True)
        info = await store.lookup(digest)
        assert info is not None and info.rpm == 20
        got = await store.get("updating")
        assert got is not None and got.rpm == 10
        await store.update("updating", rpm=20)
        got, info = await store.get("updating"), await store.lookup(digest)
        assert got is not None and info is not None and got.rpm == info.rpm == 20
        assert await r.get(k.key_by_hash(digest)) == await r.get(k.key_record("updating"))

        # an update that lost the race to a revoke (its record step finds the record revoked) writes nothing more
        secret = await store.create("raced", rpm=1)
        digest = _digest(secret)
        old = await store.get("raced")
        assert old is not None
        real_set = r.set

        async def revoke_first(name: str, value: bytes, **kw: object) -> object:
            done = await real_set(name, value, **kw)  # the update's lookup-copy step, then the whole revoke
            assert await store.revoke("raced") is True
            return done

        r.set = revoke_first  # type: ignore[method-assign]
        try:
            with pytest.raises(ValueError, match="revoked"):
                await store.update("raced", rpm=2)
        finally:
            r.set = real_set  # type: ignore[method-assign]
        got = await store.get("raced")
        assert got is not None and got.revoked is not None and got.rpm == 1
        assert await store.lookup(digest) is None and await r.exists(k.key_by_hash(digest)) == 0


async def test_on_a_cluster_a_crashed_create_is_rolled_back_by_repair(redis_cluster: ClusterSet,
                                                                      tmp_path: Path) -> None:
    """Creates that crashed after their claim, their lookup copy or their record (the store's own steps, the rest
    never run): not listed but named incomplete, left alone while younger than the grace period, rolled back by an
    applied repair after it (id, copy, record: the id is free again); a dry run changes nothing; a create running
    past the grace period finds its commit refused and deletes what it wrote; an id claimed by a store from before
    the pending entries is adopted, then rolled back."""
    async with _cluster_store(redis_cluster, tmp_path) as (st, store):
        r, k = st.handle.client, store.keys
        whole = await store.create("whole")

        def half(key_id: str) -> KeyRecord:
            return KeyRecord(key_id, _digest(f"tg-never-returned-{key_id}"), created=time.time())

        claimed, copied, recorded = half("claimed"), half("copied"), half("recorded")
        for rec in (claimed, copied, recorded):
            await store.claim(rec)
        for rec in (copied, recorded):
            await store.write_copy(rec)
        await store.write_record(recorded)
        await r.sadd(k.key_ids, "legacy")  # an old store's crash after its SADD: no pending entry
        crashed = ["claimed", "copied", "recorded"]

        assert [x.id for x in await store.list()] == ["whole"]  # "recorded" has a record, but never committed
        assert await store.incomplete() == crashed
        before = {n: await r.get(n) for n in (k.key_by_hash(copied.secret_sha256),
                                               k.key_by_hash(recorded.secret_sha256), k.key_record("recorded"))}

        # within the grace period (it may be a create still running): left alone, applied or not
        found = await store.repair(apply=True)
        assert {f.id: f.state for f in found} == {**dict.fromkeys(crashed, "young"), "legacy": "adopted"}
        assert [(f.copy, f.record) for f in found if f.id in crashed] == [(False, False), (True, False), (True, True)]
        # a dry run past it: says what it would do, changes nothing
        found = await store.repair(grace_s=0)
        assert {f.id: f.state for f in found} == dict.fromkeys([*crashed, "legacy"], "would_roll_back")
        assert None not in before.values() and [await r.get(n) for n in before] == list(before.values())
        claims = [orjson.loads(await r.hget(k.key_pending, i) or b"{}")["sha256"] for i in crashed]
        assert claims == [x.secret_sha256 for x in (claimed, copied, recorded)]  # each claim names its digest

        # a create claimed now is never rolled back by a repair with a grace period: it finishes, and is a key
        running = half("running")
        await store.claim(running)
        await asyncio.sleep(1.1)
        found = await store.repair(grace_s=60, apply=True)
        assert {f.id: f.state for f in found} == dict.fromkeys([*crashed, "legacy", "running"], "young")
        await store.finish(running)
        assert [x.id for x in await store.list()] == ["running", "whole"]
        assert "running" not in {f.id for f in await store.repair(grace_s=0)}  # committed: no longer pending

        # applied past the grace period: rolled back whole
        found = await store.repair(grace_s=1, apply=True)
        assert {f.id: f.state for f in found} == dict.fromkeys([*crashed, "legacy"], "rolled_back")
        for rec in (claimed, copied, recorded):
            assert not await r.sismember(k.key_ids, rec.id)
            assert await r.exists(k.key_by_hash(rec.secret_sha256), k.key_record(rec.id)) == 0
            assert await store.lookup(rec.secret_sha256) is None
        assert not await r.sismember(k.key_ids, "legacy") and await r.exists(k.key_pending) == 0
        assert await store.incomplete() == [] and await store.repair(grace_s=0, apply=True) == []
        assert await store.lookup(_digest(whole)) is not None  # committed keys untouched
        assert [x.id for x in await store.list()] == ["running", "whole"]
        secret = await store.create("recorded")  # the id is free again: nobody ever had the old one's secret
        assert (await store.lookup(_digest(secret))) is not None

        # a create that ran past the grace period, rolled back between its steps: its commit is refused, it deletes
        # what it wrote after the repair and returns no secret
        slow = half("slow")
        await store.claim(slow)
        await store.write_copy(slow)
        [f] = await store.repair(grace_s=0, apply=True)
        assert (f.id, f.state, f.copy) == ("slow", "rolled_back", True)
        with pytest.raises(KeyCreateRolledBack):
            await store.finish(slow)
        assert await r.exists(k.key_by_hash(slow.secret_sha256), k.key_record("slow"), k.key_pending) == 0
        assert not await r.sismember(k.key_ids, "slow")
        assert [x.id for x in await store.list()] == ["recorded", "running", "whole"]
