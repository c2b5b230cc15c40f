"""Redis (``redis:``): the connection the ``gateway/state/`` services share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse, urlsplit, urlunsplit

from pydantic import Field, field_validator

from gateway.config.base import _Strict
from gateway.config.paths import STATE_DIR


def url_nodes(parsed: Any, default_port: int) -> list[tuple[str, int]]:
    """The ``host:port`` list of a URL's netloc (comma-separated; credentials dropped). Raises ValueError for a
    port that is not a number, or no host."""
    netloc = parsed.netloc.rsplit("@", 1)[-1]
    nodes: list[tuple[str, int]] = []
    for part in netloc.split(","):
        host, _, port = part.rpartition(":")
        if host and not port.isdigit():
            raise ValueError(f"redis.url: port {port!r} of {part!r} is not a number")
        nodes.append((host or part, int(port) if host else default_port))
    if not nodes or not all(h for h, _ in nodes):
        raise ValueError("redis.url: no host")
    return nodes


def shown_url(url: str) -> str:
    """``url`` as messages show it: no password (``user:***@``) and no query (``?password=…``)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in userinfo else f"{user}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def check_url(url: str) -> None:
    """Raise ValueError (one line) when ``url`` is not a Redis URL :func:`gateway.state.redis.connect` takes: its
    scheme, its ports, a Sentinel URL's service name — checked when the configuration loads, not at the first
    command."""
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme in ("redis+cluster", "rediss+cluster"):
        url_nodes(parsed, 6379)
    elif scheme in ("redis+sentinel", "rediss+sentinel"):
        url_nodes(parsed, 26379)
        if not [p for p in parsed.path.split("/") if p]:
            raise ValueError("redis.url: a redis+sentinel:// URL needs the service name as its path")
    elif scheme in ("redis", "rediss"):
        try:
            parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError:
            raise ValueError(f"redis.url: the port of {shown_url(url)!r} is not a number") from None
        if "," in parsed.netloc:
            raise ValueError("redis.url: several hosts are for redis+cluster:// or redis+sentinel:// URLs")
    elif scheme != "unix":
        raise ValueError(f"redis.url: unsupported scheme {parsed.scheme!r} (redis, rediss, unix, redis+cluster, "
                         "redis+sentinel)")




class RedisConfig(_Strict):
    """Where the shared state lives (see ``gateway/state/redis.py`` for the URL forms).

    ``url``: ``redis://`` / ``rediss://`` / ``unix://`` (one server), ``redis+cluster://host:port[,host:port…]``
    (Redis Cluster: list several seeds, so one dead node does not read as a dead cluster),
    ``redis+sentinel://host:port[,host:port…]/service_name[/db]`` (Sentinel). In Cluster mode
    ``key_prefix`` is wrapped in a hash tag (``{tg:}``) unless it already has one: the keys of the admission and
    metering scripts share that slot, and tenant-owned keys (cache, conversations, sessions…) get a tag of their
    own tenant (``{tg:<tenant>}``, ``gateway/state/keys.py``); a prefix with its own hash tag keeps every key in
    that one slot. ``cluster_placement`` (Cluster only): ``shared`` keeps each API key's own metering and admission
    keys (its counters, usage cubes, reservations, RPM/TPM windows) in that shared slot, with the levels above the
    key; ``tenant`` puts them in the key's tenant slot, so admission and metering spread over the masters too
    (the metering scripts then run per slot, ``gateway/state/metering.py``). An existing deployment's data written
    under one is moved to the other, offline, by ``thinkgate redis migrate-placement`` (``docs/metering.md``).
    ``socket_timeout_s`` bounds connect and every command;
    after a failure the circuit breaker answers "down" at once for ``breaker_cooldown_s`` seconds.
    ``data_dir``: where the private ``redis-server`` that ``serve`` starts (``start_if_missing``) keeps its
    append-only file, one folder per port (``<data_dir>/6379/``), so keys, budgets and usage survive a restart.
    """

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "tg:"
    cluster_placement: Literal["shared", "tenant"] = "shared"
    socket_timeout_s: float = Field(0.25, gt=0)
    start_if_missing: bool = True
    data_dir: Path = STATE_DIR / "redis"
    breaker_cooldown_s: float = Field(5.0, gt=0)
    max_connections: int = Field(256, ge=1)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        check_url(v)  # a bad URL is a config error at load (exit 2), not a traceback at the first command
        return v

