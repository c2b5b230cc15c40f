"""``thinkgate eval …``: client-side evaluations against a running gateway (THINKGATE_URL, THINKGATE_API_KEY)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from router.console import console

app = typer.Typer(no_args_is_help=True)


@app.command("tiers")
def tiers_cmd(
    tiers: str = typer.Option("none,short,long", help="Comma-separated tier names to evaluate."),
    task: str = typer.Option("arith", help="Held-out task: arith | gsm8k | math."),
    n_per_level: int = typer.Option(10, min=1, help="Problems per difficulty level."),
    seed: int = typer.Option(0, help="Seed of the held-out sample."),
    levels: str = typer.Option("", help="Comma-separated difficulty levels (default: all of the task's)."),
    concurrency: int = typer.Option(4, min=1, help="Requests in flight."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the report as JSON here."),
) -> None:
    """Accuracy, mean/max reasoning tokens and cost per tier and per difficulty."""

    from gateway.cli.evals import render, run

    try:
        result = run(
            [t for t in tiers.split(",") if t],
            task=task,
            n_per_level=n_per_level,
            seed=seed,
            difficulties=[int(x) for x in levels.split(",") if x] or None,
            concurrency=concurrency,
        )
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    console().print(render(result))
    if json_path:
        json_path.write_text(json.dumps(result, indent=2))
        typer.echo(f"wrote {json_path}")
