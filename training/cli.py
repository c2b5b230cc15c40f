"""`thinkgate train …` commands."""

from __future__ import annotations

from pathlib import Path

import typer

from training.grpo.cli import grpo
from training.plan.cli import plan, report, runs
from training.sft.cli import sft
from training.tiny.dial_cli import eval_dial, train_dial_router, train_dial_sft

app = typer.Typer(no_args_is_help=True)


# --- thinkgate train tiny ------------------------------------------------------------------------------------
# Not the shipped models/thinkgate-tiny: a plain `thinkgate train tiny` (the README's command) wrote its ledger there
# at once, so a Ctrl-C left the tracked model directory holding an interrupted run (listed by `train runs --root
# models`, and every later `train tiny` refused), and a finished run replaced the shipped weights. Replacing them is
# `--output-dir models/thinkgate-tiny` (docs/local-model.md).
_TINY_DEFAULT_DIR = "runs/tiny"


@app.command("tiny")
def tiny(
    output_dir: str = typer.Option(
        _TINY_DEFAULT_DIR,
        help="Where to write the Hugging Face model directory (models/thinkgate-tiny replaces the shipped one).",
    ),
    seed: int = typer.Option(0, help="Seed of the tokenizer corpus, the data streams and the initialisation."),
    steps: int = typer.Option(3000, help="Stage-1 SFT steps (from scratch; batch 24)."),
    steps2: int = typer.Option(2500, help="Stage-2 SFT steps (continued; batch 16). 0: stage 1 only."),
    max_minutes: float = typer.Option(22.0, help="Stage-1 wall-time bound (its LR decay and curriculum end by then)."),
    max_minutes2: float = typer.Option(18.0, help="Stage-2 wall-time bound."),
    steps3: int = typer.Option(1400, help="Stage-3 (over-thinking) SFT steps (batch 16). 0: stop after stage 2."),
    max_minutes3: float = typer.Option(14.0, help="Stage-3 wall-time bound."),
    from_stage2: str | None = typer.Option(
        None, help="Run stage 3 only, continuing this two-stage model directory (e.g. thinkgate-tiny v1)."
    ),
    threads: int = typer.Option(1, help="torch CPU threads (1 is fastest on a shared 2-core box)."),
    eval_n: int = typer.Option(240, help="Held-out arith problems for the offline check after training (0: skip)."),
) -> None:
    """Train the tiny local reasoning model by SFT on the arith task (CPU, seeded) and save it.

    Three stages (``training.tiny.train.recipe`` and ``overthink_stage``): from scratch with a curriculum,
    continued at a lower learning rate on all difficulties (that was v1), then continued on mostly verbose,
    self-re-checking thoughts so that greedy decoding over-thinks (v2, the shipped model). Writes config +
    float32 safetensors, tokenizer with chat template, generation config, ``training_summary.json``, a model
    card ``README.md`` and, unless ``--eval-n 0``, an offline accuracy check (transformers, greedy, vLLM budget
    semantics) at thinking budgets 24 and 256 tokens and with thinking off, into ``offline_eval.json``.
    Measure through vLLM with ``python -m bench.tiny_measure``. Billed like the other training jobs
    (:class:`training.tiny.billing.SFTBilling`): a cost ledger in the output directory, listed by ``train runs``;
    exit 2 when that directory already holds a run.
    """
    import json
    import shutil

    from router.errors import require

    require("torch", "train", "thinkgate train tiny")
    from training.grpo.config import ConfigError, resolve_model_path
    from training.tiny.billing import SFTBilling
    from training.tiny.card import write_card
    from training.tiny.train import overthink_stage, recipe, train, train_overthink, train_recipe

    out = Path(output_dir)
    try:
        if from_stage2:  # a wrong path is refused before the bill starts
            resolve_model_path(from_stage2)
        billing = SFTBilling(out, {"run_name": out.name, "method": "tiny-sft"})
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    with billing:  # a Ctrl-C or an error is billed before it propagates (SFTBilling.bill_unfinished)
        hook = billing.on_step
        if from_stage2:
            s3 = overthink_stage(from_stage2, seed=seed + 2, steps=steps3, max_minutes=max_minutes3, threads=threads)
            summary = train_overthink(s3, out, log=typer.echo, on_step=hook)
        else:
            s1, s2 = recipe(seed=seed, steps=(steps, steps2), max_minutes=(max_minutes, max_minutes2), threads=threads)
            if steps2 <= 0:
                summary = train(s1, out, log=typer.echo, on_step=hook)
            elif steps3 <= 0:
                summary = train_recipe((s1, s2), out, log=typer.echo, on_step=hook)
            else:
                stage2_dir = out / "stage2"
                sum12 = train_recipe((s1, s2), stage2_dir, log=typer.echo, on_step=hook)
                s3 = overthink_stage(
                    str(stage2_dir), seed=seed + 2, steps=steps3, max_minutes=max_minutes3, threads=threads
                )
                summary = train_overthink(s3, out, log=typer.echo, earlier=sum12["stages"], on_step=hook)
                shutil.rmtree(stage2_dir, ignore_errors=True)
        eval_s = 0.0
        if eval_n > 0:
            import time

            from training.tiny.evaluate import offline_report

            t_eval = time.perf_counter()
            report = offline_report(out, n=eval_n, threads=threads)
            eval_s = time.perf_counter() - t_eval
            (out / "offline_eval.json").write_text(json.dumps(report, indent=2) + "\n")
            for name, acc in report["accuracy"].items():
                typer.echo(f"{name:>10}: " + "  ".join(f"d{d}={a:.2f}" for d, a in acc.items()))
        write_card(out)
        spent = billing.finish(eval_s)["spent_usd"]
    typer.echo(f"done in {summary['wall_s']} s -> {out} (billed ${spent}: {out / 'ledger.jsonl'})")


app.command("grpo")(grpo)  # thinkgate train grpo (training/grpo/cli.py; typer only at import)
app.command("plan")(plan)  # thinkgate train plan (training/plan/cli.py)
app.command("report")(report)  # thinkgate train report
app.command("runs")(runs)  # thinkgate train runs (training/registry.py)
app.command("sft")(sft)  # thinkgate train sft (training/sft/)
app.command("dial-sft")(train_dial_sft)  # thinkgate train dial-sft (training/tiny/dial_sft.py)
app.command("dial-router")(train_dial_router)  # thinkgate train dial-router (training/tiny/dial_map.py)

#: Offline evaluations that join the gateway's ``thinkgate eval`` group (gateway/cli/main.py attaches them
#: through this plug-in, so the product never imports training).
EVAL_COMMANDS = {"dial": eval_dial}
app.eval_commands = EVAL_COMMANDS  # type: ignore[attr-defined]


@app.command("storage")
def storage(
    run_dir: Path = typer.Argument(..., help="A run directory."),
    apply: bool = typer.Option(False, "--apply", help="Apply the lifecycle policy (else only show the bytes)."),
    hot_steps: int | None = typer.Option(None, "--hot-steps", help="Override storage.hot_steps of the run."),
    cold_after_steps: int | None = typer.Option(None, "--cold-after-steps", help="Override storage.cold_after_steps."),
    stats_only_after_steps: int | None = typer.Option(
        None, "--stats-only-after-steps", help="Override storage.stats_only_after_steps."
    ),
) -> None:
    """Bytes per storage class (hot JSONL, cold Parquet, stats-only, kept models/config/summary/ledger,
    checkpoints, other); with --apply, move the rollouts to the class the run's ``storage:`` policy gives them at
    the run's last step. Exit codes: 0 shown/applied, 2 not a run directory or an invalid policy."""
    import yaml

    from training.storage import Policy, RolloutStore, bytes_by_class

    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        typer.echo(f"storage error: {run_dir} has no config.yaml (not a run directory)", err=True)
        raise typer.Exit(2)
    st = (yaml.safe_load(cfg_path.read_text()) or {}).get("storage") or {}
    try:
        policy = Policy(
            hot_steps if hot_steps is not None else int(st.get("hot_steps", 20)),
            cold_after_steps if cold_after_steps is not None else st.get("cold_after_steps"),
            stats_only_after_steps if stats_only_after_steps is not None else st.get("stats_only_after_steps"),
        )
    except ValueError as e:
        typer.echo(f"storage error: {e}", err=True)
        raise typer.Exit(2) from e
    store = RolloutStore(run_dir, policy)
    steps = store.steps()
    before = bytes_by_class(run_dir)
    if apply:
        current = max(steps, default=0)
        for step, src, dst, b0, b1 in store.apply(current):
            typer.echo(f"step {step}: {src} -> {dst}  {b0} -> {b1} bytes")
    after = bytes_by_class(run_dir)
    typer.echo(f"{'class':<12}{'bytes':>14}" + (f"{'after':>14}" if apply else ""))
    for k in before:
        typer.echo(f"{k:<12}{before[k]:>14}" + (f"{after[k]:>14}" if apply else ""))
    typer.echo(f"{'total':<12}{sum(before.values()):>14}" + (f"{sum(after.values()):>14}" if apply else ""))
