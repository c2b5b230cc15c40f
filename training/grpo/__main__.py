"""``python -m training.grpo --config RUN.yaml`` — the entry point for ``accelerate launch -m training.grpo``."""

from __future__ import annotations

import typer

from training.grpo.cli import grpo

if __name__ == "__main__":
    typer.run(grpo)
