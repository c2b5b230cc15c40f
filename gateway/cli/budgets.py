"""``thinkgate budgets set|list|remove``: spend limits (USD) of the levels above the key — a tag, or the whole gateway.

    thinkgate budgets set --tag team=a --usd-day 50 [--usd-month 1000]
    thinkgate budgets set --global --usd-month 5000
    thinkgate budgets list [--json]
    thinkgate budgets remove --tag team=a

Every key tagged ``team=a`` then shares one spend limit, checked and reserved atomically with the key's own at
admission. The commands write the Redis hash ``budgets:defs`` the running gateways read (within
``limits.budget_refresh_s``); a level set here overrides the same level in the config
(``limits.tag_budgets`` / ``limits.global_budget``), and ``remove`` brings the config's back. ``list`` shows both
sources with today's and this month's spend.

Exit codes: 0 ok, 1 no such budget (remove), 2 invalid arguments or config, 3 Redis unreachable, 4 Redis refused the
write or, for ``list``, the read (a ThinkGate key of the wrong type, named in the message; nothing written: ``set``
and ``remove`` are all or nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import orjson
import typer

from gateway.cli.common import CONFIG_OPTION, load_settings, run_on_redis
from gateway.cli.keys import _usd

app = typer.Typer(no_args_is_help=True)
T = TypeVar("T")

TAG_OPTION = typer.Option(None, "--tag", help="The tag level, name=value (every key with this tag).")
GLOBAL_OPTION = typer.Option(False, "--global", help="The global level (every key).")


def _written(what: str, level: str, write: Callable[[], T]) -> T:
    """Run ``write`` (a ``run_on_redis`` of a :class:`~gateway.state.budgets.BudgetStore` write); a write Redis
    refused (an error reply: a key of the wrong type) is one line naming the key — the script's error says which, and
    that nothing was written — and exit 4, not a traceback."""
    from redis.exceptions import ResponseError

    try:
        return write()
    except ResponseError as exc:
        typer.echo(f"thinkgate: budget of {level} not {what}, nothing written — Redis refused the write: {exc}; fix or "
                   "delete the key it names, then run the command again", err=True)
        raise typer.Exit(4) from None


def _level(tag: str | None, is_global: bool) -> str:
    if (tag is None) == (not is_global):
        typer.echo("thinkgate: give exactly one of --tag name=value or --global", err=True)
        raise typer.Exit(2)
    if is_global:
        return "global"
    assert tag is not None
    k, sep, _ = tag.partition("=")
    if not sep or not k or "|" in tag:
        typer.echo(f"thinkgate: --tag wants name=value, got {tag!r}", err=True)
        raise typer.Exit(2)
    return f"tag:{tag}"


@app.command("set")
def set_budget(
    tag: str | None = TAG_OPTION,
    is_global: bool = GLOBAL_OPTION,
    usd_day: str | None = typer.Option(None, "--usd-day", help="Spend limit in USD per UTC day."),
    usd_month: str | None = typer.Option(None, "--usd-month", help="Spend limit in USD per UTC month."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Set (replace) the daily and/or monthly spend limit (USD) of a tag or of the whole gateway."""
    from gateway.state.breaker import Breaker
    from gateway.state.budgets import BudgetStore

    level = _level(tag, is_global)
    day, month = _usd(usd_day, "--usd-day"), _usd(usd_month, "--usd-month")
    if day is None and month is None:
        typer.echo("thinkgate: give --usd-day and/or --usd-month", err=True)
        raise typer.Exit(2)
    settings = load_settings(config)
    _written("set", level, lambda: run_on_redis(settings, lambda h: BudgetStore(h, Breaker(1.0)).set(level, day,
                                                                                                     month)))
    typer.echo(f"thinkgate: budget of {level} set: usd/day {day if day is not None else '-'}, "
               f"usd/month {month if month is not None else '-'}", err=True)


@app.command("remove")
def remove_budget(tag: str | None = TAG_OPTION, is_global: bool = GLOBAL_OPTION,
                  config: Path | None = CONFIG_OPTION) -> None:
    """Remove the spend limit set with ``budgets set`` for a level (one in the config file stays)."""
    from gateway.state.breaker import Breaker
    from gateway.state.budgets import BudgetStore

    level = _level(tag, is_global)
    settings = load_settings(config)
    removed = _written("removed", level,
                       lambda: run_on_redis(settings, lambda h: BudgetStore(h, Breaker(1.0)).remove(level)))
    if not removed:
        lim = settings.limits
        in_config = lim.global_budget is not None if level == "global" else level[4:] in lim.tag_budgets
        where = ("limits.global_budget" if level == "global" else f"limits.tag_budgets[{level[4:]!r}]")
        typer.echo(f"thinkgate: no budget set for {level} with 'budgets set'" +
                   (f"; its budget is in the config ({where}): change it there" if in_config else ""), err=True)
        raise typer.Exit(1)
    typer.echo(f"thinkgate: budget of {level} removed", err=True)


@app.command("list")
def list_budgets(
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line instead of a table."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """List the tag and global spend limits (config and Redis) with today's and this month's spend (USD)."""
    from redis.exceptions import ResponseError

    from gateway.ledger.event import micro_to_usd
    from gateway.state.breaker import Breaker
    from gateway.state.budgets import BudgetLevels, parse_level
    from gateway.state.keys import RedisKeys

    settings = load_settings(config)
    now = time.time()
    day = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")

    async def go(handle: Any) -> list[dict[str, Any]]:
        breaker = Breaker(1.0)
        # Redis first: the refresh below keeps its last copy when Redis is down (the request path's rule), and an
        # empty table with exit 0 read as "no budgets set" (exit 3, as every other Redis command)
        await breaker.call(lambda: handle.client.ping())
        levels = BudgetLevels(handle, breaker, settings.limits)
        await levels.refresh(force=True)
        if levels.refused is not None:  # the gateway keeps its last copy; a listing must not show a partial one
            raise ResponseError(levels.refused)
        keys = RedisKeys.of(handle)
        rows = []
        for level_id, (d, m, source) in sorted(levels.configured().items()):
            kind, name = parse_level(level_id)
            spent_d = await handle.client.hget(keys.level_day(kind, name, day), "cost_micro_usd")
            spent_m = await handle.client.hget(keys.level_month(kind, name, day[:7]), "cost_micro_usd")
            rows.append({
                "level": level_id, "source": source,
                "usd_day": str(micro_to_usd(d)) if d is not None else None,
                "usd_month": str(micro_to_usd(m)) if m is not None else None,
                "spent_usd_day": str(micro_to_usd(int(spent_d or 0))),
                "spent_usd_month": str(micro_to_usd(int(spent_m or 0))),
            })
        return rows

    try:
        rows = run_on_redis(settings, go)
    except ResponseError as exc:
        typer.echo(f"thinkgate: budgets not listed — Redis refused a read: {exc}; fix or delete the key it names, "
                   "then run the command again", err=True)
        raise typer.Exit(4) from None
    if as_json:
        for r in rows:
            typer.echo(orjson.dumps(r).decode())
        return
    typer.echo(f"{'level':<32} {'source':<7} {'usd/day':>12} {'spent today':>12} {'usd/month':>12} "
               f"{'spent month':>12}")
    for r in rows:
        typer.echo(f"{r['level']:<32} {r['source']:<7} {r['usd_day'] or '-':>12} {r['spent_usd_day']:>12} "
                   f"{r['usd_month'] or '-':>12} {r['spent_usd_month']:>12}")
