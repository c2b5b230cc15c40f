"""The local usage spool: events that could not reach Redis, one JSON line each, fsync'd before return.

Several gateway processes may share one spool file (same state directory): every append and every drain
holds an exclusive ``fcntl.flock`` on the file; inside one process an ``asyncio.Lock`` serialises them too,
and appends that arrive while one is being written are written together with one fsync (group commit: while
Redis is unreachable every request's event lands here, and one fsync each would queue them up for seconds
on a busy disk).
Draining never rewrites the file partially: it reads every line, hands the events to a sink, and truncates
the file only when the sink accepted all of them. A crash or failure in the middle leaves the whole file in
place; the next drain sends the already-counted events again and the metering script drops them by
``event_id`` (so nothing is lost and nothing counted twice). A torn last line (crash during a write, never
acknowledged) is skipped with a warning — or, for a spool given a :class:`Quarantine`, kept there before the
file is truncated (every usage spool: a line the drain cannot read may be money, and a truncate dropped it). An
append after such a torn line first ends it with a newline: glued to it, the appended record was unreadable too.

:meth:`Spool.drain_keeping` (the dead-letter spool of events Redis refused, ``gateway/state/metering.py``) keeps
the records its sink did not accept: the file is replaced by one holding only those, written beside it, fsync'd
and renamed over it (so a crash leaves the old file or the new, never neither). Every append and drain checks,
once it holds the lock, that the file it opened is still the one at the path (else it opens the new one): an
append that waited on the lock of a replaced file is never written into it.

:class:`Quarantine` (``<spool stem>.quarantine.jsonl``, ``gateway/state/metering.py``) is where metering sets aside
what it must neither count nor drop: an event too old to be counted once for sure (its id may have left the seen-set
that dedups it), one that cannot be written at all (malformed), a line no record can be read from (unreadable). The
gateway only appends to it and never reads it back: an operator decides, with ``thinkgate usage quarantine``
(``gateway/state/quarantine.py``), which rewrites it without what it settled (:meth:`Quarantine.remove_lines`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast

import orjson

from gateway.ledger.event import UsageEvent
from gateway.state.breaker import RedisDown
from router.durable import fsync_dir

log = logging.getLogger("thinkgate.metering")


class Spoolable(Protocol):
    def to_json(self) -> bytes: ...


T = TypeVar("T", bound=Spoolable)


class Spool(Generic[T]):
    """Append-only fsync'd JSONL file of :class:`UsageEvent` at ``path`` (directories created on demand).

    ``decode`` parses one line back (default ``UsageEvent.from_json``): the outcome stream
    (``gateway/control/outcomes.py``) spools its records in a file of its own through the same class."""

    def __init__(self, path: Path, decode: Callable[[bytes], T] | None = None,
                 quarantine: Quarantine | None = None) -> None:
        self.path = Path(path)
        #: where a drain keeps the lines it cannot read (None: skipped with a warning, as the outcome spool does)
        self.quarantine = quarantine
        self.decode: Callable[[bytes], T] = decode or cast(Callable[[bytes], T], UsageEvent.from_json)
        self._lock = asyncio.Lock()
        self._waiting: list[tuple[bytes, asyncio.Future[None]]] = []  # appends not yet written
        #: the file may hold records not yet sent (an append since the last full drain, or a file left by an
        #: earlier process); an attribute read, so the request path can ask it for free
        self.dirty = self.pending_bytes() > 0

    def _append_sync(self, lines: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_locked(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        assert fd is not None  # O_CREAT: there is always a file to open
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                # a line torn by a crash mid-write: ended here, or the first record appended now would be glued to it
                # and unreadable with it (the drain skipped the pair: an acknowledged event lost)
                lines = b"\n" + lines
            _write_all(fd, lines)
        finally:
            os.close(fd)  # closing releases the flock

    async def append(self, events: list[T]) -> None:
        """Append ``events`` durably (written and fsync'd when this returns). Raises ``OSError`` on disk errors."""
        if not events:
            return
        data = b"".join(e.to_json() + b"\n" for e in events)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((data, done))
        async with self._lock:
            if not done.done():  # nobody wrote ours while we waited for the lock: write every waiting append
                batch, self._waiting = self._waiting, []
                try:
                    await asyncio.to_thread(self._append_sync, b"".join(d for d, _ in batch))
                    self.dirty = True
                except BaseException as exc:
                    for _, f in batch:
                        if f is not done and not f.done():
                            f.set_exception(exc if isinstance(exc, Exception) else OSError("spool write interrupted"))
                    raise
                for _, f in batch:
                    if not f.done():
                        f.set_result(None)
        await done

    def pending_bytes(self) -> int:
        """Size of the spool file in bytes (0 when absent): non-zero means events wait for Redis."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def read_all(self) -> list[T]:
        """Every well-formed event in the file (for inspection and tests)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        return _parse(raw, self.decode)

    async def drain(self, sink: Callable[[list[T]], Awaitable[None]], batch: int = 200) -> int:
        """Send every spooled event to ``sink`` (in batches) and truncate the file once all were accepted.

        Returns the number of events sent. When ``sink`` raises, the exception propagates and the file is
        left untouched (idempotent sinks make the retry safe).
        """
        if self.pending_bytes() == 0:
            self.dirty = False
            return 0
        async with self._lock:
            fd = await asyncio.to_thread(_open_locked, self.path)
            if fd is None:
                self.dirty = False
                return 0
            try:
                events = await self._read_locked(fd)
                for i in range(0, len(events), batch):
                    await sink(events[i : i + batch])
                await asyncio.to_thread(_truncate, fd)
                self.dirty = False  # appends wait for the lock, so none landed between the read and the truncate
                return len(events)
            finally:
                os.close(fd)

    async def _read_locked(self, fd: int) -> list[T]:
        """The records of the file open (and locked) as ``fd``; with a :attr:`quarantine`, the lines that are none
        are kept there first (reason ``unreadable``): the drain that reads them truncates or replaces the file.
        Raises ``OSError`` when the quarantine cannot be written (the drain then keeps the file)."""
        records, bad = _parse_lines(await asyncio.to_thread(_read_fd, fd), self.decode)
        if bad and self.quarantine is not None:
            await self.quarantine.append([
                quarantined("unreadable", f"line {n} is no record: {err}", self.path,
                            {"line": line.decode("utf-8", "backslashreplace")}) for n, line, err in bad])
        return records

    def head(self, n: int) -> list[T]:
        """The first ``n`` records of the file, read without its lock (a probe: an append racing it at most adds a
        torn last line, which is skipped); [] when there is no file."""
        lines: list[bytes] = []
        try:
            with self.path.open("rb") as f:
                for line in f:
                    if len(lines) >= n:
                        break
                    if line.endswith(b"\n"):
                        lines.append(line)
        except FileNotFoundError:
            return []
        return _parse(b"".join(lines), self.decode)

    async def drain_keeping(self, sink: Callable[[list[T]], Awaitable[list[T]]], batch: int = 200) -> tuple[int, int]:
        """:meth:`drain`, but ``sink`` returns the records of its batch it did not accept: the file is then replaced
        by one holding only those (written beside it, fsync'd, renamed over it), or truncated when it accepted all.
        Returns ``(records sent, records kept)``. When ``sink`` raises, the file is left untouched."""
        if self.pending_bytes() == 0:
            self.dirty = False
            return 0, 0
        async with self._lock:
            fd = await asyncio.to_thread(_open_locked, self.path)
            if fd is None:
                self.dirty = False
                return 0, 0
            try:
                events = await self._read_locked(fd)
                kept: list[T] = []
                for i in range(0, len(events), batch):
                    kept += await sink(events[i : i + batch])
                if kept:
                    await asyncio.to_thread(_replace, self.path, b"".join(e.to_json() + b"\n" for e in kept))
                else:
                    await asyncio.to_thread(_truncate, fd)
                    self.dirty = False
                return len(events), len(kept)
            finally:
                os.close(fd)

    async def replay(self, sink: Callable[[list[T]], Awaitable[None]], what: str) -> int:
        """:meth:`drain` into ``sink`` (a writer to Redis); 0 when the spool is empty or Redis is down
        (:class:`~gateway.state.breaker.RedisDown`: the file is kept for the next try). ``what`` names the spool in
        the log line ("usage", "outcome")."""
        if self.pending_bytes() == 0:
            self.dirty = False  # e.g. drained by another process sharing the file
            return 0
        try:
            n = await self.drain(sink)
        except RedisDown:
            return 0
        if n:
            log.info("%s spool replayed: %d records sent (each counted once: one already counted is dropped by its "
                     "id)", what, n)
        return n

    async def run_replayer(self, replay: Callable[[], Awaitable[int]], stop: asyncio.Event, interval_s: float,
                           what: str) -> None:
        """Call ``replay`` every ``interval_s`` seconds until ``stop`` is set (a background task). A failure — an
        unreadable spool file, or a Redis error that is not an outage (a Cluster's ``CLUSTERDOWN`` / ``TRYAGAIN``
        while it fails over, a client error) — is logged and retried at the next interval, never fatal: the file
        stays as it was (:meth:`drain` truncates only once every record was accepted, and the sinks are
        idempotent), so a dead replayer can never strand the records."""
        while not stop.is_set():
            try:
                await replay()
            except OSError as exc:
                log.error("%s spool replay failed: %r", what, exc)
            except Exception:  # see the docstring: the next pass retries; only cancellation ends the task
                log.exception("%s spool replay failed; retrying in %.1f s", what, interval_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


#: why a record is set aside (:class:`Quarantined`'s ``reason``, the metrics' label): ``past_dedup_window`` — an event
#: too old to be replayed once for sure (``gateway/state/metering.py``, ``past_dedup_window``); ``malformed`` — an
#: event whose write cannot even be built (a ``ts`` that is no number: no day to count it on), sent again it would
#: only raise again; ``unreadable`` — a spool line that is no record (``event``: ``{"line": its text}``)
QUARANTINE_REASONS = ("past_dedup_window", "malformed", "unreadable")


@dataclass(frozen=True, slots=True)
class Quarantined:
    """One line of the quarantine file: what was set aside (``event``: the record as it was read), from which
    file (``source``), when (``at``, epoch s), why (``reason``, a short name the metrics label with; ``detail``, the
    sentence for a person)."""

    reason: str
    detail: str
    source: str
    event: dict[str, Any]
    at: float

    @property
    def key(self) -> str:
        """What makes two records the same: the reason and the event's id, a write-ahead record's request id and
        the time of its last write (it has no ``event_id``: keyed on that alone, every record after a process's
        first was taken for a copy of it and dropped with its spool), or an unreadable line's text (a pass retried
        after a failure sets the same event aside again)."""
        ev = self.event
        ident = ev.get("event_id") or ev.get("line")
        if ident is None and ev.get("request_id"):
            ident = f"{ev['request_id']} {ev.get('updated_ms')}"
        return f"{self.reason} {ident}"

    def to_json(self) -> bytes:
        return orjson.dumps(self)


class Quarantine:
    """Fsync'd JSONL file of :class:`Quarantined` records at ``path``, shared by processes like a spool (``flock``).
    The gateway only appends; ``thinkgate usage quarantine --settle`` removes what it settled (:meth:`remove_lines`).
    ``counts`` (by reason) are this process's records, for the metrics.

    A pass that sets records aside and then fails (Redis down before its file is truncated) keeps its file and sets
    them aside again on the next pass: this process writes each ``(reason, event_id)`` once (``_written``, bounded),
    so a long outage does not fill the file with copies; another process, or a restart, may still write one twice
    (same ``event_id``)."""

    #: records remembered as written; past it the memory starts afresh (a rare copy, never a loss)
    MEMORY = 100_000

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.counts: dict[str, int] = {}
        self._written: set[str] = set()
        self._lock = threading.Lock()  # appends run in worker threads (asyncio.to_thread)

    def append_sync(self, records: list[Quarantined]) -> int:
        """Write the ``records`` this process has not written yet, durably (fsync'd when this returns); how many were
        new. Raises ``OSError`` (disk full): the caller keeps them where they were."""
        with self._lock:
            new = list({r.key: r for r in records if r.key not in self._written}.values())
            if not new:
                return 0
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = _open_locked(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            assert fd is not None  # O_CREAT
            try:
                _write_all(fd, b"".join(r.to_json() + b"\n" for r in new))
            finally:
                os.close(fd)
            if len(self._written) > self.MEMORY:
                self._written.clear()
            for r in new:
                self._written.add(r.key)
                self.counts[r.reason] = self.counts.get(r.reason, 0) + 1
            return len(new)

    async def append(self, records: list[Quarantined]) -> int:
        """:meth:`append_sync` in a worker thread."""
        return await asyncio.to_thread(self.append_sync, records) if records else 0

    def pending_bytes(self) -> int:
        """Size of the file in bytes (0 when absent): non-zero means something waits for an operator."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def read_all(self) -> list[dict[str, Any]]:
        """Every record of the file as a dict (for inspection and tests)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        return [orjson.loads(line) for line in raw.splitlines() if line.strip()]

    def read_locked(self) -> list[bytes]:
        """The file's lines (bytes, without their newline; blank ones left out), read under its lock, so no append is
        half written; [] when there is no file. Raises ``OSError``."""
        fd = _open_locked(self.path, os.O_RDONLY)
        if fd is None:
            return []
        try:
            return [line for line in _read_fd(fd).split(b"\n") if line.strip()]
        finally:
            os.close(fd)

    def remove_lines(self, lines: Iterable[bytes]) -> int:
        """Rewrite the file without ``lines`` (as :meth:`read_locked` gave them; one listed twice removes two
        copies) — ``thinkgate usage quarantine --settle``. Under the file's lock the file is read again, so a record
        a gateway appended since the caller read it is kept; the rest is written beside it, fsync'd and renamed over
        it (a crash leaves the old file or the new), and an append that waited on the old file's lock writes into
        the new one (:func:`_open_locked`). Every kept line ends with a newline (a line a crash tore is ended).
        Returns how many lines were removed. Raises ``OSError`` (the file is then as it was)."""
        gone = Counter(lines)
        if not gone:
            return 0
        with self._lock:  # this process's own appends (worker threads)
            fd = _open_locked(self.path)
            if fd is None:
                return 0
            try:
                kept, removed = [], 0
                for line in _read_fd(fd).split(b"\n"):
                    if gone[line] > 0:
                        gone[line] -= 1
                        removed += 1
                    elif line.strip():
                        kept.append(line + b"\n")
                if removed:
                    _replace(self.path, b"".join(kept))
                return removed
            finally:
                os.close(fd)  # after the rename: a waiting append then finds the new file at the path


def quarantined(reason: str, detail: str, source: Path, event: dict[str, Any]) -> Quarantined:
    """A :class:`Quarantined` record stamped now."""
    return Quarantined(reason, detail, str(source), event, time.time())


def _open_locked(path: Path, flags: int = os.O_RDWR) -> int | None:
    """``path`` opened with ``flags`` and locked (``flock``, exclusive): the file at the path once the lock is held —
    one replaced meanwhile (:meth:`Spool.drain_keeping`) is let go and the new one opened. None when there is no
    file (without ``O_CREAT``)."""
    while True:
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _is_current(fd, path):
            return fd
        os.close(fd)  # replaced (drain_keeping) while we waited for its lock: the new file


def _is_current(fd: int, path: Path) -> bool:
    """Whether the file open as ``fd`` is still the one at ``path``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write less than asked) and fsync it."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def _replace(path: Path, data: bytes) -> None:
    """Replace the file at ``path`` by one holding ``data``, durably (a crash leaves the old file or the new)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _truncate(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.fsync(fd)


def _read_fd(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(raw: bytes, decode: Callable[[bytes], Any]) -> list[Any]:
    """The records of ``raw`` (JSON lines), unreadable ones skipped with a warning."""
    return _parse_lines(raw, decode)[0]


def _parse_lines(raw: bytes, decode: Callable[[bytes], Any]) -> tuple[list[Any], list[tuple[int, bytes, str]]]:
    """``(records, unreadable)`` of ``raw``: each unreadable line as ``(line number, its bytes, the error)``, logged
    at WARNING."""
    events: list[Any] = []
    bad: list[tuple[int, bytes, str]] = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            events.append(decode(line))
        except (ValueError, TypeError) as exc:
            log.warning("usage spool: skipping unreadable line %d: %r", n, exc)
            bad.append((n, line, repr(exc)))
    return events, bad
