"""The real vLLM server with the shipped tiny model, started once for the whole test run.

``engine`` (session) yields the OpenAI base URL ``http://127.0.0.1:<free port>/v1``; ``local_engine`` yields
the :class:`gateway.engine.LocalEngine` itself. Set ``THINKGATE_TEST_ENGINE_URL`` to reuse a server that is
already running (same model, ``--reasoning-parser qwen3``) instead of starting one. Start-up takes ~40 s on
2 CPU cores; a failed start fails the tests that need it (with the server log tail), it never skips them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from gateway.config import DEFAULT_MODEL_DIR, EngineConfig
from gateway.engine import LocalEngine
from gateway.redis_server import free_port


@pytest.fixture(scope="session")
def local_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine | None]:
    """The session's LocalEngine (None when ``THINKGATE_TEST_ENGINE_URL`` names an external server)."""
    if os.environ.get("THINKGATE_TEST_ENGINE_URL"):
        yield None
        return
    cfg = EngineConfig(model_path=DEFAULT_MODEL_DIR, port=free_port(), startup_timeout_s=240)
    eng = LocalEngine(cfg, state_dir=tmp_path_factory.mktemp("engine-state"))
    eng.start()
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
