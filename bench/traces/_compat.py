"""Thin adapter to the router package's trace functions (``router.fit.traces``, ``router.fit.ladder_eval``)
while they are not on this branch yet. Delete once they are: import them directly."""

from __future__ import annotations

import hashlib

try:  # pragma: no cover - depends on what main holds
    from router.fit.traces import is_heldout
except ImportError:  # pragma: no cover
    def is_heldout(dataset: str, qid: str, frac: float = 0.2) -> bool:
        """Same rule as ``router.fit.traces.is_heldout``: salted SHA-256 of (dataset, id) < frac."""
        h = hashlib.sha256(f"thinkgate-heldout-v1/{dataset}/{qid}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2.0**64 < frac

__all__ = ["is_heldout"]
