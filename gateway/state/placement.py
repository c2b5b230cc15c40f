"""Whether a Redis Cluster holds API-key data written under the other ``redis.cluster_placement``.

``tenant`` keeps each API key's own record, counters and limits in its tenant slot; ``shared`` (every earlier
version) in the one shared slot (``gateway/state/keys.py``). The names differ, so a gateway switched from one to the
other on a cluster that already holds keys would find none of them: its keys stop authenticating and its spend
budgets read $0 spent — the budgets reset mid-month. ``thinkgate serve`` refuses to start then, and every CLI
command that connects (``gateway/cli/common.py`` ``run_on_redis``) refuses to run (:func:`placement_conflict`),
instead of serving on, or writing beside, half the data. ``thinkgate redis migrate-placement`` moves the data from
one placement to the other (``gateway/state/placement_migration.py``); while it runs, and after a run that stopped
midway, both placements are refused.
"""

from __future__ import annotations

import logging

import orjson

from gateway.state.keys import RedisKeys
from gateway.state.redis import RedisHandle, as_text

SAMPLE = 8  # key ids sampled from each of the two shared id sets


async def placement_conflict(handle: RedisHandle) -> str | None:
    """A one-line reason when the cluster behind ``handle`` holds key records or counters under the placement
    ``handle`` does not use (sampled: :data:`SAMPLE` ids of the key store's id set and of ``usage:keys``, both
    shared), or a placement migration is running or stopped midway (``RedisKeys.placement_migration``, either
    placement: ``gateway/state/placement_migration.py``); None when it holds none, or ``handle`` is no sharded
    Cluster prefix (one server, Sentinel: the names are the same whatever the setting). Raises what the client
    raises (the caller decides what an outage means)."""
    keys = RedisKeys.of(handle)
    if not keys.sharded:
        return None
    other = RedisKeys(keys.prefix, "shared" if keys.per_key_slots else "tenant")
    r = handle.client
    migrating = await r.get(keys.placement_migration)
    if migrating is not None:  # half the keys under each placement's names: neither finds them all
        to = str(orjson.loads(migrating).get("to", "?"))
        return (f"a migration of redis.cluster_placement to {to} is running on this Redis Cluster, or stopped before "
                f"its end ({keys.placement_migration}): each API key's data is under one placement's names or the "
                f"other's. Let it finish, or run it again to finish it: thinkgate redis migrate-placement --to {to} "
                f"with redis.cluster_placement: {to} (docs/deploy.md, section 3)")
    ids: set[str] = set()
    for name in (keys.key_ids, keys.usage_keys):
        ids.update(as_text(m) for m in (await r.srandmember(name, SAMPLE) or []) if isinstance(m, bytes | str))
    for key_id in sorted(ids):
        for mine, theirs in ((keys.key_record(key_id), other.key_record(key_id)),
                             (keys.key_total(key_id), other.key_total(key_id))):
            if await r.exists(theirs) and not await r.exists(mine):
                return (f"this Redis Cluster holds the data of API key {key_id!r} under redis.cluster_placement: "
                        f"{other.placement} ({theirs}), and this configuration says {keys.placement}: it would not "
                        "find that key, nor its spend (its budgets would read $0 spent), and would write new keys "
                        f"where no gateway of the other placement reads them. Set redis.cluster_placement: "
                        f"{other.placement} (the gateway and every CLI command alike), or, with every gateway "
                        f"stopped, move the data: thinkgate redis migrate-placement --to {keys.placement} "
                        "(docs/deploy.md, section 3)")
    return None


async def checked_conflict(handle: RedisHandle, unknown_level: int = logging.DEBUG) -> str | None:
    """:func:`placement_conflict` where a check that cannot run (an outage, a cluster still forming) is no conflict:
    None, logged at ``unknown_level`` — the caller's own Redis calls say what is wrong. Never raises. For ``thinkgate
    serve`` and every CLI command that connects (``gateway/cli/serve.py``, ``gateway/cli/common.py``)."""
    try:
        return await placement_conflict(handle)
    except Exception as exc:  # see the docstring
        logging.getLogger("thinkgate").log(unknown_level, "could not check redis.cluster_placement against the "
                                           "cluster's data: %r", exc)
        return None
