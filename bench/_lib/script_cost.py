"""What the paired Lua-script cost benches share (``bench/metering_script_cost.py``,
``bench/admission_script_cost.py``): their command line, and the Redis time per ``EVALSHA`` read from a private
server's ``INFO commandstats``."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def paired_args(description: str, base: str, what: str, unit: str) -> argparse.Namespace:
    """``--base`` (the commit whose ``what`` is "before"), ``--tags`` (per ``unit``), ``--batches``, ``--pairs``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--base", default=base, help=f"the commit whose {what} is 'before'")
    ap.add_argument("--tags", type=int, default=2, help=f"tags per {unit} (a level each)")
    ap.add_argument("--batches", type=int, default=300, help="pipelines of 32 calls per version and pair")
    ap.add_argument("--pairs", type=int, default=3, help="runs, each once per server order")
    return ap.parse_args()


def head_commit(repo: Path) -> str:
    """The checkout's short HEAD (the "after" side is HEAD plus its working tree)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                          text=True).stdout.strip()


async def evalsha_usec(client: Any) -> float:
    """Mean µs of Redis time per ``EVALSHA`` since the server's start, then the server emptied for the next run."""
    us = float((await client.info("commandstats"))["cmdstat_evalsha"]["usec_per_call"])
    await client.flushdb()
    return us


def paired_deltas(run: Callable[[list[str]], list[float]], before: str, after: str, pairs: int,
                  label: str = "") -> list[float]:
    """``run([script on server 0, script on server 1])`` → µs per call on each, ``pairs`` times in each order (the
    two servers swapped, so a faster server is on both sides); prints each pair and returns after − before."""
    deltas: list[float] = []
    for _ in range(pairs):
        for order in (("before", "after"), ("after", "before")):
            us = run([before if o == "before" else after for o in order])
            got = dict(zip(order, us, strict=True))
            deltas.append(got["after"] - got["before"])
            print(f"  {label}before {got['before']:6.2f}  after {got['after']:6.2f}  "
                  f"after - before {deltas[-1]:+.2f} ({deltas[-1] / got['before']:+.1%})")
    return deltas


@contextlib.contextmanager
def two_servers() -> Iterator[list[str]]:
    """Two private ``redis-server`` processes (``start_private``: a free loopback port each) → their URLs; stopped
    on exit, stdout flushed."""
    from gateway.engine.redis_server import start_private

    servers = [start_private(), start_private()]
    try:
        yield [url for _, url in servers]
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(timeout=15)
        sys.stdout.flush()
