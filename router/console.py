"""The rich Console every command line prints its tables with (``thinkgate usage report``, ``eval``, ``router …``,
the benches): one rule for the width, so that output that is not a terminal keeps each number whole.

On a terminal a table fits its width (``width`` when the command asks for one, else the terminal's) and a column
too narrow folds its cells. Anywhere else — a pipe, a file, a CI log — rich would assume 80 columns (or
``$COLUMNS``) and fold ``0.000782`` into ``0.00078`` and ``2`` on two lines, or cut it to ``0.0007…``: there the width
is :data:`PIPED_WIDTH` (no table of ours is that wide; lines are not padded to it), whatever ``$COLUMNS`` says.
This module lives in the lowest package so every package may import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

#: the width of output that is not a terminal (module doc)
PIPED_WIDTH = 1000


def console(*, stderr: bool = False, width: int | None = None) -> Console:
    """A rich Console on stdout (``stderr``: on stderr): ``width`` (else the terminal's) on a terminal,
    :data:`PIPED_WIDTH` on anything else (module doc)."""
    from rich.console import Console

    con = Console(stderr=stderr, width=width)
    if not con.is_terminal:
        con.width = PIPED_WIDTH
    return con
