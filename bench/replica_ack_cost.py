"""What ``metering.replica_acks`` costs the metering writer: a batch of usage events counted with and without the
replica acknowledgement (a probe write and ``WAIT N`` after each batch, ``Meter._acked``), alternating, on a private
master with one replica on loopback.

    python -m bench.replica_ack_cost [--batches 300] [--batch 32] [--rounds 3]
    python -m bench.replica_ack_cost --gateway [--requests 3000] [--seconds 30] [--rounds 3]

Prints, per setting, the wall time per batch (the writer's latency: it runs off the request path, so this is how
long a batch's events wait before the writer takes the next batch) and this process's CPU per event. Nothing is
spooled in either setting (the replica keeps up); ``unreplicated`` says so. ``--gateway``: two ``thinkgate serve``
processes on that master (``metering.replica_acks`` 0 and 1) under the same closed loop at 32 concurrent,
alternating (``bench/gateway_overhead.py``'s load and CPU accounting): gateway CPU per request and RPS.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path

import redis

from gateway.config import MeteringConfig, Prices, RedisConfig
from gateway.engine.redis_server import free_port
from gateway.ledger.event import UsageEvent
from gateway.state.breaker import Breaker
from gateway.state.metering import Meter
from gateway.state.redis import connect
from gateway.state.spool import Spool

PRICES = Prices(input_usd_per_mtok=Decimal("0.50"), cached_input_usd_per_mtok=Decimal("0.25"),
                output_usd_per_mtok=Decimal("2.00"))


def _server(port: int, workdir: Path, *args: str) -> subprocess.Popen[bytes]:
    exe = shutil.which("redis-server") or "redis-server"
    return subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait(pred: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pred():  # type: ignore[operator]
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready in {timeout_s} s")


def _online(port: int) -> bool:
    rep = redis.Redis(port=port).info("replication")
    return any(k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online" for k, v in rep.items())


def _events(n: int) -> list[UsageEvent]:
    out = []
    for i in range(n):
        ev = UsageEvent(key_id=f"k{i % 4}", requested_model="auto", tier="short", upstream_model="m",
                        route_reason="predicted", prompt_tokens=100 + i, completion_tokens=50 + i, ts=time.time())
        ev.price(PRICES)
        out.append(ev)
    return out


async def _run(url: str, prefix: str, workdir: Path, acks: int, batches: int, batch: int) -> tuple[float, float, int]:
    """(ms wall per batch, µs CPU per event, events spooled as unreplicated)."""
    handle = connect(RedisConfig(url=url, key_prefix=prefix))
    meter = Meter(handle, Breaker(0.5), Spool(workdir / f"spool-{acks}.jsonl"),
                  MeteringConfig(spool_path=workdir / f"spool-{acks}.jsonl", replica_acks=acks))
    try:
        await meter.record_many(_events(batch))  # warm: scripts loaded, connections open
        wall = cpu = 0.0
        for _ in range(batches):
            evs = _events(batch)
            t0, c0 = time.perf_counter(), time.process_time()
            await meter.record_many(evs)
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
        return 1000 * wall / batches, 1e6 * cpu / (batches * batch), meter.unreplicated
    finally:
        await handle.close()


def _gateways(url: str, workdir: Path, args: argparse.Namespace) -> None:
    """``--gateway``: gateway CPU per request and RPS with ``replica_acks`` 0 and 1 (module doc)."""
    import os

    from bench.gateway_overhead import measure, start_gateway, stop_all
    from tests.fixtures.upstream import start_sim

    os.environ["REDIS_URL"] = url  # start_gateway's Redis
    sim = start_sim()
    procs = []
    try:
        targets = []
        for acks in (0, 1):
            proc, target = start_gateway(sim, workdir, name=f"acks{acks}", extra={"metering": {
                "replica_acks": acks, "spool_path": str(workdir / f"gw-spool-{acks}.jsonl")}})
            procs.append(proc)
            targets.append(target)
        res = asyncio.run(measure(targets, [32], args.requests, args.seconds, args.rounds, False))
        print(f"c=32, {args.rounds} rounds alternating, master + 1 replica on loopback")
        print("replica_acks | requests | RPS | p99 ms | gateway CPU ms/request")
        for t in targets:
            x = res[(t.name, 32)]
            print(f"{t.name[-1]} | {len(x.latencies_ms)} | {x.rps:.0f} | {x.pct(99):.2f} | {x.cpu_ms_per_request}")
    finally:
        stop_all(procs, sim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="events per batch")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two settings")
    ap.add_argument("--gateway", action="store_true", help="gateway CPU per request instead (module doc)")
    ap.add_argument("--requests", type=int, default=3000, help="--gateway: requests per setting")
    ap.add_argument("--seconds", type=float, default=30.0, help="--gateway: time cap per setting")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="thinkgate-ack-"))
    master, replica = free_port(), free_port()
    procs = [_server(master, workdir)]
    (workdir / "r").mkdir()
    procs.append(_server(replica, workdir / "r", "--replicaof", "127.0.0.1", str(master)))
    try:
        _wait(lambda: _online(master), "replica")
        url = f"redis://127.0.0.1:{master}/0"
        if args.gateway:
            _gateways(url, workdir, args)
            return
        rows: dict[int, list[tuple[float, float, int]]] = {0: [], 1: []}
        for _ in range(args.rounds):
            for acks in (0, 1):
                prefix = f"tgack{uuid.uuid4().hex[:6]}:"
                rows[acks].append(asyncio.run(_run(url, prefix, workdir, acks, args.batches, args.batch)))
        print(f"{args.rounds} rounds × {args.batches} batches of {args.batch} events, master + 1 replica on loopback")
        print("replica_acks | ms per batch (wall) | µs CPU per event (writer) | unreplicated events")
        for acks, rs in rows.items():
            walls = ", ".join(f"{r[0]:.2f}" for r in rs)
            cpus = ", ".join(f"{r[1]:.1f}" for r in rs)
            print(f"{acks} | {walls} | {cpus} | {sum(r[2] for r in rs)}")
        w0 = sum(r[0] for r in rows[0]) / len(rows[0])
        w1 = sum(r[0] for r in rows[1]) / len(rows[1])
        c0 = sum(r[1] for r in rows[0]) / len(rows[0])
        c1 = sum(r[1] for r in rows[1]) / len(rows[1])
        print(f"mean: +{w1 - w0:.2f} ms per batch ({w1 / w0:.2f}×), CPU +{c1 - c0:.1f} µs per event ({c1 / c0:.2f}×)")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
