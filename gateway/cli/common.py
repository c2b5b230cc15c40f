"""What every ``thinkgate`` sub-command shares: the ``--config`` option and loading the settings with a clean
exit (code 2 and the ConfigError message, no traceback) on an invalid configuration."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

if TYPE_CHECKING:
    from gateway.config import Settings

T = TypeVar("T")

CONFIG_OPTION = typer.Option(None, "--config", "-c", help="YAML config file (default: $THINKGATE_CONFIG).")
#: ``--model-dir`` of ``serve`` and ``config show`` (one meaning: :func:`load_settings` applies it).
MODEL_DIR_OPTION = typer.Option(None, "--model-dir", help="Serve this model directory with the embedded engine "
                                "instead of engine.model_path. A dial model's directory (with dial.json) also sets "
                                "its name, its tiers as budgets and its router; any other keeps the tiers.")


def load_settings(config: Path | None, model_dir: Path | None = None, **overrides: Any) -> Settings:
    """``Settings.load(config, **overrides)``, serving ``model_dir`` when given (``--model-dir``:
    :func:`gateway.config.model_dir.with_model_dir`), or exit 2 with the ConfigError message."""
    from gateway.config import ConfigError, Settings
    from gateway.config.model_dir import with_model_dir

    try:
        settings = Settings.load(config, **overrides)
        return settings if model_dir is None else with_model_dir(settings, model_dir)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


def run_on_redis(settings: Settings, fn: Callable[[Any], Awaitable[T]], min_timeout_s: float = 2.0, *,
                 check_placement: bool = True) -> T:
    """Run ``fn(RedisHandle)`` on the configured Redis (socket timeout at least ``min_timeout_s`` seconds: an
    offline command may wait longer than the request path) and close it; exit 3 when Redis is unreachable, exit 2
    when the cluster holds data of the other ``redis.cluster_placement`` (``gateway/state/placement.py``).
    ``check_placement`` False skips that check: for ``thinkgate redis migrate-placement`` alone, whose job is that
    data."""
    from gateway.config.redis import shown_url
    from gateway.state.breaker import RedisDown
    from gateway.state.placement import checked_conflict
    from gateway.state.redis import connect

    cfg = settings.redis.model_copy(update={"socket_timeout_s": max(settings.redis.socket_timeout_s, min_timeout_s)})

    async def go() -> T:
        handle = connect(cfg)
        try:
            conflict = await checked_conflict(handle) if check_placement else None
            if conflict is not None:  # a command on the other placement's names would read or write the wrong keys
                typer.echo(f"thinkgate: {conflict}", err=True)
                raise typer.Exit(2)
            return await fn(handle)
        finally:
            await handle.close()

    # the breaker's WARNING ("redis unreachable, breaker open…") is the server's log line: with no logging set up,
    # Python printed it bare to the terminal before this command's own message, which says the same once
    breaker_log = logging.getLogger("thinkgate.redis")
    level = breaker_log.level
    breaker_log.setLevel(logging.ERROR)
    try:
        return asyncio.run(go())
    except RedisDown as exc:
        # one line: no password from the URL, and no redis-py pool repr (a Sentinel failure dumped ~1,500 chars)
        why = " ".join(str(exc).split())
        why = why if len(why) <= 200 else why[:200] + "…"
        typer.echo(f"thinkgate: Redis unreachable at {shown_url(settings.redis.url)}: {why}"
                   f"{unreachable_hint(settings)}", err=True)
        raise typer.Exit(3) from None
    finally:
        breaker_log.setLevel(level)


def unreachable_hint(settings: Settings) -> str:
    """What to do when an offline command (``keys``, ``budgets``, ``usage``) finds no Redis at the configured URL,
    to follow its one-line error. The Redis ``thinkgate serve`` starts for itself (``redis.start_if_missing``, a
    loopback URL nobody answers) runs only while that gateway does — ``make serve`` stopped, ``thinkgate usage
    report`` said only "Connect call failed" — and its data folder on disk says it is that one; else the command may
    be pointed elsewhere than the gateway (another ``--config`` / ``REDIS_URL``)."""
    from urllib.parse import urlsplit

    from gateway.engine.redis_server import port_dir

    redis = settings.redis
    parts = urlsplit(redis.url)
    if (redis.start_if_missing and "+" not in parts.scheme and parts.hostname in ("127.0.0.1", "localhost", "::1")
            and port_dir(redis.data_dir, parts.port or 6379).is_dir()):
        return (f" — the private Redis that `thinkgate serve` starts on this port (its data in "
                f"{port_dir(redis.data_dir, parts.port or 6379)}) runs only while the gateway does: start the "
                "gateway (`make serve`, `thinkgate serve`) and run this again while it serves")
    return " — is the gateway running, and does this command get the same --config / REDIS_URL as its `serve`?"
