"""JSONL, one JSON object per line: the one reader (and writer) for every package (the router is the bottom
package, so the gateway, training, bench and the router's own tasks and fitting all may import it).

``.gz`` files are read and written through gzip, by their suffix.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any


def open_text(path: str | Path, mode: str = "r") -> IO[str]:
    """Open ``path`` as UTF-8 text; ``.gz`` files through gzip. ``mode``: "r", "w" or "a"."""
    p = Path(path)
    if p.suffix == ".gz":
        return io.TextIOWrapper(gzip.GzipFile(p, mode + "b"), encoding="utf-8")
    return open(p, mode, encoding="utf-8")


def read_jsonl(path: str | Path, *, missing_ok: bool = False, skip_invalid: bool = False) -> Iterator[dict[str, Any]]:
    """Yield each non-blank line of ``path`` parsed as a JSON object, in file order.

    ``missing_ok``: a missing file yields nothing (else FileNotFoundError). ``skip_invalid``: a line that is not
    a JSON object is passed over — a log that a killed process left with half a line (else ValueError naming
    the file and the line).
    """
    if missing_ok and not Path(path).is_file():
        return
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                if skip_invalid:
                    continue
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                if skip_invalid:
                    continue
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            yield obj


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write ``rows`` to ``path`` (overwriting), one compact JSON object per line. Returns the row count."""
    n = 0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open_text(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
            n += 1
    return n
