"""The Redis key store: hashed at rest, create/list/revoke/lookup, caching and outage behaviour."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.auth.keys import KeyStore
from gateway.auth.redis_store import KeyExists, KeyStoreUnavailable, RedisKeyStore
from gateway.config import AuthConfig
from gateway.errors import AuthError
from gateway.state.breaker import Breaker
from gateway.state.redis import connect
from tests.fixtures.redis_stack import stack

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
