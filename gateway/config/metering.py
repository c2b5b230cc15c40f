"""Metering (``metering:``): the usage stream and its spool (``gateway/state/metering.py``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from gateway.config.base import _Strict
from gateway.config.paths import STATE_DIR


class MeteringConfig(_Strict):
    """Usage events: Redis Stream ``{prefix}usage:events`` + counters; a local fsync'd spool while Redis is
    down, replayed every ``replay_interval_s`` seconds. ``dedup_ttl_s`` is how long an ``event_id`` is
    remembered: a replay sets aside an event older than that less an hour (it could count twice) in the
    quarantine file beside the spool (``docs/metering.md``). ``stream_maxlen`` trims the stream
    approximately (None = never; exports read the stream)."""

    spool_path: Path = STATE_DIR / "usage-spool.jsonl"
    replay_interval_s: float = Field(5.0, gt=0)
    # Events Redis refused with an error reply (a ThinkGate key of the wrong type, gateway/state/metering.py): kept
    # in the dead-letter spool beside the usage spool and sent again after dead_letter_interval_s seconds — the wait
    # doubling, up to an hour, while a retry counts none of them
    dead_letter_interval_s: float = Field(60.0, gt=0)
    dedup_ttl_s: int = Field(40 * 86400, ge=60)
    # Redis replicates asynchronously: a master that crashes before its replicas have a write loses it in the
    # failover. replica_acks = N > 0: after each batch of usage events is counted, WAIT N replicas (at most
    # replica_ack_timeout_ms); events fewer acknowledge are also kept in the usage spool, replayed (dropped by event_id
    # where they survived) and let go once N replicas hold them; and at every heartbeat the process's write-ahead
    # records older than a beat are written again and WAITed for (WriteAhead.reassert). 0: off (one more round trip
    # per batch, and two per beat while a call is open longer than a beat, off the request path, when on; the spool
    # grows while fewer than N replicas are up).
    replica_acks: int = Field(0, ge=0)
    replica_ack_timeout_ms: int = Field(100, ge=1, le=10_000)
    stream_maxlen: int | None = Field(None, ge=1000)
    # Write-ahead records (gateway/state/write_ahead.py): every upstream call leaves one in Redis before its first
    # byte, its streamed tokens written at most every write_ahead_interval_s, deleted by its usage event; records
    # of a process whose heartbeat (TTL heartbeat_ttl_s) expired are metered as partial by any replica, checked at
    # start and every reconcile_interval_s (at most reconcile_batch records of dead owners per pass).
    write_ahead: bool = True
    write_ahead_interval_s: float = Field(1.0, gt=0)
    heartbeat_ttl_s: float = Field(15.0, ge=0.5)
    reconcile_interval_s: float = Field(30.0, gt=0)
    reconcile_batch: int = Field(1000, ge=1)
    # Reads of the stream by id range (a period's sub-day edges, exports with an end) stop late_after_s past the
    # period's end; the metering script indexes every event written later than that after its ts (a spool replay,
    # a reconciled orphan, a request longer than that) so the read still finds it. Same value on every replica.
    late_after_s: float = Field(900.0, ge=1)

