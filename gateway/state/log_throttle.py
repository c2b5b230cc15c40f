"""When a recurring error's log line is due: at most one line per distinct error per interval.

A Redis that is down, full or read-only fails the same way on every request, every metering batch or every sweep;
one line per occurrence buries the log (and costs a formatted line on the request path). The owner asks
:meth:`LogThrottle.due` before logging and appends the count of the lines held back to the one it writes.
"""

from __future__ import annotations

import time
from typing import Final

#: seconds between two lines of the same error, unless a caller says otherwise
EVERY_S: Final = 60.0
#: distinct errors remembered; past it all are forgotten (each logs again once): keys or payloads that vary without
#: end must not grow the table
MAX_KINDS: Final = 1024


class LogThrottle:
    """At most one line per distinct ``what`` per ``every_s`` seconds (monotonic clock).

    Not thread-safe; one per owner, used from its event loop.
    """

    def __init__(self, every_s: float = EVERY_S, max_kinds: int = MAX_KINDS) -> None:
        self.every_s = every_s
        self.max_kinds = max_kinds
        self._seen: dict[str, tuple[float, int]] = {}  # what → (when last logged, lines held back since)

    def due(self, what: str = "", now: float | None = None) -> int | None:
        """None when a line of ``what`` was written less than ``every_s`` ago (this one is counted as held back);
        otherwise the number held back since the last line (0 the first time) — the caller logs now.

        ``now``: a ``time.monotonic()`` reading (default: read it)."""
        now = time.monotonic() if now is None else now
        last, held = self._seen.get(what, (None, 0))
        if last is not None and now - last < self.every_s:
            self._seen[what] = (last, held + 1)
            return None
        if what not in self._seen and len(self._seen) >= self.max_kinds:
            self._seen.clear()
        self._seen[what] = (now, 0)
        return held


def held_back(n: int) -> str:
    """`` (N more since the last line)`` for ``n`` > 0, else empty: the suffix of a throttled line."""
    return f" ({n} more since the last line)" if n else ""
