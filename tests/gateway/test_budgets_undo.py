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
from decimal import Decimal
from pathlib import Path

import pytest
import redis
from redis.exceptions import ResponseError

from gateway.state.budgets import BudgetStore
from gateway.state.keys import RedisKeys
from tests.fixtures.redis_stack import snapshot, stack

REPO = Path(__file__).resolve().parents[2]


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
