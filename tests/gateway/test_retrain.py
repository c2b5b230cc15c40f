"""``thinkgate router retrain --from-outcomes`` on outcomes in the real Redis: a better router is written (and
carries its version), a worse one is refused with exit code 1 and no file."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from gateway.cli.main import app
from gateway.ledger.outcome import Outcome, window_digest
from router.fit.retrain import is_heldout_digest, items_from_outcomes, label_of
from router.persistence import load_router, save_router
from tests.fixtures.gateway import SECRETS, accounting_gateway
from tests.fixtures.outcomes import serving_router, write_outcomes
from tests.fixtures.upstream import SimProcess, wait_for

HARD = ["prove", "integral", "theorem", "derive", "lemma", "asymptotic"]
EASY = ["capital", "color", "name", "city", "animal", "fruit"]


def _text(hard: bool, i: int) -> str:
    rng = random.Random(i)
    words = rng.sample(HARD if hard else EASY, 3)
    return f"question {i}: " + " ".join(words) + " " + " ".join(rng.sample(["a", "b", "c", "d", "e"], 2))


def _router(path: Path, informative: bool) -> Path:
    return serving_router(path, informative, _text)


def _outcomes(invert_training: bool) -> list[Outcome]:
    out = []
    for i in range(240):
        hard = i % 2 == 0
        text = _text(hard, i)
        d = window_digest(text)
        needs_top = hard if (is_heldout_digest(d, 0.2) or not invert_training) else not hard
        out.append(Outcome(source="shadow", request_id=f"r{i}", key_id="alice", tier="short", sufficed=not needs_top,
                           judge="agreement", window_digest=d, text=text, other_tier="long"))
    return out


def _config(tmp: Path, redis_url: str, prefix: str, router: Path) -> Path:
    # the retraining's state dir: where the command keeps the copy of a file it adopts (the replicas' own, below)
    cfg = {"redis": {"url": redis_url, "key_prefix": prefix, "start_if_missing": False},
           "routing": {"router_path": str(router), "routed_tiers": ["short", "long"],
                       "retrain": {"state_dir": str(tmp / "routers")}}}
    path = tmp / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_labels_from_outcomes() -> None:
    assert label_of({"tier": "short", "sufficed": True}, "long") == 0
    assert label_of({"tier": "short", "sufficed": False}, "long") == 1
    # a top-tier answer graded wrong says nothing about the cheap tier (issue 24: it used to read as "easy")
    assert label_of({"tier": "long", "sufficed": False}, "long") is None
    assert label_of({"tier": "long", "sufficed": True}, "long") is None
    rows = [{"tier": "short", "sufficed": False, "text": "q", "window_digest": "d", "source": "shadow"},
            {"tier": "short", "sufficed": True, "text": "q", "window_digest": "d", "source": "feedback"},
            {"tier": "short", "sufficed": True, "window_digest": "e", "source": "feedback"}]  # no text: unusable
    [item] = items_from_outcomes(rows, "long")
    assert (item.label, item.group, item.meta["n"]) == (1, "d", 2)  # a tie counts as needing the top tier


@pytest.mark.parametrize("case", ["better", "worse"])
def test_retrain_writes_a_better_router_and_refuses_a_worse_one(redis_url: str, redis_prefix: str, tmp_path: Path,
                                                                case: str) -> None:
    # better: the router in service is noise, the outcomes teach the real rule;
    # worse: the router in service knows the rule, the fitted part of the outcomes teaches its opposite
    old = _router(tmp_path / "old.skops", informative=case == "worse")
    write_outcomes(redis_url, redis_prefix, _outcomes(invert_training=case == "worse"), tmp_path)
    out = tmp_path / "new.skops"
    res = CliRunner().invoke(app, ["router", "retrain", "--from-outcomes", "--output", str(out),
                                   "--config", str(_config(tmp_path, redis_url, redis_prefix, old))])
    if case == "better":
        assert res.exit_code == 0, res.output
        new = load_router(out)
        assert new.metadata["version"].startswith("retrain-") and new.metadata["retrained_from"] == "old-noise"
        r = new.metadata["retrain"]
        assert r["new"]["auc"] > r["old"]["auc"] + 0.2 and r["n_heldout"] >= 10
        assert sum(new.metadata["score_histogram"]["counts"]) == r["n_fit"]
    else:
        assert res.exit_code == 1, res.output
        assert "refused" in res.output and "AUC" in res.output
        assert not out.exists()


def test_retrain_into_router_path_takes_over_from_a_promoted_router(redis_url: str, redis_prefix: str,
                                                                    tmp_path: Path) -> None:
    """With a router promoted by automatic retraining (``p router:current``), the replicas serve that file, not
    ``routing.router_path``: the command compares with the promoted one, and a file it writes to
    ``routing.router_path`` becomes the promoted router (audited) — it was written and silently never served."""
    import orjson
    import redis

    from gateway.control.retrain_trigger import file_digest

    configured = _router(tmp_path / "configured.skops", informative=False)
    promoted = _router(tmp_path / "promoted.skops", informative=False)
    r = redis.Redis.from_url(redis_url)
    r.hset(redis_prefix + "router:current", mapping={"path": str(promoted), "version": "auto-1",
                                                     "previous": str(configured)})
    write_outcomes(redis_url, redis_prefix, _outcomes(invert_training=False), tmp_path)
    res = CliRunner().invoke(app, ["router", "retrain", "--from-outcomes", "--output", str(configured),
                                   "--config", str(_config(tmp_path, redis_url, redis_prefix, configured))])
    assert res.exit_code == 0, res.output
    assert f"in service: {promoted}" in res.output
    cur = {k.decode(): v.decode() for k, v in r.hgetall(redis_prefix + "router:current").items()}
    version = load_router(configured).metadata["version"]
    # the bytes written, kept under their digest: a later write to routing.router_path does not change what serves
    digest = file_digest(configured.read_bytes())
    assert cur["path"] == str(tmp_path / "routers" / f"{digest}.skops") and cur["digest"] == digest
    assert Path(cur["path"]).read_bytes() == configured.read_bytes() and cur["version"] == version
    assert (cur["previous"], cur["previous_version"]) == (str(promoted), "auto-1")
    [(_, fields)] = r.xrevrange(redis_prefix + "router:history", count=1)
    event = orjson.loads(fields[b"e"])
    assert event["event"] == "promote" and event["version"] == version and event["reason"].startswith("operator")
    r.close()


def test_hot_reload_shows_the_retrained_version(upstream_sim: SimProcess, redis_url: str, redis_prefix: str,
                                                tmp_path: Path) -> None:
    path = _router(tmp_path / "serving.skops", informative=False)
    routing = {"router_path": str(path), "routed_tiers": ["short", "long"], "reload_interval_s": 0.1}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, routing=routing) as gw:
        def version() -> str:
            r = httpx.get(gw.base_url + "/models", headers={"authorization": f"Bearer {SECRETS['alice']}"})
            return str(r.json()["data"][0]["thinkgate"]["router_status"]["version"])
        assert version() == "old-noise"
        new = load_router(path)
        new.metadata["version"] = "retrain-test"
        save_router(new, path)  # what `router retrain --output <routing.router_path>` does
        assert wait_for(lambda: version() == "retrain-test", timeout_s=10)


def test_retrain_with_three_routed_tiers_writes_one_cut_per_boundary(redis_url: str, redis_prefix: str,
                                                                     tmp_path: Path) -> None:
    """With routed tiers none/short/long the written file carries two ascending cuts — the lower one at the share the
    router in service sends past it, the upper one at its top share — so a gateway on that ladder loads it (a file
    with one cut is refused there)."""
    from gateway.config import Settings
    from router.serving import RouterService

    old = load_router(_router(tmp_path / "old.skops", informative=False))
    old.thresholds = [0.3, 0.7]
    save_router(old, tmp_path / "old.skops")
    write_outcomes(redis_url, redis_prefix, _outcomes(invert_training=False), tmp_path)
    cfg = {"redis": {"url": redis_url, "key_prefix": redis_prefix, "start_if_missing": False},
           "routing": {"router_path": str(tmp_path / "old.skops"), "routed_tiers": ["none", "short", "long"],
                       "on_router_error": "refuse_start"}}
    (tmp_path / "gw.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "new.skops"
    res = CliRunner().invoke(app, ["router", "retrain", "--from-outcomes", "--output", str(out),
                                   "--config", str(tmp_path / "gw.yaml")])
    assert res.exit_code == 0, res.output
    assert "thresholds " in res.output
    new = load_router(out)
    assert len(new.thresholds) == 2 and new.thresholds[0] <= new.thresholds[1]
    above = new.metadata["retrain"]["shares_above"]
    assert len(above) == 2 and above[0] >= above[1] and new.metadata["retrain"]["long_share"] == above[1]
    routing = Settings.load(tmp_path / "gw.yaml", routing={**cfg["routing"], "router_path": str(out)}).routing
    svc = RouterService.from_config(routing)  # refuse_start: raises unless the file fits the three tiers
    assert svc.available and svc.thresholds == new.thresholds


def test_a_file_written_by_retrain_gets_one_promote_event_with_replicas_watching(
        upstream_sim: SimProcess, redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """``router retrain --output routing.router_path`` points ``router:current`` at the file it wrote, and a replica
    watching that path adopts a new file there: both wrote a promote event for the one file (and the replica's
    adoption kept the file itself as its own ``previous``). One file, one promote event — whoever is first; the
    other says so and writes nothing. Both orders: the command while a replica runs, then a replica first."""
    import orjson
    import redis

    from gateway.cli.common import load_settings
    from gateway.cli.retrain import adopt
    from gateway.control.retrain_trigger import file_digest

    configured = _router(tmp_path / "configured.skops", informative=False)
    promoted = _router(tmp_path / "promoted.skops", informative=False)
    r = redis.Redis.from_url(redis_url)
    r.hset(redis_prefix + "router:current", mapping={"path": str(promoted), "version": "auto-1",
                                                     "previous": str(configured)})
    write_outcomes(redis_url, redis_prefix, _outcomes(invert_training=False), tmp_path)
    config = _config(tmp_path, redis_url, redis_prefix, configured)
    routing = {"router_path": str(configured), "routed_tiers": ["short", "long"], "reload_interval_s": 0.1,
               "retrain": {"every_outcomes": 10**6, "state_dir": str(tmp_path / "routers"), "interval_s": 0.05}}

    def promotes() -> list[tuple[str, str | None]]:
        events = [orjson.loads(f[b"e"]) for _, f in r.xrange(redis_prefix + "router:history")]
        return [(e["version"], e["previous"]) for e in events if e["event"] == "promote"]

    def current() -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in r.hgetall(redis_prefix + "router:current").items()}

    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                                routing=routing) as gw:
            # the replica's first look: the configured file is the deployment's baseline, nothing to adopt
            assert wait_for(lambda: r.exists(redis_prefix + "router:configured") == 1, timeout_s=10)
            res = CliRunner().invoke(app, ["router", "retrain", "--from-outcomes", "--output", str(configured),
                                           "--config", str(config)])
            assert res.exit_code == 0, res.output
            version = load_router(configured).metadata["version"]
            kept = tmp_path / "routers" / f"{file_digest(configured.read_bytes())}.skops"
            assert wait_for(lambda: gw.app.state.retrain.service.path == kept, timeout_s=10)
            time.sleep(1.0)  # twenty more ticks: a second adoption would be written by now
            assert promotes() == [(version, "auto-1")], res.output
            assert current()["previous"] == str(promoted)  # not the file itself (the second adoption's previous)

            # a replica first: it adopts the file an operator wrote; the command's step for the same file is a no-op
            again = load_router(configured)
            again.metadata["version"] = "operator-2"
            save_router(again, tmp_path / "next.tmp")
            (tmp_path / "next.tmp").replace(configured)
            assert wait_for(lambda: current()["version"] == "operator-2", timeout_s=10)
            assert r.get(redis_prefix + "router:configured").decode() == file_digest(configured.read_bytes())
            assert adopt(load_settings(config), configured.resolve(), "operator-2", 0) is None
            assert promotes() == [(version, "auto-1"), ("operator-2", version)]
    finally:
        r.close()


def test_a_file_written_back_is_adopted_again_after_the_readopt_window(
        upstream_sim: SimProcess, redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """The adopted mark of a file lasted a day, so an operator putting an earlier router back by writing its file
    to ``routing.router_path`` (as docs/closed-loop.md says to) was ignored for up to a day, silently. Within
    ``routing.retrain.readopt_after_s`` a replaced file is still not adopted back (a lagging replica's copy must
    not flip the fleet); after it, it is."""
    import orjson
    import redis

    configured = _router(tmp_path / "configured.skops", informative=False)
    promoted = _router(tmp_path / "promoted.skops", informative=False)
    r = redis.Redis.from_url(redis_url)
    r.hset(redis_prefix + "router:current", mapping={"path": str(promoted), "version": "auto-1",
                                                     "previous": str(configured)})
    write_outcomes(redis_url, redis_prefix, _outcomes(invert_training=False), tmp_path)
    window_s = 3
    routing = {"router_path": str(configured), "routed_tiers": ["short", "long"], "reload_interval_s": 0.1,
               "retrain": {"every_outcomes": 10**6, "state_dir": str(tmp_path / "routers"), "interval_s": 0.05,
                           "readopt_after_s": window_s}}

    saved = {}
    for version in ("operator-a", "operator-b"):
        f = load_router(configured)
        f.metadata["version"] = version
        save_router(f, tmp_path / f"{version}.skops")
        saved[version] = (tmp_path / f"{version}.skops").read_bytes()  # the same bytes each time it is written

    def write(version: str) -> None:
        (tmp_path / "next.tmp").write_bytes(saved[version])
        (tmp_path / "next.tmp").replace(configured)  # a new inode: the replica reads the path again

    def current() -> str:
        return r.hget(redis_prefix + "router:current", "version").decode()

    def promotes() -> list[str]:
        events = [orjson.loads(f[b"e"]) for _, f in r.xrange(redis_prefix + "router:history")]
        return [e["version"] for e in events if e["event"] == "promote"]

    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, routing=routing):
            assert wait_for(lambda: r.exists(redis_prefix + "router:configured") == 1, timeout_s=10)
            write("operator-a")
            assert wait_for(lambda: current() == "operator-a", timeout_s=10)
            adopted_a = time.monotonic()
            write("operator-b")
            assert wait_for(lambda: current() == "operator-b", timeout_s=10)
            write("operator-a")  # within the window: taken for a lagging copy, not adopted
            time.sleep(0.5)  # ten ticks
            assert current() == "operator-b" and promotes() == ["operator-a", "operator-b"]
            time.sleep(max(0.0, window_s + 0.5 - (time.monotonic() - adopted_a)))
            write("operator-a")  # the same bytes again, after the window: put back
            assert wait_for(lambda: current() == "operator-a", timeout_s=10)
            assert promotes() == ["operator-a", "operator-b", "operator-a"]
    finally:
        r.close()


def test_retrain_into_router_path_prunes_old_copies_like_a_replica(redis_url: str, redis_prefix: str,
                                                                   tmp_path: Path) -> None:
    """The command keeps a copy of the file it adopts in the retraining's state dir, as a replica does, but never
    removed one: a nightly retrain grew the directory by a router a night. Now it prunes with the replicas' helper —
    the newest ``routing.retrain.keep_files`` others stay, what ``router:current`` names stays, and so does every
    file ThinkGate did not write."""
    import os

    import redis

    from gateway.control.retrain_trigger import file_digest

    configured = _router(tmp_path / "configured.skops", informative=False)
    promoted = _router(tmp_path / "promoted.skops", informative=False)
    state = tmp_path / "routers"
    state.mkdir()
    old = [state / f"{i:032x}.skops" for i in range(1, 6)]  # earlier adoptions' copies, an hour apart
    for i, path in enumerate(old):
        path.write_bytes(b"an old router")
        t = time.time() - (10 - i) * 3600
        os.utime(path, (t, t))
    mine = state / "notes.txt"  # an operator's own file: never touched
    mine.write_text("hands off")
    os.utime(mine, (time.time() - 86400, time.time() - 86400))
    r = redis.Redis.from_url(redis_url)
    r.hset(redis_prefix + "router:current", mapping={"path": str(promoted), "version": "auto-1",
                                                     "previous": str(configured)})
    write_outcomes(redis_url, redis_prefix, _outcomes(invert_training=False), tmp_path)
    config = _config(tmp_path, redis_url, redis_prefix, configured)
    cfg = yaml.safe_load(config.read_text())
    cfg["routing"]["retrain"]["keep_files"] = 2
    config.write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(app, ["router", "retrain", "--from-outcomes", "--output", str(configured),
                                   "--config", str(config)])
    assert res.exit_code == 0, res.output
    kept = state / f"{file_digest(configured.read_bytes())}.skops"
    assert r.hget(redis_prefix + "router:current", "path").decode() == str(kept)
    assert sorted(p.name for p in state.iterdir()) == sorted([kept.name, old[3].name, old[4].name, mine.name])
    assert "removed 3 router file(s) no longer in use (routing.retrain.keep_files = 2)" in res.output
    r.close()
