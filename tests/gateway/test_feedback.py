"""``POST /v1/feedback`` and the outcome stream on a real gateway and the real Redis: only the key that made a
request may grade it, the outcome carries the request's routing, escalations are outcomes, and outcomes
written while Redis is down are spooled and replayed once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from gateway.config import OutcomesConfig, RedisConfig
from gateway.control.outcomes import OutcomeStore
from gateway.ledger.outcome import Outcome, window_digest
from gateway.state.breaker import Breaker
from gateway.state.redis import connect
from tests.fixtures.gateway import SECRETS, accounting_gateway
from tests.fixtures.redis_db import read_outcomes
from tests.fixtures.upstream import SimProcess, sim_tiers, wait_for


def _auth(who: str) -> dict[str, str]:
    return {"authorization": f"Bearer {SECRETS[who]}"}


def test_feedback_only_from_the_key_that_made_the_request(upstream_sim: SimProcess, redis_url: str,
                                                          redis_prefix: str, tmp_path: Path) -> None:
    prefix = redis_prefix
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=prefix) as gw, \
            httpx.Client(timeout=30) as client:
        question = "what is the capital of france?"
        r = client.post(gw.base_url + "/chat/completions", headers=_auth("alice"), json={
            "model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": question}]})
        assert r.status_code == 200
        rid, tier = r.headers["x-request-id"], r.headers["x-thinkgate-tier"]
        rdb = redis.Redis.from_url(redis_url)
        assert wait_for(lambda: rdb.exists(prefix + "req:" + rid) == 1, timeout_s=5)  # indexed in the background
        ttl = gw.settings.routing.outcomes.request_ttl_s  # feedback is accepted for that long, then forgotten
        assert ttl - 10 <= rdb.ttl(prefix + "req:" + rid) <= ttl
        rdb.close()

        def fb(who: str, body: dict[str, object]) -> httpx.Response:
            return client.post(gw.base_url + "/feedback", headers=_auth(who), json=body)

        other = fb("bob", {"request_id": rid, "correct": True})
        assert other.status_code == 404 and other.json()["error"]["code"] == "request_not_found"
        # the 404 says what to do when the request was answered a moment ago by another replica (not indexed yet)
        assert "retry after a second" in other.json()["error"]["message"]
        assert fb("alice", {"request_id": "nope", "correct": True}).status_code == 404
        for bad in ({"request_id": rid}, {"request_id": rid, "correct": True, "score": 1},
                    {"request_id": rid, "score": 1.5}, {"request_id": rid, "correct": "yes"},
                    {"request_id": rid, "score": 0.5, "comment": 3}, {"request_id": rid, "correct": True, "x": 1}):
            bad_r = fb("alice", bad)
            assert bad_r.status_code == 400 and bad_r.json()["error"]["type"] == "invalid_request_error", bad
        assert client.post(gw.base_url + "/feedback", json={"request_id": rid, "correct": True}).status_code == 401
        # a body over the limit is refused before it is read whole (413, as every endpoint; it read 400 MB first)
        big = client.post(gw.base_url + "/feedback", headers=_auth("alice"), content=b"x" * 20_000)
        assert big.status_code == 413, big.text
        assert read_outcomes(redis_url, prefix) == []  # nothing recorded by the refused ones

        ok = fb("alice", {"request_id": rid, "correct": False, "comment": "wrong city"})
        assert ok.status_code == 200, ok.text
        assert ok.json() | {"id": None} == {"id": None, "object": "feedback", "request_id": rid, "sufficed": False,
                                            "stored": "redis"}
        again = fb("alice", {"request_id": rid, "score": 0.9})
        assert again.status_code == 200 and again.json()["stored"] == "duplicate"
        assert again.json()["sufficed"] is False  # the first grade stands, and the answer says so (it echoed True)
        [o] = read_outcomes(redis_url, prefix)
        assert (o.source, o.request_id, o.key_id, o.tier, o.sufficed, o.judge, o.comment, o.value) == (
            "feedback", rid, "alice", tier, False, "client", "wrong city", 0.0)
        assert o.route_reason == "predicted" and o.score is not None
        assert o.window_digest == window_digest(question) and o.text is None  # text only under retain_text


def test_feedback_keys_limits_who_trains_the_shared_router(upstream_sim: SimProcess, redis_url: str,
                                                           redis_prefix: str, tmp_path: Path) -> None:
    """Every key's grades train the one router all keys are served by (and decide its rollback).
    ``routing.outcomes.feedback_keys`` lists the keys trusted with that: another key's feedback on its own answer is
    a 403 ``permission_error`` and records nothing — before, any key could steer every tenant's routing."""
    routing = {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5], "default_tier": "long",
               "outcomes": {"feedback_keys": ["alice"]}}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, routing=routing) as gw, \
            httpx.Client(timeout=30) as client:
        graded = {}
        for who in ("alice", "bob"):
            r = client.post(gw.base_url + "/chat/completions", headers=_auth(who), json={
                "model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": f"{who}'s question"}]})
            assert r.status_code == 200
            graded[who] = client.post(gw.base_url + "/feedback", headers=_auth(who),
                                      json={"request_id": r.headers["x-request-id"], "correct": True})
        assert graded["alice"].status_code == 200, graded["alice"].text
        refused = graded["bob"]
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["type"] == "permission_error"
        assert "routing.outcomes.feedback_keys" in refused.json()["error"]["message"]
        assert [o.key_id for o in read_outcomes(redis_url, redis_prefix)] == ["alice"]


def test_escalations_areread_outcomes(upstream_sim: SimProcess, redis_url: str, redis_prefix: str,
                                  tmp_path: Path) -> None:
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"thinking_budget": 100, "max_tokens": 4, "escalate_on": ["length_in_thought"]})
    prefix = redis_prefix
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=prefix, tiers=tiers,
                            routing={"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.9],
                                     "outcomes": {"retain_text": True}}) as gw:
        r = httpx.post(gw.base_url + "/chat/completions", headers=_auth("bob"), timeout=30, json={
            "model": "auto", "messages": [{"role": "user", "content": "a b c"}]})
        assert r.status_code == 200 and r.headers["x-thinkgate-route-reason"] == "escalated"
        assert wait_for(lambda: len(read_outcomes(redis_url, prefix)) == 1, timeout_s=5)
        [o] = read_outcomes(redis_url, prefix)
        assert (o.source, o.key_id, o.tier, o.sufficed, o.judge) == (
            "escalation", "bob", "short", False, "escalation:length_in_thought")
        assert o.text == "a b c" and o.window_digest == window_digest("a b c")
        # graded, the escalated answer says which attempt escalated: the router's decision here, the client's
        # when it named the tier — only the first is the router's answer for its realised floor
        forced = httpx.post(gw.base_url + "/chat/completions", headers=_auth("bob"), timeout=30, json={
            "model": "short", "messages": [{"role": "user", "content": "a b c d"}]})
        assert forced.status_code == 200 and forced.headers["x-thinkgate-route-reason"] == "escalated"
        for resp in (r, forced):
            fb = httpx.post(gw.base_url + "/feedback", headers=_auth("bob"), timeout=30,
                            json={"request_id": resp.headers["x-request-id"], "correct": False})
            assert fb.status_code == 200, fb.text
        graded = {o.request_id: o for o in read_outcomes(redis_url, prefix) if o.source == "feedback"}
        mine, theirs = graded[r.headers["x-request-id"]], graded[forced.headers["x-request-id"]]
        assert (mine.route_reason, mine.escalated_from, mine.tier) == ("escalated", "predicted", "long")
        assert (theirs.route_reason, theirs.escalated_from) == ("escalated", "forced")


def test_outcomes_survive_a_redis_outage(redis_url: str, redis_prefix: str, tmp_path: Path,
        port_lease: Callable[[], int]) -> None:
    spool = tmp_path / "outcomes.jsonl"
    cfg = OutcomesConfig()

    async def go() -> None:
        dead = connect(RedisConfig(url=f"redis://127.0.0.1:{port_lease()}/0", key_prefix=redis_prefix,
                                   socket_timeout_s=0.2))
        down = OutcomeStore(cfg, dead, Breaker(5.0), spool)
        outcome = Outcome(source="shadow", request_id="r1", key_id="alice", tier="short", sufficed=True,
                          judge="agreement")
        assert await down.record(outcome) == "spool"
        assert [o.outcome_id for o in down.spool.read_all()] == [outcome.outcome_id]
        await dead.close()
        up = OutcomeStore(cfg, connect(RedisConfig(url=redis_url, key_prefix=redis_prefix)), Breaker(5.0), spool)
        assert await up.replay() == 1
        assert spool.stat().st_size == 0
        await up.spool.append([outcome])  # a crash after the write, before the truncate: replayed again
        assert await up.replay() == 1
        got = await up.outcomes()
        assert [orjson.loads(o.to_json()) for o in got] == [orjson.loads(outcome.to_json())]  # written once
        await up.redis.aclose()
    asyncio.run(go())


def test_feedback_right_after_the_answer(upstream_sim: SimProcess, redis_url: str, redis_prefix: str,
                                         tmp_path: Path) -> None:
    """A client grading the answer it has just received (before the request index's background write) gets
    200, not 404: the answering replica reads its own queue."""
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix) as gw, \
            httpx.Client(timeout=30) as client:
        for i in range(5):
            r = client.post(gw.base_url + "/chat/completions", headers=_auth("alice"), json={
                "model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": f"question {i}?"}]})
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            other = client.post(gw.base_url + "/feedback", headers=_auth("bob"), json={"request_id": rid,
                                                                                       "correct": True})
            assert other.status_code == 404  # the queued entry is still another key's request
            ok = client.post(gw.base_url + "/feedback", headers=_auth("alice"), json={"request_id": rid,
                                                                                      "correct": True})
            assert ok.status_code == 200, ok.text
            assert ok.json()["stored"] == "redis"
        assert len(read_outcomes(redis_url, redis_prefix)) == 5


def test_late_feedback_is_credited_to_the_router_that_served(upstream_sim: SimProcess, redis_url: str,
                                                             redis_prefix: str, tmp_path: Path) -> None:
    """A grade sent after a promotion belongs to the router that answered the request, not to the one serving when
    the grade arrives (the realised floor — and so a rollback — read the previous router's answers as the new
    one's). The version is taken when the request is indexed."""
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix) as gw, \
            httpx.Client(timeout=30) as client:
        store = gw.app.state.outcomes
        serving = {"version": "router-a"}
        store.router_version = lambda: serving["version"]  # what a promotion changes: the version in service
        r = client.post(gw.base_url + "/chat/completions", headers=_auth("alice"), json={
            "model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": "late grade?"}]})
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        rdb = redis.Redis.from_url(redis_url)
        assert wait_for(lambda: rdb.exists(redis_prefix + "req:" + rid) == 1, timeout_s=5)
        rdb.close()
        serving["version"] = "router-b"  # promoted after the answer, before the grade
        ok = client.post(gw.base_url + "/feedback", headers=_auth("alice"), json={"request_id": rid,
                                                                                  "correct": False})
        assert ok.status_code == 200, ok.text
        [o] = read_outcomes(redis_url, redis_prefix)
        assert o.router_version == "router-a"


# The write script before grades were kept beside the seen-set (commit 96eb0d2): a feedback outcome written by it —
# by a gateway before that change, or by a replica not yet upgraded during a rollout — is in the day's seen-set and
# the stream, and in no grades hash.
PRE_GRADES_RECORD_LUA = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'o', ARGV[2])
return 1
"""


@pytest.mark.parametrize(("first", "want"), [({"correct": True}, True), ({"score": 0.3}, False)])
def test_a_duplicate_of_a_grade_written_before_grades_were_kept_says_that_grade(
        upstream_sim: SimProcess, redis_url: str, redis_prefix: str, tmp_path: Path, first: dict[str, Any],
        want: bool) -> None:
    """The first grade written in the old shape (seen-set and stream, no grades hash); a second grade on the same
    request answers ``stored: "duplicate"`` with the first's ``sufficed``, read from the stream — it answered
    ``sufficed: null``, though the grade that stands was there all along."""
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix) as gw, \
            httpx.Client(timeout=30) as client:
        r = client.post(gw.base_url + "/chat/completions", headers=_auth("alice"), json={
            "model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": "graded long ago?"}]})
        assert r.status_code == 200
        rid, tier = r.headers["x-request-id"], r.headers["x-thinkgate-tier"]
        # what the gateway of that time wrote for the first grade (the same feedback rule, the same outcome id)
        value = first["score"] if "score" in first else float(first["correct"])
        old = Outcome(source="feedback", request_id=rid, key_id="alice", tier=tier, sufficed=value >= 0.5,
                      judge="client", outcome_id=f"fb:{rid}", value=value)
        rdb = redis.Redis.from_url(redis_url)
        try:
            # a few other outcomes of the day after it: the grade is found among them
            others = [Outcome(source="shadow", request_id=f"s{i}", key_id="alice", tier="short", sufficed=True,
                              judge="agreement") for i in range(3)]
            script = rdb.register_script(PRE_GRADES_RECORD_LUA)
            for o in (old, *others):
                assert script(keys=[redis_prefix + f"outcomes:seen:{o.day}", redis_prefix + "outcomes"],
                              args=[o.outcome_id, o.to_json(), 40 * 86400, 1_000_000]) == 1
            assert wait_for(lambda: rdb.exists(redis_prefix + "req:" + rid) == 1, timeout_s=5)
            for second in ({"correct": not want}, {"score": 0.0 if want else 1.0}):  # read, then as kept
                again = client.post(gw.base_url + "/feedback", headers=_auth("alice"),
                                    json={"request_id": rid, **second})
                assert again.status_code == 200, again.text
                assert (again.json()["stored"], again.json()["sufficed"]) == ("duplicate", want)
            assert rdb.hget(redis_prefix + f"outcomes:grades:{old.day}", old.outcome_id) == (b"1" if want else b"0")
        finally:
            rdb.close()
        assert [(o.outcome_id, o.sufficed) for o in read_outcomes(redis_url, redis_prefix)
                if o.source == "feedback"] == [(old.outcome_id, want)]  # the first stands, nothing added


def test_a_second_grade_after_midnight_is_a_duplicate(upstream_sim: SimProcess, redis_url: str, redis_prefix: str,
                                                       tmp_path: Path) -> None:
    """A request answered yesterday evening, graded before midnight, graded again after it (within the feedback
    window): the second grade went to the seen-set of *its* day, missed the first and was stored as a second
    outcome — two labels for one answer in the next retrain. Grades are deduplicated in the answered request's
    day."""
    import time

    from gateway.control.outcomes import RECORD_LUA

    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix) as gw, \
            httpx.Client(timeout=30) as client:
        r = client.post(gw.base_url + "/chat/completions", headers=_auth("alice"), json={
            "model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": "graded twice?"}]})
        assert r.status_code == 200
        rid, tier = r.headers["x-request-id"], r.headers["x-thinkgate-tier"]
        rdb = redis.Redis.from_url(redis_url)
        try:
            index = redis_prefix + "req:" + rid
            assert wait_for(lambda: rdb.exists(index) == 1, timeout_s=5)
            # answered yesterday (the entry the gateway indexed then) ...
            entry = orjson.loads(rdb.get(index))
            assert abs(entry["ts"] - time.time()) < 60  # the index keeps when the request was answered
            yesterday = time.time() - 86400
            entry["ts"] = yesterday
            rdb.set(index, orjson.dumps(entry), keepttl=True)
            # ... and graded then, before midnight, by the gateway's write script (seen-set, stream, grades hash)
            first = Outcome(source="feedback", request_id=rid, key_id="alice", tier=tier, sufficed=True,
                            judge="client", outcome_id=f"fb:{rid}", value=1.0, ts=yesterday, request_ts=yesterday)
            day = first.day
            assert rdb.register_script(RECORD_LUA)(
                keys=[redis_prefix + f"outcomes:seen:{day}", redis_prefix + "outcomes",
                      redis_prefix + f"outcomes:grades:{day}"],
                args=[first.outcome_id, first.to_json(), 40 * 86400, 1_000_000, "1"]) == 1
            again = client.post(gw.base_url + "/feedback", headers=_auth("alice"),
                                json={"request_id": rid, "correct": False})  # today
            assert again.status_code == 200, again.text
            assert (again.json()["stored"], again.json()["sufficed"]) == ("duplicate", True)
        finally:
            rdb.close()
        assert [(o.outcome_id, o.sufficed) for o in read_outcomes(redis_url, redis_prefix)
                if o.source == "feedback"] == [(f"fb:{rid}", True)]  # the first stands, nothing added


def test_a_second_grade_while_the_first_waits_in_the_spool_is_a_duplicate(
        upstream_sim: SimProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis is down: the replica that answered a request (its index entry still queued here) accepts its grade and
    spools it. A second grade then was spooled too and answered ``stored: "spool"`` with its own grade — the replay
    dropped it as a duplicate of the first; and a grade sent once Redis was back, before the replay, was written
    (``"redis"``) and stood, the replay dropping the first, which the client had been told was stored. The first
    grade stands (the one-grade rule of ``/v1/feedback``), and every later one is answered as its duplicate."""
    from tests.fixtures.crash_process import DurableRedis

    monkeypatch.delenv("REDIS_URL", raising=False)  # the suite's: it would override this test's private Redis
    server = DurableRedis(tmp_path / "redis").start()
    prefix = "tgtest:feedback-spool:"
    try:
        # no replay between Redis coming back and the third grade: the replayer's first pass is at start
        with accounting_gateway(upstream_sim.base_url, server.url, tmp_path, prefix=prefix,
                                routing={"router_path": None, "routed_tiers": ["short", "long"],
                                         "thresholds": [0.5], "default_tier": "long",
                                         "outcomes": {"replay_interval_s": 600}}) as gw, \
                httpx.Client(timeout=30) as client:
            server.kill()
            r = client.post(gw.base_url + "/chat/completions", headers=_auth("alice"), json={
                "model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": "graded in an outage?"}]})
            assert r.status_code == 200, r.text  # limits.on_redis_down: fail_open
            rid = r.headers["x-request-id"]

            def grade(correct: bool) -> tuple[str, bool]:
                fb = client.post(gw.base_url + "/feedback", headers=_auth("alice"),
                                 json={"request_id": rid, "correct": correct})
                assert fb.status_code == 200, fb.text
                return fb.json()["stored"], fb.json()["sufficed"]

            assert grade(True) == ("spool", True)
            assert grade(False) == ("duplicate", True)  # was ("spool", False), dropped by the replay
            server.start()  # same port, same data
            rdb = redis.Redis.from_url(server.url)
            try:  # the index entry written: Redis answers this replica again
                assert wait_for(lambda: rdb.exists(prefix + "req:" + rid) == 1, timeout_s=10)
            finally:
                rdb.close()
            assert grade(False) == ("duplicate", True)  # was ("redis", False), and it stood
        # the gateway's close replays the spool
        assert [(o.outcome_id, o.sufficed) for o in read_outcomes(server.url, prefix)
                if o.source == "feedback"] == [(f"fb:{rid}", True)]
    finally:
        server.kill()
