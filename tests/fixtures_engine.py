"""The real vLLM server with the shipped tiny model, started once for the whole test run.

``engine`` (session) yields the OpenAI base URL ``http://127.0.0.1:<free port>/v1``; ``local_engine`` yields
the :class:`gateway.engine.LocalEngine` itself. Set ``THINKGATE_TEST_ENGINE_URL`` to reuse a server that is
already running (same model, ``--reasoning-parser qwen3``) instead of starting one. Start-up takes ~40 s on
an idle 2-core box and was measured up to ~4 min on a loaded one; it is bounded by ``STARTUP_TIMEOUT_S`` and
is *not* charged to the per-test timeout of whichever test happens to request the engine first (pytest-timeout's
SIGALRM is paused while the engine starts). A failed start fails the tests that need it (with the server log
tail); it never skips them.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from gateway.config import DEFAULT_MODEL_DIR, EngineConfig
from gateway.engine import LocalEngine
from gateway.redis_server import free_port

STARTUP_TIMEOUT_S = 600.0


def _start_outside_test_timeout(eng: LocalEngine) -> None:
    """``eng.start()`` with pytest-timeout's per-test alarm (signal method) paused, then re-armed."""
    if threading.current_thread() is not threading.main_thread():
        eng.start()
        return
    remaining, interval = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        eng.start()
    finally:
        if remaining > 0:
            signal.setitimer(signal.ITIMER_REAL, remaining, interval)


@pytest.fixture(scope="session")
def local_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine | None]:
    """The session's LocalEngine (None when ``THINKGATE_TEST_ENGINE_URL`` names an external server)."""
    if os.environ.get("THINKGATE_TEST_ENGINE_URL"):
        yield None
        return
    cfg = EngineConfig(model_path=DEFAULT_MODEL_DIR, port=free_port(), startup_timeout_s=STARTUP_TIMEOUT_S)
    eng = LocalEngine(cfg, state_dir=tmp_path_factory.mktemp("engine-state"))
    _start_outside_test_timeout(eng)
    try:
        yield eng
    finally:
        eng.stop()


@pytest.fixture(scope="session")
def engine(local_engine: LocalEngine | None) -> str:
    """Base URL (``…/v1``) of the real vLLM server serving ``thinkgate-tiny``."""
    if local_engine is None:
        return os.environ["THINKGATE_TEST_ENGINE_URL"].rstrip("/")
    return local_engine.base_url
