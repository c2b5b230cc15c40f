"""The upstream simulator and the gateway as real servers on loopback, for tests and benchmarks.

Fixtures:

- ``upstream_sim`` (session): ``tests/upstream_sim.py`` as a subprocess on a free port → :class:`SimProcess`.
- ``gateway`` (session): the gateway app under a real uvicorn (in a thread) on a free port, tiers
  ``none``/``short``/``long`` on the simulator, engine off, Redis at ``redis_url``, test key
  :data:`TEST_KEY` → :class:`GatewayServer`.
- ``openai_client``: the official ``openai.OpenAI`` pointed at ``gateway`` with the test key.

Helpers for one-off set-ups: :func:`start_sim` (a simulator with process flags), :func:`sim_settings`
(gateway settings over a simulator) and :class:`GatewayServer` (a context manager).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.app import create_app
from gateway.config import Settings
from gateway.redis_server import free_port

SIM_PATH = Path(__file__).with_name("upstream_sim.py")
TEST_KEY = "tg-test-key-0123456789"
TEST_KEY_ID = "test"
START_TIMEOUT_S = 20.0
SESSION_PREFIX = f"tgtest:{uuid.uuid4().hex[:8]}:"


class SimProcess:
    """A running simulator: ``base_url`` (``…/v1``), ``root``; ``stats()`` and ``tag(t)`` read its records."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.port = port
        self.root = f"http://127.0.0.1:{port}"
        self.base_url = self.root + "/v1"

    def stats(self) -> dict[str, int]:
        return httpx.get(self.root + "/sim/stats", timeout=5).json()

    def tag(self, tag: str) -> dict[str, Any] | None:
        r = httpx.get(f"{self.root}/sim/requests/{tag}", timeout=5)
        return r.json() if r.status_code == 200 else None

    def wait_tag_status(self, tag: str, statuses: set[str], timeout_s: float = 10.0) -> dict[str, Any] | None:
        """Poll until the tagged request reaches one of ``statuses``; returns its last record."""
        deadline = time.monotonic() + timeout_s
        rec = self.tag(tag)
        while time.monotonic() < deadline:
            rec = self.tag(tag)
            if rec is not None and rec["status"] in statuses:
                return rec
            time.sleep(0.05)
        return rec

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def wait_for(predicate: Any, timeout_s: float = 5.0) -> bool:
    """Poll ``predicate`` every 20 ms until true or ``timeout_s`` passed; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def wait_http_ok(url: str, timeout_s: float = START_TIMEOUT_S, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers 200; raises RuntimeError after ``timeout_s`` or if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


def start_sim(*flags: str, python: str = sys.executable) -> SimProcess:
    """Start ``tests/upstream_sim.py`` on a free port with extra CLI ``flags``; waits for ``/health``."""
    port = free_port()
    proc = subprocess.Popen(
        [python, str(SIM_PATH), "--port", str(port), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    sim = SimProcess(proc, port)
    try:
        wait_http_ok(sim.root + "/health", proc=proc)
    except RuntimeError:
        sim.stop()
        raise
    return sim


def sim_tiers(base_url: str, **tier_overrides: Any) -> list[dict[str, Any]]:
    """Tiers ``none``/``short``/``long`` on ``base_url`` (thinking off / budget 8 / unlimited)."""
    common = {"base_url": base_url, "model": "sim-model", "read_timeout_s": 10.0, "connect_timeout_s": 2.0,
              **tier_overrides}
    return [
        {**common, "name": "none", "max_tokens": 64, "thinking_budget": 0, "enable_thinking": False,
         "budget_mode": "off",
         "prices": {"input_usd_per_mtok": Decimal("0.05"), "cached_input_usd_per_mtok": Decimal("0.025"),
                    "output_usd_per_mtok": Decimal("0.20")}},
        {**common, "name": "short", "max_tokens": 64, "thinking_budget": 8,
         "prices": {"input_usd_per_mtok": Decimal("0.10"), "cached_input_usd_per_mtok": Decimal("0.05"),
                    "output_usd_per_mtok": Decimal("0.40")}},
        {**common, "name": "long", "max_tokens": 512, "thinking_budget": None,
         "prices": {"input_usd_per_mtok": Decimal("0.50"), "cached_input_usd_per_mtok": Decimal("0.25"),
                    "output_usd_per_mtok": Decimal("2.00")}},
    ]


def sim_settings(base_url: str, redis_url: str, *, tiers: list[dict[str, Any]] | None = None,
                 **overrides: Any) -> Settings:
    """Gateway settings over a simulator: engine off, Redis at ``redis_url``, the test key, router
    thresholds [0.5] over ``short``/``long``. ``overrides`` replace top-level sections."""
    base: dict[str, Any] = {
        "engine": {"enabled": False},
        # a prefix per test session: cache entries and counters never leak between runs on a shared Redis
        "redis": {"url": redis_url, "start_if_missing": False, "key_prefix": SESSION_PREFIX},
        "tiers": tiers if tiers is not None else sim_tiers(base_url),
        "routing": {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5],
                    "default_tier": "long"},
        "auth": {"keys": [{"id": TEST_KEY_ID, "secret": TEST_KEY, "tags": {"team": "qa"}}]},
        "server": {"host": "127.0.0.1", "port": 0, "max_body_bytes": 100_000},
    }
    base.update(overrides)
    return Settings.load(None, **base)


class GatewayServer:
    """The gateway under a real uvicorn in a background thread on a free loopback port.

    ``url`` is the root (``http://127.0.0.1:PORT``), ``base_url`` the OpenAI base (``…/v1``), ``app`` the
    FastAPI app (e.g. ``app.state.proxy.usage_sinks``). Use as a context manager or call start()/stop().
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = create_app(settings)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False,
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"gateway:{self.port}", daemon=True)

    def start(self) -> GatewayServer:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def upstream_sim() -> Iterator[SimProcess]:
    """The shared simulator process (no process-wide faults; use per-request ``sim`` body fields)."""
    sim = start_sim()
    try:
        yield sim
    finally:
        sim.stop()


@pytest.fixture(scope="session")
def gateway(upstream_sim: SimProcess, redis_url: str) -> Iterator[GatewayServer]:
    """The shared gateway over ``upstream_sim`` (see :func:`sim_settings`)."""
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url)) as gw:
        yield gw


@pytest.fixture
def openai_client(gateway: GatewayServer) -> Iterator[Any]:
    """``openai.OpenAI`` on the shared gateway with the test key; no SDK retries (tests see every error)."""
    import openai

    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=30)
    try:
        yield client
    finally:
        client.close()
