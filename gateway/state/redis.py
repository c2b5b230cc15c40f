"""One asyncio Redis client for the gateway, built from ``redis.url`` with redis-py's own client classes.

URL forms (redis-py has no URL scheme for Cluster or Sentinel; these two are ThinkGate's):

- ``redis://[user:pass@]host:port/db``, ``rediss://…``, ``unix://…`` → ``redis.asyncio.Redis.from_url``
- ``redis+cluster://[user:pass@]host:port`` (``rediss+cluster://`` for TLS) → ``redis.asyncio.RedisCluster``
- ``redis+sentinel://[user:pass@]h1:p1[,h2:p2…]/service_name[/db]`` → ``redis.asyncio.sentinel.Sentinel``
  and ``master_for(service_name)``

Every command is bounded by ``socket_timeout_s`` (connect and read) and is never retried by the client:
the gateway decides what a failure means (fail open, spool, 503) and the :class:`~gateway.state.breaker.Breaker`
stops it from paying the timeout on every request while Redis is down.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

from gateway.config import RedisConfig

AnyRedis = Redis | RedisCluster


def as_bytes(reply: bytes | str) -> bytes:
    """A reply value of the clients built here as bytes. They use ``decode_responses=False``, so replies are
    bytes; redis-py annotates them ``bytes | str`` because its annotations also cover decoding clients."""
    return reply if isinstance(reply, bytes) else reply.encode()


def as_text(reply: bytes | str) -> str:
    """A reply value (UTF-8 bytes from the clients built here) as ``str``."""
    return reply.decode() if isinstance(reply, bytes) else reply


@dataclass(frozen=True)
class RedisHandle:
    """The client, its kind, and the key prefix every ThinkGate key starts with."""

    client: AnyRedis
    kind: str  # "standalone" | "cluster" | "sentinel"
    prefix: str

    async def close(self) -> None:
        """Close the client's connections (idempotent)."""
        await self.client.aclose()


def cluster_prefix(prefix: str) -> str:
    """``prefix`` wrapped in a hash tag (``tg:`` → ``{tg:}``): the one slot of the shared keys (admission,
    metering); tenant keys then get ``{tg:<tenant>}`` (``gateway/state/keys.py``). A prefix that already has a
    hash tag is kept: every key then shares that one slot."""
    return prefix if "{" in prefix and "}" in prefix else "{" + prefix + "}"


def _common(cfg: RedisConfig) -> dict[str, Any]:
    return {
        "socket_timeout": cfg.socket_timeout_s,
        "socket_connect_timeout": cfg.socket_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": False,
    }


def connect(cfg: RedisConfig) -> RedisHandle:
    """Build the client for ``cfg.url`` (no network I/O happens here; the first command connects).

    Raises ``ValueError`` for an unsupported scheme or a Sentinel URL without a service name.
    """
    parsed = urlparse(cfg.url)
    scheme = parsed.scheme.lower()
    common = _common(cfg)
    if scheme in ("redis+cluster", "rediss+cluster"):
        url = cfg.url.replace("+cluster", "", 1)
        cluster = RedisCluster.from_url(url, max_connections=cfg.max_connections, **common)
        return RedisHandle(cluster, "cluster", cluster_prefix(cfg.key_prefix))
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        return RedisHandle(_sentinel_master(cfg, parsed, common), "sentinel", cfg.key_prefix)
    if scheme in ("redis", "rediss", "unix"):
        client = Redis.from_url(cfg.url, max_connections=cfg.max_connections, **common)
        return RedisHandle(client, "standalone", cfg.key_prefix)
    raise ValueError(f"redis.url: unsupported scheme {parsed.scheme!r} (redis, rediss, unix, redis+cluster, "
                     "redis+sentinel)")


async def ping(cfg: RedisConfig) -> bool:
    """True when the Redis of ``cfg.url`` answers PING within ``cfg.socket_timeout_s`` (any URL form; never raises).

    One server: PING. Sentinel: the sentinels name the master, the master answers. Cluster: every primary
    serving slots answers (a slot whose master is down and not yet failed over makes the cluster unready). A
    fresh client each call, so a readiness probe never reuses a connection the request path broke.
    """
    try:
        handle = connect(cfg)
    except (ValueError, RedisError, RedisClusterException, OSError):
        return False
    try:
        if isinstance(handle.client, RedisCluster):
            return bool(await handle.client.ping(target_nodes=RedisCluster.PRIMARIES))
        return bool(await handle.client.ping())
    except (RedisError, RedisClusterException, OSError):
        return False
    finally:
        with contextlib.suppress(RedisError, RedisClusterException, OSError):
            await handle.close()


def _sentinel_master(cfg: RedisConfig, parsed: Any, common: dict[str, Any]) -> Redis:
    netloc = parsed.netloc.rsplit("@", 1)[-1]
    nodes: list[tuple[str, int]] = []
    for part in netloc.split(","):
        host, _, port = part.rpartition(":")
        nodes.append((host or part, int(port) if host else 26379))
    path = [p for p in parsed.path.split("/") if p]
    if not path:
        raise ValueError("redis.url: a redis+sentinel:// URL needs the service name as its path")
    service, db = path[0], int(path[1]) if len(path) > 1 else 0
    auth: dict[str, Any] = {}
    if parsed.username:
        auth["username"] = unquote(parsed.username)
    if parsed.password:
        auth["password"] = unquote(parsed.password)
    sentinel = Sentinel(nodes, sentinel_kwargs={"socket_timeout": cfg.socket_timeout_s,
                                                "socket_connect_timeout": cfg.socket_timeout_s},
                        ssl=parsed.scheme.startswith("rediss"), **common, **auth)
    return sentinel.master_for(service, db=db)
