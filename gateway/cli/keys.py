"""``thinkgate keys create|list|update|revoke|repair``: manage the API keys in the running gateway's Redis key store.

The commands talk to Redis directly (``redis.url`` of the config; ``REDIS_URL`` honoured), the same store the
gateway reads, so a new key works on every replica at once and a revoked one stops within
``auth.key_cache_s`` seconds. ``create`` prints the new secret once, alone on stdout (everything else goes
to stderr): ``export THINKGATE_API_KEY=$(thinkgate keys create --id team-a)``. The key id of ``create``,
``update`` and ``revoke`` is their first argument or ``--id`` alike.

Exit codes: 0 ok, 1 the key exists / is unknown, 2 invalid arguments or config, 3 Redis unreachable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, TypeVar

import orjson
import typer

from gateway.auth.keys import ANONYMOUS_KEY_ID, DEV_KEY_ID
from gateway.cli.common import CONFIG_OPTION, load_settings, run_on_redis

T = TypeVar("T")

app = typer.Typer(no_args_is_help=True)


def with_store(config: Path | None, fn: Callable[[Any], Awaitable[T]]) -> T:
    """Run ``fn(RedisKeyStore)`` against the configured Redis; exit 3 when it is unreachable."""
    from gateway.auth.redis_store import RedisKeyStore
    from gateway.state.breaker import Breaker

    return run_on_redis(load_settings(config), lambda handle: fn(RedisKeyStore(handle, Breaker(1.0), cache_s=0)))


def _parse_tags(tags: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for t in tags:
        k, sep, v = t.partition("=")
        if not sep or not k:
            typer.echo(f"thinkgate: --tag wants k=v, got {t!r}", err=True)
            raise typer.Exit(2)
        out[k] = v
    return out


MICRO_USD = Decimal("0.000001")


#: The largest budget a key or level may have (USD): spend is kept in integer micro-USD in Redis (a signed 64-bit
#: counter holds 9.2e12 USD); no real budget comes near it.
MAX_BUDGET_USD = Decimal(10) ** 12


def _usd(value: str | None, name: str) -> Decimal | None:
    if value is None:
        return None
    try:
        d = Decimal(value)
    except InvalidOperation:
        typer.echo(f"thinkgate: {name} wants a decimal USD amount, got {value!r}", err=True)
        raise typer.Exit(2) from None
    if not d.is_finite() or d < 0:  # finite first: a NaN does not compare (InvalidOperation)
        typer.echo(f"thinkgate: {name} must be a finite amount >= 0, got {value!r}", err=True)
        raise typer.Exit(2)
    if d > MAX_BUDGET_USD:  # beyond it quantize() overflows Decimal's 28 digits (InvalidOperation: a traceback)
        typer.echo(f"thinkgate: {name} {value} is above the largest budget, {MAX_BUDGET_USD:,} USD", err=True)
        raise typer.Exit(2)
    if d != d.quantize(MICRO_USD):  # spend is kept in integer micro-USD: a finer budget would be rounded silently
        typer.echo(f"thinkgate: {name} {value} has more than 6 decimal places (budgets are whole micro-USD, "
                   f"$0.000001)", err=True)
        raise typer.Exit(2)
    return d


#: The key id of ``create``, ``update`` and ``revoke``: the first argument (``keys update team-a --rpm 2``, as
#: ``revoke`` always took it) or ``--id`` (what ``create`` and ``update`` took, and scripts use), never both apart.
KEY_ID_ARGUMENT = typer.Argument(None, metavar="ID", show_default=False, help="Key id (or --id).")
KEY_ID_OPTION = typer.Option(None, "--id", show_default=False, help="Key id (or as the first argument).")


def _key_id(positional: str | None, option: str | None) -> str:
    """The one key id given, as the argument or as ``--id``; exit 2 when neither is, or two that differ are."""
    if positional is not None and option is not None and positional != option:
        typer.echo(f"thinkgate: two key ids, {positional!r} and --id {option!r}: give one", err=True)
        raise typer.Exit(2)
    key_id = positional if positional is not None else option
    if key_id is None:
        typer.echo("thinkgate: give the key id, as the first argument or with --id", err=True)
        raise typer.Exit(2)
    return key_id


#: ids the gateway gives keys of its own: the admin key, the development key, requests without a key, shadow calls
RESERVED_KEY_IDS = frozenset({"admin", DEV_KEY_ID, ANONYMOUS_KEY_ID, "_shadow"})  # _shadow: control.shadow.SHADOW_KEY


@app.command("create")
def create(
    key_arg: str | None = KEY_ID_ARGUMENT,
    key_opt: str | None = typer.Option(None, "--id", show_default=False,
                                       help="Key id (letters, digits, _ . : -; or as the first argument); never "
                                       "reused."),
    tag: list[str] = typer.Option([], "--tag", help="Tag k=v for metering (repeatable)."),
    budget_usd_day: str | None = typer.Option(None, help="Budget in USD per UTC day."),
    budget_usd_month: str | None = typer.Option(None, help="Budget in USD per UTC month."),
    rpm: int | None = typer.Option(None, min=1, help="Requests per minute."),
    tpm: int | None = typer.Option(None, min=1, help="Tokens per minute (prompt + completion)."),
    cache_namespace: str | None = typer.Option(None, help="Share cached answers with keys of this namespace."),
    allowed_tier: list[str] = typer.Option([], "--allowed-tier", help="A tier the key may use (repeatable; "
                                           "default: all)."),
    downgrade: bool = typer.Option(False, "--downgrade", help="Route a request for a tier the key may not use to "
                                   "the most capable allowed tier below it, instead of refusing (403)."),
    max_thinking_budget: int | None = typer.Option(None, min=0, help="Cap on every request's thinking budget "
                                                   "(tokens)."),
    refuse_over_cap: bool = typer.Option(False, "--refuse-over-cap", help="Refuse (400) a max_tokens above the "
                                         "tier's cap or a thinking budget above the key's, instead of clamping."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Create a key; prints its secret once, alone on stdout (it is stored only as a SHA-256 hash)."""
    import re

    from gateway.auth.redis_store import KeyCreateRolledBack, KeyExists

    key_id = _key_id(key_arg, key_opt)
    if not re.fullmatch(r"[A-Za-z0-9_.:-]+", key_id):
        typer.echo(f"thinkgate: key id {key_id!r}: only letters, digits and _ . : -", err=True)
        raise typer.Exit(2)
    settings = load_settings(config)
    taken = RESERVED_KEY_IDS | {k.id for k in settings.auth.keys}
    if key_id in taken:
        # an id the gateway or the config already uses: the new key would read that key's usage, cached answers,
        # stored responses and feedback (a security review reached another team's conversations this way)
        what = "a key of the config file" if key_id in {k.id for k in settings.auth.keys} else "reserved"
        typer.echo(f"thinkgate: key id {key_id!r} is {what}; choose another id", err=True)
        raise typer.Exit(2)
    tags = _parse_tags(tag)
    names = [t.name for t in settings.tiers]
    unknown = [t for t in allowed_tier if t not in names]
    if unknown:
        typer.echo(f"thinkgate: --allowed-tier: unknown tier(s) {unknown} (tiers: {names})", err=True)
        raise typer.Exit(2)
    day, month = _usd(budget_usd_day, "--budget-usd-day"), _usd(budget_usd_month, "--budget-usd-month")

    async def go(store: Any) -> str:
        return await store.create(key_id, tags=tags, budget_usd_day=day, budget_usd_month=month, rpm=rpm, tpm=tpm,
                                  cache_namespace=cache_namespace, allowed_tiers=list(allowed_tier) or None,
                                  on_disallowed_tier="downgrade" if downgrade else "refuse",
                                  max_thinking_budget=max_thinking_budget,
                                  over_cap="refuse" if refuse_over_cap else "clamp")

    try:
        secret = with_store(config, go)
    except (KeyExists, KeyCreateRolledBack) as exc:
        typer.echo(f"thinkgate: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"thinkgate: created key {key_id!r}; the secret below is shown only once", err=True)
    typer.echo(secret)


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if ts else "-"


@app.command("list")
def list_keys(
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line instead of a table."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """List the keys of the Redis store (never their secrets). Keys from the config file are not listed."""

    async def go(store: Any) -> tuple[list[Any], list[str]]:
        return await store.list(), await store.incomplete()

    records, incomplete = with_store(config, go)
    if incomplete:  # creates that have not committed: no keys (nobody has their secret), not listed
        typer.echo(f"thinkgate: {len(incomplete)} incomplete create(s) not listed ({', '.join(incomplete)}): "
                   "running now, or crashed — `thinkgate keys repair` rolls back those older than its grace "
                   "period", err=True)
    if as_json:
        for r in records:
            typer.echo(orjson.dumps(r.public()).decode())
        return
    head = f"{'id':<24} {'status':<8} {'created':<20} {'usd/day':>9} {'usd/month':>10} {'rpm':>6} {'tpm':>8}  tags"
    typer.echo(head)
    for r in records:
        status = "revoked" if r.revoked else "active"
        tags = ",".join(f"{k}={v}" for k, v in sorted(r.tags.items()))
        typer.echo(f"{r.id:<24} {status:<8} {_when(r.created):<20} {r.budget_usd_day or '-':>9} "
                   f"{r.budget_usd_month or '-':>10} {r.rpm or '-':>6} {r.tpm or '-':>8}  {tags}")


@app.command("update")
def update(
    key_arg: str | None = KEY_ID_ARGUMENT,
    key_opt: str | None = KEY_ID_OPTION,
    tag: list[str] = typer.Option([], "--tag", help="Replace the key's tags with these k=v (repeatable)."),
    budget_usd_day: str | None = typer.Option(None, help="Budget in USD per UTC day."),
    budget_usd_month: str | None = typer.Option(None, help="Budget in USD per UTC month."),
    rpm: int | None = typer.Option(None, min=1, help="Requests per minute."),
    tpm: int | None = typer.Option(None, min=1, help="Tokens per minute (prompt + completion)."),
    max_thinking_budget: int | None = typer.Option(None, min=0, help="Cap on every request's thinking budget."),
    unset: list[str] = typer.Option([], "--unset", help="Remove a limit: budget_usd_day, budget_usd_month, rpm, "
                                    "tpm or max_thinking_budget (repeatable)."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Change an active key's limits or tags in place (same secret and id: its usage stays one key's); running
    gateways apply it within auth.key_cache_s. Exit 1: unknown or revoked key; 2: bad arguments."""
    from gateway.auth.redis_store import UPDATABLE

    key_id = _key_id(key_arg, key_opt)
    changes: dict[str, Any] = {}
    if tag:
        changes["tags"] = _parse_tags(tag)
    for name, v in (("budget_usd_day", _usd(budget_usd_day, "--budget-usd-day")),
                    ("budget_usd_month", _usd(budget_usd_month, "--budget-usd-month")), ("rpm", rpm), ("tpm", tpm),
                    ("max_thinking_budget", max_thinking_budget)):
        if v is not None:
            changes[name] = v
    for name in unset:
        if name not in UPDATABLE or name == "tags":
            typer.echo(f"thinkgate: --unset {name!r}: not a limit (budget_usd_day, budget_usd_month, rpm, tpm, "
                       "max_thinking_budget)", err=True)
            raise typer.Exit(2)
        if name in changes:
            typer.echo(f"thinkgate: {name} both set and --unset", err=True)
            raise typer.Exit(2)
        changes[name] = None
    if not changes:
        typer.echo("thinkgate: nothing to change (give a limit, --tag or --unset)", err=True)
        raise typer.Exit(2)

    async def go(store: Any) -> Any:
        return await store.update(key_id, **changes)

    try:
        rec = with_store(config, go)
    except KeyError:
        in_config = any(k.id == key_id for k in load_settings(config).auth.keys)
        typer.echo(f"thinkgate: no key {key_id!r} in the key store" +
                   ("; it is a key of the config file (auth.keys): change it there" if in_config else ""), err=True)
        raise typer.Exit(1) from None
    except ValueError as exc:
        typer.echo(f"thinkgate: {exc}", err=True)
        raise typer.Exit(1) from None
    shown = {k: v for k, v in rec.public().items() if k in UPDATABLE}
    typer.echo(f"thinkgate: key {key_id!r} updated: {orjson.dumps(shown).decode()}", err=True)


@app.command("revoke")
def revoke(key_arg: str | None = KEY_ID_ARGUMENT, key_opt: str | None = KEY_ID_OPTION,
           config: Path | None = CONFIG_OPTION) -> None:
    """Revoke a key: it stops authenticating (within auth.key_cache_s on running gateways)."""
    key_id = _key_id(key_arg, key_opt)

    async def go(store: Any) -> bool:
        return await store.revoke(key_id)

    try:
        changed = with_store(config, go)
    except KeyError:
        typer.echo(f"thinkgate: no key {key_id!r}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"thinkgate: key {key_id!r} {'revoked' if changed else 'was already revoked'}", err=True)


@app.command("repair")
def repair(
    apply: bool = typer.Option(False, "--apply", help="Roll back what is found (default: only say what would be)."),
    grace_s: float = typer.Option(600.0, "--grace-s", min=0.0, help="Leave alone a create claimed less than this "
                                  "many seconds ago (it may still be running)."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Find key creates that never finished (a Cluster under redis.cluster_placement: tenant writes a key in
    steps) and, with --apply, roll back those older than --grace-s: their id, lookup copy and record. Nobody has
    their secret (it is printed only once a create finished). Dry run by default; one line per finding on stdout."""

    async def go(store: Any) -> list[Any]:
        return await store.repair(grace_s=grace_s, apply=apply)

    found = with_store(config, go)
    if not found:
        typer.echo("thinkgate: no half-written key", err=True)
        return
    for f in found:
        wrote = "+".join(step for step, done in (("copy", f.copy), ("record", f.record)) if done) or "claim only"
        typer.echo(f"{f.id:<24} {f.state:<16} age {f.age_s:>9.1f} s  {wrote}")
    if not apply and any(f.state in ("would_roll_back", "would_adopt") for f in found):
        typer.echo("thinkgate: dry run; --apply rolls these back", err=True)
