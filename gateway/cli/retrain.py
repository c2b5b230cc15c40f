"""``thinkgate router retrain --from-outcomes``: a new router file from the gateway's outcome stream.

Reads the outcomes (``{prefix}outcomes``, written by feedback, escalations and shadow comparisons; they carry the
routing window's text only under ``routing.outcomes.retain_text``), turns them into labels
(:mod:`router.fit.retrain`; ``routing.routed_tiers``, two or more), adds the offline ``--base-labels`` (labelled
JSONL, as ``router fit`` reads), fits, calibrates the top threshold to ``routing.target.long_share`` when set (else
``--long-share``, else the share the router in service sends up on the same texts; with three or more routed tiers
each lower threshold to the share the router in service sends past it) and compares the new router with the one
in service (``--router``; default: the router automatic retraining promoted, ``p router:current``, when there is one
— the replicas serve that one —, else ``routing.router_path``) on the held-out slice of the outcomes. Writes
``--output`` (atomically) only when the new one is not worse; the gateway's hot reload then picks it up if that is
``routing.router_path`` (its ``version`` shows in ``GET /v1/models``) — with a promoted router in service, the
command also points ``p router:current`` at it, with a ``promote`` audit event, so the replicas follow (one event
per file: a replica that adopted the file first leaves nothing to do), and — as a replica does after each transition
— removes the router copies of the state dir nothing needs beyond the newest ``routing.retrain.keep_files``
(:func:`prune_copies`).
Exit codes: 0 written, 1 refused (worse,
or too few held-out outcomes to judge), 2 invalid arguments or config, 3 Redis unreachable.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from gateway.cli.common import CONFIG_OPTION, load_settings, run_on_redis


def read_outcomes(settings: Any, since_days: float | None) -> list[dict[str, Any]]:
    """The outcome stream as dicts (``since_days`` back from now; None = all). Exits 3 when Redis is down."""
    from gateway.control.outcomes import OutcomeStore, outcome_spool_path
    from gateway.state.breaker import Breaker

    since = time.time() - since_days * 86400 if since_days is not None else None

    async def collect(handle: Any) -> list[dict[str, Any]]:
        store = OutcomeStore(settings.routing.outcomes, handle, Breaker(1.0), outcome_spool_path(settings))
        import orjson

        return [orjson.loads(o.to_json()) for o in await store.outcomes(since)]

    return run_on_redis(settings, collect, min_timeout_s=5.0)


def promoted_router(settings: Any) -> tuple[Path, str] | None:
    """``(path, version)`` of the router automatic retraining promoted (``p router:current``), which every replica
    with ``routing.retrain`` on serves instead of ``routing.router_path``; None when there is none. Exits 3 when
    Redis is down."""

    async def read(handle: Any) -> tuple[Path, str] | None:
        cur = await handle.client.hgetall(f"{handle.prefix}router:current")
        path = cur.get(b"path") if cur else None
        return (Path(path.decode()), (cur.get(b"version") or b"").decode()) if path else None

    return run_on_redis(settings, read, min_timeout_s=5.0)


def adopt(settings: Any, path: Path, version: str, n_outcomes: int) -> dict[str, Any] | None:
    """Make ``path`` the promoted router (``p router:current``) — the replicas follow within
    ``routing.retrain.interval_s`` — with a ``promote`` audit event saying an operator wrote it. Without this the
    file written to ``routing.router_path`` was never served while a promoted one was (silently).

    The replicas watch that path and adopt a new file there themselves: both go through the one compare-and-set
    (:meth:`gateway.control.retrain_trigger.CurrentRouter.adopt`, the file's digest marked adopted with it), so
    the file gets one promote event, whoever is first (this command wrote one and a replica another). The event,
    or None when a replica had adopted the file already.

    As a replica does, it names the bytes it wrote, not the path: a copy kept under their digest in the retraining's
    state dir (``<state_dir>/<digest>.skops``), which no later write to ``routing.router_path`` changes (a replica
    whose state dir is not this one's keeps its own copy from its ``routing.router_path``)."""
    from gateway.control.retrain_trigger import CurrentRouter, file_digest, keep_copy, state_dir_of
    from gateway.state.breaker import Breaker

    data = path.read_bytes()
    digest = file_digest(data)
    copy = keep_copy(data, state_dir_of(settings), digest)

    async def write(handle: Any) -> dict[str, Any] | None:
        return await CurrentRouter(handle, Breaker(1.0), settings.routing.retrain.readopt_after_s).adopt(
            copy, version, digest, n_outcomes, "operator: thinkgate router retrain --output routing.router_path")

    return run_on_redis(settings, write, min_timeout_s=5.0)


def prune_copies(settings: Any) -> list[str]:
    """Remove the router files of the retraining's state dir nothing needs any more, beyond the newest
    ``routing.retrain.keep_files`` (None: nothing), with the helper a replica's retention uses
    (:func:`gateway.control.retrain_trigger.prune_state_dir`): every adoption keeps a copy there, and the command's
    copies were never removed — a cron job retraining nightly grew the directory by a router file a night. Kept:
    what ``p router:current`` names, read after the adoption (the router serving and its ``previous``, the only one
    a rollback goes back to), files written in the last ``RETAIN_YOUNG_S`` (a replica's file about to be named),
    the ``keep_files`` newest others, and every file ThinkGate did not write. Unlike a replica, the command has not
    watched which files were named lately: a replica sharing the directory that still serves a router named minutes
    ago and no more (right after a rollback) keeps it loaded, and that file is among the newest unless
    ``keep_files`` newer ones came since. The names removed; exits 3 when Redis is down. Raises ``OSError`` when
    the directory cannot be read."""
    from gateway.control.retrain_trigger import CurrentRouter, named_files, prune_state_dir, state_dir_of
    from gateway.state.breaker import Breaker

    keep_files = settings.routing.retrain.keep_files
    if keep_files is None:
        return []

    async def read(handle: Any) -> dict[str, str]:
        return await CurrentRouter(handle, Breaker(1.0), settings.routing.retrain.readopt_after_s).read()

    keep = named_files(run_on_redis(settings, read, min_timeout_s=5.0))
    return prune_state_dir(state_dir_of(settings), keep, keep_files)


def retrain_command(
    from_outcomes: bool = typer.Option(False, "--from-outcomes", help="Learn from the gateway's outcome stream."),
    output: Path = typer.Option(..., "--output", "-o", help="Router file to write (.skops)."),
    since: float | None = typer.Option(None, "--since", help="Only outcomes of the last DAYS days."),
    base_labels: list[Path] | None = typer.Option(None, "--base-labels", help="Offline labelled JSONL to add."),
    router: Path | None = typer.Option(None, "--router", help="Router in service (default: routing.router_path)."),
    long_share: float | None = typer.Option(None, "--long-share", min=0, max=1,
                                            help="Top-tier share to calibrate to (default: routing.target)."),
    heldout_frac: float = typer.Option(0.2, "--heldout-frac", min=0.05, max=0.5, help="Held-out share."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Retrain the router from routing outcomes; refuses (exit 1) to write one worse on held-out outcomes."""
    from router.fit.labels import load_items
    from router.fit.retrain import RetrainRefused, items_from_outcomes, label_counts, retrain
    from router.persistence import RouterFileError, load_router, save_router

    if not from_outcomes:
        typer.echo("thinkgate router retrain: --from-outcomes is required (the only source so far)", err=True)
        raise typer.Exit(2)
    settings = load_settings(config)
    promoted = promoted_router(settings) if router is None else None
    # in service: the promoted router when automatic retraining promoted one (the replicas serve it, not the file
    # routing.router_path names), else the configured file
    old_path = router or (promoted[0] if promoted is not None else settings.routing.router_path)
    if promoted is not None:
        typer.echo(f"in service: {promoted[0]} (promoted by automatic retraining, version {promoted[1]})")
    if old_path is None:
        typer.echo("thinkgate router retrain: no router in service to compare with; pass --router FILE", err=True)
        raise typer.Exit(2)
    try:
        old = load_router(old_path)
        base = load_items(base_labels) if base_labels else []
    except (RouterFileError, OSError, ValueError) as exc:
        typer.echo(f"thinkgate router retrain: {exc}", err=True)
        raise typer.Exit(2) from None
    tiers = settings.routing.routed_tiers
    top = tiers[-1]
    outcomes = read_outcomes(settings, since)
    items = items_from_outcomes(outcomes, tiers)
    share = long_share if long_share is not None else settings.routing.target.long_share
    typer.echo(f"{len(outcomes)} outcomes → {len(items)} labelled routing windows "
               f"({sum(it.label for it in items)} needing {top}); {len(base)} base labels")
    for src, c in sorted(label_counts(outcomes, tiers).items()):  # the label rule, per evidence source
        typer.echo(f"  {src}: cheaper tier sufficed {c['cheap_sufficed']}, did not {c['cheap_failed']}, "
                   f"dropped {c['dropped']} (answered on {top}, ungraded or without text)")
    try:
        new, report = retrain(old, items, base, long_share=share, heldout_frac=heldout_frac,
                              n_tiers=len(tiers))
    except RetrainRefused as exc:
        if exc.report is not None:
            _print(exc.report)
        typer.echo(f"refused: {exc}; {output} not written", err=True)
        raise typer.Exit(1) from None
    except ValueError as exc:
        typer.echo(f"thinkgate router retrain: {exc}", err=True)
        raise typer.Exit(1) from None
    _print(report)
    save_router(new, output)
    cuts = (f"threshold {new.thresholds[-1]:.4f}" if len(new.thresholds) == 1 else
            "thresholds " + ", ".join(f"{t:.4f}" for t in new.thresholds))
    typer.echo(f"wrote {output} (version {new.metadata['version']}, {cuts})")
    configured = settings.routing.router_path
    if promoted is not None and configured is not None and output.resolve() == Path(configured).resolve():
        event = adopt(settings, output.resolve(), str(new.metadata["version"]), len(outcomes))
        if event is None:  # a replica watching routing.router_path saw the file first (one promote event per file)
            typer.echo(f"router:current names {output}: a replica adopted it already")
        else:
            typer.echo(f"router:current now names {output}, kept as {event['path']} (it named version "
                       f"{event['previous']}): the replicas serve it within routing.retrain.interval_s")
        try:
            removed = prune_copies(settings)
        except OSError as exc:  # the directory unreadable: the router is written and adopted, nothing removed
            typer.echo(f"router files of the state dir not pruned: {exc}", err=True)
            removed = []
        if removed:
            typer.echo(f"removed {len(removed)} router file(s) no longer in use (routing.retrain.keep_files = "
                       f"{settings.routing.retrain.keep_files}): {', '.join(removed)}")


def _print(report: Any) -> None:
    typer.echo(f"held-out outcomes: {report.n_heldout}; fitted on {report.n_fit}; long share {report.long_share:.3f}")
    typer.echo(f"{'router':<10}{'AUC':>8}{'long share':>12}{'served well':>13}")
    for name, r in (("in service", report.old), ("retrained", report.new)):
        typer.echo(f"{name:<10}{r.auc:>8.3f}{r.long_share:>12.3f}{r.served_well:>13.3f}")
