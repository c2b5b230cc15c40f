"""`thinkgate train …` commands."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


# --- thinkgate train tiny ------------------------------------------------------------------------------------
_TINY_DEFAULT_DIR = str(Path(__file__).resolve().parent / "assets" / "thinkgate-tiny")


@app.command("tiny")
def tiny(
    steps: int = typer.Option(3000, help="SFT optimiser steps (batch of --batch-size examples each)."),
    output_dir: str = typer.Option(_TINY_DEFAULT_DIR, help="Where to write the Hugging Face model directory."),
    seed: int = typer.Option(0, help="Seed of the tokenizer corpus, the data stream and the initialisation."),
    batch_size: int = typer.Option(24, help="Examples per step."),
    lr: float = typer.Option(2e-3, help="Peak learning rate (warm-up then cosine decay)."),
    max_minutes: float = typer.Option(22.0, help="Wall-time bound (LR decay and curriculum end by then)."),
    threads: int = typer.Option(1, help="torch CPU threads (1 is fastest on a shared 2-core box)."),
    eval_n: int = typer.Option(240, help="Held-out arith problems for the offline check after training (0: skip)."),
) -> None:
    """Train the tiny local reasoning model by SFT on the arith task (CPU, seeded) and save it.

    Writes config + float32 safetensors, tokenizer with chat template, generation config,
    ``training_summary.json``, a model card ``README.md`` and, unless ``--eval-n 0``, an offline accuracy
    check (transformers, greedy, vLLM budget semantics) at thinking budgets 24 and 256 tokens and with thinking
    off, into ``offline_eval.json``.
    """
    import json

    from training.tiny.train import SFTConfig, train

    cfg = SFTConfig(steps=steps, seed=seed, batch_size=batch_size, lr=lr, max_minutes=max_minutes, threads=threads)
    out = Path(output_dir)
    summary = train(cfg, out, log=typer.echo)
    if eval_n > 0:
        from training.tiny.evaluate import offline_report

        report = offline_report(out, n=eval_n, threads=threads)
        (out / "offline_eval.json").write_text(json.dumps(report, indent=2) + "\n")
        for name, acc in report["accuracy"].items():
            typer.echo(f"{name:>10}: " + "  ".join(f"d{d}={a:.2f}" for d, a in acc.items()))
    from training.tiny.card import write_card

    write_card(out)
    typer.echo(f"done: {summary['steps_done']} steps in {summary['wall_s']} s -> {out}")


# --- thinkgate train grpo (training/grpo/cli.py; typer only at import) -----------------------------------------
from training.grpo.cli import grpo as _grpo  # noqa: E402

app.command("grpo")(_grpo)
