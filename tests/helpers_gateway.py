"""A real gateway (uvicorn on loopback) over the upstream simulator with its own Redis key prefix and spool,
for the cache/metering/limits/fault tests. Keys: ``alice``, ``bob`` (see :data:`SECRETS`) and the admin key."""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import redis
from fixtures_upstream import GatewayServer, sim_settings

from gateway.usage import UsageEvent

SECRETS = {"alice": "tg-alice-secret-000000000000", "bob": "tg-bob-secret-0000000000000"}
ADMIN_SECRET = "tg-admin-secret-00000000000"


def keys_config(**per_key: dict[str, Any]) -> dict[str, Any]:
    """``auth`` section: alice and bob (with ``per_key`` extras such as budgets), plus the admin key."""
    return {
        "keys": [{"id": kid, "secret": secret, "tags": {"team": kid[0]}, **per_key.get(kid, {})}
                 for kid, secret in SECRETS.items()],
        "admin_key_sha256": hashlib.sha256(ADMIN_SECRET.encode()).hexdigest(),
    }


def gateway_settings(sim_base_url: str, redis_url: str, prefix: str, spool: Path, **overrides: Any) -> Any:
    sections: dict[str, Any] = {
        "redis": {"url": redis_url, "key_prefix": prefix, "start_if_missing": False, "breaker_cooldown_s": 0.5},
        "metering": {"spool_path": str(spool), "replay_interval_s": 0.2},
        "auth": keys_config(),
    }
    sections.update(overrides)
    return sim_settings(sim_base_url, redis_url, **sections)


def cleanup(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@contextlib.contextmanager
def accounting_gateway(sim_base_url: str, redis_url: str, tmp: Path, prefix: str | None = None,
                       **overrides: Any) -> Iterator[GatewayServer]:
    """Start a gateway; on exit stop it and delete its keys (when it made up its own prefix)."""
    own = prefix is None
    prefix = prefix or f"tgtest:{uuid.uuid4().hex[:12]}:"
    settings = gateway_settings(sim_base_url, redis_url, prefix, tmp / f"spool-{uuid.uuid4().hex[:6]}.jsonl",
                                **overrides)
    try:
        with GatewayServer(settings) as gw:
            yield gw
    finally:
        if own:
            cleanup(redis_url, prefix)


def usage_events(gw: GatewayServer, request_ids: list[str] | None = None, count: int | None = None,
                 timeout_s: float = 10.0) -> dict[str, UsageEvent]:
    """Raw usage events from ``GET /v1/usage`` (admin key) by request id; waits (bounded) until the given
    ``request_ids`` (or ``count`` events) are there — metering writes happen just after each response."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(gw.base_url + "/usage", params={"since": "0", "limit": "10000"},
                      headers={"authorization": f"Bearer {ADMIN_SECRET}"}, timeout=10)
        r.raise_for_status()
        events = {row["request_id"]: _event(row) for row in r.json()["data"]}
        ready = (request_ids is None or all(i in events for i in request_ids)) and (
            count is None or len(events) >= count)
        if ready or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def _event(row: dict[str, Any]) -> UsageEvent:
    row = dict(row)
    row.pop("cost_usd", None)
    ts = row.pop("ts")
    event = UsageEvent.from_dict(row)
    event.ts = datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    return event


def create_key(redis_url: str, prefix: str, key_id: str, **limits: Any) -> str:
    """Create a key in the Redis key store under ``prefix`` (as ``thinkgate keys create`` does); its secret."""
    import asyncio

    from gateway.breaker import Breaker
    from gateway.config import RedisConfig
    from gateway.keystore import RedisKeyStore
    from gateway.redis_client import connect

    async def go() -> str:
        handle = connect(RedisConfig(url=redis_url, key_prefix=prefix, socket_timeout_s=2.0))
        try:
            return await RedisKeyStore(handle, Breaker(1.0)).create(key_id, **limits)
        finally:
            await handle.close()

    return asyncio.run(go())
