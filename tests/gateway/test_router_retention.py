"""Retention of ``routing.retrain.state_dir``: every adoption and promotion adds a router file there, and nothing
removed one — the directory grew without bound. A replica that follows a transition now removes the router files
nothing needs beyond the newest ``keep_files``, keeping what ``router:current`` names, what it serves, what it saw
named lately (a replica sharing the directory that has not followed yet serves it), and every file ThinkGate did not
write. Real :class:`RetrainTrigger` replicas (each its own connection) sharing one state dir on the real Redis; the
gateway-level case is in ``test_retrain_auto.py``."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.control.retrain_trigger import file_digest
from tests.fixtures.gateway import gateway_settings
from tests.fixtures.outcomes import retrain_replica, serving_router
from tests.gateway.test_router_by_content import _text, _write

HOUR = 3600.0


def _settings(tmp: Path, redis_url: str, prefix: str, name: str, configured: Path, state_dir: Path,
              keep_files: int | None) -> Any:
    return gateway_settings("http://127.0.0.1:1", redis_url, prefix, tmp / f"spool-{name}.jsonl",
                            routing={"router_path": str(configured), "routed_tiers": ["short", "long"],
                                     "retrain": {"every_outcomes": 10**6, "state_dir": str(state_dir),
                                                 "keep_files": keep_files}})


def _age(path: Path, hours: float) -> None:
    """``path``'s mtime set ``hours`` back: retention orders files by it, and never removes one written lately."""
    t = time.time() - hours * HOUR
    os.utime(path, (t, t), follow_symlinks=False)


def seed_state_dir(state_dir: Path, outside: Path) -> tuple[list[str], list[str], set[str]]:
    """A state dir as a deployment leaves it after months: (router files ThinkGate wrote, newest first — fits'
    ``router-<version>.skops`` and adopted ``<digest>.skops`` alike, 1 to 12 hours old; ThinkGate's leftover temporary
    files, a day old; the names of everything else in it: an operator's own files, names that merely look like
    ThinkGate's, a directory and a link with ThinkGate's names) — all old, and one temporary file being written now
    (not in the lists)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    routers = []
    for i in range(12):
        name = f"router-auto-20260101T0{i % 10}0000-{i:03d}.skops" if i % 2 else f"{i:032x}.skops"
        (state_dir / name).write_bytes(b"router %d" % i)
        _age(state_dir / name, 1 + i)
        routers.append(name)
    leftovers = [".router-k2j4_x9a.tmp", "router-auto-20260101T000000-001.skops.ab12cd_3.tmp"]
    (state_dir / ".router-young01.tmp").write_bytes(b"being written")
    other_file = ["notes.txt", "router-mine.skops", "operator.skops", f"{'A' * 32}.skops", f"{'0' * 31}.skops",
                  "router-auto-latest.skops", "router.skops.tmp", ".router-k2j4.tmp.bak"]
    for name in leftovers + other_file:
        (state_dir / name).write_bytes(b"x")
        _age(state_dir / name, 24)
    (state_dir / f"{'f' * 32}.skops").mkdir()
    _age(state_dir / f"{'f' * 32}.skops", 24)
    outside.write_bytes(b"not in the state dir")
    (state_dir / "router-auto-20200101T000000-999.skops").symlink_to(outside)
    _age(state_dir / "router-auto-20200101T000000-999.skops", 24)
    others = set(other_file) | {f"{'f' * 32}.skops", "router-auto-20200101T000000-999.skops", ".router-young01.tmp"}
    return routers, leftovers, others


def _names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def test_a_transition_removes_router_files_no_longer_in_use_and_nothing_else(redis_url: str, redis_prefix: str,
                                                                            tmp_path: Path) -> None:
    """Replicas A and B share a state dir full of old router files (``keep_files: 2``). A adopts three operator
    files in turn while B, after the first, follows none (a replica between two ticks, or cut off from Redis).
    When A follows the third: of the old files only the 2 newest are left, ThinkGate's leftover temporary files are
    gone, the operator's own files stay — and so do the files still in use, though all three are older than every
    other file: the router serving (``router:current``'s copy), its ``previous`` (what a rollback goes back to), and
    the first file, which router:current names no more but B still serves (A saw it named). A replica started since
    (no such memory; B caught up by then) removes the first file too."""
    before = serving_router(tmp_path / "before.skops", False, _text)
    shared = tmp_path / "routers"
    routers, leftovers, others = seed_state_dir(shared, tmp_path / "outside.skops")
    conf_a, conf_b = tmp_path / "a.skops", tmp_path / "b.skops"
    _write(before, conf_a, "operator-0", 0.5)
    _write(before, conf_b, "operator-0", 0.5)
    set_a = _settings(tmp_path, redis_url, redis_prefix, "a", conf_a, shared, 2)
    set_b = _settings(tmp_path, redis_url, redis_prefix, "b", conf_b, shared, 2)
    rdb = redis.Redis.from_url(redis_url)
    rdb.hset(redis_prefix + "router:current", mapping={"path": str(before), "version": "old-noise"})
    rdb.set(redis_prefix + "router:configured", file_digest(conf_a.read_bytes()))

    async def go() -> None:
        a, b = retrain_replica(set_a, redis_url, redis_prefix), retrain_replica(set_b, redis_url, redis_prefix)
        late = None
        try:
            copies = []
            for i, cut in enumerate((0.4, 0.45, 0.35), start=1):
                data = _write(before, conf_a, f"operator-{i}", cut)
                assert await a.adopt_configured()
                copies.append(shared / f"{file_digest(data)}.skops")
                for copy in copies:  # older than every seeded file: kept only because they are in use
                    _age(copy, 100)
                assert await a.follow() and a.service.path == copies[-1]
                if i == 1:
                    assert await b.follow() and b.service.path == copies[0]
            cur = {k.decode(): v.decode() for k, v in rdb.hgetall(redis_prefix + "router:current").items()}
            assert (cur["path"], cur["previous"]) == (str(copies[2]), str(copies[1]))
            assert b.service.path == copies[0] and b.service.version == "operator-1"
            assert _names(shared) == {c.name for c in copies} | set(routers[:2]) | others, sorted(_names(shared))

            # B follows: nothing B or anyone needs is gone; a replica started now, which never saw operator-1
            # named, removes its copy (no longer named, served nowhere, not among the 2 newest)
            assert await b.follow() and b.service.path == copies[2]
            assert _names(shared) == {c.name for c in copies} | set(routers[:2]) | others
            set_late = _settings(tmp_path, redis_url, redis_prefix, "late", conf_b, shared, 2)
            late = retrain_replica(set_late, redis_url, redis_prefix)
            assert await late.follow() and late.service.path == copies[2]
            assert _names(shared) == {copies[1].name, copies[2].name} | set(routers[:2]) | others
            assert not set(leftovers) & _names(shared)
        finally:
            for t in (a, b, late):
                if t is not None:
                    await t.handle.close()

    try:
        asyncio.run(go())
    finally:
        rdb.close()


def test_keep_files_null_removes_nothing(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """``keep_files: null`` is retention off: a transition followed leaves every file (the behaviour before)."""
    before = serving_router(tmp_path / "before.skops", False, _text)
    shared = tmp_path / "routers"
    seed_state_dir(shared, tmp_path / "outside.skops")
    seeded = _names(shared)
    conf = tmp_path / "a.skops"
    _write(before, conf, "operator-0", 0.5)
    settings = _settings(tmp_path, redis_url, redis_prefix, "a", conf, shared, None)
    rdb = redis.Redis.from_url(redis_url)
    rdb.hset(redis_prefix + "router:current", mapping={"path": str(before), "version": "old-noise"})
    rdb.set(redis_prefix + "router:configured", file_digest(conf.read_bytes()))

    async def go() -> None:
        a = retrain_replica(settings, redis_url, redis_prefix)
        try:
            data = _write(before, conf, "operator-1", 0.4)
            assert await a.adopt_configured() and await a.follow()
            assert _names(shared) == seeded | {f"{file_digest(data)}.skops"}
        finally:
            await a.handle.close()

    try:
        asyncio.run(go())
    finally:
        rdb.close()


def test_no_state_dir_yet_is_nothing_to_prune(redis_url: str, redis_prefix: str, tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """``router:current`` names a file outside the state dir, which does not exist yet (nothing was ever copied
    there): following it is no reason for a warning at every transition — there is nothing to prune."""
    before = serving_router(tmp_path / "before.skops", False, _text)
    conf = tmp_path / "a.skops"
    _write(before, conf, "operator-0", 0.5)
    settings = _settings(tmp_path, redis_url, redis_prefix, "a", conf, tmp_path / "routers", 2)
    rdb = redis.Redis.from_url(redis_url)
    rdb.hset(redis_prefix + "router:current", mapping={"path": str(before), "version": "old-noise"})

    async def go() -> None:
        a = retrain_replica(settings, redis_url, redis_prefix)
        try:
            with caplog.at_level(logging.WARNING, logger="thinkgate.retrain"):
                assert await a.follow() and a.service.version == "old-noise"
        finally:
            await a.handle.close()

    try:
        asyncio.run(go())
    finally:
        rdb.close()
    assert not (tmp_path / "routers").exists()
    assert not [r for r in caplog.records if r.name == "thinkgate.retrain"], caplog.text
