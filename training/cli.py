"""`thinkgate train …` commands."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True)


# --- thinkgate train grpo (training/grpo/cli.py; typer only at import) -----------------------------------------
from training.grpo.cli import grpo as _grpo  # noqa: E402

app.command("grpo")(_grpo)
