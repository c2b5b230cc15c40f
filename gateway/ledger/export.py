"""Usage exports from the event stream: raw events or grouped sums, as CSV, JSON Lines or Parquet.

``group_by`` is a list of: ``key`` (key id), ``tier``, ``model`` (upstream model), ``day`` (UTC, of the
event's ``ts``), ``tag:NAME`` (the value of tag NAME, "" when absent) or ``tag`` (one row per ``k=v`` tag of
the event — an event with two tags counts in two groups, so sums over ``tag`` groups can exceed the total;
use ``tag:NAME`` for a partition). Grouped rows carry the counter sums (the same integers as the Redis
counters: requests, tokens by kind, ``cost_micro_usd``, ``saved_micro_usd``, cache hits, errors, partial)
plus ``cost_usd`` / ``saved_usd`` as exact decimal strings, ``refused`` (audit events of refused requests
in the group: they add nothing to any other column) and, last, ``over_bound_events`` (events whose tokens were held to
the call's admitted bound: ``over_bound`` in the raw rows). The columns only ever grow at the end: scripts read them by
position. Raw rows carry every event field, ``ts`` as ISO-8601
UTC, ``cost_usd`` / ``saved_usd``, in order of ``ts`` (the request's start); refused requests are rows with
``audit: true``, their status and error code, and cost 0.

Times for ``since``/``until``: ``YYYY-MM-DD`` or ``YYYYMMDD`` (UTC midnight), an ISO-8601 datetime (naive = UTC), or
epoch seconds; ``since`` inclusive, ``until`` exclusive. Eight digits are a date (ISO-8601's basic form, what
``date +%Y%m%d`` prints), never epoch seconds of 1970–1973.
"""

from __future__ import annotations

import csv
import io
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, Literal, Protocol

import orjson

from gateway.ledger.event import (
    COUNTER_FIELDS,
    CUBE_ONLY_FIELDS,
    UsageEvent,
    counter_increments,
    cube_only_increments,
    micro_to_usd,
)
from router.errors import ThinkGateError, require

Format = Literal["csv", "jsonl", "parquet"]
GROUPS = ("key", "tier", "model", "day", "tag")
EVENT_FIELDS = tuple(f.name for f in fields(UsageEvent))


class ExportError(ThinkGateError, ValueError):
    """Invalid export arguments (format, group-by field, time)."""


#: The latest time a period may name: 9999-12-31 (epoch seconds); the ledger's stream ids are milliseconds.
MAX_TIME_S = 253_402_300_799.0


def parse_period(since: str | float | None, until: str | float | None) -> tuple[float | None, float | None]:
    """``(since, until)`` in epoch seconds (:func:`parse_time`; None stays None). Raises :class:`ExportError` for a
    time that does not parse, and for ``since`` not before ``until``: an empty period, which every reader (the API,
    the CLI's export and report, the dashboard) refuses alike rather than answer nothing as if nothing was spent."""
    t0, t1 = parse_time(since), parse_time(until)
    if t0 is not None and t1 is not None and t0 >= t1:
        raise ExportError("since must be before until (the period would be empty)")
    return t0, t1


def parse_time(value: str | float | None) -> float | None:
    """Epoch seconds from ``YYYY-MM-DD``, ``YYYYMMDD``, ISO-8601 or epoch seconds (see module doc); None stays None.
    Raises :class:`ExportError` for text that is none of those, and for a time outside 1970-01-01 … 9999-12-31 (NaN,
    infinities and 1e400 included: they reached the ledger reader as a 500, or an OverflowError)."""
    if value is None or value == "":
        return None
    if isinstance(value, int | float):
        return _in_range(float(value), value)
    if len(value) == 8 and value.isascii() and value.isdigit():
        # YYYYMMDD (ISO-8601 basic, `date +%Y%m%d`): read as epoch seconds, --since 20261201 was 1970-08-23 — a
        # period of all history, or an empty one, answered without a word
        try:
            day = datetime.strptime(value, "%Y%m%d").replace(tzinfo=UTC)
        except ValueError:
            raise ExportError(f"cannot read time {value!r}: eight digits are a date, YYYYMMDD") from None
        return _in_range(day.timestamp(), value)
    try:
        return _in_range(float(value), value)
    except ValueError as exc:
        if isinstance(exc, ExportError):
            raise
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ExportError(f"cannot read time {value!r} (YYYY-MM-DD, YYYYMMDD, ISO-8601 or epoch seconds)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return _in_range(dt.timestamp(), value)


def month_start(now: float) -> float:
    """Epoch seconds of the start of ``now``'s UTC month: the default ``since`` of a grouped or raw query
    (``GET /v1/usage``, ``thinkgate usage export --group-by``, the dashboard)."""
    dt = datetime.fromtimestamp(now, UTC)
    return datetime(dt.year, dt.month, 1, tzinfo=UTC).timestamp()


def _in_range(ts: float, given: object) -> float:
    if not 0.0 <= ts <= MAX_TIME_S:  # False for NaN too
        raise ExportError(f"time {given!r} is outside 1970-01-01 … 9999-12-31 (epoch seconds 0 … {MAX_TIME_S:.0f})")
    return ts


def parse_group_by(spec: str | Iterable[str] | None) -> list[str]:
    """``"key,tier"`` → ``["key", "tier"]``; raises :class:`ExportError` for an unknown field."""
    if spec is None:
        return []
    parts = [p.strip() for p in (spec.split(",") if isinstance(spec, str) else spec) if p.strip()]
    for p in parts:
        if p not in GROUPS and not (p.startswith("tag:") and len(p) > 4):
            raise ExportError(f"unknown group-by field {p!r} (key, tier, model, day, tag, tag:NAME)")
    return parts


class Groupable(Protocol):
    """What grouping reads of an event or of a cube cell (:class:`gateway.ledger.aggregate.Cell`)."""

    @property
    def key_id(self) -> str: ...
    @property
    def tier(self) -> str | None: ...
    @property
    def upstream_model(self) -> str | None: ...
    @property
    def day(self) -> str: ...
    @property
    def tags(self) -> dict[str, str]: ...


def _group_values(event: Groupable, group_by: list[str]) -> list[tuple[str, ...]]:
    combos: list[tuple[str, ...]] = [()]
    for g in group_by:
        if g == "key":
            vals = [event.key_id]
        elif g == "tier":
            vals = [event.tier or ""]
        elif g == "model":
            vals = [event.upstream_model or ""]
        elif g == "day":
            vals = [event.day]
        elif g == "tag":
            vals = [f"{k}={v}" for k, v in sorted(event.tags.items())] or [""]
        else:
            vals = [event.tags.get(g[4:], "")]
        combos = [(*c, v) for c in combos for v in vals]
    return combos


def increments(event: UsageEvent) -> dict[str, int]:
    """What one event adds to its group: :func:`counter_increments` plus ``refused`` (1 for an audit event, whose
    counters are all 0) and :func:`~gateway.ledger.aggregate.cube_only_increments` (``over_bound_events``) — what
    the metering script adds to its cube cell."""
    return {**counter_increments(event), "refused": int(event.audit), **cube_only_increments(event)}


def group(events: Iterable[UsageEvent], group_by: list[str]) -> list[dict[str, Any]]:
    """Sum the counters of ``events`` per group (rows sorted by group values)."""
    return group_sums(((e, increments(e)) for e in events), group_by)


_SUMS = (*COUNTER_FIELDS, "refused", *CUBE_ONLY_FIELDS)


def group_sums(parts: Iterable[tuple[Groupable, Mapping[str, int]]], group_by: list[str]) -> list[dict[str, Any]]:
    """Rows of ``group_by`` from ``(attributes, sums)`` parts — events with their :func:`increments`, or cube cells
    with their counters (``gateway/ledger/aggregate.py``): one row per group value combination that any part
    has, with every counter of :data:`COUNTER_FIELDS`, ``refused``, ``over_bound_events`` and ``cost_usd`` /
    ``saved_usd`` (exact decimal strings), sorted by the group values."""
    sums: dict[tuple[str, ...], dict[str, int]] = {}
    for part, inc in parts:
        for values in _group_values(part, group_by):
            acc = sums.get(values)
            if acc is None:
                acc = sums[values] = dict.fromkeys(_SUMS, 0)
            for k, v in inc.items():
                acc[k] += v
    rows = []
    for values in sorted(sums):
        row: dict[str, Any] = dict(zip(group_by, values, strict=True))
        row.update(sums[values])
        row["cost_usd"] = str(micro_to_usd(row["cost_micro_usd"]))
        row["saved_usd"] = str(micro_to_usd(row["saved_micro_usd"]))
        rows.append(row)
    return rows


def event_row(event: UsageEvent) -> dict[str, Any]:
    """A raw event as an export row (``ts`` ISO-8601 UTC, plus ``cost_usd`` and ``saved_usd``)."""
    row = event.to_dict()
    row["ts"] = datetime.fromtimestamp(event.ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    row["cost_usd"] = str(micro_to_usd(event.cost_micro_usd))
    row["saved_usd"] = str(micro_to_usd(event.saved_micro_usd))
    return row


def columns(group_by: list[str]) -> list[str]:
    """Column order of the rows for ``group_by`` (raw events when empty)."""
    if group_by:
        # over_bound_events after the columns scripts already read by position: a column is only ever added at the end
        return [*group_by, *COUNTER_FIELDS, "refused", "cost_usd", "saved_usd", *CUBE_ONLY_FIELDS]
    return [*EVENT_FIELDS, "cost_usd", "saved_usd"]


def write(rows: list[dict[str, Any]], cols: list[str], fmt: Format, out: BinaryIO) -> None:
    """Write ``rows`` (with columns ``cols``) to the binary stream ``out`` in ``fmt``."""
    if fmt == "jsonl":
        for row in rows:
            out.write(orjson.dumps({c: row.get(c) for c in cols}) + b"\n")
    elif fmt == "csv":
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _csv_cell(row.get(c)) for c in cols})
        out.write(text.getvalue().encode())
    elif fmt == "parquet":
        _write_parquet(rows, cols, out)
    else:
        raise ExportError(f"unknown format {fmt!r} (csv, jsonl, parquet)")


def _csv_cell(v: Any) -> Any:
    if isinstance(v, dict):
        return orjson.dumps(v).decode()
    if v is None:
        return ""
    if isinstance(v, bool):  # as JSON Lines writes them (and pandas, DuckDB, BigQuery read them): not Python's True
        return "true" if v else "false"
    if isinstance(v, str) and v[:1] in _FORMULA_START:
        # a text a spreadsheet would run as a formula (a client's own ``model`` string: "=HYPERLINK(…)"): quoted
        # with a leading apostrophe (OWASP's CSV injection rule); JSON Lines and Parquet keep it as sent
        return "'" + v
    return v


_FORMULA_START = frozenset("=+-@\t\r")


def _write_parquet(rows: list[dict[str, Any]], cols: list[str], out: BinaryIO) -> None:
    pa = require("pyarrow", "report", "Parquet export")
    import pyarrow.parquet as pq

    types: dict[str, Any] = {c: pa.int64() for c in (*COUNTER_FIELDS, "refused", *CUBE_ONLY_FIELDS)}
    types.update({"ts": pa.timestamp("ms", tz="UTC"), "tags": pa.map_(pa.string(), pa.string()),
                  "difficulty": pa.float64(), "latency_ms": pa.float64(), "ttft_ms": pa.float64(),
                  "cache_similarity": pa.float64(),
                  "status": pa.int64(), "cached": pa.bool_(), "stream": pa.bool_(), "audit": pa.bool_(),
                  "over_bound": pa.bool_()})
    if "requests" not in cols:  # raw events: partial is a bool there
        types["partial"] = pa.bool_()
    arrays = []
    for c in cols:
        vals = [r.get(c) for r in rows]
        if c == "ts":
            vals = [datetime.fromisoformat(str(v).replace("Z", "+00:00")) for v in vals]
        elif c == "tags":
            vals = [list((v or {}).items()) for v in vals]
        arrays.append(pa.array(vals, type=types.get(c, pa.string())))
    pq.write_table(pa.Table.from_arrays(arrays, names=cols), out)


def build(events: Iterable[UsageEvent], group_by: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows, columns) for ``events``: grouped sums, or raw event rows when ``group_by`` is empty."""
    if group_by:
        return group(events, group_by), columns(group_by)
    # by request start: the stream is in write order, and a spooled or crash-reconciled event is written late
    return [event_row(e) for e in sorted(events, key=lambda e: e.ts)], columns([])


def write_file(rows: list[dict[str, Any]], cols: list[str], fmt: Format, path: Path | None, stdout: BinaryIO) -> None:
    """Write to ``path`` (atomically: temp file + rename), or to ``stdout`` when ``path`` is None."""
    if path is None:
        write(rows, cols, fmt, stdout)
        return
    # a new file of our own beside the target (mkstemp: O_EXCL, never through a link someone left at "<name>.tmp"
    # in a shared directory), renamed over it
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    mask = os.umask(0)  # the mode a plain open() would give (mkstemp's is 0600); the CLI is one thread
    os.umask(mask)
    os.fchmod(fd, 0o666 & ~mask)
    try:
        with os.fdopen(fd, "wb") as f:
            write(rows, cols, fmt, f)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
