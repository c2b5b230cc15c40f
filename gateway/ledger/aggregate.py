"""Usage aggregates: what the metering script keeps per key and UTC day so that grouped usage queries need not
scan the event stream, and which days of a period they can answer.

**The cube.** For every counted event, the metering script (``gateway/state/metering.py`` ``RECORD``, and
``AUDIT`` for refused requests) adds the event's counter increments to one hash per key and UTC day,
``usage:agg:key:{id}:d:{day}``, under the field ``"<counter> <cell>"``. The *cell* (:func:`cell_of`) is the JSON
text ``[tier, upstream model, {tags}]`` (``""`` for a missing tier or model, tags with sorted keys): together
with the key and the day it is every attribute ``group_by`` may name (``key``, ``tier``, ``model``, ``day``,
``tag``, ``tag:NAME``), so any grouping of the events is a grouping of the cells with the same sums. Counters are
:data:`~gateway.ledger.event.COUNTER_FIELDS` plus ``refused`` (audit events) and
:data:`~gateway.ledger.event.CUBE_ONLY_FIELDS` (``over_bound_events``: events whose tokens were held to the call's
admitted bound, ``UsageEvent.over_bound``; in the cube, not in the key's and tier's counter hashes), integers
(tokens, micro-USD, counts); a counter whose increment is 0 is not written (an absent field reads 0). A cube written
before ``over_bound_events`` existed reads 0 there: the raw export (``over_bound`` per event) is the record of those
days.

**Which days the cube can answer** (:func:`day_verdict`): the script also counts, per day, how many events it
aggregated (``n:{day}`` of ``usage:agg:index``); the day's seen-set (``usage:seen:{day}``, every counted event id of
that day, audit events included) says how many were counted at all. Equal counts mean every event of the day is in
the cube — events counted before the upgrade that introduced the cube, or by a replica still running the old
script, make them differ, and the day is answered from the stream instead until ``thinkgate usage backfill``
rebuilds it. Seen-sets expire ``metering.dedup_ttl_s`` after a day's last event: a day found complete while its
seen-set lived is marked ``ok:{day}`` and trusted afterwards; the cube hashes themselves expire after
``DAY_TTL_S`` (400 days), so older days are scanned.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Literal

import orjson

from gateway.ledger.event import COUNTER_FIELDS, CUBE_ONLY_FIELDS, UsageEvent

if TYPE_CHECKING:
    from gateway.ledger.export import Groupable

#: every counter of a cube cell: the event counters, ``refused`` (audit events) and ``CUBE_ONLY_FIELDS``
CUBE_FIELDS: tuple[str, ...] = (*COUNTER_FIELDS, "refused", *CUBE_ONLY_FIELDS)
DAY_S = 86400
#: how long before its TTL says so a seen-set is taken for gone (its day's ``ok:`` mark, :func:`day_verdict`; an event
#: too old to be replayed, ``gateway/state/metering.py``): clock skew between the replica that stamped a ``ts`` and
#: Redis, which runs the TTL, and the time between a check and the script it guards
SEEN_MARGIN_S = 3600

Verdict = Literal["cube", "empty", "scan"]
_NAMES = {name.encode(): name for name in CUBE_FIELDS}


@dataclass(frozen=True, slots=True)
class Cell:
    """The attributes a group-by can name, of every event in one cube cell (same names as :class:`UsageEvent`'s)."""

    key_id: str
    day: str
    tier: str | None
    upstream_model: str | None
    tags: dict[str, str]


def cell_of(event: UsageEvent) -> str:
    """The cell text of ``event`` (see the module doc): ``[tier, model, {tags}]`` as compact JSON, tags sorted, so
    two events with the same attributes always share one field name."""
    return orjson.dumps([event.tier or "", event.upstream_model or "", event.tags],
                        option=orjson.OPT_SORT_KEYS).decode()


def parse_cube(key_id: str, day: str, raw: Mapping[bytes | str, bytes | str]) -> list[tuple[Cell, dict[str, int]]]:
    """The cells of one cube hash (``HGETALL`` of ``usage:agg:key:{key_id}:d:{day}``) with their counters (every
    :data:`CUBE_FIELDS` name, 0 when absent). Raises ``ValueError`` on a field that is no ``"<counter> <cell>"``."""
    # a month of an admin's query is ~60,000 fields: one pass, no per-field allocation beyond the name
    cells: dict[bytes, dict[str, int]] = {}
    for f, v in raw.items():
        name, _, text = (f if isinstance(f, bytes) else f.encode()).partition(b" ")
        counts = cells.get(text)
        if counts is None:
            counts = cells[text] = dict.fromkeys(CUBE_FIELDS, 0)
        try:
            counts[_NAMES[name]] += int(v)
        except KeyError:
            raise ValueError(f"not a cube field: {f!r}") from None
        if not text:
            raise ValueError(f"not a cube field: {f!r}")
    out = []
    for text, counts in cells.items():
        tier, model, tags = orjson.loads(text)
        out.append((Cell(key_id, day, tier, model, tags), counts))
    return out


def day_of(ts: float) -> str:
    """UTC day ``YYYY-MM-DD`` of epoch seconds ``ts``."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d")


def day_start(day: str) -> float:
    """Epoch seconds of ``day``'s UTC midnight."""
    return datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=UTC).timestamp()


def days_between(first: str, last: str) -> list[str]:
    """Every UTC day from ``first`` to ``last`` inclusive (empty when ``last < first``)."""
    d, end = datetime.strptime(first, "%Y-%m-%d"), datetime.strptime(last, "%Y-%m-%d")
    out = []
    while d <= end:
        out.append(d.strftime("%Y-%m-%d"))
        d += timedelta(days=1)
    return out


def plan_period(since: float, until: float | None, now: float,
                known: Iterable[str]) -> tuple[list[str], list[tuple[float, float | None]]]:
    """Split ``[since, until)`` (epoch seconds; ``until`` None = open) into the UTC days it wholly covers and the
    sub-day stretches at its ends, which only the stream can answer. Returns ``(days, edges)``: ``edges`` are
    ``(lo, hi)`` windows (``hi`` None = open). The days run at most to the later of tomorrow (a replica's clock a
    little ahead) and the latest day of ``known`` (the days the cube index has seen): no later day holds a counted
    event, and a later ``until`` leaves one edge from there to it."""
    first_start = day_start(day_of(since))
    if first_start < since:
        first_start += DAY_S
    horizon = day_start(max([day_of(now + DAY_S), *known])) + DAY_S
    # an until of 9999-12-31 (any key may send it) planned 2.9 million days: seconds of Redis and event loop a query
    end = horizon if until is None else min(day_start(day_of(until)), horizon)
    if end <= first_start:  # no whole day inside: the period is one stretch
        return [], [(since, until)]
    days = days_between(day_of(first_start), day_of(end - DAY_S))
    edges: list[tuple[float, float | None]] = []
    if since < first_start:
        edges.append((since, first_start))
    if until is None:
        edges.append((end, None))  # events dated after every known day: none expected, but the scan would see them
    elif end < until:
        edges.append((end, until))
    return days, edges


def day_verdict(day: str, aggregated: int, seen: int, ok_mark: bool, now: float, dedup_ttl_s: int,
                cube_ttl_s: int) -> Verdict:
    """How day ``day`` is answered: ``cube`` (every event of it is aggregated), ``empty`` (no event counted on it),
    or ``scan`` (the stream must answer it). ``aggregated``: events the script aggregated (``n:{day}``); ``seen``:
    the size of its seen-set (0 once expired); ``ok_mark``: ``ok:{day}`` was set when it was found complete.
    See the module doc."""
    start = day_start(day)
    # an event is counted at or after its own ts, and its writes renew the hashes' TTLs: the day's cube lives at
    # least until start + cube_ttl_s, its seen-set until start + dedup_ttl_s (a day of margin, an hour of margin)
    if start + cube_ttl_s - DAY_S <= now:
        return "scan"
    if seen > 0:
        return "cube" if aggregated == seen else "scan"
    if start + dedup_ttl_s > now + SEEN_MARGIN_S:  # the seen-set would still live: nothing was counted that day
        return "empty" if aggregated == 0 else "scan"
    return "cube" if ok_mark else "scan"


def merge_windows(windows: Iterable[tuple[float, float | None]]) -> list[tuple[float, float | None]]:
    """Sorted, with overlapping or touching windows joined (``hi`` None = open, and swallows what follows)."""
    out: list[tuple[float, float | None]] = []
    for lo, hi in sorted(windows, key=lambda w: w[0]):
        if out and (out[-1][1] is None or lo <= out[-1][1]):
            prev_lo, prev_hi = out[-1]
            out[-1] = (prev_lo, None if prev_hi is None or hi is None else max(prev_hi, hi))
        else:
            out.append((lo, hi))
    return out


@dataclass
class GroupedUsage:
    """A grouped usage answer and where it came from: ``rows`` as :func:`gateway.ledger.export.group` makes them;
    ``cube_days``: days answered from the cube; ``scan_windows``: the ``(lo, hi)`` stretches (epoch seconds,
    ``hi`` None = open) answered from the stream — sub-day edges and days the cube cannot answer;
    ``events_scanned``: stream events read for them."""

    rows: list[dict[str, object]]
    cube_days: list[str]
    scan_windows: list[tuple[float, float | None]]
    events_scanned: int = 0


@dataclass
class PeriodParts:
    """A period's usage before grouping: ``parts`` are ``(attributes, sums)`` pairs for
    :func:`gateway.ledger.export.group_sums` (cube cells, and stream events for what the cubes cannot answer);
    ``cube_days``, ``scan_windows``, ``events_scanned`` as in :class:`GroupedUsage`."""

    parts: list[tuple[Groupable, Mapping[str, int]]]
    cube_days: list[str]
    scan_windows: list[tuple[float, float | None]]
    events_scanned: int = 0


class ScanTooLarge(ValueError):
    """A key's grouped query would read more of the event stream than a key may ask for (the message says how
    much, and how to ask instead): ``GET /v1/usage`` answers it 400 ``usage_scan_too_large``."""
