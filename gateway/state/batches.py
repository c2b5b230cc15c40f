"""Writes a lost reply must not apply twice: a token per writer, and numbered batches applied once.

A Redis call that times out may still have been applied (the reply was lost, not the command). Two tools:

- :func:`new_token`: a value unique to one writer (process id + random), for marks and locks that writer may need
  to recognise as its own after such a timeout (the fit lock, alert marks).
- :class:`NumberedBatches` with :data:`FRESH_BATCH_LUA`: a replica's batches of additions (routing decisions and
  costs, drift scores) carry increasing numbers; a batch whose reply was lost is sent again as it was — never
  merged into the next — and the script applies each number once, so it counts once however often it is sent.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

#: Lua, prepended to a script: ``fresh_batch(key, seq)`` → whether batch number ``seq`` is new for the replica
#: whose last applied number ``key`` holds; records it (the key expires a day after the replica's last batch).
FRESH_BATCH_LUA = """
local function fresh_batch(key, seq)
  local last = tonumber(redis.call('GET', key) or '0') or 0
  redis.call('SET', key, tostring(math.max(seq, last)), 'EX', 86400)
  return seq > last
end
"""


def new_token() -> str:
    """A value unique to one writer: ``"<pid>:<32 hex digits>"``."""
    return f"{os.getpid()}:{uuid.uuid4().hex}"


class NumberedBatches(Generic[T]):
    """One replica's numbered batches (module doc). ``key``: the Redis key of its last applied number, passed to
    the script's ``fresh_batch``. Not thread-safe: one event loop."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._seq = 0
        self._unsent: tuple[int, T] | None = None

    def current(self, take: Callable[[], T]) -> tuple[int, T, bool]:
        """The batch to send now: (number, batch, resent). The one whose reply was lost, as it was (resent
        True), else a new number with ``take()`` (what has accumulated since)."""
        if self._unsent is not None:
            return (*self._unsent, True)
        self._seq += 1
        self._unsent = (self._seq, take())
        return (*self._unsent, False)

    def sent(self) -> None:
        """The script answered: the current batch is applied."""
        self._unsent = None
