"""Automatic retraining (``routing.retrain``) on a real gateway and the real Redis: a better router is fitted,
written as a versioned file and promoted by hot reload (``/v1/models``, ``thinkgate router history``); a worse
one is kept out; a promoted router whose realised floor falls is rolled back to the previous file."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from typer.testing import CliRunner

from gateway.cli.main import app
from gateway.config import OutcomesConfig
from gateway.control.retrain_trigger import file_digest
from gateway.ledger.outcome import Outcome, window_digest
from router.fit.retrain import is_heldout_digest
from router.persistence import load_router, save_router
from tests.fixtures.crash_process import DurableRedis
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS
from tests.fixtures.gateway import accounting_gateway as _accounting_gateway
from tests.fixtures.outcomes import serving_router, write_outcomes
from tests.fixtures.upstream import SimProcess, wait_for
from tests.gateway.test_router_retention import seed_state_dir

# How long a test waits for a fit (a process of its own) to be done: ~5 s on an idle box; over 60 s was seen in
# fresh-clone CI runs with the suite's 3 workers, the vLLM engine starting and GRPO runs beside it on 2 cores. A
# bound for a fit that never ends, not a speed check (pytest-timeout's 300 s per test bounds the whole test).
FIT_WAIT_S = 150.0

HARD = ["prove", "integral", "theorem", "derive", "lemma", "asymptotic"]
EASY = ["capital", "color", "name", "city", "animal", "fruit"]


def _gateway(*args: Any, **kwargs: Any) -> Any:
    """:func:`tests.fixtures.gateway.accounting_gateway` with Redis commands bounded at 2 s, not 0.25 s: retraining
    is under test here, not the breaker; with a fit process and other pytest workers on both cores, the default bound
    opened the breaker and the retrain loop skipped its windows (CI, 2026-12-07)."""
    return _accounting_gateway(*args, redis={"socket_timeout_s": 2.0}, **kwargs)


def _text(hard: bool, i: int) -> str:
    rng = random.Random(i)
    return f"question {i}: " + " ".join(rng.sample(HARD if hard else EASY, 3))


def _router(path: Path, informative: bool) -> Path:
    return serving_router(path, informative, _text)


def _graded(invert_training: bool, n: int = 1400) -> list[Outcome]:
    """Feedback on cheap answers (easy right, hard wrong; inverted outside the held-back slice when asked) and on
    top answers (all right: every cheap-wrong answer costs always-top a right one). ``n`` = 1,400 puts ~280 windows
    in the held-back slice: with no randomised arm (q = 1), at the first look (z 1.96) a perfect candidate sending
    half of them cheap has its lost count, 0, read as 3.7 — ~190 windows are needed to hold 0.98."""
    out = []
    for i in range(n):
        hard = i % 2 == 0
        text = _text(hard, i)
        d = window_digest(text)
        needs_top = hard if (is_heldout_digest(d, 0.2) or not invert_training) else not hard
        out.append(Outcome(source="feedback", request_id=f"r{i}", key_id="alice", tier="short",
                           sufficed=not needs_top, judge="client", window_digest=d, text=text))
    out += [Outcome(source="feedback", request_id=f"t{i}", key_id="alice", tier="long", sufficed=True,
                    judge="client", window_digest=window_digest(_text(True, 5000 + i)), text=_text(True, 5000 + i))
            for i in range(60)]
    return out


def _routing(router: Path, tmp: Path, **retrain: Any) -> dict[str, Any]:
    # fit_nice 0: at the default +10 the fit process got ~3.5% of a core beside the suite's other workers (4
    # CPU-seconds in 146 s, load 10 on 2 cores) and no fit ended within FIT_WAIT_S
    return {"router_path": str(router), "routed_tiers": ["short", "long"], "reload_interval_s": 0.2,
            "retrain": {"every_outcomes": 100, "state_dir": str(tmp / "routers"), "interval_s": 0.2,
                        "min_heldout": 10, "fit_nice": 0, **retrain}}


def _status(gw: Any, secret: str = ADMIN_SECRET) -> dict[str, Any]:
    """``router_status`` as the admin key reads it (with the files' full paths; any other key reads names)."""
    r = httpx.get(gw.base_url + "/models", headers={"authorization": f"Bearer {secret}"}, timeout=10)
    return dict(r.json()["data"][0]["thinkgate"]["router_status"])


def _history(redis_url: str, prefix: str, tmp: Path) -> list[dict[str, Any]]:
    cfg = tmp / "cli.yaml"
    cfg.write_text(yaml.safe_dump({"redis": {"url": redis_url, "key_prefix": prefix, "start_if_missing": False}}))
    res = CliRunner().invoke(app, ["router", "history", "--json", "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    text = CliRunner().invoke(app, ["router", "history", "--config", str(cfg)]).output
    events: list[dict[str, Any]] = json.loads(res.output)
    for e in events:
        assert e["event"] in text
    # the same events from a file (bench learn --details keeps them there once its Redis keys are gone)
    saved = tmp / "details.json"
    saved.write_text(json.dumps({"history": events}))
    assert CliRunner().invoke(app, ["router", "history", "--file", str(saved)]).output == text
    return events


@pytest.mark.parametrize("case", ["better", "worse"])
def test_a_better_router_is_promoted_and_a_worse_one_is_not(upstream_sim: SimProcess, redis_url: str,
                                                            redis_prefix: str, tmp_path: Path, case: str) -> None:
    old = _router(tmp_path / "serving.skops", informative=case == "worse")
    # one fit is due at start
    write_outcomes(redis_url, redis_prefix, _graded(invert_training=case == "worse"), tmp_path)
    # the better case fits in the child process (the default), the worse one in a worker thread
    fit_in = "process" if case == "better" else "thread"
    # no spot checks: the request below must be served where the promoted router sends it (5% by default would go up)
    with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(old, tmp_path, fit_in=fit_in, spot_check=0.0)) as gw:
        assert _status(gw)["learning"]["every_outcomes"] == 100
        assert wait_for(lambda: (_status(gw)["learning"] or {}).get("last_event") is not None, timeout_s=FIT_WAIT_S)
        st = _status(gw)
        event = st["learning"]["last_event"]
        cmp = event["comparison"]
        # this gateway runs in the test's process: a fit in the child reports another pid
        assert event["fit"]["in"] == fit_in and event["fit"]["seconds"] > 0
        assert (event["fit"]["pid"] != os.getpid()) == (fit_in == "process"), event["fit"]
        if case == "better":
            assert event["event"] == "promote", event
            assert cmp["old"]["holds_floor"] is False and cmp["new"]["holds_floor"] is True
            assert st["version"] == event["version"] and st["version"].startswith("auto-")
            assert st["path"] == event["path"] and Path(event["path"]).parent == tmp_path / "routers"
            # any other key reads the promoted file by name and digest: no directory of this server
            tenant = _status(gw, SECRETS["alice"])
            assert "path" not in tenant and tenant["learning"]["state_dir"] is None
            assert tenant["file"] == tenant["learning"]["last_event"]["path"] == Path(event["path"]).name
            assert tenant["sha256"] == st["sha256"] and str(tmp_path) not in json.dumps(tenant)
            assert old.exists()  # the previous file is kept
            # the promoted router serves: easy questions go to the cheap tier, hard ones up
            r = httpx.post(gw.base_url + "/chat/completions", headers={"authorization": f"Bearer {SECRETS['alice']}"},
                           json={"model": "auto", "max_tokens": 8,
                                 "messages": [{"role": "user", "content": _text(False, 777)}]}, timeout=30)
            assert r.headers["x-thinkgate-tier"] == "short"
        else:
            assert event["event"] == "keep", event
            assert cmp["new"] is None or cmp["new"]["holds_floor"] is False
            assert st["version"] == "old-good" and st["path"] == str(old)
            assert not list((tmp_path / "routers").glob("*.skops"))
        [h] = _history(redis_url, redis_prefix, tmp_path)
        assert h["event"] == event["event"] and h["version"] == event["version"]
        # the deployment's first judged comparison: its bounds at look 1 (z 1.96), and the count in Redis moved on
        assert cmp["rates"]["look"] == 1 and abs(cmp["rates"]["z"] - 1.96) < 0.01
        rdb = redis.Redis.from_url(redis_url)
        try:
            assert rdb.get(redis_prefix + "router:looks") == b"1"
        finally:
            rdb.close()


def _promoted(redis_url: str, prefix: str, tmp: Path) -> tuple[Path, Path]:
    """A configured router file (``old-noise``) and a promoted one (``old-good``) that ``p router:current`` names,
    as automatic retraining leaves them: (configured, promoted)."""
    configured = _router(tmp / "configured.skops", informative=False)
    promoted = _router(tmp / "promoted.skops", informative=True)
    rdb = redis.Redis.from_url(redis_url)
    try:
        rdb.hset(prefix + "router:current", mapping={"path": str(promoted), "version": "old-good",
                                                     "previous": str(configured)})
    finally:
        rdb.close()
    return configured, promoted


def test_a_restarted_replica_serves_the_promoted_router_from_its_first_request(
        upstream_sim: SimProcess, redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """A replica that starts while ``p router:current`` names a promoted router serves it before its first request
    and shows the last audit event — it served the configured file until its first tick (and stamped its answers'
    outcomes with that version), and read ``last_event: null``. Ticks are 60 s apart here: only the start can do it."""
    configured, promoted = _promoted(redis_url, redis_prefix, tmp_path)
    rdb = redis.Redis.from_url(redis_url)
    try:
        event = {"event": "promote", "ts": 1.0, "version": "old-good", "path": str(promoted), "reason": "test"}
        rdb.xadd(redis_prefix + "router:history", {"e": json.dumps(event)})
    finally:
        rdb.close()
    with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(configured, tmp_path, interval_s=60.0, every_outcomes=10**6)) as gw:
        st = _status(gw)
        assert (st["version"], st["path"]) == ("old-good", str(promoted))
        assert st["learning"]["last_event"]["version"] == "old-good"


def _write_router(path: Path, seed: int, version: str, thresholds: list[float] | None = None) -> None:
    """An operator's router file written over ``path`` the safe way (elsewhere, then renamed over it)."""
    tmp = serving_router(path.with_name(f"{version}.tmp"), False, lambda hard, i: _text(hard, i + seed))
    router = load_router(tmp)
    router.metadata["version"] = version
    if thresholds is not None:
        router.thresholds = thresholds
    save_router(router, tmp)
    os.replace(tmp, path)


def test_a_file_written_to_router_path_replaces_the_promoted_router(
        upstream_sim: SimProcess, redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """After a promotion the replicas serve ``p router:current``; an operator who writes a new file to
    ``routing.router_path`` (docs/router.md's hot reload: write elsewhere, rename over) had it ignored, with nothing
    said (a new user's first day). Now it becomes the promoted router with an operator's audit event, the promoted
    one kept as its previous; a file that does not load is left out and the promoted router keeps serving."""
    configured, promoted = _promoted(redis_url, redis_prefix, tmp_path)
    with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(configured, tmp_path, every_outcomes=10**6)) as gw:
        assert _status(gw)["version"] == "old-good"
        broken = tmp_path / "broken.tmp"
        broken.write_bytes(b"not a router file")
        os.replace(broken, configured)
        assert not wait_for(lambda: _status(gw)["version"] != "old-good", timeout_s=2)
        # one that loads but that the service refuses (two cuts for two routed tiers): left out too — named the
        # promoted router, no replica could serve it and the loop stalled on it
        _write_router(configured, 55, "operator-3tier", [0.3, 0.6])
        assert not wait_for(lambda: _status(gw)["version"] != "old-good", timeout_s=2)
        _write_router(configured, 77, "operator-1")
        assert wait_for(lambda: _status(gw)["version"] == "operator-1", timeout_s=10), _status(gw)
        # served from the bytes adopted, kept under their digest (a later write to the path does not reach it)
        assert _status(gw)["path"] == str(tmp_path / "routers" / f"{file_digest(configured.read_bytes())}.skops")
        events = _history(redis_url, redis_prefix, tmp_path)
        assert [(e["event"], e["version"], e["previous"]) for e in events] == [("promote", "operator-1", "old-good")]
        assert events[0]["reason"] == "operator: a new file at routing.router_path"
        rdb = redis.Redis.from_url(redis_url)
        try:
            assert rdb.hget(redis_prefix + "router:current", "previous") == str(promoted).encode()
            # the promoted router back in router:current (as a later promotion would, with its digest): a replica
            # restarted on the same file adopts nothing — the deployment has seen that file
            rdb.hset(redis_prefix + "router:current", mapping={
                "path": str(promoted), "version": "old-good", "digest": file_digest(promoted.read_bytes()),
                "previous": str(configured), "previous_version": "", "previous_digest": ""})
        finally:
            rdb.close()
    with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(configured, tmp_path, every_outcomes=10**6)) as gw:
        assert not wait_for(lambda: _status(gw)["version"] != "old-good", timeout_s=2)
    # a file written while no replica runs (a new ConfigMap, then a rollout): adopted by the first one up
    _write_router(configured, 99, "operator-2")
    with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(configured, tmp_path, every_outcomes=10**6)) as gw:
        assert wait_for(lambda: _status(gw)["version"] == "operator-2", timeout_s=10), _status(gw)


def test_a_rolled_back_file_written_back_is_not_adopted_again(
        upstream_sim: SimProcess, redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """An operator's file is adopted, its cheap answers come back graded wrong and it is rolled back (its version
    into ``router:bad``); a later file replaces the promoted router, then the rolled-back file is written back past
    ``readopt_after_s`` (a ConfigMap reverted to it). ``router:bad`` was written and never read: the file was
    adopted again and served the answers it had been rolled back for. Now it is left out; the same router saved
    under a new version is served (the way to put it back on purpose)."""
    configured, _ = _promoted(redis_url, redis_prefix, tmp_path)
    rdb = redis.Redis.from_url(redis_url)
    with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(configured, tmp_path, every_outcomes=10**6, realised_min=10,
                                             readopt_after_s=1)) as gw:
        try:
            assert wait_for(lambda: rdb.exists(redis_prefix + "router:configured") == 1, timeout_s=10)
            _write_router(configured, 77, "operator-1")
            assert wait_for(lambda: _status(gw)["version"] == "operator-1", timeout_s=10), _status(gw)
            rolled_back_bytes = configured.read_bytes()
            # operator-1's cheap answers: half of them wrong, where the top tier is right on all its own
            write_outcomes(redis_url, redis_prefix, _arms("operator-1", (40, 20), (30, 30), (0, 0)), tmp_path)
            assert wait_for(lambda: _status(gw)["version"] == "old-good", timeout_s=30), _status(gw)
            # by its bytes, not its version (another file may carry it)
            assert rdb.smembers(redis_prefix + "router:bad") == {f"sha256:{file_digest(rolled_back_bytes)}".encode()}
            _write_router(configured, 99, "operator-2")
            assert wait_for(lambda: _status(gw)["version"] == "operator-2", timeout_s=10), _status(gw)
            time.sleep(1.5)  # past readopt_after_s: the adopted mark is no reason to leave it out any more
            back = tmp_path / "back.tmp"
            back.write_bytes(rolled_back_bytes)
            os.replace(back, configured)  # the rolled-back file, byte for byte, written back
            assert not wait_for(lambda: _status(gw)["version"] != "operator-2", timeout_s=3), _status(gw)
            # a replica that starts now loads the rolled-back file at routing.router_path, and router:current named
            # that very path (operator-2 was adopted there): it served operator-1 again, with an error in the log.
            # router:current names operator-2's kept copy: it serves that from its first request
            with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                                    routing=_routing(configured, tmp_path, every_outcomes=10**6, interval_s=60.0,
                                                     realised_min=10, readopt_after_s=1)) as late:
                assert _status(late)["version"] == "operator-2", _status(late)
            events = _history(redis_url, redis_prefix, tmp_path)
            assert [(e["event"], e["version"]) for e in events] == [
                ("promote", "operator-1"), ("rollback", "old-good"), ("promote", "operator-2")]
            # the same router under a new version: an operator's deliberate choice, served
            router = load_router(configured)
            router.metadata["version"] = "operator-1-again"
            save_router(router, back)
            os.replace(back, configured)
            assert wait_for(lambda: _status(gw)["version"] == "operator-1-again", timeout_s=10), _status(gw)
        finally:
            rdb.close()


def test_a_lagging_copy_of_router_path_is_not_served_by_the_hot_reload(
        upstream_sim: SimProcess, redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """Two operator files are adopted in turn from ``routing.router_path``, then the first one's bytes land there again
    within ``readopt_after_s`` (a replica's lagging copy of the path): not adopted — and not served. While
    ``router:current`` named the path itself, the service's hot reload of that path (every ``reload_interval_s``)
    loaded whatever was written there: the replica served the file the fleet had replaced, and router:current, the
    audit trail and /v1/models' learning said otherwise. Served now is the adopted bytes' copy, which no write to the
    path changes."""
    configured, _ = _promoted(redis_url, redis_prefix, tmp_path)
    with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(configured, tmp_path, every_outcomes=10**6)) as gw:
        rdb = redis.Redis.from_url(redis_url)
        try:
            assert wait_for(lambda: rdb.exists(redis_prefix + "router:configured") == 1, timeout_s=10)
        finally:
            rdb.close()
        _write_router(configured, 77, "operator-a")
        lagging = configured.read_bytes()
        assert wait_for(lambda: _status(gw)["version"] == "operator-a", timeout_s=10), _status(gw)
        _write_router(configured, 99, "operator-b")
        assert wait_for(lambda: _status(gw)["version"] == "operator-b", timeout_s=10), _status(gw)
        back = tmp_path / "lagging.tmp"
        back.write_bytes(lagging)
        os.replace(back, configured)  # operator-a's bytes again, well within readopt_after_s (900 s)
        # ten hot-reload intervals and ten ticks
        assert not wait_for(lambda: _status(gw)["version"] != "operator-b", timeout_s=2), _status(gw)
        assert [(e["event"], e["version"]) for e in _history(redis_url, redis_prefix, tmp_path)] == [
            ("promote", "operator-a"), ("promote", "operator-b")]


def test_the_state_dir_keeps_the_routers_in_use_and_the_newest_others(
        upstream_sim: SimProcess, redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """A gateway whose state dir holds months of router files (``keep_files: 1``) adopts a new file at
    ``routing.router_path``: every adoption and promotion added a file there and none was ever removed. Now, once it
    follows, only the newest old router file is left besides the two in use — the adopted copy serving and the router
    it replaced (``previous``, what a rollback goes back to; older than every other file) —, ThinkGate's leftover
    temporary files are gone and everything else in the directory is as it was."""
    configured, promoted = _promoted(redis_url, redis_prefix, tmp_path)
    routers = tmp_path / "routers"
    old, leftovers, others = seed_state_dir(routers, tmp_path / "outside.skops")
    data = promoted.read_bytes()
    previous = routers / f"{file_digest(data)}.skops"  # old-good as an earlier adoption kept it
    previous.write_bytes(data)
    os.utime(previous, (time.time() - 100 * 3600,) * 2)
    rdb = redis.Redis.from_url(redis_url)
    try:
        rdb.hset(redis_prefix + "router:current", mapping={"path": str(previous), "digest": file_digest(data),
                                                           "gen": 1, "digest_gen": 1})
        with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                                routing=_routing(configured, tmp_path, every_outcomes=10**6, keep_files=1)) as gw:
            assert _status(gw)["version"] == "old-good"
            assert wait_for(lambda: rdb.exists(redis_prefix + "router:configured") == 1, timeout_s=10)
            _write_router(configured, 77, "operator-1")
            assert wait_for(lambda: _status(gw)["version"] == "operator-1", timeout_s=10), _status(gw)
            current = routers / f"{file_digest(configured.read_bytes())}.skops"
            assert rdb.hget(redis_prefix + "router:current", "previous") == str(previous).encode()
            want = {current.name, previous.name, old[0]} | others
            assert wait_for(lambda: {p.name for p in routers.iterdir()} == want, timeout_s=5), sorted(
                p.name for p in routers.iterdir())
            assert not set(leftovers) & {p.name for p in routers.iterdir()}
    finally:
        rdb.close()


def _status_or_none(gw: Any) -> dict[str, Any] | None:
    try:
        return _status(gw)
    except (httpx.HTTPError, KeyError, ValueError):  # Redis down: /v1/models may answer an error
        return None


def test_redis_dying_during_a_fit_does_not_skip_it(upstream_sim: SimProcess, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis is killed while the fit runs in its child process, and comes back with its data: the gateway fits the
    same outcomes again and promotes. Marking ``router:fitted_at`` and leaving the lock before the verdict (as it
    was) made an outage mid-fit cost the fit: no refit until ``every_outcomes`` more outcomes, and the lock blocked
    every replica for ten minutes."""
    monkeypatch.delenv("REDIS_URL", raising=False)  # the suite's: it would override this test's private Redis
    server = DurableRedis(tmp_path / "redis").start()
    prefix = "tgtest:fit-outage:"
    try:
        old = _router(tmp_path / "serving.skops", informative=False)
        write_outcomes(server.url, prefix, _graded(invert_training=False), tmp_path)  # 1,460: one fit due
        before = {p.pid for p in multiprocessing.active_children()}
        with _gateway(upstream_sim.base_url, server.url, tmp_path, prefix=prefix,
                                routing=_routing(old, tmp_path, every_outcomes=1400)) as gw:
            # the fit process is spawned once the outcomes are read: the verdict will meet a dead Redis
            assert wait_for(lambda: {p.pid for p in multiprocessing.active_children()} - before, timeout_s=FIT_WAIT_S)
            server.kill()
            assert wait_for(lambda: (_status_or_none(gw) or {}).get("learning", {}).get("fitting") is False,
                            timeout_s=FIT_WAIT_S)
            assert _status(gw)["version"] == "old-noise"
            server.start()  # same port, same data (append-only file)
            assert wait_for(lambda: str((_status_or_none(gw) or {}).get("version")).startswith("auto-"),
                            timeout_s=FIT_WAIT_S)
            assert [e["event"] for e in _history(server.url, prefix, tmp_path)] == ["promote"]
        rdb = redis.Redis.from_url(server.url)
        try:
            assert rdb.get(prefix + "router:fitted_at") == b"1460" and rdb.get(prefix + "router:lock") is None
        finally:
            rdb.close()
    finally:
        server.kill()


@pytest.mark.parametrize("n_bad", [40, 120])
def test_a_promoted_router_whose_realised_floor_falls_is_rolled_back(upstream_sim: SimProcess, redis_url: str,
                                                                     redis_prefix: str, tmp_path: Path,
                                                                     n_bad: int) -> None:
    """40 graded answers: the floor check alone is due. 120 (more than ``every_outcomes``) on questions with words
    the router in service has not seen: a fit is due at the same tick, and its candidate learns those words need the
    top tier — the floor is read first, so the bad router is rolled back (the fit ran first and replaced it by a
    promotion, "holds the floor where the router in service does not": its broken floor was never recorded, and the
    audit trail said promote, not rollback)."""
    old = _router(tmp_path / "serving.skops", informative=False)
    write_outcomes(redis_url, redis_prefix, _graded(invert_training=False), tmp_path)  # 1,460: one fit, at start
    with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(old, tmp_path, realised_min=10)) as gw:
        assert wait_for(lambda: _status(gw)["version"].startswith("auto-"), timeout_s=FIT_WAIT_S), \
            _status(gw)["learning"]
        promoted = _status(gw)["version"]

        def bad_text(i: int) -> str:
            return _text(False, 9000 + i) + (" zeta omega" if n_bad > 100 else "")

        # the promoted router's own cheap answers come back graded wrong (and its top answers right)
        bad = [Outcome(source="feedback", request_id=f"p{i}", key_id="alice", tier="short" if i % 4 else "long",
                       sufficed=i % 4 == 0, judge="client", router_version=promoted,
                       window_digest=window_digest(bad_text(i)), text=bad_text(i))
               for i in range(n_bad)]
        write_outcomes(redis_url, redis_prefix, bad, tmp_path)

        def rolled_back() -> bool:  # one read (``_history`` compares three, which an event landing between fails)
            cfg = tmp_path / "poll.yaml"
            cfg.write_text(yaml.safe_dump({"redis": {"url": redis_url, "key_prefix": redis_prefix,
                                                     "start_if_missing": False}}))
            res = CliRunner().invoke(app, ["router", "history", "--json", "--config", str(cfg)])
            return res.exit_code == 0 and "rollback" in [e["event"] for e in json.loads(res.output)]

        assert wait_for(rolled_back, timeout_s=FIT_WAIT_S), _history(redis_url, redis_prefix, tmp_path)
        events = _history(redis_url, redis_prefix, tmp_path)
        assert [e["event"] for e in events][:2] == ["promote", "rollback"]
        if n_bad == 40:  # nothing else due: the previous file serves again — the bytes that served, kept under
            # their digest when the fit replaced them (routing.router_path may hold others by now)
            assert wait_for(lambda: _status(gw)["version"] == "old-noise", timeout_s=30)
            assert _status(gw)["path"] == str(tmp_path / "routers" / f"{file_digest(old.read_bytes())}.skops")
            assert len(events) == 2
        rb = events[1]
        assert rb["previous"] == promoted and rb["version"] == "old-noise"
        assert rb["realised"]["holds_floor"] is False and rb["realised"]["n_cheap"] >= 10


@pytest.mark.parametrize(("cut", "arms", "tier", "reason"), [
    (1.0, {"spot_check": 1.0}, "long", "spot_check"),  # the router sends it cheap, the spot check to the top tier
    (1.0, {"spot_check": 0.0}, "short", "predicted"),
    (0.0, {"explore": 1.0}, "short", "explore"),   # the router sends it up, exploration one tier down
    (0.0, {"explore": 1.0, "spot_check": 1.0}, "short", "explore"),  # an explored answer is never spot-checked back up
])
def test_spot_checked_and_explored_answers_say_so(upstream_sim: SimProcess, redis_url: str, redis_prefix: str,
                                             tmp_path: Path, cut: float, arms: dict[str, float], tier: str,
                                             reason: str) -> None:
    """The route reason of the spot-check arm and of exploration is on the response and on the outcome a grade of it
    records — so the realised floor can tell them apart on any replica; the drift alarm records the router's own
    choice."""
    path = _router(tmp_path / "cut.skops", informative=False)
    router = load_router(path)
    router.thresholds = [cut]  # 1.0: every routed request to the cheap tier; 0.0: every one to the top tier
    save_router(router, path)
    with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(path, tmp_path, every_outcomes=10_000, **arms)) as gw, \
            httpx.Client(timeout=30) as client:
        auth = {"authorization": f"Bearer {SECRETS['alice']}"}
        r = client.post(gw.base_url + "/chat/completions", headers=auth, json={
            "model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": "name a city"}]})
        assert r.status_code == 200, r.text
        assert (r.headers["x-thinkgate-tier"], r.headers["x-thinkgate-route-reason"]) == (tier, reason)
        # the drift alarm sees the tier the router chose, not the one exploration or a spot check served: those
        # move the served mix by design (its window is pushed every 10 s; this request is still pending)
        [entry] = list(gw.app.state.drift._pending)
        assert entry.split(",")[1] == ("0" if cut == 1.0 else "1")
        rid = r.headers["x-request-id"]
        rdb = redis.Redis.from_url(redis_url)
        try:
            assert wait_for(lambda: rdb.exists(redis_prefix + "req:" + rid) == 1, timeout_s=5)
            fb = client.post(gw.base_url + "/feedback", headers=auth, json={"request_id": rid, "correct": True})
            assert fb.status_code == 200, fb.text
            [o] = [Outcome.from_json(f[b"o"]) for _, f in rdb.xrange(redis_prefix + "outcomes")]
        finally:
            rdb.close()
        assert (o.tier, o.route_reason, o.router_version) == (tier, reason, "old-noise")
        assert _status(gw)["learning"]["spot_check"] == arms.get("spot_check", 0.05)


def _arms(version: str, cheap: tuple[int, int], top: tuple[int, int], checked: tuple[int, int],
          explored: tuple[int, int] = (0, 0)) -> list[Outcome]:
    """Feedback on ``version``'s answers: (graded, right) of its cheap answers, its top answers, its spot-check
    answers (top answers to questions it sent cheap) and explored answers (cheap answers it did not choose)."""
    out = []
    # the cheap arm last: the gateway reads the realised floor every 0.2 s while write_outcomes writes one outcome at
    # a time, and judges it once realised_min cheap answers are in — written first, they were judged with no
    # spot-check arm yet (the nesting estimate: a rollback at 40 cheap, 0 spot-checked, in a full run once the fit
    # was no longer starved). Each arm's right answers come first, so a reading of part of the cheap arm never falls
    # below the reading of all of it here
    for arm, tier, reason, (n, k) in (("t", "long", "predicted", top), ("s", "long", "spot_check", checked),
                                     ("e", "short", "explore", explored), ("c", "short", "predicted", cheap)):
        out += [Outcome(source="feedback", request_id=f"{arm}{i}", key_id="alice", tier=tier, sufficed=i < k,
                        judge="client", router_version=version, route_reason=reason,
                        window_digest=window_digest(_text(False, 20_000 + i)), text=_text(False, 20_000 + i))
                for i in range(n)]
    return out


@pytest.mark.parametrize("case", ["spot-check-broken", "spot-check-holds", "nesting-on-the-same"])
def test_the_realised_floor_reads_the_spot_check_arm(upstream_sim: SimProcess, redis_url: str, redis_prefix: str,
                                                 tmp_path: Path, case: str) -> None:
    """Broken: 39 of 40 cheap answers right, but the top tier is right on all 30 spot-checked questions — nesting
    reads 0.989 (holds), the spot-check arm 0.978 (broken) → rolled back. Holds: 32 of 40 cheap right and the top tier
    right on only 22 of 30 of the same kind of question — the spot-check arm reads 1.08 (kept), while nesting on the
    very same feedback (``spot_check_min`` above the count) reads 0.92 and rolls back. Twenty explored cheap answers
    graded wrong ride along in both: counted as the router's choice they would break the floor."""
    old = _router(tmp_path / "serving.skops", informative=False)
    write_outcomes(redis_url, redis_prefix, _graded(invert_training=False), tmp_path)
    spot_check_min = 10**6 if case == "nesting-on-the-same" else 30
    with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            # one fit, at start: the arms below (110 outcomes) judge that router, not a refit
                            routing=_routing(old, tmp_path, realised_min=10, spot_check_min=spot_check_min,
                                             every_outcomes=1400)) as gw:
        assert wait_for(lambda: _status(gw)["version"].startswith("auto-"), timeout_s=FIT_WAIT_S), \
            _status(gw)["learning"]
        promoted = _status(gw)["version"]
        arms = _arms(promoted, (40, 39), (20, 10), (30, 30)) if case == "spot-check-broken" else \
            _arms(promoted, (40, 32), (20, 10), (30, 22), explored=(20, 0))
        write_outcomes(redis_url, redis_prefix, arms, tmp_path)
        if case == "spot-check-holds":
            assert not wait_for(lambda: _status(gw)["version"] != promoted, timeout_s=4)
            real = _status(gw)["learning"]["realised"]  # the reading that kept it, in /v1/models
            assert (real["version"], real["method"], real["n_spot_check"], real["n_cheap"]) == (
                promoted, "spot_check", 30, 40)
            assert real["holds_floor"] is True and real["accuracy_ratio"] > 1.0
            # a replica that never fits (behind the same load balancer) shows the same reading
            with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                                    routing=_routing(old, tmp_path, fit_here=False)) as other:
                assert wait_for(lambda: _status(other)["learning"]["realised"] == real, timeout_s=10)
            assert "rollback" not in [e["event"] for e in _history(redis_url, redis_prefix, tmp_path)]
            return
        assert wait_for(lambda: _status(gw)["version"] == "old-noise", timeout_s=30)
        rb = _history(redis_url, redis_prefix, tmp_path)[-1]
        assert rb["event"] == "rollback" and rb["previous"] == promoted
        method = "spot_check" if case == "spot-check-broken" else "nesting"
        assert rb["realised"]["method"] == method and rb["realised"]["holds_floor"] is False
        assert rb["realised"]["n_spot_check"] == 30 and f"({method} estimate)" in rb["reason"]


KINDS = {"easy": EASY, "mid": ["explain", "compare", "summarise", "outline", "contrast", "describe"], "hard": HARD}


def _text3(kind: str, i: int) -> str:
    rng = random.Random(i)
    return f"question {i}: " + " ".join(rng.sample(KINDS[kind], 3))


def _graded3() -> list[Outcome]:
    """Three routed tiers none → short → long, feedback only: easy windows right on none and short (0 at both
    boundaries), middle ones wrong on none and right on short (1 at none|short, 0 at short|long), hard ones wrong
    on none and short (1 at both); 60 top answers, all right; and the serving router's explored arms (below)."""
    def fb(rid: str, tier: str, ok: bool, text: str) -> Outcome:
        return Outcome(source="feedback", request_id=rid, key_id="alice", tier=tier, sufficed=ok, judge="client",
                       window_digest=window_digest(text), text=text)

    out = []
    for i in range(720):  # ~140 held back: enough for each boundary's 0.99 at the bound (q ≈ 0.1, p_top 0.5)
        kind = ("easy", "mid", "hard")[i % 3]
        text = _text3(kind, i)
        if kind == "easy":
            out += [fb(f"n{i}", "none", True, text), fb(f"s{i}", "short", True, text)]
        elif kind == "mid":  # both grades: labelled at both boundaries (1 at none|short, 0 at short|long)
            out += [fb(f"n{i}", "none", False, text), fb(f"s{i}", "short", True, text)]
        else:
            out += [fb(f"n{i}", "none", False, text), fb(f"s{i}", "short", False, text)]
    out += [fb(f"t{i}", "long", True, _text3("hard", 5000 + i)) for i in range(60)]
    # the router in service's randomised arms at both boundaries (no text: they give q, not labels): half right on
    # each side, 600 graded answers in each arm — q ≈ 0.1 at the 90% bounds instead of the strict 1
    for lower, upper in (("none", "short"), ("short", "long")):
        for i in range(600):
            for tier, reason in ((lower, "explore"), (upper, "predicted")):
                out.append(Outcome(source="feedback", request_id=f"{reason}-{tier}-{upper}-{i}", key_id="alice",
                                   tier=tier, sufficed=i % 2 == 0, judge="client", route_reason=reason,
                                   router_version="old-noise"))
    return out


def test_three_routed_tiers_promote_a_router_with_one_cut_per_boundary(upstream_sim: SimProcess, redis_url: str,
                                                                       redis_prefix: str, tmp_path: Path) -> None:
    """Automatic retraining on the none/short/long ladder: the router in service (noise, cuts 0.5/0.5) sends hard
    questions to ``none`` and breaks the floor at both boundaries; the candidate — one score, two cuts, each held to
    its share of the floor — is promoted, audited, shown in ``/v1/models``, and serves hard questions on ``long``
    and easy ones below it, in order."""
    path = serving_router(tmp_path / "serving.skops", False, lambda hard, i: _text3("hard" if hard else "easy", i))
    old = load_router(path)
    old.thresholds = [0.5, 0.5]
    save_router(old, path)
    write_outcomes(redis_url, redis_prefix, _graded3(), tmp_path)  # 3,600 outcomes: one fit, at start
    routing = {**_routing(path, tmp_path, spot_check=0.0, fit_in="thread"), "routed_tiers": ["none", "short", "long"]}
    with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, routing=routing) as gw:
        assert wait_for(lambda: (_status(gw)["learning"] or {}).get("last_event") is not None, timeout_s=FIT_WAIT_S)
        st = _status(gw)
        event = st["learning"]["last_event"]
        assert event["event"] == "promote", event
        cmp = event["comparison"]
        assert [b["tiers"] for b in cmp["new"]["boundaries"]] == [["none", "short"], ["short", "long"]]
        assert all(b["holds_floor"] and b["floor"] == 0.99 for b in cmp["new"]["boundaries"])  # 1 - 0.02 / 2
        assert cmp["old"]["holds_floor"] is False and cmp["new"]["holds_floor"] is True
        assert [b["tiers"] for b in cmp["rates"]["boundaries"]] == [["none", "short"], ["short", "long"]]
        assert st["version"] == event["version"] and st["version"].startswith("auto-")
        promoted = load_router(Path(event["path"]))
        assert len(promoted.thresholds) == 2 and promoted.thresholds[0] <= promoted.thresholds[1]
        assert st["thresholds"] == promoted.thresholds
        # q from each boundary's explored arm of the router in service
        arms = [(b["source"], b["n_cheap"], b["n_top"]) for b in cmp["rates"]["boundaries"]]
        assert arms == [("explore", 600, 600)] * 2
        assert all(b["q"] < 0.15 for b in cmp["rates"]["boundaries"])
        assert cmp["rates"]["source"] == "explore"  # the boundaries' common source ("mixed" when they differ)
        served = {}
        with httpx.Client(timeout=30) as client:
            for kind in ("easy", "mid", "hard"):
                r = client.post(gw.base_url + "/chat/completions",
                                headers={"authorization": f"Bearer {SECRETS['alice']}"},
                                json={"model": "auto", "max_tokens": 8,
                                      "messages": [{"role": "user", "content": _text3(kind, 901)}]})
                assert r.headers["x-thinkgate-route-reason"] == "predicted"
                served[kind] = ["none", "short", "long"].index(r.headers["x-thinkgate-tier"])
        assert served["hard"] == 2 and served["easy"] < 2 and served["easy"] <= served["mid"] <= served["hard"]
        [h] = _history(redis_url, redis_prefix, tmp_path)
        assert (h["event"], h["version"]) == ("promote", event["version"])


def test_retraining_goes_on_once_the_outcome_stream_is_at_its_cap(upstream_sim: SimProcess, redis_url: str,
                                                                  redis_prefix: str, tmp_path: Path) -> None:
    """``routing.outcomes.stream_maxlen`` trims the stream at every write once it is full, so its length stays at the
    cap: counted by ``XLEN``, the outcomes written after that never made a fit (nor a realised-floor check) due again,
    and the loop stopped learning — and stopped rolling back — for good, saying nothing. Counted as written
    (``entries-added``), 100 more outcomes past the cap make the next fit due."""
    cap = OutcomesConfig(stream_maxlen=1000)

    def graded(n: int, start: int) -> list[Outcome]:  # no text: nothing to learn, so each fit is quick (a keep)
        return [Outcome(source="feedback", request_id=f"c{start + i}", key_id="alice", tier="short",
                        sufficed=i % 2 == 0, judge="client") for i in range(n)]

    old = _router(tmp_path / "serving.skops", informative=False)
    write_outcomes(redis_url, redis_prefix, graded(1000, 0), tmp_path, cap)  # the stream is full: one fit due
    routing = {**_routing(old, tmp_path, fit_in="thread", spot_check=0.0), "outcomes": {"stream_maxlen": 1000}}
    with _gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, routing=routing) as gw:
        def judged_at() -> int:
            return int(((_status(gw)["learning"] or {}).get("last_event") or {}).get("outcomes") or 0)

        assert wait_for(lambda: judged_at() == 1000, timeout_s=FIT_WAIT_S), _status(gw)["learning"]
        write_outcomes(redis_url, redis_prefix, graded(100, 1000), tmp_path, cap)
        rdb = redis.Redis.from_url(redis_url)
        try:
            assert rdb.xlen(redis_prefix + "outcomes") < 1100  # trimmed: the length alone says nothing is new
        finally:
            rdb.close()
        assert wait_for(lambda: judged_at() == 1100, timeout_s=30), _status(gw)["learning"]
    assert [e["outcomes"] for e in _history(redis_url, redis_prefix, tmp_path)] == [1000, 1100]
