"""``thinkgate router history``: the automatic retraining's audit events (``p router:history``), oldest first.

One line per event: time (UTC), ``promote`` | ``keep`` | ``rollback``, the version served after it, the one
before, the outcome count and the reason; ``--json`` prints the events as a JSON list (the fields of
``gateway/control/retrain_trigger.py``). ``--file PATH`` reads the events from a file instead of Redis: a JSON
list (this command's ``--json``) or an object with a ``history`` list (``thinkgate bench learn --details``, whose
Redis keys are gone when it ends). Exit codes: 0, 2 invalid config or an unreadable file, 3 Redis unreachable.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from gateway.cli.common import CONFIG_OPTION, load_settings, run_on_redis


def history_command(
    limit: int = typer.Option(50, "--limit", "-n", min=1, max=10_000, help="The last N events."),
    as_json: bool = typer.Option(False, "--json", help="Print the events as JSON."),
    file: Path | None = typer.Option(None, "--file", help="Read the events from this JSON file (a list, or an "
                                     "object with 'history': bench learn --details) instead of Redis."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Promotions, refusals and rollbacks of the automatic retraining (routing.retrain), oldest first."""
    from gateway.control.retrain_trigger import read_history
    from gateway.state.breaker import Breaker

    if file is not None:
        events = _from_file(file)[-limit:]
    else:
        settings = load_settings(config)

        async def collect(handle: Any) -> list[dict[str, Any]]:
            return await read_history(handle, Breaker(1.0), limit)

        events = run_on_redis(settings, collect, min_timeout_s=5.0)
    if as_json:
        typer.echo(json.dumps(events, indent=1))
        return
    if not events:
        typer.echo("no retraining events yet (routing.retrain.every_outcomes is 0, or too few outcomes so far)")
        return
    typer.echo(f"{'time (UTC)':<20} {'event':<9} {'serving':<34} {'before':<34} {'outcomes':>8}  reason")
    for e in events:
        ts = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(e.get("ts") or 0)))
        typer.echo(f"{ts:<20} {e.get('event', ''):<9} {e.get('version')!s:<34} {e.get('previous')!s:<34} "
                   f"{_cell(e.get('outcomes')):>8}  {e.get('reason', '')}")


def _cell(v: Any) -> str:
    """A table cell: "—" for a missing or null value (``f"{None:>8}"`` raises, and the table stopped there)."""
    return "—" if v is None else str(v)


def _from_file(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        typer.echo(f"thinkgate: cannot read {path}: {exc}", err=True)
        raise typer.Exit(2) from None
    events = data.get("history") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        typer.echo(f"thinkgate: {path} holds no list of events (a JSON list, or an object with 'history')", err=True)
        raise typer.Exit(2)
    return events
