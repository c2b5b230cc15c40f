"""Shared fixtures. Each fixtures_*.py module owns one real component (Redis, upstream simulator, engine)."""

from tests.fixtures.engine import *  # noqa: F403
from tests.fixtures.ports import port_lease
from tests.fixtures.redis_cluster import redis_cluster, redis_sentinel, shared_redis_cluster
from tests.fixtures.redis_db import *  # noqa: F403
from tests.fixtures.upstream import *  # noqa: F403

# registered here, once: imported into each test module instead, the session's cluster was started once per module
__all__ = ["port_lease", "redis_cluster", "redis_sentinel", "shared_redis_cluster"]
