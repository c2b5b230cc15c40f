"""Deleting a throw-away Redis key prefix (benches and tests run on the shared Redis under prefixes of their own):
the one cleanup every bench and test fixture uses."""

from __future__ import annotations

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
