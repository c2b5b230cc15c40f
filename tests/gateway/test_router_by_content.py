"""Routers adopted by the gateway's retraining are kept by content: ``p router:current`` names a copy of the bytes
adopted (``<state_dir>/<digest>.skops``) with their digest, and ``p router:bad`` names a rolled-back router by its
digest. Real :class:`RetrainTrigger` replicas (each its own connection, state dir and ``routing.router_path``) on the
real Redis; the gateway-level cases (a lagging copy, a replica starting on a rolled-back file) are in
``test_retrain_auto.py``."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.control.retrain_trigger import file_digest
from gateway.ledger.outcome import Outcome
from router.persistence import RouterFileError, load_router, save_router
from tests.fixtures.gateway import gateway_settings
from tests.fixtures.outcomes import retrain_replica, serving_router, write_outcomes


def _text(hard: bool, i: int) -> str:
    rng = random.Random(i)
    return f"question {i}: " + " ".join(rng.sample(["prove", "integral", "theorem", "derive"] if hard
                                                    else ["capital", "color", "name", "city"], 3))


def _settings(tmp: Path, redis_url: str, prefix: str, configured: Path, state_dir: Path) -> Any:
    return gateway_settings("http://127.0.0.1:1", redis_url, prefix, tmp / f"spool-{state_dir.parent.name}.jsonl",
                            routing={"router_path": str(configured), "routed_tiers": ["short", "long"],
                                     "retrain": {"every_outcomes": 10**6, "state_dir": str(state_dir),
                                                 "realised_min": 10, "readopt_after_s": 1}})


def _write(base: Path, path: Path, version: str, cut: float) -> bytes:
    """A router file written over ``path`` the safe way (elsewhere, then renamed over it): ``base``'s router with
    ``version`` and threshold ``cut`` (two cuts, two files of other bytes); its bytes."""
    router = load_router(base)
    router.metadata["version"] = version
    router.thresholds = [cut]
    tmp = path.with_name(path.name + ".tmp")
    save_router(router, tmp)
    os.replace(tmp, path)
    return path.read_bytes()


def _put(data: bytes, path: Path) -> None:
    """``data`` written over ``path`` (elsewhere, then renamed over it): a file put back byte for byte (a router
    saved again is other bytes: the zip members carry their time)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_router_bad_names_a_rolled_back_router_by_its_bytes(redis_url: str, redis_prefix: str,
                                                            tmp_path: Path) -> None:
    """An operator's file (``operator-1``) is adopted and rolled back. ``router:bad`` held its version: another
    file that carries the same version string (a different router) was refused with it. Now it holds the bytes'
    digest: the other file is adopted, the rolled-back bytes written back are not, and a version-only entry left
    in Redis from before still refuses that version (by adoption and by the service's reload)."""
    before = serving_router(tmp_path / "before.skops", False, _text)  # old-noise: what the rollback goes back to
    configured = tmp_path / "configured.skops"
    settings = _settings(tmp_path, redis_url, redis_prefix, configured, tmp_path / "routers")
    _write(before, configured, "operator-0", 0.5)
    rdb = redis.Redis.from_url(redis_url)
    rdb.hset(redis_prefix + "router:current", mapping={"path": str(before), "version": "old-noise"})
    rdb.set(redis_prefix + "router:configured", file_digest(configured.read_bytes()))  # the deployment's baseline

    def current() -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in rdb.hgetall(redis_prefix + "router:current").items()}

    async def go() -> None:
        trigger = retrain_replica(settings, redis_url, redis_prefix)
        try:
            rolled_back = _write(before, configured, "operator-1", 0.5)
            assert await trigger.adopt_configured()
            cur = current()
            assert (cur["version"], cur["digest"]) == ("operator-1", file_digest(rolled_back))
            assert Path(cur["path"]).read_bytes() == rolled_back and cur["previous"] == str(before)
            # operator-1's cheap answers graded wrong (its top answers right): its realised floor is broken
            await asyncio.to_thread(write_outcomes, redis_url, redis_prefix, [
                Outcome(source="feedback", request_id=f"p{i}", key_id="alice", tier="short" if i % 4 else "long",
                        sufficed=i % 4 == 0, judge="client", router_version="operator-1") for i in range(40)],
                tmp_path)
            event = await trigger.check_realised()
            assert event is not None and event["event"] == "rollback" and current()["path"] == str(before)
            assert rdb.smembers(redis_prefix + "router:bad") == {f"sha256:{file_digest(rolled_back)}".encode()}
            assert event["previous_digest"] == file_digest(rolled_back)

            # another router that happens to carry the same version string: adopted
            other = _write(before, configured, "operator-1", 0.4)
            assert other != rolled_back
            assert await trigger.adopt_configured()
            assert (current()["version"], current()["digest"]) == ("operator-1", file_digest(other))

            # the rolled-back bytes written back, past readopt_after_s: not adopted (by their digest)
            await asyncio.sleep(1.2)
            _put(rolled_back, configured)
            assert not await trigger.adopt_configured()
            assert current()["digest"] == file_digest(other)

            # a version-only entry (written before rollbacks named digests) still refuses that version
            rdb.sadd(redis_prefix + "router:bad", "operator-9")
            _write(before, configured, "operator-9", 0.45)
            assert not await trigger.adopt_configured()
            assert current()["digest"] == file_digest(other)
            # the service's own reload refuses both kinds (router:bad read as every tick does): the rolled-back
            # bytes at any path, and the legacy version
            await trigger.read_bad()
            svc = trigger.service
            assert svc.refused_versions == {"operator-9"} and svc.refused_digests == {file_digest(rolled_back)}
            svc.path = configured  # operator-9
            with pytest.raises(RouterFileError, match="version operator-9"):
                svc.reload()
            (tmp_path / "renamed.skops").write_bytes(rolled_back)
            svc.path = tmp_path / "renamed.skops"
            with pytest.raises(RouterFileError, match=f"sha256 {file_digest(rolled_back)}"):
                svc.reload()
            svc.path = tmp_path / "other.skops"
            svc.path.write_bytes(other)  # same version as the rolled-back file, other bytes: served
            assert svc.reload().metadata["version"] == "operator-1" and svc.sha256 == hashlib.sha256(other).hexdigest()
        finally:
            await trigger.handle.close()

    try:
        asyncio.run(go())
    finally:
        rdb.close()


def test_a_replica_with_a_state_dir_of_its_own_keeps_its_own_copy(redis_url: str, redis_prefix: str,
                                                                 tmp_path: Path) -> None:
    """Replicas that share no state dir (each its own volume) but each have a copy of ``routing.router_path``
    (a ConfigMap): replica A adopts a file, ``router:current`` names A's copy, which B cannot read. B keeps its own
    copy from its ``routing.router_path`` once that holds the bytes named — before it does (its copy of the path
    lags) it keeps serving what it has."""
    before = serving_router(tmp_path / "before.skops", False, _text)
    conf_a, conf_b = tmp_path / "a" / "router.skops", tmp_path / "b" / "router.skops"
    for p in (conf_a, conf_b):
        p.parent.mkdir()
        _write(before, p, "operator-0", 0.5)
    set_a = _settings(tmp_path, redis_url, redis_prefix, conf_a, tmp_path / "a" / "routers")
    set_b = _settings(tmp_path, redis_url, redis_prefix, conf_b, tmp_path / "b" / "routers")
    rdb = redis.Redis.from_url(redis_url)
    rdb.hset(redis_prefix + "router:current", mapping={"path": str(before), "version": "old-noise"})
    rdb.set(redis_prefix + "router:configured", file_digest(conf_a.read_bytes()))

    async def go() -> None:
        a, b = retrain_replica(set_a, redis_url, redis_prefix), retrain_replica(set_b, redis_url, redis_prefix)
        try:
            assert await b.follow() and b.service.version == "old-noise"
            new = _write(before, conf_a, "operator-1", 0.4)
            assert await a.adopt_configured()
            kept_a = tmp_path / "a" / "routers" / f"{file_digest(new)}.skops"
            assert await a.follow() and a.service.path == kept_a
            kept_a.rename(tmp_path / "elsewhere.skops")  # not on B's disk
            assert not await b.follow()  # B's copy of the path lags: nothing to load, old-noise keeps serving
            assert b.service.version == "old-noise"
            _put(new, conf_b)  # B's copy arrives
            assert await b.follow()
            assert b.service.path == tmp_path / "b" / "routers" / f"{file_digest(new)}.skops"
            assert b.service.version == "operator-1" and b.service.path.read_bytes() == new
            assert not await b.follow()  # followed: no reload at every tick
        finally:
            for t in (a, b):
                await t.handle.close()

    try:
        asyncio.run(go())
    finally:
        rdb.close()


def test_a_transition_by_a_replica_of_the_earlier_release_is_followed_by_its_path(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """A rolling upgrade: a replica of the release before ``router:current`` carried digests adopts a new file at
    ``routing.router_path`` — it moves ``path`` (to the path itself) and ``version``, bumps ``gen``, and leaves the
    ``digest`` of the state before. Followed by that digest, the replicas of this release kept serving the router it
    replaced (their kept copy of it). A digest not written with the state (``digest_gen`` ≠ ``gen``) is not
    trusted: the path named is loaded as it is, as before."""
    before = serving_router(tmp_path / "before.skops", False, _text)
    configured = tmp_path / "configured.skops"
    _write(before, configured, "operator-0", 0.5)
    settings = _settings(tmp_path, redis_url, redis_prefix, configured, tmp_path / "routers")
    rdb = redis.Redis.from_url(redis_url)
    rdb.hset(redis_prefix + "router:current", mapping={"path": str(before), "version": "old-noise"})
    rdb.set(redis_prefix + "router:configured", file_digest(configured.read_bytes()))

    async def go() -> None:
        trigger = retrain_replica(settings, redis_url, redis_prefix)
        try:
            first = _write(before, configured, "operator-1", 0.4)
            assert await trigger.adopt_configured() and await trigger.follow()
            assert trigger.service.version == "operator-1"
            # the earlier release's adoption of the next file: its script's writes, no digest fields
            _write(before, configured, "operator-2", 0.45)
            rdb.hincrby(redis_prefix + "router:current", "gen", 1)
            rdb.hset(redis_prefix + "router:current", mapping={
                "path": str(configured), "version": "operator-2", "previous": str(trigger.service.path),
                "previous_version": "operator-1"})
            assert rdb.hget(redis_prefix + "router:current", "digest") == file_digest(first).encode()  # stale
            assert await trigger.follow()
            assert (trigger.service.path, trigger.service.version) == (configured, "operator-2")
            assert "digest" not in await trigger.current.read()
        finally:
            await trigger.handle.close()

    try:
        asyncio.run(go())
    finally:
        rdb.close()
