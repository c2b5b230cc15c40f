"""Shared fixtures. Each fixtures_*.py module owns one real component (Redis, upstream simulator, engine)."""

from tests.fixtures.engine import *  # noqa: F403
from tests.fixtures.redis_db import *  # noqa: F403
from tests.fixtures.upstream import *  # noqa: F403
