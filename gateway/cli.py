"""The ``thinkgate`` command line: one entry point for serving, routing, training and benchmarks.

Sub-apps live next to the code they drive (``router/cli.py``, ``training/cli.py``); heavy libraries
(torch, transformers, vllm, scikit-learn) are imported inside the commands so ``thinkgate --help`` is fast.
"""

from __future__ import annotations

import typer

from router.cli import app as router_app
from training.cli import app as train_app

app = typer.Typer(
    name="thinkgate",
    help="ThinkGate: route, budget and meter reasoning-model traffic; train length-controlled models.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(router_app, name="router", help="Fit, calibrate, evaluate and label the difficulty router.")
app.add_typer(train_app, name="train", help="Offline training jobs (tiny local model, GRPO).")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
