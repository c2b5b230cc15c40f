"""Deleting a throw-away Redis key prefix (benches and tests run on the shared Redis under prefixes of their own):
the one cleanup every bench and test fixture uses."""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config import Settings

#: keys per DEL command (a prefix with a million keys is deleted in bounded commands)
BATCH = 1000


def delete_prefix(redis_url: str, prefix: str) -> int:
    """Delete every key under ``prefix`` on ``redis_url`` (SCAN, never FLUSHDB: the server is shared), ``BATCH``
    keys per DEL. Returns the number of keys deleted. Synchronous: an async caller calls it at teardown."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=BATCH))
        for i in range(0, len(keys), BATCH):
            client.delete(*keys[i:i + BATCH])
        return len(keys)
    finally:
        client.close()


def bench_redis(stack: ExitStack, settings: Settings, prefix: str) -> Settings:
    """The Redis a bench runs on: ``settings.redis.url`` if one answers, else a private ``redis-server`` stopped
    when ``stack`` closes (``gateway.engine.redis_server.ensure``); every key under ``prefix`` is deleted then too.
    Returns ``settings`` with the URL in use."""
    from gateway.engine.redis_server import ensure

    proc, redis_url = ensure(settings.redis.url)
    if proc is not None:
        stack.callback(proc.terminate)
    stack.callback(delete_prefix, redis_url, prefix)
    return settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": redis_url})})
