"""Metering on a real 3-master Redis Cluster, ``redis.cluster_placement: shared`` vs ``tenant`` side by side:
events counted per second through ``Meter.record_many`` (batches as the gateway's usage writer sends them), and where
the keys land (per master, and in the shared ``{tg:}`` slot).

    python -m bench.cluster_placement [--keys 100] [--events 3000] [--batch 100] [--json OUT]

Starts its own cluster (3 masters, no replicas: the writes, not replication, are measured) from ``redis-server`` on
loopback ports, leased as the tests lease them (``THINKGATE_TEST_CLUSTER_PORTS``), and stops it. Each placement gets a
fresh prefix; every event carries a team tag and releases reservations at the key, the tag and the global level, as a
request's does. Bounded: ``--events`` events per placement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import redis

from gateway.config import MeteringConfig, Prices, RedisConfig
from gateway.ledger.event import UsageEvent
from gateway.state.breaker import Breaker
from gateway.state.metering import Meter
from gateway.state.redis import connect
from gateway.state.spool import Spool
from tests.fixtures.redis_cluster import ClusterSet

PRICES = Prices(input_usd_per_mtok=Decimal("0.50"), cached_input_usd_per_mtok=Decimal("0.25"),
                output_usd_per_mtok=Decimal("2.00"))


def _events(n: int, keys: int) -> list[UsageEvent]:
    out = []
    for i in range(n):
        ev = UsageEvent(key_id=f"team{i % keys:03d}", requested_model="auto", tier="short", upstream_model="m",
                        route_reason="predicted", prompt_tokens=100 + i % 50, completion_tokens=40 + i % 30,
                        tags={"team": f"t{i % 5}"}, ts=time.time())
        ev.price(PRICES)
        out.append(ev)
    return out


async def _run(url: str, placement: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    prefix = f"tgb{uuid.uuid4().hex[:6]}:"
    handle = connect(RedisConfig(url=url, key_prefix=prefix, socket_timeout_s=2.0, cluster_placement=placement))
    meter = Meter(handle, Breaker(1.0), Spool(workdir / f"{placement}.jsonl"),
                  MeteringConfig(spool_path=workdir / f"{placement}.jsonl"))
    events = _events(args.events, args.keys)
    r, k = handle.client, meter.keys
    exp = int(time.time() * 1000) + 600_000
    for ev in events:  # what admission leaves: a reservation at the key, its tag and the global level
        for h in (k.reservations(ev.key_id), k.level_reservations("tag", f"team={ev.tags['team']}"),
                  k.level_reservations("global", "global")):
            await r.hset(h, ev.event_id, f"900|0|{exp}")
    try:
        t0 = time.perf_counter()
        stored = []
        for i in range(0, len(events), args.batch):
            stored += [res.stored for res in await meter.record_many(events[i:i + args.batch])]
        wall = time.perf_counter() - t0
        assert stored == ["redis"] * len(events), {s: stored.count(s) for s in set(stored)}
        assert await r.xlen(k.events) == len(events)
        return {"placement": placement, "events": len(events), "wall_s": round(wall, 3),
                "events_per_s": round(len(events) / wall, 1), "prefix": prefix,
                "round_trips_per_event": 3 if meter.split else 1}
    finally:
        await handle.close()


def _keys_per_master(c: ClusterSet, prefix: str) -> tuple[dict[int, int], int]:
    """Keys of ``prefix`` per master, and how many are in the shared ``{prefix}`` slot."""
    counts, shared = {}, 0
    for port in c.masters():
        n = 0
        for key in redis.Redis(port=port).scan_iter(match="{" + prefix + "*", count=1000):
            n += 1
            shared += key.startswith(b"{" + prefix.encode() + b"}")
        counts[port] = n
    return counts, shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=100)
    ap.add_argument("--events", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ClusterSet(Path(tmp), masters=3, replicas_per_master=0).start()
        try:
            rows = []
            for placement in ("shared", "tenant"):
                row = asyncio.run(_run(cluster.url, placement, args, Path(tmp)))
                counts, shared = _keys_per_master(cluster, row["prefix"])
                total = sum(counts.values())
                row |= {"keys_per_master": list(counts.values()), "keys": total, "shared_slot_keys": shared,
                        "max_master_share": round(max(counts.values()) / total, 3)}
                rows.append(row)
        finally:
            cluster.stop()
    print(f"{args.events} events from {args.keys} keys (5 team tags), batches of {args.batch}, 3-master cluster:")
    print(f"{'placement':<10} {'events/s':>9} {'calls/event':>12} {'keys per master':>20} {'max share':>10} "
          f"{'in {tg:}':>9}")
    for row in rows:
        print(f"{row['placement']:<10} {row['events_per_s']:>9.0f} {row['round_trips_per_event']:>12} "
              f"{'/'.join(map(str, row['keys_per_master'])):>20} {row['max_master_share']:>10.1%} "
              f"{row['shared_slot_keys']:>9}")
    ratio = rows[1]["events_per_s"] / rows[0]["events_per_s"]
    print(f"tenant / shared events per second: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "tenant_over_shared_events_per_s": round(ratio, 3),
                                         "args": vars(args) | {"json": str(args.json)}}, indent=2))


if __name__ == "__main__":
    main()
