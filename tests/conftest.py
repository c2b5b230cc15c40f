"""Shared fixtures. Each fixtures_*.py module owns one real component (Redis, upstream simulator, engine)."""

from fixtures_engine import *  # noqa: F403
from fixtures_redis import *  # noqa: F403
from fixtures_upstream import *  # noqa: F403
