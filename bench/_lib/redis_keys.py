"""Deleting a throw-away Redis key prefix (benches and tests run on the shared Redis under prefixes of their own)."""

from __future__ import annotations


def delete_prefix(redis_url: str, prefix: str) -> None:
    """Delete every key under ``prefix`` on ``redis_url`` (SCAN, never FLUSHDB: the server is shared)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
