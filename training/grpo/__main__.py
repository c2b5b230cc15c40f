"""``python -m training.grpo --config RUN.yaml`` — the entry point for ``accelerate launch -m training.grpo``.

When the command is done it runs the ``atexit`` handlers, flushes and leaves with ``os._exit``: Python's module
teardown after a torch/transformers/TRL run is seconds of CPU (measured 3-10 s on the 2-core box) that come after
the ledger's last row and could never be billed — so they are not spent.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

import typer

from training.grpo.cli import grpo


def main() -> None:
    code: int = 0
    try:
        typer.run(grpo)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
