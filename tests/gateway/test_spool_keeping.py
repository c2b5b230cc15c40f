"""Spool.drain_keeping (the dead-letter spool): the records its sink refused stay, the others go; an append that
waited on the lock of the file it replaced lands in the new file."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.ledger.event import UsageEvent
from gateway.state.spool import Spool


def _events(n: int) -> list[UsageEvent]:
    return [UsageEvent(key_id=f"k{i}", requested_model="m") for i in range(n)]


async def test_the_refused_records_stay_and_an_append_waiting_meanwhile_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "usage-spool.dead.jsonl"
    spool, other = Spool(path), Spool(path)  # two writers of one file (two processes share a state directory)
    events = _events(6)
    await spool.append(events[:5])
    late: list[asyncio.Task[None]] = []

    async def sink(batch: list[UsageEvent]) -> list[UsageEvent]:
        # another writer appends while the drain holds the file's lock: it waits for it, then must find the new file
        late.append(asyncio.create_task(other.append(events[5:])))
        await asyncio.sleep(0.05)
        return [e for e in batch if e.key_id in ("k1", "k3")]

    assert await spool.drain_keeping(sink) == (5, 2)
    await asyncio.gather(*late)
    assert [e.key_id for e in spool.read_all()] == ["k1", "k3", "k5"]
    assert not list(tmp_path.glob("*.tmp"))

    async def take_all(batch: list[UsageEvent]) -> list[UsageEvent]:
        return []

    assert await spool.drain_keeping(take_all) == (3, 0)
    assert spool.pending_bytes() == 0 and spool.read_all() == []
    assert await spool.drain_keeping(take_all) == (0, 0)
