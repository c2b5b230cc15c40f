"""``thinkgate serve``: Redis (started if missing), the local vLLM engine (if enabled), then the gateway."""

from __future__ import annotations

import logging
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import typer

from gateway.cli.common import CONFIG_OPTION, MODEL_DIR_OPTION, load_settings
from router.errors import install_hint

if TYPE_CHECKING:
    from gateway.config import Settings
    from gateway.engine.vllm import LocalEngine

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _dev_keys(settings: Settings) -> list[Any]:
    # With no key configured at all, a local development key keeps the gateway closed but usable.
    from gateway.auth.keys import DEV_KEY_ID, ensure_dev_key, sha256_hex
    from gateway.config import KeyConfig

    auth = settings.auth
    if not auth.require_key or auth.keys or auth.admin_key_sha256:
        return auth.keys
    secret, created = ensure_dev_key(auth.dev_key_file)
    what = "created a development API key" if created else "using the development API key"
    typer.echo(f"thinkgate: {what} in {auth.dev_key_file} (mode 0600); get it with: cat {auth.dev_key_file}",
               err=True)
    return [KeyConfig(id=DEV_KEY_ID, secret_sha256=sha256_hex(secret))]


def serve(
    config: Path | None = CONFIG_OPTION,
    host: str | None = typer.Option(None, help="Listen address (default: server.host, 127.0.0.1)."),
    port: int | None = typer.Option(None, help="Listen port (default: server.port, 8080)."),
    model_dir: Path | None = MODEL_DIR_OPTION,
) -> None:
    """Run the gateway: Redis (started if missing), the local vLLM engine (if enabled), then the API."""
    import uvicorn

    from gateway.config import missing_model, unpriced_tiers
    from gateway.engine.redis_server import RedisUnavailable, ensure, port_dir

    loaded = load_settings(config, model_dir)
    logging.basicConfig(level=loaded.server.log_level.upper(), format=LOG_FORMAT)
    missing = missing_model(loaded.engine.model_path) if loaded.engine.enabled else None
    if missing is not None:  # before anything starts: a wheel install on the embedded defaults has no model
        typer.echo(f"thinkgate: {missing}", err=True)
        raise typer.Exit(2)
    unpriced = unpriced_tiers(loaded.tiers)
    if unpriced:  # spend budgets, cost limits and USD reports silently read $0 otherwise
        typer.echo(f"thinkgate: warning: no prices on tier(s) {', '.join(unpriced)}: their tokens are metered at "
                   "$0, so spend budgets and cost limits never bind on them (set tiers[].prices, USD per 1M "
                   "tokens)", err=True)
    redis_proc, redis_url = None, loaded.redis.url
    if loaded.redis.start_if_missing:
        try:
            # persisted (the product's keys, budgets and usage outlive a restart) and in its own session: a
            # terminal's Ctrl-C goes to the gateway only, which stops this server in ``finally`` after its shutdown
            redis_proc, redis_url = ensure(loaded.redis.url, data_dir=loaded.redis.data_dir, own_session=True)
        except RedisUnavailable as exc:
            typer.echo(f"thinkgate: warning: {exc}; continuing without Redis (/ready reports it)", err=True)
        else:
            # which Redis, said once: a server that was already answering may be shared with other gateways
            parts = urlsplit(redis_url)  # never print a password: no user info, no query (?password=…)
            shown = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
            typer.echo(f"thinkgate: Redis: started a private redis-server at {shown} (its data in "
                       f"{port_dir(loaded.redis.data_dir, parts.port or 6379)})" if redis_proc is not None
                       else f"thinkgate: Redis: using the server already answering at {shown} (key prefix "
                       f"{loaded.redis.key_prefix!r}: a gateway with the same prefix there shares keys, limits, "
                       "cache and usage with this one)", err=True)
    # The settings are frozen: the command-line overrides, the private Redis and the dev key make one copy.
    settings = loaded.model_copy(update={
        "server": loaded.server.model_copy(update={"host": host or loaded.server.host,
                                                   "port": port if port is not None else loaded.server.port}),
        "redis": loaded.redis.model_copy(update={"url": redis_url}),
        "auth": loaded.auth.model_copy(update={"keys": (keys := _dev_keys(loaded)),
                                               "dev_key_only": keys is not loaded.auth.keys}),
    })
    conflict = _placement_conflict(settings)
    if conflict is not None:
        typer.echo(f"thinkgate: {conflict}", err=True)
        raise typer.Exit(2)
    if settings.redis.url.split("://", 1)[0] in ("redis+cluster", "rediss+cluster") and \
            settings.redis.cluster_placement == "shared":
        # the default keeps an existing cluster's data where it is, but a new user who missed deploy.md's advice got
        # every key's data on one master without a word (a new user's trial)
        typer.echo("thinkgate: note: redis.cluster_placement is shared: every API key's counters, cubes and windows "
                   "share one hash slot, one master of this cluster; a new cluster should set tenant, an existing "
                   "one can move with thinkgate redis migrate-placement (docs/deploy.md, section 3)", err=True)
    # uvicorn re-raises a captured SIGTERM after its graceful shutdown; with the default handler that kills
    # the process before the ``finally`` below, orphaning the engine and the private Redis.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    engine = None
    try:
        if settings.engine.enabled:
            engine = _start_engine(settings)
        from gateway.app import create_app
        from router.serving import RouterUnavailable

        try:
            app = create_app(settings)
        except RouterUnavailable as exc:  # routing.on_router_error: refuse_start
            typer.echo(f"thinkgate: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"thinkgate: serving on http://{settings.server.host}:{settings.server.port}/v1", err=True)
        if settings.dashboard.enabled:
            typer.echo(f"thinkgate: dashboard on http://{settings.server.host}:{settings.server.port}/dashboard "
                       "(log in with the admin key; on embedded defaults the development key)", err=True)
        from gateway.api.slow_clients import uvicorn_options

        uvicorn.run(app, host=settings.server.host, port=settings.server.port,
                    log_level=settings.server.log_level, access_log=False, **uvicorn_options(settings.server))
    finally:
        if engine is not None:
            engine.stop()
        if redis_proc is not None:
            _stop_redis(redis_proc)


def _placement_conflict(settings: Any) -> str | None:
    """On a Redis Cluster: data of the other ``redis.cluster_placement`` there (``gateway/state/placement.py``), or
    None. Redis unreachable: None (a WARNING) — the gateway starts and ``/ready`` reports it, as without the check."""
    import asyncio

    from gateway.state.placement import checked_conflict
    from gateway.state.redis import connect

    async def check() -> str | None:
        handle = connect(settings.redis)
        try:
            return await checked_conflict(handle, logging.WARNING)
        finally:
            await handle.close()

    return asyncio.run(check())


def _stop_redis(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """Stop the private Redis and wait for it: on SIGTERM it writes its append-only file out before exiting, and a
    ``serve`` started again at once must find the port free and the data complete (killed only if it hangs)."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _start_engine(settings: Settings) -> LocalEngine:
    from importlib.util import find_spec

    from gateway.engine.vllm import EngineError, LocalEngine

    if find_spec("vllm") is None:
        typer.echo(f"thinkgate: the embedded engine (engine.enabled: true) needs vllm; {install_hint('engine-cpu')}, "
                   "or set THINKGATE_ENGINE__ENABLED=false and point the tiers at your vLLM servers", err=True)
        raise typer.Exit(2)
    engine = LocalEngine(settings.engine)
    typer.echo(f"thinkgate: starting the local vLLM engine ({settings.engine.served_model_name}) …", err=True)
    try:
        engine.start()
    except EngineError as exc:
        typer.echo(f"thinkgate: the local engine failed to start: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"thinkgate: engine ready at {engine.base_url}", err=True)
    return engine


