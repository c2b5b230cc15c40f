"""Redis time per ``RECORD`` call: this checkout's metering script against another commit's, paired.

Each version runs on a private ``redis-server`` of its own (so ``INFO commandstats`` tells them apart), the two
alternating every pipeline of 32 events — a busy, shared machine slows both alike —; then the servers swap
versions and it runs again (a server's own speed cancels out). Each event is what the writer sends in production:
its reservations at the key, the global level and each tag (released by the script), the key's TPM window and a
write-ahead record (deleted by it). Prints, per pair, µs of Redis time per script call (``usec_per_call``).

    .venv/bin/python -m bench.metering_script_cost [--base 6bbebf0] [--tags 2] [--batches 300] [--pairs 3]
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from pathlib import Path
from types import ModuleType

from bench._lib.script_cost import evalsha_usec, head_commit, paired_args, paired_deltas, two_servers
from bench.usage_query import REPO, meter_module_at
from gateway.config import MeteringConfig, RedisConfig
from gateway.ledger.event import UsageEvent
from gateway.state import metering
from gateway.state.breaker import Breaker
from gateway.state.redis import connect
from gateway.state.spool import Spool

BATCH = 32  # events per pipeline (the writer batches what queued up: dozens at high concurrency)
WARMUP = 20  # batches per version before the counters are reset


async def pair(urls: list[str], scripts: list[str], batches: int, ntags: int) -> list[float]:
    """µs of Redis time per call of each script, ``scripts[i]`` on ``urls[i]``, alternating batch by batch."""
    tags = {f"t{j}": "v" for j in range(ntags)}
    spool = Path("/tmp") / f"tg-bench-unused-{uuid.uuid4().hex}.jsonl"
    runs = []
    for url, script in zip(urls, scripts, strict=True):
        handle = connect(RedisConfig(url=url, key_prefix=f"tgcost:{uuid.uuid4().hex[:8]}:", socket_timeout_s=30.0))
        meter = metering.Meter(handle, Breaker(1.0), Spool(spool), MeteringConfig(spool_path=spool))
        runs.append((meter, await handle.client.script_load(script)))
    exp = int(time.time() * 1000) + 600_000
    for b in range(WARMUP + batches):
        if b == WARMUP:
            for meter, _ in runs:
                await meter.redis.config_resetstat()
        for meter, sha in runs if b % 2 == 0 else runs[::-1]:
            r, k = meter.redis, meter.keys
            events = [UsageEvent(key_id=f"key{(b * BATCH + j) % 50}", requested_model="auto", tier="short",
                                 upstream_model="m", route_reason="predicted", prompt_tokens=1000 + j,
                                 cached_tokens=100, completion_tokens=200, reasoning_tokens=50, tags=tags,
                                 cost_micro_usd=1234) for j in range(BATCH)]
            async with r.pipeline(transaction=False) as p:  # what admission and the upstream call leave
                for e in events:
                    p.hset(k.reservations(e.key_id), e.event_id, f"9000|5000|{exp}")
                    p.hset(k.level_reservations("global", "global"), e.event_id, f"9000|0|{exp}")
                    for t in tags:
                        p.hset(k.level_reservations("tag", f"{t}=v"), e.event_id, f"9000|0|{exp}")
                    p.set(k.tpm(e.key_id, e.minute), 10_000, px=120_000)
                    p.hset(k.write_ahead, e.event_id, "{}")
                await p.execute()
            async with r.pipeline(transaction=False) as p:
                for e in events:
                    keys, args = meter._keys_args(e)
                    p.evalsha(sha, len(keys), *keys, *args)
                await p.execute(raise_on_error=True)
    out = []
    for meter, _ in runs:
        out.append(await evalsha_usec(meter.redis))
        await meter.redis.aclose()
    return out


def main() -> None:
    args = paired_args(__doc__.split("\n\n")[0], "6bbebf0", "RECORD script", "event")
    commit = head_commit(REPO)
    old: ModuleType = meter_module_at(args.base)
    scripts = {"before": old.RECORD_LUA, "after": metering.RECORD_LUA}
    with two_servers() as urls:
        print(f"RECORD of {args.base} (before) and of {commit} + working tree (after), {args.tags} tags, "
              f"{args.batches} x {BATCH} calls each per run; µs of Redis time per call")
        deltas = paired_deltas(lambda pair_scripts: asyncio.run(pair(urls, pair_scripts, args.batches, args.tags)),
                               scripts["before"], scripts["after"], args.pairs)
        print(f"mean after - before {statistics.mean(deltas):+.2f} µs, median {statistics.median(deltas):+.2f}")


if __name__ == "__main__":
    main()
