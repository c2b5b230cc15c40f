"""``thinkgate bench``: whole-stack benchmarks, available in a source checkout (bench/ is not in the wheel).

Plugged into the ``thinkgate`` command line through the ``thinkgate.cli`` entry-point group.
"""

from __future__ import annotations

import typer

from bench.learn import learn
from bench.savings_stack import savings
from bench.traces.bench import traces

app = typer.Typer(no_args_is_help=True)
app.command("savings")(savings)
app.command("traces")(traces)
app.command("learn")(learn)


@app.callback()
def bench() -> None:
    """Whole-stack benchmarks; each prints a table and writes its JSON/PNG (see docs/savings.md)."""
