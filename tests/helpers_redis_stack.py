"""Builds the Redis-backed gateway components (client, breaker, meter, spool…) for a test, on a key prefix.

Used by the cache/metering/limits/keys/fault tests; everything is real (a real Redis server), nothing mocked.
Components are built inside the test's own event loop (``async with stack(...)``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.breaker import Breaker
from gateway.config import CacheConfig, LimitsConfig, MeteringConfig, RedisConfig
from gateway.metering import Meter
from gateway.redis_client import RedisHandle, connect
from gateway.redis_server import free_port, ping
from gateway.spool import Spool


@dataclass
class Stack:
    handle: RedisHandle
    breaker: Breaker
    meter: Meter
    spool: Spool
    redis_cfg: RedisConfig
    metering_cfg: MeteringConfig


@contextlib.asynccontextmanager
async def stack(url: str, prefix: str, spool_path: Path, *, socket_timeout_s: float = 0.25,
                cooldown_s: float = 0.5, replay_interval_s: float = 0.2) -> AsyncIterator[Stack]:
    """Client + breaker + meter on ``url`` with keys under ``prefix``; closed on exit."""
    rcfg = RedisConfig(url=url, key_prefix=prefix, socket_timeout_s=socket_timeout_s,
                       breaker_cooldown_s=cooldown_s)
    mcfg = MeteringConfig(spool_path=spool_path, replay_interval_s=replay_interval_s)
    handle = connect(rcfg)
    breaker = Breaker(cooldown_s)
    spool = Spool(spool_path)
    try:
        yield Stack(handle, breaker, Meter(handle, breaker, spool, mcfg), spool, rcfg, mcfg)
    finally:
        await handle.close()


def cache_cfg(**kw: Any) -> CacheConfig:
    return CacheConfig(**kw)


def limits_cfg(**kw: Any) -> LimitsConfig:
    return LimitsConfig(**kw)


class PersistentRedis:
    """A private ``redis-server`` on a free loopback port whose data survives stop/start (AOF, fsync always),
    for outage tests: :meth:`stop` (SIGTERM: clean shutdown), :meth:`start` (same port, data reloaded),
    :meth:`pause` / :meth:`resume` (SIGSTOP / SIGCONT)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server not on PATH"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ping(self.url):
                return
            time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def persistent_redis(workdir: Path) -> Iterator[PersistentRedis]:
    server = PersistentRedis(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
