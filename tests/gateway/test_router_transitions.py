"""Transitions of ``p router:current`` race on the real Redis: one replica adopts a new file at
``routing.router_path`` while another rolls the promoted router back (its realised floor broke), each a real
:class:`RetrainTrigger` with its own connection, started together many times over. With a separate read and write
each, the two interleaved: the rollback was overwritten (``router:current`` kept the rolled-back file as the
adopted one's ``previous``) or the adoption lost, with audit events for both. Every run must end in a state that
the audit events, replayed from the start, lead to."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
from pathlib import Path
from typing import Any

import orjson
import redis

from gateway.control.retrain_trigger import file_digest
from gateway.ledger.outcome import Outcome
from router.persistence import load_router, save_router
from tests.fixtures.gateway import gateway_settings
from tests.fixtures.outcomes import retrain_replica, serving_router, write_outcomes

RUNS = 40  # the bad interleaving showed in most runs before the fix; bounded by TIME_S too
TIME_S = 90.0


def _text(hard: bool, i: int) -> str:
    rng = random.Random(i)
    return f"question {i}: " + " ".join(rng.sample(["prove", "integral", "theorem", "derive"] if hard
                                                    else ["capital", "color", "name", "city"], 3))


def _replay(start: dict[str, str], events: list[dict[str, Any]]) -> dict[str, str]:
    """The state of ``router:current`` the audit events lead to from ``start``; each event must start from the
    state the one before it left (its ``previous`` is the version serving when it happened)."""
    state = dict(start)
    for e in events:
        assert e["previous"] == (state["version"] or None), (e, state, events)
        if e["event"] == "promote":
            state = {"path": e["path"], "version": e["version"], "previous": state["path"]}
        else:
            assert e["event"] == "rollback" and e["path"] == state["previous"], (e, state, events)
            state = {"path": e["path"], "version": e["version"], "previous": ""}
    return state


def test_an_adoption_racing_a_rollback_ends_in_a_state_its_audit_events_lead_to(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    before = serving_router(tmp_path / "before.skops", False, _text)  # old-noise: what a rollback goes back to
    promoted = tmp_path / "promoted.skops"
    router = load_router(before)
    router.metadata["version"] = "auto-x"
    save_router(router, promoted)
    configured = tmp_path / "configured.skops"
    save_router(router, configured)
    # the promoted router's own cheap answers graded wrong (and its top answers right): its floor is broken
    write_outcomes(redis_url, redis_prefix, [
        Outcome(source="feedback", request_id=f"p{i}", key_id="alice", tier="short" if i % 4 else "long",
                sufficed=i % 4 == 0, judge="client", router_version="auto-x") for i in range(40)], tmp_path)
    settings = gateway_settings("http://127.0.0.1:1", redis_url, redis_prefix, tmp_path / "spool.jsonl", routing={
        "router_path": str(configured), "routed_tiers": ["short", "long"],
        "retrain": {"every_outcomes": 10**6, "state_dir": str(tmp_path / "routers"), "realised_min": 10}})
    start = {"path": str(promoted), "version": "auto-x", "previous": str(before)}
    rdb = redis.Redis.from_url(redis_url)

    async def race() -> dict[str, int]:
        adopter, checker = (retrain_replica(settings, redis_url, redis_prefix) for _ in range(2))
        seen = {"rollback then promote": 0, "promote only": 0, "other": 0}
        deadline = time.monotonic() + TIME_S
        try:
            for run in range(RUNS):
                if time.monotonic() > deadline:
                    break
                # each run: the promoted router serving, its floor broken, and a new operator file at router_path
                rdb.delete(*[redis_prefix + k for k in ("router:current", "router:history", "router:bad")])
                rdb.hset(redis_prefix + "router:current", mapping={**start, "previous_version": "old-noise"})
                # the deployment has seen the file there now (p router:configured: its SHA-256, 32 hex characters)
                rdb.set(redis_prefix + "router:configured",
                        hashlib.sha256(configured.read_bytes()).hexdigest()[:32])
                router.metadata["version"] = f"operator-{run}"
                save_router(router, tmp_path / "next.tmp")
                os.replace(tmp_path / "next.tmp", configured)

                async def after(delay: float, job: Any) -> Any:
                    await asyncio.sleep(delay)
                    return await job()

                await asyncio.gather(after(random.uniform(0, 0.004), adopter.adopt_configured),
                                     after(random.uniform(0, 0.004), checker.check_realised))
                events = [orjson.loads(f[b"e"]) for _, f in rdb.xrange(redis_prefix + "router:history")]
                cur = {k.decode(): v.decode() for k, v in rdb.hgetall(redis_prefix + "router:current").items()}
                want = _replay(start, events)
                assert {k: cur.get(k) for k in want} == want, (run, cur, events)
                kinds = [e["event"] for e in events]
                # the operator's file is never lost: adopted once, whatever the rollback did
                assert kinds.count("promote") == 1 and kinds.count("rollback") <= 1, (run, events)
                assert cur["version"] == f"operator-{run}", (run, cur, events)
                seen[{("rollback", "promote"): "rollback then promote", ("promote",): "promote only"}.get(
                    tuple(kinds), "other")] += 1
        finally:
            for t in (adopter, checker):
                await t.handle.close()
        return seen

    try:
        seen = asyncio.run(race())
    finally:
        rdb.close()
    assert seen["other"] == 0 and sum(seen.values()) >= 10, seen


def test_a_superseded_promotion_names_no_path_to_a_tenant(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """A fit's promotion finds ``router:current`` moved (another replica adopted a file meanwhile): its event becomes
    a ``keep`` whose reason says where it moved. ``/v1/models`` shows that event to every API key
    (``status(with_paths=False)``): the file by name, never its path — the reason named the full path (the
    server's directory layout, which the tenant's view leaves out everywhere else)."""
    before = serving_router(tmp_path / "before.skops", False, _text)
    settings = gateway_settings("http://127.0.0.1:1", redis_url, redis_prefix, tmp_path / "spool.jsonl", routing={
        "router_path": str(before), "routed_tiers": ["short", "long"],
        "retrain": {"every_outcomes": 10**6, "state_dir": str(tmp_path / "routers")}})
    moved = tmp_path / "deep" / "layout" / "operator.skops"
    rdb = redis.Redis.from_url(redis_url)
    rdb.hset(redis_prefix + "router:current", mapping={"path": str(moved), "version": "operator-1",
                                                       "previous": str(before), "previous_version": "old"})

    async def go() -> dict[str, Any]:
        trigger = retrain_replica(settings, redis_url, redis_prefix)
        try:
            candidate = tmp_path / "routers" / "router-auto-1.skops"
            event: dict[str, Any] = {"event": "promote", "ts": time.time(), "version": "auto-1", "previous": "old",
                                     "path": str(candidate), "outcomes": 10, "reason": "better"}
            await trigger._promote({"path": str(candidate), "version": "auto-1", "previous": str(before),
                                    "previous_version": "old"}, event)
            assert event["event"] == "keep" and moved.name in event["reason"]
            return trigger.status(with_paths=False)
        finally:
            await trigger.handle.close()

    try:
        status = asyncio.run(go())
    finally:
        rdb.close()
    text = orjson.dumps(status).decode()
    assert str(tmp_path) not in text, status["last_event"]


def test_a_promotion_reaches_a_replica_with_a_state_dir_of_its_own(redis_url: str, redis_prefix: str,
                                                                   tmp_path: Path) -> None:
    """Two replicas on one Redis, each with its own ``routing.retrain.state_dir`` (the shipped Kubernetes deployment:
    an ``emptyDir`` per pod). One promotes the candidate its fit wrote to its state dir; the other must serve it. It
    read the path ``router:current`` names, found no such file on its disk and kept serving the old router, warning
    at every tick — a promotion was served by the replica that fitted it alone. Then the first replica rolls back."""
    before = serving_router(tmp_path / "before.skops", False, _text)

    def settings(name: str) -> Any:
        return gateway_settings("http://127.0.0.1:1", redis_url, redis_prefix, tmp_path / f"spool-{name}.jsonl",
                                routing={"router_path": str(before), "routed_tiers": ["short", "long"],
                                         "retrain": {"every_outcomes": 10**6,
                                                     "state_dir": str(tmp_path / f"routers-{name}")}})
    fitter_dir = tmp_path / "routers-a"
    fitter_dir.mkdir()
    candidate = fitter_dir / "router-auto-20261207T000000-001.skops"  # as a fit writes it (FIT_FILE)
    router = load_router(before)
    router.metadata["version"] = "auto-1"
    save_router(router, candidate)
    candidate_bytes = candidate.read_bytes()
    rdb = redis.Redis.from_url(redis_url)

    async def go() -> tuple[str | None, str | None]:
        fitter, other = (retrain_replica(settings(n), redis_url, redis_prefix) for n in ("a", "b"))
        try:
            event: dict[str, Any] = {"event": "promote", "ts": time.time(), "version": "auto-1",
                                     "previous": "old-noise", "path": str(candidate), "outcomes": 10, "reason": "x"}
            await fitter._promote({"path": str(candidate), "version": "auto-1", "digest": file_digest(candidate_bytes),
                                   "previous": str(before), "previous_version": "old-noise",
                                   "previous_digest": file_digest(before.read_bytes())}, event)
            assert event["event"] == "promote", event
            assert await fitter.follow()  # it serves the candidate (loaded whole into memory)
            fitter_dir.rename(tmp_path / "elsewhere")  # the other replica's disk has no such file
            assert await other.follow()
            served = fitter.service.version, other.service.version
            # rolled back: the bytes published for the replicas without the file go with it
            blob = redis_prefix + "router:file:" + file_digest(candidate_bytes)
            assert rdb.exists(blob) == 1
            c = await fitter.current.read()
            assert await fitter.current.transition(c, {"path": str(before), "version": "old-noise"},
                                                   {"event": "rollback"}, "rollback", bad="x") == 1
            assert rdb.exists(blob) == 0
            return served
        finally:
            for t in (fitter, other):
                await t.handle.close()

    try:
        assert asyncio.run(go()) == ("auto-1", "auto-1")  # b served old-noise
    finally:
        rdb.close()


def test_a_fit_releases_the_lock_only_while_it_holds_it(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """A fit that outlives the lock's TTL (10 minutes: a large outcome stream) has lost the lock to another replica,
    which fits now. Ending, it deleted the lock whatever it held — the other replica's — and a third could start a
    fit beside that one. It removes only its own."""
    before = serving_router(tmp_path / "before.skops", False, _text)
    write_outcomes(redis_url, redis_prefix, [
        Outcome(source="feedback", request_id=f"r{i}", key_id="alice", tier="short", sufficed=i % 2 == 1,
                judge="client", window_digest=f"{i:016x}", text=_text(i % 2 == 0, i)) for i in range(20)], tmp_path)
    settings = gateway_settings("http://127.0.0.1:1", redis_url, redis_prefix, tmp_path / "spool.jsonl", routing={
        "router_path": str(before), "routed_tiers": ["short", "long"],
        "retrain": {"every_outcomes": 10, "fit_in": "thread", "state_dir": str(tmp_path / "routers")}})
    rdb = redis.Redis.from_url(redis_url)
    lock = redis_prefix + "router:lock"

    async def go() -> None:
        trigger = retrain_replica(settings, redis_url, redis_prefix)
        try:
            async def lose_the_lock() -> None:  # what its expiry and another replica's SET NX come to
                deadline = time.monotonic() + 20.0
                while time.monotonic() < deadline:  # at every turn of the loop: the fit awaits Redis several times
                    if trigger.fitting:
                        rdb.set(lock, "another-replica")
                        return
                    await asyncio.sleep(0)
                raise AssertionError("the fit never ran")

            await asyncio.gather(trigger.fit_once(20), lose_the_lock())
            assert rdb.get(lock) == b"another-replica"  # it was deleted
            rdb.set(lock, trigger._token)
            await trigger.fit_once(20)
            assert rdb.get(lock) is None  # its own is released
        finally:
            await trigger.handle.close()

    try:
        asyncio.run(go())
    finally:
        rdb.close()


def test_a_replica_that_cannot_keep_the_published_router_warns_and_ticks_on(
        redis_url: str, redis_prefix: str, tmp_path: Path, monkeypatch: Any) -> None:
    """The replica without the promoted file finds its bytes in Redis but cannot write its copy (a full or read-only
    state dir): it keeps serving the router it has and says so, as when the file cannot be loaded — ``follow`` raised
    the ``OSError``, so every tick failed at its start (no realised-floor check, no fit on that replica)."""
    from gateway.control import retrain_trigger

    before = serving_router(tmp_path / "before.skops", False, _text)

    def settings(name: str) -> Any:
        return gateway_settings("http://127.0.0.1:1", redis_url, redis_prefix, tmp_path / f"spool-{name}.jsonl",
                                routing={"router_path": str(before), "routed_tiers": ["short", "long"],
                                         "retrain": {"every_outcomes": 10**6,
                                                     "state_dir": str(tmp_path / f"routers-{name}")}})
    fitter_dir = tmp_path / "routers-a"
    fitter_dir.mkdir()
    candidate = fitter_dir / "router-auto-20261207T000000-001.skops"
    router = load_router(before)
    router.metadata["version"] = "auto-1"
    save_router(router, candidate)
    digest = file_digest(candidate.read_bytes())

    def full(*_: Any) -> Path:
        raise OSError(28, "No space left on device")

    async def go() -> tuple[bool, str | None]:
        fitter, other = (retrain_replica(settings(n), redis_url, redis_prefix) for n in ("a", "b"))
        try:
            event: dict[str, Any] = {"event": "promote", "ts": time.time(), "version": "auto-1",
                                     "previous": "old-noise", "path": str(candidate), "outcomes": 10, "reason": "x"}
            await fitter._promote({"path": str(candidate), "version": "auto-1", "digest": digest,
                                   "previous": str(before), "previous_version": "old-noise",
                                   "previous_digest": file_digest(before.read_bytes())}, event)
            fitter_dir.rename(tmp_path / "elsewhere")  # the other replica's disk has no such file
            monkeypatch.setattr(retrain_trigger, "keep_copy", full)
            return await other.follow(), other.service.version
        finally:
            for t in (fitter, other):
                await t.handle.close()

    assert asyncio.run(go()) == (False, "old-noise")  # raised OSError before
