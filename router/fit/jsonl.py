"""JSONL helpers: read/write one JSON object per line, gzip by file suffix, content hashes."""

from __future__ import annotations

import gzip
import hashlib
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


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield each non-blank line of ``path`` parsed as a JSON object.

    Raises ValueError naming the file and line for a line that is not a JSON object.
    """
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
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


def sha256_files(paths: Iterable[str | Path]) -> str:
    """Hex sha256 over the bytes of ``paths`` in the given order (each prefixed by its length)."""
    h = hashlib.sha256()
    for p in paths:
        data = Path(p).read_bytes()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def sha256_rows(rows: Iterable[dict[str, Any]]) -> str:
    """Hex sha256 of rows as canonical JSON (sorted keys), order-sensitive: the training-data fingerprint."""
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(row, ensure_ascii=False, sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()
