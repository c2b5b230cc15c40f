"""``thinkgate train plan`` and ``thinkgate train report`` (typer only at import)."""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation
from pathlib import Path

import typer


def _refuse_sft(config: Path) -> None:
    """Raise ConfigError for an SFT run file (its ``traces:`` section): the planner models GRPO's phases (rollouts,
    rewards), and read as a GRPO file an SFT one only failed on ``traces: unknown key``."""
    import yaml

    from training.grpo.config import ConfigError

    try:
        doc = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError):
        return  # load_config says what is wrong with it
    if isinstance(doc, dict) and "traces" in doc:
        raise ConfigError(f"{config} is an SFT run file (it has `traces:`): `train plan` estimates GRPO runs only; "
                          "an SFT run's ledger is read by `train runs`")


def plan(
    config: Path = typer.Option(..., "--config", "-c", help="Run file (YAML) to estimate; see training/configs/."),
    json_out: Path = typer.Option(..., "--json", help="Write the plan (JSON) here, e.g. runs/smoke/plan.json."),
    probe_steps: int | None = typer.Option(
        None, "--probe-steps", help="Measure the per-token costs with a probe: N steps of the same run file (billed)."
    ),
    from_run: Path | None = typer.Option(
        None, "--from-run", help="Take the per-token costs from an earlier run directory's ledger instead."
    ),
    usd_per_device_hour: str | None = typer.Option(
        None, "--usd-per-device-hour", help="Price (USD per device-hour; default: the run file's price list)."
    ),
) -> None:
    """Estimate a GRPO run before launch, per phase (startup, sampling, reward, update, eval, io), in tokens,
    device-hours and USD with a low-high range. Exactly one of --probe-steps / --from-run (default: a 2-step probe).

    Exit codes: 0 written, 2 invalid input (config, price, flags, a failed probe)."""
    from training.grpo.config import ConfigError, load_config
    from training.plan.planner import make_plan, run_probe

    try:
        if probe_steps is not None and from_run is not None:
            raise ConfigError("--probe-steps and --from-run: give one of them")
        price = None
        if usd_per_device_hour is not None:
            try:
                price = Decimal(usd_per_device_hour)
            except InvalidOperation as e:
                raise ConfigError(f"--usd-per-device-hour: not a decimal: {usd_per_device_hour!r}") from e
            if price < 0 or not price.is_finite():
                raise ConfigError("--usd-per-device-hour: must be a finite number >= 0")
        _refuse_sft(config)
        cfg = load_config(config)
        from training.grpo.run import check_trl_options

        check_trl_options(cfg, build=False)  # a plan for options the run would refuse is no plan
        if from_run is not None:
            reference, steps = from_run, None
        else:
            steps = probe_steps if probe_steps is not None else 2
            probe_dir = json_out.with_name(json_out.stem + ".probe")
            typer.echo(f"probe: {steps} step(s) of {config} in {probe_dir} ...", err=True)
            reference = run_probe(cfg, steps, probe_dir)
        result = make_plan(cfg, reference=reference, price_usd_per_device_hour=price, probe_steps=steps)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        typer.echo(f"plan error: {e}", err=True)
        raise typer.Exit(2) from e
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    a = result["assumptions"]
    ref = a.get("probe") or a.get("reference_run")
    typer.echo(f"{'phase':<10}{'device-h':>12}{'usd':>12}{'low':>12}{'high':>12}")
    for p, v in result["phases"].items():
        typer.echo(f"{p:<10}{v['device_hours']:>12.6f}{v['usd']:>12.6f}{v['low_usd']:>12.6f}{v['high_usd']:>12.6f}")
    typer.echo(
        f"{'total':<10}{a['device_hours']:>12.6f}{result['total_usd']:>12.6f}{result['low_usd']:>12.6f}"
        f"{result['high_usd']:>12.6f}"
    )
    typer.echo(f"sampled tokens {result['sampled_tokens']}, trained tokens {result['trained_tokens']}")
    what = "probe" if "probe" in a else "reference run"
    typer.echo(f"{what}: {ref['steps']} step(s), billed ${ref['usd']:.6f} ({ref['device_hours']:.6f} device-h)")
    for w in a.get("warnings", []):
        typer.echo(f"warning: {w}", err=True)
    typer.echo(f"plan: {json_out}")


def report(
    run_dir: Path = typer.Argument(..., help="A finished (or stopped) run directory."),
    plan_file: Path | None = typer.Option(None, "--plan", help="The plan JSON (default RUN_DIR/plan.json)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the comparison as JSON here."),
) -> None:
    """Estimate vs actual per phase (USD) with the error ((estimate - actual) / actual), from the run's ledger.

    Exit codes: 0 printed, 2 no plan or no ledger."""
    from training.plan.planner import format_report
    from training.plan.planner import report as compare

    pf = plan_file or run_dir / "plan.json"
    # name only what is missing: the user looked for a ledger that was there when both were named
    missing: list[str] = []
    if not pf.is_file():
        missing.append(f"{pf} (write it with thinkgate train plan --json, or pass --plan)")
    if not (run_dir / "ledger.jsonl").is_file():
        missing.append(f"{run_dir / 'ledger.jsonl'} (not a run directory, or the run has not started)")
    if missing:
        typer.echo(f"report error: no {' and no '.join(missing)}", err=True)
        raise typer.Exit(2)
    rep = compare(json.loads(pf.read_text()), run_dir)
    typer.echo(format_report(rep))
    if json_out is not None:
        json_out.write_text(json.dumps(rep, indent=2) + "\n")


def runs(
    root: Path = typer.Option(Path("runs"), "--root", help="Directory searched for run directories (ledger.jsonl)."),
    tag: list[str] = typer.Option([], "--tag", help="KEY=VALUE; repeat to require several tags."),
    csv_out: Path | None = typer.Option(None, "--csv", help="Also write the list as CSV here."),
    by: str | None = typer.Option(None, "--by", help="Attribute the cost by this tag (e.g. owner, team, purpose)."),
    stale_s: float = typer.Option(600.0, "--stale-s", help="A run without a summary is abandoned after this silence."),
) -> None:
    """List runs with status (running / finished / stopped / interrupted / failed / abandoned), USD, device-hours,
    held-out accuracy, tokens and tags (a failed run's error on the line below it); ``--by TAG`` sums the cost per
    tag value (exact: integer micro-USD of the ledgers).

    Exit codes: 0 listed, 2 a malformed --tag or a --root that is no directory."""
    from training.registry import attribute, list_runs, parse_tag_filters, write_csv

    try:
        want = parse_tag_filters(tag)
    except ValueError as e:
        typer.echo(f"runs error: {e}", err=True)
        raise typer.Exit(2) from e
    if not root.is_dir():  # a typo'd --root listed "0 run(s), $0", as if nothing had been spent there
        typer.echo(f"runs error: no directory {root} (no run has been written there; --root names the directory "
                   "holding the run directories, default runs/)", err=True)
        raise typer.Exit(2)
    recs = list_runs(root, want, stale_s=stale_s)
    typer.echo(f"{'run':<40}{'status':<12}{'usd':>11}{'device-h':>10}{'steps':>6}{'acc':>7}{'sampled':>9}  tags")
    for r in recs:
        acc = "" if r.heldout_accuracy is None else f"{r.heldout_accuracy:.3f}"
        shown = {k: v for k, v in r.tags.items() if k not in ("data_hash", "reward_hash", "hparam_hash")}
        tags = " ".join(f"{k}={v}" for k, v in sorted(shown.items()))
        typer.echo(
            f"{r.run_dir[-39:]:<40}{r.status:<12}{r.usd:>11}{r.device_hours:>10.5f}{r.steps:>6}{acc:>7}"
            f"{r.sampled_tokens:>9}  {tags}"
        )
        if r.status == "failed":
            typer.echo(f"  error: {r.stop_reason}")
    total = sum(r.micro_usd for r in recs)
    typer.echo(f"{len(recs)} run(s), ${Decimal(total) / Decimal(1_000_000)}")
    if by:
        typer.echo(f"\ncost by {by}:")
        for value, e in attribute(recs, by).items():
            typer.echo(
                f"  {value:<30}{e['runs']:>4} run(s)  ${Decimal(e['micro_usd']) / Decimal(1_000_000)}"
                f"  {e['device_hours']:.5f} device-h"
            )
    if csv_out is not None:
        write_csv(recs, csv_out)
