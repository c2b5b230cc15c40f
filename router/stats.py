"""The one percentile of the project (latency tables, the dashboard, bench reports, the dial's adherence)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import overload


@overload
def percentile(values: Iterable[float], q: float) -> float | None: ...


@overload
def percentile(values: Iterable[float], q: float, empty: float) -> float: ...


def percentile(values: Iterable[float], q: float, empty: float | None = None) -> float | None:
    """Nearest-rank percentile: the smallest value with at least ``q`` percent of ``values`` at or below it, i.e.
    the ``ceil(q / 100 × n)``-th smallest of the ``n`` values (the 1st for ``q = 0``). Always one of the values,
    never an interpolation. ``q`` in [0, 100] (ValueError outside); ``empty`` (default None) when there are none.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    ordered = sorted(values)
    if not ordered:
        return empty
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
