"""bench/RESULTS.md holds one ``## `` section per benchmark script; each script rewrites only its own."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "RESULTS.md"


def write_section(section: str, text: str, path: Path = RESULTS, *, keep_history: bool = False) -> None:
    """Replace the section whose heading line is ``section`` (e.g. ``"## Savings"``) with ``text``, or append
    ``text`` when there is none; every other section is kept as it is.

    ``keep_history``: the section's previous body is kept below ``text`` under ``### Earlier run`` (its own
    earlier runs with it), so a measurement that others quote — targets met or not on a given day — is never
    lost by the next run."""
    current = path.read_text() if path.exists() else "# Benchmark results\n"
    start = current.find(section + "\n")
    if start < 0:
        new = current.rstrip("\n") + "\n\n" + text
    else:
        end = current.find("\n## ", start + len(section))
        body = current[start + len(section):end if end >= 0 else len(current)].strip("\n")
        if keep_history and body:
            text = text.rstrip("\n") + "\n\n### Earlier run\n\n" + body + "\n"
        new = current[:start] + text + (current[end:] if end >= 0 else "")
    path.write_text(new.rstrip("\n") + "\n")
