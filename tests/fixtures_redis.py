"""A real Redis for the tests: the one at $REDIS_URL (default 127.0.0.1:6379), or a private one started here."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from gateway.redis_server import ensure, ping, start_private


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of an answering Redis server; starts ``redis-server`` on a free port when none answers."""
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    proc = None
    if ping(url):
        yield url
        return
    try:
        proc, url = ensure(url)
    except Exception:
        proc, url = start_private()
    try:
        yield url
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix unique to this test; its keys are deleted afterwards."""
    import redis

    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
