"""``thinkgate usage export`` and ``thinkgate usage report``: usage from the Redis Stream (the metering ledger).
``thinkgate usage quarantine`` (``gateway/cli/usage_quarantine.py``) settles the usage quarantine file against it.

``report`` is the savings report (spend by tier, cache savings, always-long counterfactual per difficulty
bucket; ``gateway/ledger/report.py``, ``docs/savings.md``) as a table, CSV, PNG and JSON. ``export``:

Reads the same ledger ``GET /v1/usage`` reads (every key; filter with ``--key``). Without ``--group-by`` one
row per event, from the stream (without ``--since``: all of it); with it, summed counters per group
(``gateway/ledger/export.py``): whole UTC days from the per-day usage cubes (``Meter.grouped``, the same rows) and
the stream only for the rest. ``--since`` of a grouped export defaults, as ``GET /v1/usage``'s, to the start of the
current UTC month (said on stderr); ``--since 0`` asks for all history, from the oldest retained day, through the
cubes. Output to ``--output FILE`` (written atomically) or stdout.
Exit codes: 0 ok, 2 invalid arguments or config, 3 Redis unreachable.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import typer

from gateway.cli.common import CONFIG_OPTION, load_settings, run_on_redis
from gateway.cli.usage_quarantine import quarantine
from router.console import console
from router.errors import require

app = typer.Typer(no_args_is_help=True)
app.command("quarantine")(quarantine)


def read_events(settings: Any, since: float | None, until: float | None, key: str | None) -> list[Any]:
    """The usage events of the ledger (Redis Stream) in [since, until) (epoch seconds; None = open), of one key
    id or all. Exits with code 3 when Redis is unreachable. A longer socket timeout than the request path's:
    an export may scan a long stream."""
    from gateway.state.breaker import Breaker
    from gateway.state.metering import Meter
    from gateway.state.spool import Spool

    async def collect(handle: Any) -> list[Any]:
        meter = Meter(handle, Breaker(1.0), Spool(settings.metering.spool_path), settings.metering)
        return [e async for e in meter.events(since, until) if key is None or e.key_id == key]

    return run_on_redis(settings, collect, min_timeout_s=5.0)


def read_grouped(settings: Any, group_by: list[str], since: float, until: float | None, key: str | None) -> Any:
    """:meth:`gateway.state.metering.Meter.grouped` (a ``GroupedUsage``) on the configured Redis. Exits with code 3
    when Redis is unreachable."""
    from gateway.state.breaker import Breaker
    from gateway.state.metering import Meter
    from gateway.state.spool import Spool

    async def collect(handle: Any) -> Any:
        meter = Meter(handle, Breaker(1.0), Spool(settings.metering.spool_path), settings.metering)
        return await meter.grouped(group_by, since, until, key)

    return run_on_redis(settings, collect, min_timeout_s=5.0)


@app.command("export")
def export(
    fmt: str = typer.Option("csv", "--format", "-f", help="csv | jsonl | parquet"),
    since: str | None = typer.Option(None, help="From (inclusive): YYYY-MM-DD, ISO-8601 or epoch seconds, UTC. "
                                     "Default: with --group-by and no --until the start of the current UTC month "
                                     "(as GET /v1/usage; --since 0 for all history), otherwise the whole stream."),
    until: str | None = typer.Option(None, help="Until (exclusive), same forms."),
    group_by: str | None = typer.Option(None, "--group-by", help="Comma list of key,tier,model,day,tag,tag:NAME."),
    key: str | None = typer.Option(None, "--key", help="Only this key id."),
    output: Path | None = typer.Option(None, "--output", "-o", help="File to write (default, or '-': stdout)."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Export usage: raw events (all unless --since/--until), or sums grouped by key/tier/model/day/tag (this UTC
    month unless --since)."""
    from gateway.ledger import export as ex

    if output is not None and str(output) == "-":  # the Unix convention: '-' is standard output
        output = None
    if fmt not in ("csv", "jsonl", "parquet"):
        typer.echo("thinkgate: --format must be csv, jsonl or parquet", err=True)
        raise typer.Exit(2)
    if fmt == "parquet":
        require("pyarrow", "report", "thinkgate usage export --format parquet")
    if fmt == "parquet" and output is None and sys.stdout.isatty():
        typer.echo("thinkgate: parquet is binary; give --output FILE", err=True)
        raise typer.Exit(2)
    try:
        groups = ex.parse_group_by(group_by)
        t0, t1 = ex.parse_period(since, until)
    except ex.ExportError as exc:
        typer.echo(f"thinkgate: {exc}", err=True)
        raise typer.Exit(2) from None
    settings = load_settings(config)
    if groups:  # whole days from the usage cubes (the same rows), the stream for the rest
        if t0 is None and t1 is None:  # GET /v1/usage's default period: the month so far, not all history
            t0 = ex.month_start(time.time())
            typer.echo(f"thinkgate: since {time.strftime('%Y-%m-%d', time.gmtime(t0))} (the start of this UTC month; "
                       "--since 0 for all history)", err=True)
        elif t0 is None:  # --until alone: everything before it (a billing run on the 1st: last month and before)
            t0 = 0.0
        got = read_grouped(settings, groups, t0, t1, key)
        rows, cols = got.rows, ex.columns(groups)
        summary = f"{len(got.cube_days)} days from the usage cubes, {got.events_scanned} events scanned"
    else:
        events = read_events(settings, t0, t1, key)
        rows, cols = ex.build(events, groups)
        summary = f"{len(events)} events"
    ex.write_file(rows, cols, fmt, output, sys.stdout.buffer)  # type: ignore[arg-type]
    sys.stdout.buffer.flush()
    typer.echo(f"thinkgate: {summary}, {len(rows)} rows", err=True)


@app.command("backfill")
def backfill(
    since: str | None = typer.Option(None, help="Only days from this one (YYYY-MM-DD, ISO-8601 or epoch seconds, "
                                     "UTC); default: every day in the stream."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Build the per-day usage cubes of days counted before they existed (run once after the upgrade, when every
    replica runs it). Grouped queries scan the stream for such days until then; running it again is harmless."""
    from gateway.ledger import export as ex
    from gateway.state.breaker import Breaker
    from gateway.state.metering import Meter
    from gateway.state.spool import Spool

    try:
        t0 = ex.parse_time(since)
    except ex.ExportError as exc:
        typer.echo(f"thinkgate: {exc}", err=True)
        raise typer.Exit(2) from None
    settings = load_settings(config)

    async def run(handle: Any) -> dict[str, int]:
        meter = Meter(handle, Breaker(1.0), Spool(settings.metering.spool_path), settings.metering)
        return await meter.backfill(t0)

    got = run_on_redis(settings, run, min_timeout_s=5.0)
    typer.echo(f"thinkgate: {got['days']} days with events: {got['complete']} complete already, {got['rebuilt']} "
               f"rebuilt, {got['skipped']} skipped (events of the day arrived meanwhile: run again)")


@app.command("report")
def report_cmd(
    since: str | None = typer.Option(None, help="From (inclusive): YYYY-MM-DD, ISO-8601 or epoch seconds, UTC."),
    until: str | None = typer.Option(None, help="Until (exclusive), same forms."),
    key: str | None = typer.Option(None, "--key", help="Only this key id."),
    long_tier: str | None = typer.Option(None, "--long-tier", help="Tier of the always-long counterfactual "
                                         "(default: 'long' when configured, else the last tier, as the dashboard)."),
    buckets: int = typer.Option(10, "--buckets", min=1, max=100, help="Difficulty buckets (equal width)."),
    csv_path: Path | None = typer.Option(None, "--csv", help="Write the report rows as CSV here."),
    png_path: Path | None = typer.Option(None, "--png", help="Write the chart as PNG here."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the headline figures as JSON here."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Savings report from the ledger: spend by tier, cache savings, estimated cost of always-long."""
    import json

    from gateway.cli.usage_report import plot, render
    from gateway.ledger import export as ex
    from gateway.ledger import report as rp

    try:
        t0, t1 = ex.parse_period(since, until)
    except ex.ExportError as exc:
        typer.echo(f"thinkgate: {exc}", err=True)
        raise typer.Exit(2) from None
    if png_path:
        require("matplotlib", "report", "thinkgate usage report --png")
    settings = load_settings(config)
    chosen = long_tier
    long_tier = long_tier or rp.long_tier_of(settings)
    try:
        prices = settings.tier(long_tier).prices
    except KeyError:
        typer.echo(f"thinkgate: no tier {long_tier!r} in the configuration", err=True)
        raise typer.Exit(2) from None
    events = read_events(settings, t0, t1, key)
    result = rp.build(events, long_tier, prices, n_buckets=buckets, since=t0, until=t1, key=key)
    if result.long_mean_completion_tokens is None and chosen is None and "tiers" not in settings.model_fields_set:
        # no estimate on the embedded defaults' 'long': most likely the gateway's tiers are others (its config
        # was not given), and the note alone read as "nothing ran on the top tier"
        seen = sorted({t.tier for t in result.tiers} - {t.name for t in settings.tiers} - {"_unrouted"})
        result.notes.append(
            f"the tiers are the embedded defaults ({', '.join(t.name for t in settings.tiers)}): no --config FILE "
            "and no THINKGATE_CONFIG was given" + (f", and these events are on tiers {', '.join(seen)}" if seen
                                                    else "")
            + "; pass the gateway's configuration with --config FILE (--long-tier only picks one of the "
            "configuration's tiers)")
    drift = read_drift(settings)
    console().print(render(result))
    typer.echo(drift_line(drift, settings.routing.drift.threshold))
    if csv_path:
        csv_path.write_text(rp.to_csv(result))
    if png_path:
        plot(result, png_path)
    if json_path:
        json_path.write_text(json.dumps({"summary": result.summary(), "rows": rp.rows(result), "drift": drift},
                                        indent=2))


def read_drift(settings: Any) -> dict[str, Any] | None:
    """The drift alarm's last state (``gateway/control/drift.py``; None: never computed). Exits 3 if Redis is down."""
    from gateway.control.drift import read_state
    from gateway.state.breaker import Breaker

    async def get(handle: Any) -> dict[str, Any] | None:
        return await read_state(handle, Breaker(1.0))

    return run_on_redis(settings, get)


def drift_line(state: dict[str, Any] | None, threshold: float) -> str:
    """One line for the report: the router version's PSI (score, tier mix) and whether it is past the alarm."""
    if not state:
        return ("Routing drift: not computed yet (needs routing.drift.min_samples routed requests; with a router "
                "file without a score_histogram, such as the shipped one, a first full routing.drift.window)")
    if state.get("psi_score") is None:
        return (f"Routing drift: not computed yet for router {state.get('router_version')} ({state.get('n')} of "
                "routing.drift.min_samples routed requests under it)")
    worst = max(state.get("psi_score") or 0.0, state.get("psi_tier") or 0.0)
    flag = "ALERT" if worst >= threshold else "ok"
    return (f"Routing drift (PSI vs the router's {state.get('reference')} reference, router "
            f"{state.get('router_version')}, last {state.get('n')} routed): score {state.get('psi_score'):.3f}, "
            f"tier mix {state.get('psi_tier'):.3f} — {flag} (alarm at {threshold:g})")
