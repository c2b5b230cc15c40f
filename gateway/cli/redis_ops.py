"""``thinkgate redis migrate-placement``: operations on the gateway's Redis itself rather than on one kind of record.

A group of its own (not ``keys``): the migration moves every API key's spend history, budgets' counters, cubes and
rate windows besides the key store's records, and further cluster operations belong beside it.

``migrate-placement --to tenant|shared`` moves each API key's own data between the two ``redis.cluster_placement``
layouts of a Redis Cluster (``gateway/state/placement_migration.py`` says what moves and how a stopped run is
finished by running it again). It runs with the configuration the gateways will start with — ``--to`` must be its
``redis.cluster_placement`` — and is the one command that skips the placement check (its job is the other
placement's data). Offline: stop every gateway first; it refuses while the cluster shows a live one (a heartbeat, or
a usage event newer than ``--quiet-s``), unless ``--force``.

Exit codes: 0 done (or the dry run), 1 names left in conflict (both kept; the migration stays marked, so gateways keep
refusing), 2 invalid arguments or config, a live gateway, not a Cluster; 3 Redis unreachable.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from gateway.cli.common import CONFIG_OPTION, load_settings, run_on_redis
from gateway.cli.keys import RESERVED_KEY_IDS

if TYPE_CHECKING:
    from gateway.state.placement_migration import MigrationReport

app = typer.Typer(no_args_is_help=True)

@app.command("migrate-placement")
def migrate_placement(
    to: str = typer.Option(..., "--to", help="The placement to move to: tenant or shared (must be the config's "
                           "redis.cluster_placement)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count what would move (per kind and destination "
                                 "master); write nothing."),
    force: bool = typer.Option(False, "--force", help="Run although the cluster shows a live gateway (a heartbeat "
                               "or a recent usage event), or (to tenant) counted events the stream no longer holds: "
                               "only when you know every gateway is stopped with its spool files empty."),
    quiet_s: float = typer.Option(60.0, "--quiet-s", min=0, help="Refuse when a usage event was written less than "
                                  "this many seconds ago."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Move each API key's own data (record, lookup copy, counters, cubes, reservations, RPM/TPM windows) to the
    names of ``redis.cluster_placement`` ``--to``, on a Redis Cluster, with every gateway stopped. Run it again to
    finish a run that stopped midway. Prints one summary line."""
    settings = load_settings(config)
    if to not in ("tenant", "shared"):
        typer.echo(f"thinkgate: --to wants tenant or shared, got {to!r}", err=True)
        raise typer.Exit(2)
    if settings.redis.cluster_placement != to:
        typer.echo(f"thinkgate: run it with the configuration the gateways will use after it: --to {to} needs "
                   f"redis.cluster_placement: {to} (THINKGATE_REDIS__CLUSTER_PLACEMENT={to}); this one says "
                   f"{settings.redis.cluster_placement}", err=True)
        raise typer.Exit(2)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from gateway.state.breaker import RedisDown, is_outage
    from gateway.state.placement_migration import Migration, MigrationRefused, live_writers

    # ids Redis may not list: the config's keys and the gateway's own (the development key, requests without a key,
    # shadow calls) meter like any key
    extra = [k.id for k in settings.auth.keys] + sorted(RESERVED_KEY_IDS)
    err = Console(stderr=True)

    async def go(handle: Any) -> MigrationReport | str:
        try:
            return await migrate(handle)
        except Exception as exc:  # the client's own errors (no breaker here): an outage is run_on_redis's exit 3
            if is_outage(exc):
                raise RedisDown(" ".join(str(exc).split()) or type(exc).__name__) from exc
            raise

    async def migrate(handle: Any) -> MigrationReport | str:
        busy = await live_writers(handle, quiet_s)
        if busy is not None and dry_run:
            err.print(f"[yellow]note[/]: {busy}: a real run would refuse (or need --force)")
        elif busy is not None and not force:
            return busy
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=False) as bar:
            tasks: dict[str, Any] = {}

            def progress(phase: str, done: int, total: int | None) -> None:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(phase, total=total)
                bar.update(tasks[phase], completed=done, total=total)

            try:
                return await Migration(handle, settings.metering, extra_ids=extra, dry_run=dry_run,
                                       progress=progress, repair_creates=_repair_creates, force=force).run()
            except MigrationRefused as exc:
                return str(exc)

    # check_placement False: the other placement's data is what this command moves (run_on_redis's check would
    # refuse exactly the cluster it is for, and a cluster a stopped run left marked)
    got = run_on_redis(settings, go, min_timeout_s=10.0, check_placement=False)
    if isinstance(got, str):
        typer.echo(f"thinkgate: {got}", err=True)
        raise typer.Exit(2)
    if dry_run:
        _print_dry_run(got)
    typer.echo(got.summary())
    if got.conflicts:
        shown = ", ".join(got.conflicts[:5]) + (" …" if len(got.conflicts) > 5 else "")
        typer.echo(f"thinkgate: {len(got.conflicts)} keys exist under both placements' names with different data "
                   f"(a gateway of the new placement wrote there?): {shown}. Both kept; decide which is right, delete "
                   "the other, run it again", err=True)
        raise typer.Exit(1)


async def _repair_creates(tenant: Any) -> int:
    """tenant -> shared: the key creates that never committed, rolled back with no grace period (the migration is
    offline; a create still running finds its commit refused and cleans up after itself); a second pass rolls back
    the ids the first adopted (claimed by a store from before the pending entries). How many were rolled back."""
    from gateway.auth.redis_store import RedisKeyStore
    from gateway.state.breaker import Breaker

    store = RedisKeyStore(tenant, Breaker(1.0), cache_s=0)
    done = 0
    for _ in range(2):
        done += sum(f.state == "rolled_back" for f in await store.repair(grace_s=0, apply=True))
    return done


def _print_dry_run(report: MigrationReport) -> None:
    from rich.console import Console
    from rich.table import Table

    kinds = Table(title=f"would move ({report.source} -> {report.target})")
    kinds.add_column("kind")
    kinds.add_column("keys", justify="right")
    for kind, n in sorted(report.moved.items()):
        kinds.add_row(kind, str(n))
    masters = Table(title="per destination master")
    masters.add_column("master")
    masters.add_column("keys", justify="right")
    for master, n in sorted(report.by_master.items()):
        masters.add_row(master, str(n))
    out = Console()
    out.print(kinds)
    out.print(masters)
