"""The admission script on a real Redis: budget definitions read in Redis at every admission (single script and
grouped per level, as on Redis Cluster), the grouped path's rollback, renewal of a running call's reservation,
and a property test — random request costs × levels × script modes, concurrent: hard mode never overspends."""

from __future__ import annotations

import asyncio
import time
import uuid
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench._lib.redis_keys import delete_prefix
from gateway.config import LevelBudget, LimitsConfig
from gateway.errors import RateLimited
from gateway.state.budgets import BudgetLevels, BudgetStore
from gateway.state.limits import Estimate, KeyLimits, Limits
from tests.fixtures.budget_race import CALLS, budget_race
from tests.fixtures.redis_stack import Stack, stack

MODES = ["single", "grouped"]


def _limits(s: Stack, mode: str, **cfg: object) -> Limits:
    limits = Limits(s.handle, s.breaker, LimitsConfig(admission_script=mode, **cfg))
    assert limits.grouped is (mode == "grouped")
    return limits


@pytest.mark.parametrize("mode", MODES)
async def test_a_budget_stored_in_redis_holds_for_the_next_admission(redis_url: str, redis_prefix: str,
                                                                    tmp_path: Path, mode: str) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        cfg = LimitsConfig(budget_refresh_s=3600, tag_budgets={"team=a": LevelBudget(usd_day=Decimal("1"))})
        levels = BudgetLevels(s.handle, s.breaker, cfg)
        await levels.refresh()  # the local copy: config only, and not re-read for an hour
        limits = _limits(s, mode, tag_budgets=cfg.tag_budgets)
        store = BudgetStore(s.handle, s.breaker)
        lim = KeyLimits("k1")
        tags = {"team": "a"}

        async def admit(micro: int) -> str:
            try:
                await limits.admit(lim, uuid.uuid4().hex, Estimate(micro, 1), time.time(), levels.candidates(tags),
                                   levels.above_key(tags))
            except RateLimited as exc:
                return exc.headers["x-thinkgate-budget-level"]
            return "ok"

        assert await admit(900_000) == "ok"  # the config's $1 (the reservation stays open)
        await store.set("tag:team=a", Decimal("0.5"), None)  # lowered below what is reserved
        assert await admit(1) == "tag:team=a"
        await store.set("tag:team=a", Decimal("2"), None)  # raised
        assert await admit(900_000) == "ok"
        # a new level: it already sees the $1.8 reserved by the calls in flight (every level is reserved)
        await store.set("global", Decimal("1.85"), None)
        assert await admit(50_001) == "global"
        assert await admit(50_000) == "ok"
        await store.remove("global")
        await store.remove("tag:team=a")  # back to the config's $1, of which 1.85 are reserved
        assert await admit(1) == "tag:team=a"
        # the local copy never changed: Redis alone decided
        assert [lv.id for lv in levels.above_key(tags)] == ["tag:team=a"]


async def test_grouped_refusal_rolls_back_the_levels_already_reserved(redis_url: str, redis_prefix: str,
                                                                      tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        limits = _limits(s, "grouped")
        store = BudgetStore(s.handle, s.breaker)
        await store.set("tag:team=b", Decimal("0.000050"), None)
        await store.set("global", Decimal("1"), None)
        lim = KeyLimits("k2", budget_day_micro=1_000_000, rpm=5, tpm=1_000)
        levels = BudgetLevels(s.handle, s.breaker, LimitsConfig()).candidates({"team": "b"})
        r = s.handle.client
        k = limits.keys
        now = time.time()
        w = int(now * 1000) // 60_000
        with pytest.raises(RateLimited) as info:  # the key admits it, the tag refuses: the key's part is undone
            await limits.admit(lim, "too-big", Estimate(51, 10), now, levels)
        assert info.value.headers["x-thinkgate-budget-level"] == "tag:team=b"
        assert not await r.hexists(k.reservations("k2"), "too-big")
        assert not await r.hexists(k.level_reservations("tag", "team=b"), "too-big")
        assert not await r.hexists(k.level_reservations("global", "global"), "too-big")
        assert int(await r.get(k.rpm("k2", w)) or 0) == 0 and int(await r.get(k.tpm("k2", w)) or 0) == 0
        # five refused in a row do not use up the key's RPM of 5: the sixth, that fits, is admitted
        for i in range(5):
            with pytest.raises(RateLimited):
                await limits.admit(lim, f"big-{i}", Estimate(51, 10), now, levels)
        adm = await limits.admit(lim, "fits", Estimate(50, 10), now, levels)
        assert [st.level.id for st in adm.levels] == ["key:k2", "tag:team=b", "global"]
        assert [st.level.day_micro for st in adm.levels] == [1_000_000, 50, 1_000_000]
        for h in (k.reservations("k2"), k.level_reservations("tag", "team=b"),
                  k.level_reservations("global", "global")):
            assert await r.hexists(h, "fits")


async def test_a_rollback_stopped_by_an_outage_is_sent_once_redis_answers(redis_url: str, redis_prefix: str,
                                                                           tmp_path: Path) -> None:
    """Grouped admission (Redis Cluster): a rollback that meets an outage is kept and sent once Redis answers — its
    reservations used to stay for ``reservation_ttl_s`` (10 min by default) and refuse the tenant's requests
    spuriously all that while. The rollback is idempotent: sent twice, it takes the RPM/TPM counts back once."""
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        limits = _limits(s, "grouped")
        lim = KeyLimits("k5", budget_day_micro=1_000_000, rpm=5, tpm=1_000)
        levels = BudgetLevels(s.handle, s.breaker, LimitsConfig()).candidates({"team": "e"})
        all_levels = [lim.level, *levels]
        r = s.handle.client
        k = limits.keys
        now = time.time()
        w = int(now * 1000) // 60_000
        est = Estimate(50, 10)
        await limits.admit(lim, "kept", est, now, levels)
        await limits.admit(lim, "other", est, now, levels)
        holds = [k.reservations("k5"), k.level_reservations("tag", "team=e"), k.level_reservations("global", "global")]
        s.breaker.record_failure(ConnectionError("test: breaker open"))  # every call refused: RedisDown
        await limits._roll_back(lim, "kept", est, now, all_levels)  # never raises
        assert all([await r.hexists(h, "kept") for h in holds])  # not undone during the outage
        deadline = time.monotonic() + 5
        while await r.hexists(k.level_reservations("global", "global"), "kept") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not any([await r.hexists(h, "kept") for h in holds])  # undone once Redis answered, at every level
        assert all([await r.hexists(h, "other") for h in holds])
        assert int(await r.get(k.rpm("k5", w)) or 0) == 1 and int(await r.get(k.tpm("k5", w)) or 0) == 10
        await limits._roll_back(lim, "kept", est, now, all_levels)  # again: nothing is taken back twice
        assert int(await r.get(k.rpm("k5", w)) or 0) == 1 and int(await r.get(k.tpm("k5", w)) or 0) == 10
        await limits.close()


async def test_a_renewed_reservation_keeps_counting_past_its_ttl(redis_url: str, redis_prefix: str,
                                                                 tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        limits = _limits(s, "auto", reservation_ttl_s=0.6)
        lim = KeyLimits("k3", budget_day_micro=10_000)
        levels = BudgetLevels(s.handle, s.breaker, LimitsConfig()).candidates({"team": "c"})
        await limits.admit(lim, "stream", Estimate(6000, 10), time.time(), levels)
        for _ in range(3):  # 0.9 s in all: past the TTL, renewed every 0.3 s
            await asyncio.sleep(0.3)
            assert await limits.renew("k3", {"team": "c"}, "stream", time.time()) == 3
        with pytest.raises(RateLimited):
            await limits.admit(lim, "next", Estimate(6000, 10), time.time(), levels)
        await asyncio.sleep(0.7)  # no longer renewed (a crashed replica): it stops counting
        await limits.admit(lim, "later", Estimate(6000, 10), time.time(), levels)
        assert await limits.renew("k3", {"team": "c"}, "stream", time.time()) == 0  # gone: not re-created


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=CALLS, mode=st.sampled_from(MODES), budgets=st.tuples(st.integers(0, 2000), st.integers(0, 2000),
                                                                   st.integers(0, 4000)))
def test_property_hard_mode_never_overspends_any_level(redis_url: str, tmp_path: Path,
                                                       calls: list[tuple[int, float, str]], mode: str,
                                                       budgets: tuple[int, int, int]) -> None:
    """Concurrent calls of two keys (tags team=x, and team=x + dept=y): each admitted with a random estimate,
    then billed a random cost up to it; the key, tag and global levels never end above their budgets."""
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"

    async def run() -> None:
        async with stack(redis_url, prefix, tmp_path / f"s-{uuid.uuid4().hex[:6]}", socket_timeout_s=2.0) as s:
            await budget_race(s, _limits(s, mode), calls, budgets)
            delete_prefix(redis_url, prefix)

    asyncio.run(run())


async def test_an_unbudgeted_levels_reservations_cannot_pile_up(redis_url: str, redis_prefix: str,
                                                                tmp_path: Path) -> None:
    # every level is reserved, budgeted or not; a crashed replica's reservations at an unbudgeted level (never
    # settled) are swept once the hash is large, instead of growing with every crash
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as s:
        limits = _limits(s, "single")
        r, k = s.handle.client, limits.keys
        resv = k.level_reservations("global", "global")
        await r.hset(resv, mapping={f"dead-{i}": "5|0|1000" for i in range(4100)})  # expired long ago
        levels = BudgetLevels(s.handle, s.breaker, LimitsConfig()).candidates({})
        await limits.admit(KeyLimits("k4", rpm=100), "live", Estimate(5, 1), time.time(), levels)
        assert await r.hlen(resv) == 1 and await r.hexists(resv, "live")
