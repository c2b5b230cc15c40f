"""Redis time per admission call: this checkout's ``HOT`` (the one-call hot path) and ``ADMIT`` scripts against another
commit's, paired — the sibling of bench/metering_script_cost.py, for the all-or-nothing admission scripts.

Each version runs on a private ``redis-server`` of its own (so ``INFO commandstats`` tells them apart), the two
alternating every pipeline of 32 admissions — a busy, shared machine slows both alike —; then the servers swap
versions and it runs again (a server's own speed cancels out). Each call is what a request's first upstream call
sends on a single Redis: a key with a daily budget, RPM and TPM, ``--tags`` tags (the first with a budget definition
in Redis), the global level, 8 other reservations open at every level, and (``HOT``) a write-ahead record of ~400
bytes and an exact-cache lookup that misses and takes the single-flight lock; ``ADMIT`` is the same admission without
the rider (an escalation's, a shadow's). Each batch's reservations, records and locks are deleted between batches
(not timed). Prints, per pair and script, µs of Redis time per script call (``usec_per_call``).

    .venv/bin/python -m bench.admission_script_cost [--base 801fc82] [--tags 2] [--batches 300] [--pairs 3]
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import subprocess
import sys
import time
import uuid
from decimal import Decimal
from types import ModuleType
from typing import Any

from bench._lib.script_cost import evalsha_usec, head_commit, paired_args, paired_deltas, two_servers
from bench.usage_query import REPO
from gateway.config import LimitsConfig, RedisConfig
from gateway.state import limits as limits_mod
from gateway.state.breaker import Breaker
from gateway.state.budgets import BudgetLevels, BudgetStore
from gateway.state.cache import Lookup
from gateway.state.cache_policy import CacheDecision
from gateway.state.limits import Estimate, KeyLimits, Limits, Rider
from gateway.state.redis import connect

BATCH = 32  # admissions per pipeline (concurrent requests' admissions leave together: FastLane coalesce)
WARMUP = 20  # batches per version before the counters are reset
OPEN = 8  # other reservations open at every level (requests in flight)
SCRIPTS = ("HOT", "ADMIT")


def _module_at(commit: str, path: str, name: str) -> ModuleType:
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    exec(compile(source, f"{commit}:{path}", "exec"), mod.__dict__)
    return mod


def scripts_at(commit: str) -> dict[str, str]:
    """``HOT_LUA`` and ``ADMIT_LUA`` as of ``commit``: its ``limits.py`` loaded against its own ``reservations.py`` and
    ``undo.py`` (the Lua fragments it pastes in; a commit before ``undo.py`` pastes none of it), the rest of its
    imports today's — else a change to the undo helpers alone would be on both sides."""
    swapped = {"gateway.state.undo": "gateway/state/undo.py", "gateway.state.reservations":
               "gateway/state/reservations.py"}
    here = {name: sys.modules[name] for name in swapped}
    try:
        for name, path in swapped.items():  # undo first: reservations.py of the commit imports it
            there = subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=REPO, capture_output=True)
            if there.returncode == 0:
                sys.modules[name] = _module_at(commit, path, f"bench_{name.rsplit('.', 1)[1]}_before")
        old = _module_at(commit, "gateway/state/limits.py", "bench_limits_before")
    finally:
        sys.modules.update(here)
    return {"HOT": old.HOT_LUA, "ADMIT": old.ADMIT_LUA}


async def _calls(limits: Limits, levels: BudgetLevels, rids: list[str], ntags: int, hot: bool
                 ) -> list[tuple[list[Any], list[Any]]]:
    """The (keys, args) of one admission per ``rids``, as :meth:`Limits._run` builds them (its script call caught)."""
    made: list[tuple[list[Any], list[Any]]] = []

    async def catch(keys: list[Any], args: list[Any], coalesce: str | None = None) -> list[Any]:
        made.append((list(keys), list(args)))
        return []

    limits._hot = catch  # type: ignore[assignment]
    limits._script = catch  # type: ignore[assignment]
    tags = {f"t{j}": "v" for j in range(ntags)}
    now = time.time()
    k = limits.keys
    for i, rid in enumerate(rids):
        lim = KeyLimits(f"key{i % 50}", budget_day_micro=10**12, rpm=10**9, tpm=10**12)
        rider = None
        if hot:
            digest = uuid.uuid4().hex
            look = Lookup(digest, CacheDecision(lookup=True, store=True, ttl_s=60), "t", k.cache_entry(digest, "t"),
                          k.cache_lock(digest, "t"), token=rid, wait_ms=30_000)
            rider = Rider(k.write_ahead, b'{"request_id": "%s", "pad": "%s"}' % (rid.encode(), b"x" * 340), look)
        levels_now = [lv for lv in levels.candidates(tags)]
        await limits._run(lim, rid, Estimate(20_000, 3000), now, [lim.level, *levels_now],
                          *limits_mod._day_month(now), rate=True, rider=rider)
    return made


async def pair(urls: list[str], scripts: list[str], which: str, batches: int, ntags: int) -> list[float]:
    """µs of Redis time per call of each script, ``scripts[i]`` on ``urls[i]``, alternating batch by batch."""
    runs = []
    for url, script in zip(urls, scripts, strict=True):
        handle = connect(RedisConfig(url=url, key_prefix=f"tgadm:{uuid.uuid4().hex[:8]}:", socket_timeout_s=30.0))
        breaker = Breaker(1.0)
        limits = Limits(handle, breaker, LimitsConfig(admission_script="single"))
        await BudgetStore(handle, breaker).set("tag:t0=v", Decimal("1000000"), None)
        levels = BudgetLevels(handle, breaker, LimitsConfig())
        # the other requests in flight: OPEN reservations at every level of every key
        exp = int(time.time() * 1000) + 3_600_000
        r, k = handle.client, limits.keys
        hashes = [*(k.reservations(f"key{i}") for i in range(50)), k.level_reservations("global", "global"),
                  *(k.level_reservations("tag", f"t{j}=v") for j in range(ntags))]
        async with r.pipeline(transaction=False) as p:
            for h in hashes:
                p.hset(h, mapping={f"open{j}": f"20000|3000|{exp}" for j in range(OPEN)})
            await p.execute()
        runs.append((handle, limits, levels, hashes, await r.script_load(script)))
    for b in range(WARMUP + batches):
        if b == WARMUP:
            for handle, *_ in runs:
                await handle.client.config_resetstat()
        for handle, limits, levels, hashes, sha in runs if b % 2 == 0 else runs[::-1]:
            r, k = handle.client, limits.keys
            rids = [uuid.uuid4().hex for _ in range(BATCH)]
            calls = await _calls(limits, levels, rids, ntags, which == "HOT")
            async with r.pipeline(transaction=False) as p:
                for keys, args in calls:
                    p.evalsha(sha, len(keys), *keys, *args)
                replies = await p.execute(raise_on_error=True)
            assert all(int(x[0]) == 1 for x in replies), replies[:1]  # every one admitted
            async with r.pipeline(transaction=False) as p:  # what metering would settle: not timed
                for h in hashes:
                    p.hdel(h, *rids)
                p.delete(k.write_ahead)
                for keys, _ in calls:
                    if which == "HOT":
                        p.delete(keys[-1])  # the lock
                await p.execute()
    out = []
    for handle, *_ in runs:
        out.append(await evalsha_usec(handle.client))
        await handle.close()
    return out


def main() -> None:
    args = paired_args(__doc__.split("\n\n")[0], "801fc82", "admission scripts", "key")
    commit = head_commit(REPO)
    old = scripts_at(args.base)
    new = {"HOT": limits_mod.HOT_LUA, "ADMIT": limits_mod.ADMIT_LUA}
    with two_servers() as urls:
        print(f"HOT and ADMIT of {args.base} (before) and of {commit} + working tree (after), {args.tags} tags, "
              f"{args.batches} x {BATCH} calls each per run; µs of Redis time per call")
        for which in SCRIPTS:
            deltas = paired_deltas(
                lambda scripts, w=which: asyncio.run(pair(urls, scripts, w, args.batches, args.tags)),
                old[which], new[which], args.pairs, f"{which:5} ")
            print(f"{which}: mean after - before {statistics.mean(deltas):+.2f} µs, "
                  f"median {statistics.median(deltas):+.2f}")


if __name__ == "__main__":
    main()
