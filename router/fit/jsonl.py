"""Content hashes of training data; the JSONL reader and writer live in :mod:`router.jsonl` (re-exported here)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from router.jsonl import open_text, read_jsonl, write_jsonl

__all__ = ["open_text", "read_jsonl", "sha256_files", "sha256_rows", "write_jsonl"]


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
