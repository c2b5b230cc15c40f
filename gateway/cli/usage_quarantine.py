"""``thinkgate usage quarantine``: the usage quarantine file, line by line, against the ledger — and ``--settle``.

Reads the file the gateway writes beside ``metering.spool_path`` (``<stem>.quarantine.jsonl``; ``--file`` for
another) and, for each line, prints its reason, source, event id / request id, key, tier, ``ts``, cost (micro-USD)
and status: ``counted`` (its id is in the usage stream of its day), ``absent`` (it is not), ``unusable`` (unreadable
or malformed: nothing can be counted from it; its detail shown) or ``unverifiable`` (the stream was trimmed past its
day: absence proves nothing). ``--json``: one JSON object for scripts. ``--settle`` (after a confirmation, or
``--yes``) counts every ``absent`` event once through the gateway's own metering script and rewrites the file without
the lines now counted (``gateway/state/quarantine.py`` says how, and how write-ahead records are billed). Works on
every Redis URL the gateway takes (single, Sentinel, Cluster).
Exit codes: 0 ok, 2 invalid arguments or config (``--settle`` without ``--yes`` where no one can confirm), 3 Redis
unreachable (a settle cut short keeps the lines it had not counted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from gateway.cli.common import CONFIG_OPTION, load_settings, run_on_redis
from gateway.cli.serve import LOG_FORMAT
from router.console import console

if TYPE_CHECKING:
    from gateway.state.quarantine import Entry

STATUSES = ("counted", "absent", "unusable", "unverifiable")


def quarantine(
    file: Path | None = typer.Option(None, "--file", help="The quarantine file (default: <stem>.quarantine.jsonl "
                                     "beside metering.spool_path, as the gateway writes it)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout (entries, summary, settled)."),
    do_settle: bool = typer.Option(False, "--settle", help="Count every absent event once (the gateway's metering "
                                   "script) and remove the lines now counted from the file."),
    yes: bool = typer.Option(False, "--yes", "-y", help="With --settle: no confirmation."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """List the usage quarantine file against the ledger (counted / absent / unusable); --settle counts the absent
    events once and removes what is counted."""
    from gateway.state.metering import quarantine_path

    if yes and not do_settle:
        typer.echo("thinkgate: --yes only goes with --settle", err=True)
        raise typer.Exit(2)
    if do_settle and not yes and not sys.stdin.isatty():
        typer.echo("thinkgate: --settle counts money: confirm on a terminal, or give --yes", err=True)
        raise typer.Exit(2)
    settings = load_settings(config)
    path = file or quarantine_path(settings.metering.spool_path)
    if do_settle:  # one WARNING line per event counted: the audit trace on stderr
        logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT, stream=sys.stderr)
    confirm = None if yes or not do_settle else _confirm
    got = run_on_redis(settings, lambda handle: _run(settings, handle, path, do_settle, confirm, as_json),
                       min_timeout_s=5.0)
    entries, settled, removed, note = got
    if as_json:
        sys.stdout.write(json.dumps({"file": str(path), "entries": [e.to_dict() for e in entries],
                                     "summary": _summary(entries), "settled": settled and {
                                         "counted": settled.counted, "cost_micro_usd": settled.cost_micro_usd,
                                         "lines_removed": removed, "error": settled.error, "note": note}},
                                    indent=2) + "\n")
    if settled is not None:
        typer.echo(f"thinkgate: settled: {settled.counted} events counted ({settled.cost_micro_usd} micro-USD), "
                   f"{removed} lines removed from {path}" + (f"; {note}" if note else ""), err=True)
        if settled.error:
            typer.echo(f"thinkgate: stopped early, the rest kept: {settled.error}", err=True)
            raise typer.Exit(3)


async def _run(settings: Any, handle: Any, path: Path, do_settle: bool, confirm: Any,
               as_json: bool) -> tuple[list[Entry], Any, int, str | None]:
    """Read and classify the file; with ``do_settle``, (after ``confirm``, when given) settle and rewrite it. Prints
    the table (unless ``as_json``). Returns ``(entries, Settled or None, lines removed, note)``."""
    from gateway.state import quarantine as q
    from gateway.state.breaker import Breaker
    from gateway.state.metering import Meter
    from gateway.state.spool import Quarantine, Spool

    meter = Meter(handle, Breaker(1.0), Spool(settings.metering.spool_path), settings.metering)
    file = Quarantine(path)
    prices = {t.name: t.prices for t in settings.tiers}
    entries = q.read_entries(file, meter, prices)
    await q.classify(meter, entries)
    if not as_json:
        _print(path, entries)
    if not do_settle:
        return entries, None, 0, None
    absent = [e for e in entries if e.status == "absent"]
    n_counted = sum(e.status == "counted" for e in entries)
    if confirm is not None and (absent or n_counted):
        cost = sum(e.cost_micro_usd or 0 for e in absent)
        if not await asyncio.to_thread(confirm, f"Count {len(absent)} absent events ({cost} micro-USD) and remove "
                                                f"them and {n_counted} counted lines from {path}?"):
            typer.echo("thinkgate: nothing settled", err=True)
            return entries, None, 0, None
    settled = await q.settle(meter, entries)
    removed, note = await q.rewrite(file, entries, meter)
    if not as_json:
        _print_outcomes(entries)
    return entries, settled, removed, note


def _confirm(question: str) -> bool:
    return typer.confirm(question, default=False, err=True)


def _summary(entries: list[Entry]) -> dict[str, Any]:
    """Lines per status, and the absent events' cost (micro-USD; None where a tier has no prices)."""
    out: dict[str, Any] = {s: sum(e.status == s for e in entries) for s in STATUSES}
    out["lines"] = len(entries)
    out["absent_cost_micro_usd"] = sum(e.cost_micro_usd or 0 for e in entries if e.status == "absent")
    return out


def _print(path: Path, entries: list[Entry]) -> None:
    """The table on stdout, the summary line on stderr."""
    from rich.table import Table

    s = _summary(entries)
    if not path.exists():  # "0 lines" of a file that is not there read as "checked, nothing set aside"
        typer.echo(f"thinkgate: {path}: no such file — nothing was set aside there. A relative metering.spool_path "
                   "is read from the current directory: run this where the gateway runs, or give its --config or "
                   "--file", err=True)
        return
    typer.echo(f"thinkgate: {path}: {s['lines']} lines: {s['counted']} counted, {s['absent']} absent "
               f"({s['absent_cost_micro_usd']} micro-USD), {s['unusable']} unusable, {s['unverifiable']} unverifiable",
               err=True)
    if not entries:
        return
    table = Table("line", "reason", "source", "event_id / request_id", "key", "tier", "ts", "cost_micro_usd",
                  "status", "detail")
    for e in entries:
        table.add_row(str(e.line), e.reason or "-", Path(e.source).name or "-",
                      e.event_id or (f"request {e.request_id}" if e.request_id else "-"), e.key_id or "-",
                      e.tier or "-", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(e.ts)) if e.ts else "-",
                      "-" if e.cost_micro_usd is None else str(e.cost_micro_usd), e.status,
                      e.detail if e.status in ("unusable", "unverifiable") else "")
    console().print(table)


def _print_outcomes(entries: list[Entry]) -> None:
    """What ``--settle`` did with each line, on stdout."""
    from rich.table import Table

    table = Table("line", "event_id / request_id", "status", "outcome")
    for e in entries:
        table.add_row(str(e.line), e.event_id or (f"request {e.request_id}" if e.request_id else "-"), e.status,
                      e.outcome or "-")
    console().print(table)
