"""Redis (``redis:``): the connection the ``gateway/state/`` services share.
"""

from __future__ import annotations

from pydantic import Field

from gateway.config.base import _Strict


class RedisConfig(_Strict):
    """Where the shared state lives (see ``gateway/state/redis.py`` for the URL forms).

    ``url``: ``redis://`` / ``rediss://`` / ``unix://`` (one server), ``redis+cluster://host:port`` (Redis
    Cluster), ``redis+sentinel://host:port[,host:port…]/service_name[/db]`` (Sentinel). In Cluster mode
    ``key_prefix`` is wrapped in a hash tag (``{tg:}``) unless it already has one: the keys of the admission and
    metering scripts share that slot, and tenant-owned keys (cache, conversations, sessions…) get a tag of their
    own tenant (``{tg:<tenant>}``, ``gateway/state/keys.py``); a prefix with its own hash tag keeps every key in
    that one slot. ``socket_timeout_s`` bounds connect and every command;
    after a failure the circuit breaker answers "down" at once for ``breaker_cooldown_s`` seconds.
    """

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "tg:"
    socket_timeout_s: float = Field(0.25, gt=0)
    start_if_missing: bool = True
    breaker_cooldown_s: float = Field(5.0, gt=0)
    max_connections: int = Field(256, ge=1)

