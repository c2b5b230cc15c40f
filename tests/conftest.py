"""Shared fixtures. Each fixtures_*.py module owns one real component (Redis, upstream simulator, engine).

The suite runs in parallel workers (pytest-xdist; ``make test`` passes ``-n 3``): most tests wait on real servers
(Redis, gateways, the simulator), and one process kept ~0.7 of a core busy. The scheduler below sends each test file
to one worker whole (its module fixtures start once) and every file that needs the session's vLLM engine to one
worker, so the engine (a minute or more of CPU to start) starts once per run, not once per worker.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures.engine import *  # noqa: F403
from tests.fixtures.paused_redis import private_redis
from tests.fixtures.ports import port_lease
from tests.fixtures.redis_cluster import redis_cluster, redis_sentinel, shared_redis_cluster
from tests.fixtures.redis_db import *  # noqa: F403
from tests.fixtures.upstream import *  # noqa: F403
from tests.fixtures.workers import ENGINE_FILES, file_of, make_scheduler

# registered here, once: imported into each test module instead, the session's cluster was started once per module
__all__ = ["port_lease", "private_redis", "redis_cluster", "redis_sentinel", "shared_redis_cluster"]

ENGINE_FIXTURES = frozenset({"engine", "local_engine"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuses a test that needs the engine in a file the scheduler does not send to the engine's worker."""
    stray = sorted({file_of(i.nodeid) for i in items
                    if ENGINE_FIXTURES.intersection(getattr(i, "fixturenames", ()))} - ENGINE_FILES)
    if stray:
        raise pytest.UsageError(f"{', '.join(stray)} use the vLLM engine fixture: add them to ENGINE_FILES in "
                                "tests/fixtures/workers.py (or each worker starts its own engine)")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return make_scheduler(config, log)
