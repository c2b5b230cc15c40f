"""Property test through real gateways over the upstream simulator and a real Redis: random request shapes (model /
tier, n, max_tokens, stream, prompt length) × tiers (thinking off, forced two-phase thinking that escalates, native
thinking) × admission modes (one script for all levels, or one per level group as on Redis Cluster) × budget levels
(key, tag): a concurrent burst never takes a hard budget past its amount."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import RedisConfig
from gateway.ledger.event import micro_to_usd
from gateway.state.breaker import Breaker
from gateway.state.budgets import BudgetStore
from gateway.state.keys import RedisKeys
from gateway.state.redis import connect
from tests.fixtures.gateway import accounting_gateway, cleanup, create_key
from tests.fixtures.upstream import GatewayServer, SimProcess, sim_tiers

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


@pytest.fixture(scope="module")
def gateways(upstream_sim: SimProcess, redis_url: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, GatewayServer]]]:
    tmp: Path = tmp_path_factory.mktemp("budprop")
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"budget_mode": "forced", "thinking_budget": 8, "escalate_on": ["length_in_thought"]})
    common: dict[str, Any] = {"tiers": tiers, "redis": {"url": redis_url, "key_prefix": prefix,
                                                        "start_if_missing": False, "socket_timeout_s": 5.0}}
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp, prefix,
                                limits={"budget_mode": "hard", "admission_script": "single"}, **common) as one, \
                accounting_gateway(upstream_sim.base_url, redis_url, tmp, prefix,
                                   limits={"budget_mode": "hard", "admission_script": "grouped"}, **common) as per:
            yield prefix, {"single": one, "grouped": per}
    finally:
        cleanup(redis_url, prefix)


SHAPE = st.fixed_dictionaries({
    "model": st.sampled_from(["none", "short", "long", "auto"]),
    "n": st.integers(1, 3),
    "max_tokens": st.sampled_from([None, 1, 5, 64, 10_000]),
    "stream": st.booleans(),
    "words": st.integers(1, 120),
})


def _body(shape: dict[str, Any]) -> dict[str, Any]:
    text = " ".join(WORDS[i % len(WORDS)] for i in range(shape["words"]))
    body: dict[str, Any] = {"model": shape["model"], "n": shape["n"], "stream": shape["stream"],
                            "messages": [{"role": "user", "content": text}], "sim": {"tag": uuid.uuid4().hex}}
    if shape["max_tokens"] is not None:
        body["max_tokens"] = shape["max_tokens"]
    return body


async def _fire(urls: list[str], secret: str, bodies: list[dict[str, Any]]) -> list[int]:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=len(bodies))) as http:
        async def one(i: int, body: dict[str, Any]) -> int:
            headers = {"authorization": f"Bearer {secret}", "cache-control": "no-store"}
            async with http.stream("POST", urls[i % len(urls)] + "/chat/completions", json=body,
                                   headers=headers) as r:
                await r.aread()
                return r.status_code
        return list(await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies))))


async def _set_tag_budget(redis_url: str, prefix: str, tag: str, micro: int) -> None:
    handle = connect(RedisConfig(url=redis_url, key_prefix=prefix, socket_timeout_s=5.0))
    try:
        await BudgetStore(handle, Breaker(1.0)).set(f"tag:{tag}", Decimal(micro) / 1_000_000, None)
    finally:
        await handle.close()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=st.lists(SHAPE, min_size=1, max_size=3), mode=st.sampled_from(["single", "grouped", "both"]),
       level=st.sampled_from(["key", "tag"]), budget=st.integers(100, 4000))
def test_property_no_request_shape_tier_or_mode_overspends_a_hard_budget(
        gateways: tuple[str, dict[str, GatewayServer]], redis_url: str, shapes: list[dict[str, Any]], mode: str,
        level: str, budget: int) -> None:
    prefix, gws = gateways
    urls = [gws[m].base_url for m in (["single", "grouped"] if mode == "both" else [mode])]
    kid = f"prop-{uuid.uuid4().hex[:8]}"
    tag = f"team=p{uuid.uuid4().hex[:8]}"
    if level == "key":
        secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(budget))
    else:
        asyncio.run(_set_tag_budget(redis_url, prefix, tag, budget))
        secret = create_key(redis_url, prefix, kid, tags={"team": tag.split("=")[1]})
    bodies = [_body(shapes[i % len(shapes)]) for i in range(8)]
    statuses = asyncio.run(_fire(urls, secret, bodies)) + asyncio.run(_fire(urls, secret, bodies[:4]))
    assert all(s in (200, 400, 429) for s in statuses), statuses
    client = redis.Redis.from_url(redis_url)
    k = RedisKeys(prefix)
    try:
        deadline = time.monotonic() + 20
        while client.hlen(k.reservations(kid)) and time.monotonic() < deadline:  # every call settled
            time.sleep(0.05)
        assert client.hlen(k.reservations(kid)) == 0
        day = time.strftime("%Y-%m-%d", time.gmtime())
        name = k.key_day(kid, day) if level == "key" else k.level_day("tag", tag, day)
        spent = int(client.hget(name, "cost_micro_usd") or 0)
    finally:
        client.close()
    assert spent <= budget, (spent, budget, statuses, shapes)
