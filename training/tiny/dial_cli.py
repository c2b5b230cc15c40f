"""Command lines of the dial model: ``thinkgate eval dial`` and ``thinkgate train dial-sft`` (typer only at import;
torch and transformers inside the commands)."""

from __future__ import annotations

from pathlib import Path

import typer


def eval_dial(
    model: str = typer.Option(..., "--model", help="The dial model directory (Hugging Face format)."),
    budgets: str = typer.Option("16,32,64,128,256", help="Comma-separated requested thinking budgets (tokens)."),
    json_path: Path = typer.Option(..., "--json", help="Write the report here (JSON)."),
    png: Path | None = typer.Option(None, "--png", help="Also plot accuracy and adherence per budget here."),
    n: int = typer.Option(120, min=1, help="Held-out arith problems (load_task('arith', 'test', n, seed))."),
    seed: int = typer.Option(0, help="Seed of the held-out sample."),
    forcing_model: str = typer.Option(
        "", help="Model for the budget-forcing column (default: the shipped SFT model models/thinkgate-tiny)."
    ),
    no_forcing: bool = typer.Option(False, "--no-forcing", help="Skip the budget-forcing column."),
    threads: int = typer.Option(1, help="torch CPU threads."),
) -> None:
    """Adherence to a requested thinking budget (share within ±10% / ±4 tokens for budgets ≤ 32, mean and p90
    relative error) and accuracy per budget on held-out problems, beside budget forcing on the SFT model.
    Exit 2 on a bad budget list or a missing model directory."""
    from router.errors import require

    try:
        values = [int(x) for x in budgets.split(",") if x.strip()]
    except ValueError:
        typer.echo(f"error: --budgets must be comma-separated integers, got {budgets!r}", err=True)
        raise typer.Exit(2) from None
    if not values or min(values) < 1:
        typer.echo("error: --budgets needs at least one budget >= 1", err=True)
        raise typer.Exit(2)
    if not (Path(model) / "config.json").is_file():
        typer.echo(f"error: {model} is not a model directory (no config.json)", err=True)
        raise typer.Exit(2)
    require("torch", "train", "thinkgate eval dial")
    from training.tiny.dial_eval import DEFAULT_FORCING_MODEL, evaluate, plot, write

    ref = None if no_forcing else (forcing_model or DEFAULT_FORCING_MODEL)
    report = evaluate(model, values, n=n, seed=seed, forcing_model=ref, threads=threads, log=typer.echo)
    typer.echo(f"wrote {write(report, json_path)}")
    if png:
        typer.echo(f"wrote {plot(report, png)}")


def train_dial_sft(
    output_dir: Path = typer.Option(..., help="Where to write the warm-started model directory."),
    init_from: str = typer.Option("", help="Model to continue (default: models/thinkgate-tiny)."),
    steps: int = typer.Option(1500, help="SFT steps (batch 16)."),
    max_minutes: float = typer.Option(22.0, help="Wall-time bound (the LR decay ends by then)."),
    seed: int = typer.Option(5, help="Data seed."),
    lr: float = typer.Option(1e-3, min=1e-6, max=1e-1, help="Peak learning rate (warm-up 50 steps, cosine). "
                             "Continuing a trained dial model: 3e-4 or less (at 1e-3 it forgets first)."),
    threads: int = typer.Option(1, min=1, help="torch CPU threads."),
) -> None:
    """Warm-start a dial model: SFT on thoughts that fill the budget stated in the prompt (training.tiny.dial).
    Billed by a cost ledger in the output directory (``train runs`` lists it); exit 2 when the directory already
    holds a run."""
    from router.errors import require

    require("torch", "train", "thinkgate train dial-sft")
    from dataclasses import replace

    from training.grpo.config import ConfigError
    from training.tiny.dial_sft import DEFAULT_INIT, dial_stage, run_dial_sft

    cfg = replace(dial_stage(init_from or DEFAULT_INIT, steps, max_minutes, seed), lr=lr, threads=threads)
    try:
        summary = run_dial_sft(cfg, output_dir, log=typer.echo)
    except ConfigError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(f"done in {summary['wall_s']} s, billed ${summary['spent_usd']} -> {output_dir}")


def train_dial_router(
    model: Path = typer.Option(..., "--model", help="The dial model directory (Hugging Face format)."),
    out: Path = typer.Option(..., "--out", help="Write the router file (skops) here."),
    router: Path | None = typer.Option(None, "--router", help="Router whose score picks the budget (default: "
                                       "the shipped default router)."),
    tier: str = typer.Option("long", help="The routed prompted tier the budgets are for."),
    budgets: str = typer.Option("16,32,48,64,96,128,unlimited", help="Candidate thinking budgets, ascending "
                                "(tokens; 'unlimited' last = the tier's own setting, the floor's reference). "
                                "Default: 16,32,48,64,96,128,unlimited."),
    n: int = typer.Option(400, min=8, help="arith train-split problems (split by a hash of each problem into "
                          "about half to order the candidate maps, half to test them)."),
    seed: int = typer.Option(0, help="Seed of the problem sample."),
    bins: int = typer.Option(4, min=1, max=8, help="Score bins of the step map."),
    floor: float = typer.Option(0.98, min=0.5, max=1.0, help="Keep this share of the tier's own accuracy."),
    delta: float = typer.Option(0.1, min=0.001, max=0.5, help="1 - confidence of the floor."),
    threads: int = typer.Option(2, help="torch CPU threads."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the report (JSON) here."),
) -> None:
    """Calibrate a router score -> thinking budget map for a dial model (Learn-then-Test on the quality floor) and
    write a router file that serves it (training/tiny/dial_map.py). Exit 2 on bad arguments."""
    import json

    from router.errors import require
    from training.tiny.dial_map import build, parse_budgets

    try:
        values = parse_budgets(budgets)
    except ValueError as exc:
        typer.echo(f"error: --budgets: {exc}", err=True)
        raise typer.Exit(2) from None
    if not (model / "config.json").is_file():
        typer.echo(f"error: {model} is not a model directory (no config.json)", err=True)
        raise typer.Exit(2)
    if router is None:
        from importlib.resources import files

        router = Path(str(files("router").joinpath("assets", "default.skops")))
    if not Path(router).is_file():
        typer.echo(f"error: --router {router}: no such file", err=True)
        raise typer.Exit(2)
    require("torch", "train", "thinkgate train dial-router")
    report = build(str(model), Path(router), out, tier=tier, budgets=values, n=n, seed=seed, n_bins=bins, floor=floor,
                   delta=delta, threads=threads, log=typer.echo)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        typer.echo(f"wrote {json_path}")
    typer.echo(f"wrote {out}")
