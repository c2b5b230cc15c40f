"""The local usage spool: events that could not reach Redis, one JSON line each, fsync'd before return.

Several gateway processes may share one spool file (same state directory): every append and every drain
holds an exclusive ``fcntl.flock`` on the file; inside one process an ``asyncio.Lock`` serialises them too.
Draining never rewrites the file partially: it reads every line, hands the events to a sink, and truncates
the file only when the sink accepted all of them. A crash or failure in the middle leaves the whole file in
place; the next drain sends the already-counted events again and the metering script drops them by
``event_id`` (so nothing is lost and nothing counted twice). A torn last line (crash during a write, never
acknowledged) is skipped with a warning.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson

from gateway.usage import Settlement, UsageEvent

SpoolRecord = tuple[UsageEvent, Settlement | None]

log = logging.getLogger("thinkgate.metering")


class Spool:
    """Append-only fsync'd JSONL file of :class:`UsageEvent` at ``path`` (directories created on demand).

    Each line is the event's JSON object, plus ``"_settle"`` when the write also settles a reservation.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = asyncio.Lock()

    def _append_sync(self, lines: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            view = memoryview(lines)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)  # closing releases the flock

    async def append(self, records: list[SpoolRecord]) -> None:
        """Append ``records`` durably (written and fsync'd when this returns). Raises ``OSError`` on disk errors."""
        if not records:
            return
        data = b"".join(_encode(e, s) for e, s in records)
        async with self._lock:
            await asyncio.to_thread(self._append_sync, data)

    def pending_bytes(self) -> int:
        """Size of the spool file in bytes (0 when absent): non-zero means events wait for Redis."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def read_all(self) -> list[SpoolRecord]:
        """Every well-formed record in the file (for inspection and tests)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        return _parse(raw)

    async def drain(self, sink: Callable[[list[SpoolRecord]], Awaitable[None]], batch: int = 200) -> int:
        """Send every spooled record to ``sink`` (in batches) and truncate the file once all were accepted.

        Returns the number of events sent. When ``sink`` raises, the exception propagates and the file is
        left untouched (idempotent sinks make the retry safe).
        """
        if self.pending_bytes() == 0:
            return 0
        async with self._lock:
            fd = await asyncio.to_thread(_open_locked, self.path)
            if fd is None:
                return 0
            try:
                raw = await asyncio.to_thread(_read_fd, fd)
                events = _parse(raw)
                for i in range(0, len(events), batch):
                    await sink(events[i : i + batch])
                await asyncio.to_thread(_truncate, fd)
                return len(events)
            finally:
                os.close(fd)


def _open_locked(path: Path) -> int | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _truncate(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.fsync(fd)


def _read_fd(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _encode(event: UsageEvent, settle: Settlement | None) -> bytes:
    data = event.to_dict()
    if settle is not None:
        data["_settle"] = settle.to_dict()
    return orjson.dumps(data) + b"\n"


def _parse(raw: bytes) -> list[SpoolRecord]:
    events: list[SpoolRecord] = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = orjson.loads(line)
            settle = data.pop("_settle", None)
            events.append((UsageEvent.from_dict(data), Settlement.from_dict(settle) if settle else None))
        except (ValueError, TypeError) as exc:
            log.warning("usage spool: skipping unreadable line %d: %r", n, exc)
    return events
