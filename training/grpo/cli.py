"""``thinkgate train grpo``: GRPO with length penalties, dynamic sampling, monitors and a cost ledger.

Only typer is imported at module load; torch/transformers/trl load inside the command.
"""

from __future__ import annotations

from pathlib import Path

import typer


def grpo(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run file (YAML); see training/configs/."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Override trl.max_steps (optimizer steps)."),
    output_dir: Path | None = typer.Option(None, "--output-dir", help="Override the run directory."),
    resume: str | None = typer.Option(
        None, "--resume", help="'auto' (last checkpoint in the run dir) or a checkpoint-N path inside the run dir."
    ),
    quiet: bool = typer.Option(
        False, "--quiet", help="No progress bars and no per-step log dicts (the logs are in metrics.jsonl)."
    ),
    force: bool = typer.Option(False, "--force", help="Resume even though the run file changed rewards/hparams."),
    allow_dirty: bool = typer.Option(
        False, "--allow-dirty", help="Run from a git tree with uncommitted changes (the tag records -dirty)."
    ),
) -> None:
    """Run GRPO on TRL's GRPOTrainer; writes the run directory (config, metrics, ledger, plots, model, card).

    Exit codes: 0 done (also when a monitor, a budget or exhausted data stopped the run early; the reason is
    printed and in summary.json), 2 invalid configuration, a dirty git tree without ``--allow-dirty`` or a resume
    whose run file changed without ``--force``, 130 interrupted (SIGINT; the run is ``interrupted`` in
    ``train runs`` until resumed).
    """
    import json

    from router.errors import require

    require("trl", "train", "thinkgate train grpo")
    from training.grpo.config import ConfigError, load_config
    from training.grpo.run import check_clean_tree, run_grpo

    if quiet:  # transformers' own bars too (loading and writing weights)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        cfg = load_config(config)
        check_clean_tree(allow_dirty=allow_dirty)
        summary = run_grpo(
            cfg, max_steps=max_steps, output_dir=output_dir, resume=resume, progress=not quiet, force=force
        )
    except ConfigError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from e
    except KeyboardInterrupt:  # Ctrl-C / SIGINT: say where the run stands and how to go on; `train runs` shows it
        flags = _again_flags(config, max_steps, allow_dirty=allow_dirty, quiet=quiet)
        typer.echo(_interrupted(cfg.output_dir if "cfg" in locals() else None, flags), err=True)
        raise typer.Exit(130) from None
    run_dir = Path(cfg.output_dir)
    keys = (
        "global_step",
        "spent_usd",
        "device_hours",
        "accuracy_before",
        "accuracy_after",
        "usd_per_accuracy_point",
        "stop_reason",
    )
    typer.echo(json.dumps({k: summary.get(k) for k in keys}, indent=2, default=str))
    typer.echo(f"run directory: {run_dir}  (model: {run_dir / 'model'}, tier snippet: {run_dir / 'tier.yaml'})")


def _again_flags(config: Path | None, max_steps: int | None, *, allow_dirty: bool, quiet: bool) -> list[str]:
    """The original command's flags that a resume or a fresh start must repeat (shell-quoted): ``--config``, the
    ``--max-steps`` override (else the run file's max_steps would apply to a fresh start), ``--allow-dirty`` and
    ``--quiet``. ``--output-dir`` is added by :func:`_interrupted`; ``--force`` is not repeated (the resumed run's
    ``config.yaml`` already holds the forced run file)."""
    import shlex

    flags = [f"--config {shlex.quote(str(config))}"] if config is not None else []
    if max_steps is not None:
        flags.append(f"--max-steps {max_steps}")
    return flags + (["--allow-dirty"] if allow_dirty else []) + (["--quiet"] if quiet else [])


def _interrupted(run_dir: str | None, flags: list[str]) -> str:
    """Mark an interrupted run (:func:`training.registry.mark_interrupted`) and say how to go on: resume from its
    last checkpoint, or — none written yet — start again in a fresh run directory; ``flags`` are the original
    command's (:func:`_again_flags`)."""
    import shlex

    from training.registry import mark_interrupted

    step = mark_interrupted(run_dir) if run_dir is not None else None
    if run_dir is None or step is None:
        return "interrupted before the run started: nothing to resume"
    command = " ".join(["thinkgate train grpo", *flags])
    if not any(Path(run_dir).glob("checkpoint-*")):
        return (f"interrupted at step {step}, before the first checkpoint: start it again from step 0, its ledger "
                f"kept: {command} --output-dir {shlex.quote(run_dir)} --resume auto")
    return (f"interrupted at step {step}: the steps since the last checkpoint are redone (their ledger rows kept as "
            f"discarded) when you resume: {command} --output-dir {shlex.quote(run_dir)} --resume auto")
