"""Settling the usage quarantine file (``thinkgate usage quarantine``): what each record set aside is, whether the
ledger counted it, and counting — once — the ones it did not.

The quarantine file (``<spool stem>.quarantine.jsonl``, :class:`~gateway.state.spool.Quarantine`) holds what metering
must neither count nor drop (``docs/metering.md``). :func:`read_entries` reads each line as one :class:`Entry`;
:func:`classify` gives it a status:

- a usage event set aside past the dedup window (reason ``past_dedup_window``): ``counted`` when its ``event_id`` is in
  the ledger — its day's seen-set, else the stream's events of its day, read as ``thinkgate usage export`` reads them
  (:meth:`Meter.events`); ``absent`` when it is not; ``unverifiable`` when the stream no longer holds every event the
  usage cubes counted on that day (trimmed: ``metering.stream_maxlen``, an ``XTRIM``), or — a day the cube index does
  not know — when a trimmed stream (``stream_maxlen`` set) begins after the event's ``ts``: absence proves nothing
  there, and settling it could count it twice.
- a write-ahead record (from the write-ahead spool ``<stem>.wal.jsonl``: a record with a ``request_id`` and an
  ``owner``, no ``event_id``): the same, for its request — its own usage event (id = the request id), or the
  ``{request id}:unsent`` audit event the reconciler writes for a call never sent.
- anything else — ``unreadable`` and ``malformed`` lines, a line that is no record, an event whose write cannot be
  built (:meth:`Meter.write_error`) — is ``unusable``: shown with its detail, never counted, never removed (a person
  repairs it and appends it to the dead letters, or deletes it by hand: ``docs/metering.md``).

:func:`settle` counts every ``absent`` entry once through the metering script itself (:meth:`Meter.record_direct`:
``RECORD``, or ``AUDIT`` for an audit event) — stream, key and tier counters, the day's cube, the budget levels of the
event's own day and month — and marks it ``counted``; an entry ``counted`` already is never sent again. Exactly once:
the script drops an id already in its day's seen-set, and counting one recreates that set for ``metering.dedup_ttl_s``,
so a second run, or two at once, count nothing more; a run stopped between counting and rewriting leaves lines the
next run finds ``counted`` and only removes. Usage events go before write-ahead records: a request whose own event is
set aside too is counted at its real usage, its records then found ``counted``.

A write-ahead record found absent is billed the way the orphan reconciler bills the record of a dead process
(``WriteAhead.reconcile``), since no reconciler will ever see it (it never reached Redis): its final event when it holds
one; a call never sent (:attr:`WalRecord.unsent`) gets its ``{request id}:unsent`` audit event, no money; any other
call is *lost* — a partial ``gateway_lost`` event at its last written tokens, priced at its tier's prices from the
configuration given (:meth:`WalRecord.event`). Several records of one request (a begin, progress writes) are billed
once, from the latest (one with a final event first, else the last written). One whose tier has no prices in that
configuration is kept, not billed at 0 as the reconciler would: the operator may have left out the gateway's config.

:func:`rewrite` then removes the settled lines (``counted``, by the bytes read) under the file's lock
(:meth:`Quarantine.remove_lines`): a record a gateway appended meanwhile is kept. Before that, every removed line is
appended, with what was done, to the settled journal beside it (:func:`settled_path`, fsync'd): the audit trail of
the hand correction — the product has no other audit record of usage corrections — with one WARNING log line per
event counted. With ``metering.replica_acks`` = N > 0 nothing is removed unless N replicas acknowledge the counting
(:meth:`Meter.replica_acks`): a failover could lose it, and the next run would find it absent and count it then.
"""

from __future__ import annotations

import functools
import getpass
import logging
import math
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from redis.exceptions import ResponseError

from gateway.config import Prices
from gateway.ledger.aggregate import DAY_S, day_of, day_start
from gateway.ledger.event import UsageEvent
from gateway.state.breaker import RedisDown
from gateway.state.metering import EARLY_SLACK_S, Meter
from gateway.state.redis import as_text
from gateway.state.spool import Quarantine, Spool
from gateway.state.write_ahead import WalRecord

log = logging.getLogger("thinkgate.metering")

#: ``counted``: in the ledger; ``absent``: not (settling counts it); ``unusable``: nothing can be counted from it;
#: ``unverifiable``: the stream no longer holds its day whole, so absence proves nothing (settling keeps it)
Status = Literal["counted", "absent", "unusable", "unverifiable"]
Kind = Literal["usage", "write_ahead", "none"]


@dataclass(slots=True)
class Entry:
    """One line of the quarantine file. ``line``: its number (1-based); ``raw``: its bytes (what a rewrite removes);
    ``reason``, ``source``, ``at`` (epoch s), ``detail``: the quarantine record's (``reason`` "" for a line that is no
    record); ``kind``: a usage event, a write-ahead record, or neither. ``ts`` epoch s; ``cost_micro_usd``: a usage
    event's own, or what settling an absent write-ahead record bills (None: not known — unusable, a tier without
    prices, a write-ahead record already counted). ``outcome`` (after
    :func:`settle`): ``counted`` (counted now), ``already counted``, or ``kept: why``."""

    line: int
    raw: bytes
    reason: str
    source: str
    kind: Kind
    status: Status
    detail: str
    at: float | None = None
    event_id: str | None = None
    request_id: str | None = None
    key_id: str | None = None
    tier: str | None = None
    ts: float | None = None
    cost_micro_usd: int | None = None
    outcome: str | None = None
    #: what settling counts (None: nothing: unusable, or a write-ahead record whose tier has no prices)
    event: UsageEvent | None = field(default=None, repr=False)
    wal: WalRecord | None = field(default=None, repr=False)

    @property
    def ids(self) -> tuple[str, ...]:
        """The ledger ids that say this entry was counted: the event's id; a write-ahead record's request id and
        its never-sent audit event's id."""
        if self.kind == "write_ahead" and self.request_id:
            return self.request_id, f"{self.request_id}:unsent"
        return (self.event_id,) if self.event_id else ()

    def to_dict(self) -> dict[str, Any]:
        """The entry for ``--json``: every field but the raw line and the parsed records."""
        return {"line": self.line, "reason": self.reason, "source": self.source, "kind": self.kind,
                "status": self.status, "detail": self.detail, "at": self.at, "event_id": self.event_id,
                "request_id": self.request_id, "key_id": self.key_id, "tier": self.tier, "ts": self.ts,
                "cost_micro_usd": self.cost_micro_usd, "outcome": self.outcome}


def settled_path(quarantine: Path) -> Path:
    """The settled journal beside ``quarantine``: ``<stem>.quarantine.settled.jsonl`` (one JSON line per line removed
    from the quarantine file, with what was done)."""
    return quarantine.with_name(quarantine.name.removesuffix(".jsonl") + ".settled.jsonl")


def read_entries(quarantine: Quarantine, meter: Meter, prices: Mapping[str, Prices]) -> list[Entry]:
    """The lines of the quarantine file as entries (read under its lock), statuses ``unusable`` or, for the others,
    ``absent`` until :func:`classify` asks the ledger. ``prices``: tier → prices, to bill a lost write-ahead record
    (the configuration's tiers). Raises ``OSError``."""
    return [_entry(n, raw, meter, prices) for n, raw in enumerate(quarantine.read_locked(), 1)]


def _entry(n: int, raw: bytes, meter: Meter, prices: Mapping[str, Prices]) -> Entry:
    try:
        rec = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Entry(n, raw, "", "", "none", "unusable", f"not a quarantine record (no JSON: {exc})")
    if not isinstance(rec, dict) or not isinstance(rec.get("event"), dict):
        return Entry(n, raw, "", "", "none", "unusable", "not a quarantine record (no 'event' object)")
    ev: dict[str, Any] = rec["event"]
    at = rec.get("at") if isinstance(rec.get("at"), int | float) else None
    e = Entry(n, raw, str(rec.get("reason") or ""), str(rec.get("source") or ""), "none", "unusable",
              str(rec.get("detail") or ""), at, _text(ev.get("event_id")), _text(ev.get("request_id")),
              _text(ev.get("key_id")), _text(ev.get("tier")), _number(ev.get("ts")),
              ev.get("cost_micro_usd") if type(ev.get("cost_micro_usd")) is int else None)
    if e.reason != "past_dedup_window":  # unreadable, malformed: a person's to repair
        return e
    if "event_id" not in ev and "request_id" in ev and "owner" in ev:
        return _wal_entry(e, ev, prices)
    e.kind = "usage"
    try:
        event = UsageEvent.from_dict(ev)
    except (TypeError, ValueError) as exc:
        e.detail = f"no usage event can be read from it: {exc!r}"
        return e
    if not (isinstance(event.event_id, str) and event.event_id and _finite(event.ts)):
        e.detail = "no event_id, or a ts that is no number: no day to count it on"
        return e
    error = meter.write_error(event)
    if error is not None:
        e.detail = f"its write cannot be built: {error!r}"
        return e
    e.status, e.event = "absent", event
    return e


def _wal_entry(e: Entry, ev: dict[str, Any], prices: Mapping[str, Prices]) -> Entry:
    e.kind = "write_ahead"
    try:
        rec = WalRecord.from_json(orjson.dumps(ev))
        if not (_finite(rec.ts) and isinstance(rec.request_id, str) and rec.request_id):
            raise ValueError("no request_id or no numeric ts")
    except (TypeError, ValueError) as exc:
        e.detail = f"no write-ahead record can be read from it: {exc!r}"
        return e
    e.status, e.wal = "absent", rec
    e.event, e.cost_micro_usd = _bill(rec, prices)
    return e


def _bill(rec: WalRecord, prices: Mapping[str, Prices]) -> tuple[UsageEvent | None, int | None]:
    """What settling ``rec`` counts (see the module doc) and its cost; (None, None) when its tier has no prices."""
    if rec.final is not None:
        return rec.final, rec.final.cost_micro_usd
    if rec.unsent:
        return rec.unsent_event(), 0
    tier_prices = prices.get(rec.tier or "")
    if tier_prices is None and rec.tier is not None:
        return None, None
    event = rec.event(tier_prices)
    return event, event.cost_micro_usd


async def classify(meter: Meter, entries: Sequence[Entry]) -> None:
    """Set each non-``unusable`` entry's status from the ledger (module doc): one ``SISMEMBER`` per id, then one read
    of the stream per UTC day for the ids no seen-set holds. Raises :class:`RedisDown`."""
    wanted = [e for e in entries if e.status != "unusable"]
    found: set[str] = set()
    by_day: dict[str, set[str]] = {}
    for e in wanted:
        assert e.ts is not None  # entries without a numeric ts are unusable
        day = day_of(e.ts)
        for i in e.ids:
            if await meter.breaker.call(functools.partial(meter.redis.sismember, meter.keys.seen(day), i)):
                found.add(i)
            else:
                by_day.setdefault(day, set()).add(i)
    held: dict[str, int] = {}  # events of the day the stream holds, for the days read
    for day, ids in sorted(by_day.items()):
        held[day] = 0
        async for event in meter.events(day_start(day), day_start(day) + DAY_S):
            held[day] += 1
            if event.event_id in ids:
                found.add(event.event_id)
    for e in wanted:
        e.status = "counted" if any(i in found for i in e.ids) else "absent"
        if e.status == "counted" and e.kind == "write_ahead":
            e.cost_micro_usd = None  # what was counted for its request is the ledger's, not this record's bill
    absent = [e for e in wanted if e.status == "absent"]
    if not absent:
        return
    aggregated = await _aggregated(meter, sorted({day_of(e.ts) for e in absent if e.ts is not None}))
    first_ms = await _first_entry_ms(meter) if meter.cfg.stream_maxlen else None
    for e in absent:
        assert e.ts is not None
        day = day_of(e.ts)
        n = aggregated.get(day)
        # the cubes counted n events of the day: the stream must still hold them all; a day the cube index does not
        # know: a trimmed stream that begins after the event's ts (less the clock skew allowed) may have lost it
        trimmed = (held[day] < n if n is not None
                   else first_ms is not None and first_ms > (e.ts - EARLY_SLACK_S) * 1000)
        if trimmed:
            e.status = "unverifiable"
            e.detail = (f"the usage stream no longer holds every event of {day} (trimmed: metering.stream_maxlen or "
                        "XTRIM), so its absence proves nothing; not settled")


async def _aggregated(meter: Meter, days: list[str]) -> dict[str, int]:
    """``n:{day}`` of the cube index — the events the metering script counted on that day — for each of ``days`` it
    knows. Raises :class:`RedisDown`."""
    out: dict[str, int] = {}
    for day in days:
        n = await meter.breaker.call(functools.partial(meter.redis.hget, meter.keys.agg_index, f"n:{day}"))
        if n is not None:
            out[day] = int(n)
    return out


async def _first_entry_ms(meter: Meter) -> int | None:
    """The id time (ms) of the stream's oldest entry; None when it is empty. Raises :class:`RedisDown`."""
    first = await meter.breaker.call(lambda: meter.redis.xrange(meter.keys.events, count=1)) or []
    return int(as_text(first[0][0] or b"0").split("-")[0]) if first else None


@dataclass(slots=True)
class Settled:
    """What :func:`settle` did: ``counted`` events counted now, their total cost (micro-USD); ``error``: why it
    stopped early (Redis went away: the entries after it are untouched), else None."""

    counted: int = 0
    cost_micro_usd: int = 0
    error: str | None = None


async def settle(meter: Meter, entries: Sequence[Entry], *, by: str | None = None) -> Settled:
    """Count every ``absent`` entry once (module doc) and set each entry's :attr:`Entry.outcome`: ``counted``
    (counted now: status ``counted``), ``already counted`` (status ``counted`` — found so, or its id counted
    meanwhile by another run), or ``kept: why`` (unusable, unverifiable, a tier without prices, Redis refused it). Each
    event counted is logged (WARNING, ``by``: who ran it). Stops at the first outage (the rest keep their status).
    Call :func:`classify` first."""
    by = by or who()
    out = Settled()
    billed: dict[str, Entry] = {}  # request id → the write-ahead entry billed for it (several lines of one request)
    counted: set[str] = set()  # ids in the ledger now (found so, or counted by this run)
    for e in _billing_order(entries):
        if e.status == "absent" and e.kind == "write_ahead" and e.request_id in counted:
            e.status = "counted"  # its request's own event was set aside too, and counted just now (usage first)
        if e.status == "counted":
            e.outcome = "already counted"
            counted.update(e.ids)
            continue
        if e.status != "absent":
            e.outcome = f"kept: {e.status}"
            continue
        if e.kind == "write_ahead" and e.request_id in billed:
            done = billed[e.request_id]
            if done.status == "counted":
                e.status, e.outcome = "counted", "already counted"
            else:
                e.outcome = "kept: another record of this request was not settled"
            continue
        if e.kind == "write_ahead":  # its request's other records follow this one's fate, never billed in its place
            billed[e.request_id or ""] = e
        if e.event is None:
            e.outcome = f"kept: tier {e.tier!r} has no prices in this configuration (give the gateway's --config)"
            continue
        try:
            result = await meter.record_direct(e.event)
        except RedisDown as exc:
            out.error = f"Redis unreachable: {exc}"
            break
        except ResponseError as exc:
            e.outcome = f"kept: refused by Redis: {exc}"
            continue
        e.status = "counted"
        counted.update(e.ids)
        if not result.counted:
            e.outcome = "already counted"
            continue
        e.outcome = "counted"
        out.counted += 1
        out.cost_micro_usd += e.event.cost_micro_usd
        log.warning("usage quarantine: counted %s %s of key %s (tier %s, ts %s, %d micro-USD) from line %d of the "
                    "quarantine file, set aside from %s; settled by %s", "write-ahead record of request"
                    if e.kind == "write_ahead" else "event", e.event.event_id, e.event.key_id, e.event.tier,
                    _iso(e.event.ts), e.event.cost_micro_usd, e.line, e.source, by)
    return out


def _billing_order(entries: Sequence[Entry]) -> list[Entry]:
    """``entries`` in the order :func:`settle` goes: usage events (and the rest) in file order, then the write-ahead
    records, each request's together — the one holding a final event first, then the latest written (module doc)."""
    usage = [e for e in entries if e.kind != "write_ahead"]
    wal = [e for e in entries if e.kind == "write_ahead"]
    wal.sort(key=lambda e: (e.request_id or "", -(e.wal is not None and e.wal.final is not None),
                            -(e.wal.updated_ms if e.wal is not None else 0), e.line))
    return usage + wal


async def rewrite(quarantine: Quarantine, entries: Sequence[Entry], meter: Meter, *,
                  by: str | None = None) -> tuple[int, str | None]:
    """Remove the ``counted`` entries' lines from the quarantine file (:meth:`Quarantine.remove_lines`: a line
    appended meanwhile is kept), after appending them to the settled journal (:func:`settled_path`). With
    ``metering.replica_acks`` = N > 0, only once N replicas acknowledge what was counted. Returns ``(lines removed,
    why none was when some should have been)``. Raises ``OSError``."""
    done = [e for e in entries if e.status == "counted"]
    if not done:
        return 0, None
    want = meter.cfg.replica_acks
    if want and any(e.outcome == "counted" for e in done) and await meter.replica_acks() < want:
        return 0, (f"fewer than {want} Redis replica(s) acknowledged the counting (metering.replica_acks): the lines "
                   "are kept; the next run finds them counted (or, lost in a failover, absent, and counts them)")
    journal: Spool[_Journal] = Spool(settled_path(quarantine.path), decode=_Journal.from_json)
    now, by = time.time(), by or who()
    await journal.append([_Journal(now, by, e.outcome or "", e.line, orjson.loads(e.raw)) for e in done])
    return quarantine.remove_lines([e.raw for e in done]), None


@dataclass(frozen=True, slots=True)
class _Journal:
    """One line of the settled journal: when (epoch s), by whom, what was done (``counted``: counted now; ``already
    counted``: only removed), and the quarantine line as it was."""

    at: float
    by: str
    outcome: str
    line: int
    record: dict[str, Any]

    def to_json(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def from_json(cls, raw: bytes) -> _Journal:
        return cls(**orjson.loads(raw))


def who() -> str:
    """``user@host`` of this process, for the journal and the log line."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()}"


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _number(x: object) -> float | None:
    return float(x) if _finite(x) else None  # type: ignore[arg-type]


def _text(x: object) -> str | None:
    return x if isinstance(x, str) else None
