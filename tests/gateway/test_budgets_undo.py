"""``thinkgate budgets set|remove`` write a level's definition and its listing all or nothing: real Redis.

The definition hash (``budget:…:def``: what admission applies) and the listing ``budgets:defs`` (what ``budgets
list``, ``/v1/usage`` and the replicas' own copies read) were two separate writes: a listing of the wrong type (a
string SET at ``budgets:defs``) refused the second after the first, so ``set`` left a budget in force but listed
nowhere, and ``remove`` a budget no longer in force but still listed. Now each is one script (``SET_LUA``,
``REMOVE_LUA`` in ``gateway/state/budgets.py``) and the CLI says which key to fix, exit 4.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import redis
from redis.exceptions import ResponseError

from gateway.config import LimitsConfig
from gateway.state.breaker import Breaker
from gateway.state.budgets import BudgetLevels, BudgetStore
from gateway.state.keys import RedisKeys
from tests.fixtures.gateway import SECRETS, accounting_gateway, cleanup
from tests.fixtures.redis_cluster import ClusterSet
from tests.fixtures.redis_stack import Stack, snapshot, stack
from tests.fixtures.upstream import SimProcess

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")



@pytest.mark.parametrize("defined", [False, True])
async def test_a_budget_set_refused_by_its_listing_writes_no_definition(redis_url: str, redis_prefix: str,
                                                                        tmp_path: Path, defined: bool) -> None:
    """The listing is a string: ``set`` raises an error naming it, and the level's definition is as it was — none
    (``defined`` False: it used to be created, the budget then in force) or the old amounts (it used to be
    replaced). Fixed, ``set`` writes both."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        r, k = s.handle.client, RedisKeys(s.handle.prefix)
        store = BudgetStore(s.handle, s.breaker)
        if defined:
            await store.set("tag:team=a", Decimal("100"), Decimal("1000"))
        await r.delete(k.budget_defs)
        await r.set(k.budget_defs, "not a hash")
        before = await snapshot(s)
        with pytest.raises(ResponseError) as info:
            await store.set("tag:team=a", Decimal("7"), None)
        assert await snapshot(s) == before
        assert f"ThinkGate budgets set: HSET {k.budget_defs} failed, nothing written (undone)" in str(info.value)

        await r.delete(k.budget_defs)
        await store.set("tag:team=a", Decimal("7"), None)
        assert await r.hgetall(k.level_budget("tag", "team=a")) == {b"day": b"7000000", b"month": b"-1"}
        assert await store.list() == {"tag:team=a": {"usd_day": "7", "usd_month": None}}


async def test_a_budget_remove_refused_by_its_listing_keeps_the_definition(redis_url: str, redis_prefix: str,
                                                                           tmp_path: Path) -> None:
    """The listing is a string: ``remove`` raises, and the definition is still there (it used to be deleted — the
    budget out of force — with the listing left as it was)."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        r, k = s.handle.client, RedisKeys(s.handle.prefix)
        store = BudgetStore(s.handle, s.breaker)
        await store.set("global", None, Decimal("5000"))
        await r.delete(k.budget_defs)
        await r.set(k.budget_defs, "not a hash")
        before = await snapshot(s)
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await store.remove("global")
        assert await snapshot(s) == before
        await r.delete(k.budget_defs)
        assert await store.remove("global") is False  # not listed (the listing was lost): the definition goes
        assert await r.exists(k.level_budget("global", "global")) == 0


def test_the_cli_says_which_key_refused_a_budget_and_exits_4(redis_url: str, redis_prefix: str) -> None:
    """``thinkgate budgets set`` with the listing a string: one line naming the key and saying nothing was written,
    exit 4 (it was a traceback, with the definition written)."""
    k = RedisKeys(redis_prefix)
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(k.budget_defs, "not a hash")
        env = {**os.environ, "THINKGATE_CONFIG": "", "THINKGATE_REDIS__URL": redis_url,
               "THINKGATE_REDIS__KEY_PREFIX": redis_prefix, "THINKGATE_REDIS__START_IF_MISSING": "false"}
        got = subprocess.run([sys.executable, "-m", "gateway", "budgets", "set", "--tag", "team=a", "--usd-day", "50"],
                             cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
        assert got.returncode == 4, got.stderr
        assert "Traceback" not in got.stderr and len(got.stderr.strip().splitlines()) == 1
        assert "thinkgate: budget of tag:team=a not set, nothing written — Redis refused the write" in got.stderr
        assert k.budget_defs in got.stderr
        assert client.exists(k.level_budget("tag", "team=a")) == 0
    finally:
        client.close()


def _cli(redis_url: str, redis_prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "THINKGATE_CONFIG": "", "THINKGATE_REDIS__URL": redis_url,
           "THINKGATE_REDIS__KEY_PREFIX": redis_prefix, "THINKGATE_REDIS__START_IF_MISSING": "false"}
    return subprocess.run([sys.executable, "-m", "gateway", "budgets", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=env)


def test_list_and_remove_name_the_refused_key_and_exit_4(redis_url: str, redis_prefix: str) -> None:
    """The listing a string: ``budgets list`` was a traceback (exit 1) and ``remove``'s error named only the script's
    SHA. Both say which key, one line, exit 4."""
    k = RedisKeys(redis_prefix)
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(k.budget_defs, "not a hash")
        for args in (("list",), ("list", "--json"), ("remove", "--tag", "team=a")):
            got = _cli(redis_url, redis_prefix, *args)
            assert got.returncode == 4, (args, got.stderr)
            last = got.stderr.strip().splitlines()[-1]  # (list: after the gateway's own ERROR line for the read)
            assert "Traceback" not in got.stderr and last.startswith("thinkgate: budget"), got.stderr
            assert k.budget_defs in last, got.stderr
    finally:
        client.delete(k.budget_defs)
        client.close()


async def test_a_listing_redis_refuses_keeps_the_budgets_as_last_read(redis_url: str, redis_prefix: str,
                                                                      tmp_path: Path) -> None:
    """The gateway re-reads the listing before admissions (``BudgetLevels.refresh``): a listing of the wrong type
    raised there — every request a 500. Now the copy as last read is kept (a budget set before still known) and the
    refusal is logged, once a minute, naming the key."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        r, k = s.handle.client, RedisKeys(s.handle.prefix)
        await BudgetStore(s.handle, s.breaker).set("tag:team=a", Decimal("7"), None)
        levels = BudgetLevels(s.handle, s.breaker, LimitsConfig())
        await levels.refresh(force=True)
        assert levels.configured()["tag:team=a"][0] == 7_000_000 and levels.refused is None
        await r.delete(k.budget_defs)
        await r.set(k.budget_defs, "not a hash")
        await levels.refresh(force=True)
        assert levels.configured()["tag:team=a"][0] == 7_000_000  # as last read
        assert levels.refused is not None and k.budget_defs in levels.refused
        assert not s.breaker.is_open
        await r.delete(k.budget_defs)
        await levels.refresh(force=True)
        assert levels.refused is None and "tag:team=a" not in levels.configured()


def test_a_gateway_with_a_listing_of_the_wrong_type_still_serves(upstream_sim: SimProcess, redis_url: str,
                                                                 tmp_path: Path) -> None:
    """Through a real gateway: requests were answered 500 ``internal_error`` (with a traceback each) while the
    listing was a string; now 200."""
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    k = RedisKeys(prefix)
    client = redis.Redis.from_url(redis_url)
    client.set(k.budget_defs, "not a hash")
    body = {"model": "short", "messages": [{"role": "user", "content": "budgets unreadable"}]}
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix,
                                limits={"budget_refresh_s": 0.01}) as gw:
            for _ in range(3):
                got = httpx.post(gw.base_url + "/chat/completions", json=body, timeout=30,
                                 headers={"authorization": f"Bearer {SECRETS['bob']}", "cache-control": "no-store"})
                assert got.status_code == 200, got.text
                time.sleep(0.05)
    finally:
        cleanup(redis_url, prefix)
        client.close()


OLD_LISTING = {"tag:team=a": b'{"usd_day": "50", "usd_month": null}',
               "global": b'{"usd_day": null, "usd_month": "5000"}',
               "tag:team=b": b'{"usd_day": "1", "usd_month": null}',
               "bogus": b'{"usd_day": "1"}', "tag:x=y": b"no json"}


async def _sync_once_and_again(s: Stack) -> None:
    """A listing an older version wrote (``budgets:defs`` only; ``tag:team=b`` defined since, a field that is no level
    and a value that is no JSON beside them): ``sync`` gives each listed level without a definition its amounts,
    once — a second sync writes nothing — and leaves the defined level and the junk alone."""
    r, k = s.handle.client, RedisKeys(s.handle.prefix)
    await r.hset(k.budget_defs, mapping=OLD_LISTING)
    await r.hset(k.level_budget("tag", "team=b"), mapping={"day": 7, "month": -1})
    store = BudgetStore(s.handle, s.breaker)
    assert await store.sync() == 2
    assert await r.hgetall(k.level_budget("tag", "team=a")) == {b"day": b"50000000", b"month": b"-1"}
    assert await r.hgetall(k.level_budget("global", "global")) == {b"day": b"-1", b"month": b"5000000000"}
    assert await r.hgetall(k.level_budget("tag", "team=b")) == {b"day": b"7", b"month": b"-1"}
    assert await r.exists(k.level_budget("tag", "x=y")) == 0
    assert await store.sync() == 0


async def test_sync_gives_every_listed_level_without_one_its_definition(redis_url: str, redis_prefix: str,
                                                                        tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        await _sync_once_and_again(s)


async def test_sync_runs_in_one_slot_on_a_cluster(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    """The same on Redis Cluster: the listing and every definition are shared keys (the ``{prefix}`` slot), so the one
    script may take them all (a CROSSSLOT error otherwise)."""
    async with stack(redis_cluster.url, f"tgsync{uuid.uuid4().hex[:6]}:", tmp_path / "s", socket_timeout_s=2.0) as s:
        assert s.handle.kind == "cluster"
        await _sync_once_and_again(s)


class _Meanwhile(Breaker):
    """The breaker the store's calls go through, which runs ``meanwhile`` (another process's ``thinkgate budgets``)
    right before the store's second Redis call: after ``sync`` read the listing, before it writes."""

    def __init__(self, meanwhile: Callable[[], Awaitable[object]]) -> None:
        super().__init__(0.5)
        self.meanwhile = meanwhile
        self.calls = 0

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        self.calls += 1
        if self.calls == 2:
            await self.meanwhile()
        return await super().call(fn)


@pytest.mark.parametrize("meanwhile", ["remove", "set"])
async def test_a_budget_changed_while_sync_runs_is_not_undone(redis_url: str, redis_prefix: str, tmp_path: Path,
                                                              meanwhile: str) -> None:
    """``thinkgate budgets remove`` (or ``set``) of a level between sync's read of the listing and its write wins:
    sync used to check and write level by level, so a removed level got its definition back — a budget in force but
    listed nowhere (not in ``budgets list``, ``/v1/usage``, nor the replicas' copies) — and a level set between the
    check and the write got the old amounts. The script writes a level only while its listing is still what sync
    read and it still has no definition."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        r, k = s.handle.client, RedisKeys(s.handle.prefix)
        await r.hset(k.budget_defs, "tag:team=a", OLD_LISTING["tag:team=a"])  # an older version's: no definition
        cli = BudgetStore(s.handle, s.breaker)

        async def change() -> None:
            if meanwhile == "remove":
                assert await cli.remove("tag:team=a") is True
            else:
                await cli.set("tag:team=a", Decimal("9"), None)

        store = BudgetStore(s.handle, _Meanwhile(change))
        assert await store.sync() == 0
        listed = await cli.list()
        defined = await r.hgetall(k.level_budget("tag", "team=a"))
        if meanwhile == "remove":
            assert (listed, defined) == ({}, {})  # out of force and unlisted, both
        else:
            assert listed == {"tag:team=a": {"usd_day": "9", "usd_month": None}}
            assert defined == {b"day": b"9000000", b"month": b"-1"}
