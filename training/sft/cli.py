"""``thinkgate train sft`` (typer only at import; torch/transformers/TRL load inside the command)."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def sft(
    config: Path | None = typer.Option(None, "--config", "-c", help="SFT run file (YAML); see training/configs/."),
    output_dir: Path | None = typer.Option(None, "--output-dir", help="Override the run directory."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Override trl.max_steps (optimizer steps)."),
) -> None:
    """Supervised fine-tuning on verified teacher traces of the task with TRL's SFTTrainer; the same ledger
    (phases, budgets, tags), heartbeat and run directory as ``train grpo``.

    Exit codes: 0 done (also when a budget stopped the run; the reason is in summary.json), 2 invalid config."""
    from router.errors import require

    require("trl", "train", "thinkgate train sft")
    from training.grpo.config import ConfigError
    from training.sft.run import load_sft_config, run_sft

    try:
        cfg = load_sft_config(config)
        summary = run_sft(cfg, output_dir=output_dir, max_steps=max_steps)
    except ConfigError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from e
    keys = ("global_step", "traces", "spent_usd", "device_hours", "accuracy_before", "accuracy_after",
            "usd_per_accuracy_point", "stop_reason")  # fmt: skip
    typer.echo(json.dumps({k: summary.get(k) for k in keys}, indent=2, default=str))
    typer.echo(f"run directory: {cfg.output_dir}")
