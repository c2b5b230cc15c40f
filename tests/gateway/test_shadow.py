"""Shadow comparisons (``routing.shadow``) on a real gateway, the real Redis and two simulator upstreams (the
shadow tier's answers 1.5 s late): the client's responses are never delayed, the shadow calls are metered as
``shadow`` under their own daily budget, and each comparison leaves a ``shadow`` outcome."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from gateway.config import TierConfig
from gateway.control.shadow import answers_agree, normalise_answer
from gateway.ledger.event import micro_to_usd
from gateway.pipeline import upstream_body
from gateway.state.limits import estimate
from tests.fixtures.gateway import SECRETS, accounting_gateway, usage_events
from tests.fixtures.redis_db import read_outcomes
from tests.fixtures.redis_stack import persistent_redis
from tests.fixtures.upstream import SimProcess, sim_tiers, start_sim, wait_for

SHADOW_DELAY_S = 1.5


@pytest.fixture(scope="module")
def slow_sim() -> Iterator[SimProcess]:
    sim = start_sim("--delay-ms", str(int(SHADOW_DELAY_S * 1000)))
    try:
        yield sim
    finally:
        sim.stop()


def _routing(**shadow: Any) -> dict[str, Any]:
    return {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.9], "default_tier": "long",
            "shadow": {"fraction": 1.0, **shadow}}


def _ask(client: httpx.Client, base: str, i: int, stream: bool = False) -> tuple[float, httpx.Response]:
    body: dict[str, Any] = {"model": "auto", "max_tokens": 16, "stream": stream,
                            "messages": [{"role": "user", "content": f"what is {i} plus {i}?"}]}
    t0 = time.perf_counter()
    if stream:
        with client.stream("POST", base + "/chat/completions", json=body,
                           headers={"authorization": f"Bearer {SECRETS['alice']}"}) as r:
            r.read()
    else:
        r = client.post(base + "/chat/completions", json=body, headers={"authorization": f"Bearer {SECRETS['alice']}"})
    return time.perf_counter() - t0, r


def test_normalised_answer_agreement() -> None:
    assert normalise_answer("<think>hmm</think> So... Answer: The Eiffel Tower!") == "eiffel tower"
    assert answers_agree("Paris.", "answer: paris") and not answers_agree("Paris", "Lyon")
    assert not answers_agree("", "")


def test_shadow_calls_never_delay_the_response(upstream_sim: SimProcess, slow_sim: SimProcess, redis_url: str,
                                               redis_prefix: str, tmp_path: Path) -> None:
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[2]["base_url"] = slow_sim.base_url  # long, the shadow tier, answers 1.5 s late
    latencies: dict[bool, list[float]] = {}
    for on in (False, True):
        prefix = redis_prefix + ("on:" if on else "off:")
        routing = _routing(max_concurrency=16) if on else _routing(fraction=0.0)
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=prefix, tiers=tiers,
                                routing=routing) as gw, httpx.Client(timeout=30) as client:  # one keep-alive connection
            lat = []
            for i in range(8):
                dt, r = _ask(client, gw.base_url, i, stream=i % 2 == 1)
                assert r.status_code == 200 and r.headers["x-thinkgate-tier"] == "short"
                lat.append(dt)
            latencies[on] = lat
            if on:
                assert wait_for(lambda p=prefix: len(read_outcomes(redis_url, p)) == 8, timeout_s=15)
                shadow = gw.app.state.proxy.shadow
                # counted done after its outcome is written: the last one may lag the stream by a moment
                assert wait_for(lambda s=shadow: s.stats.done == 8, timeout_s=5)
                assert shadow.stats.skipped == {}
                outcomes = read_outcomes(redis_url, prefix)
                assert {(o.source, o.tier, o.other_tier, o.judge, o.key_id) for o in outcomes} == {
                    ("shadow", "short", "long", "agreement", "alice")}
                assert all(o.cost_micro_usd > 0 and o.sufficed is not None for o in outcomes)
                events = usage_events(gw, count=16)
                shadow_events = [e for e in events.values() if e.route_reason == "shadow"]
                assert len(shadow_events) == 8
                assert {(e.key_id, e.tier) for e in shadow_events} == {("_shadow", "long")}
            else:
                assert gw.app.state.proxy.shadow is None and read_outcomes(redis_url, prefix) == []
    # the client never waits for the 1.5 s shadow call: every response (JSON and stream, each on the same
    # keep-alive connection as the shadowed one before it) well under the shadow tier's delay
    assert max(latencies[True]) < SHADOW_DELAY_S / 2, latencies
    assert max(latencies[False]) < SHADOW_DELAY_S / 2, latencies


def _shadow_estimate(sim: SimProcess, i: int) -> int:
    """The admission estimate of the shadow call of ``_ask(…, i)`` (on ``long``, the next tier up)."""
    long = TierConfig(**sim_tiers(sim.base_url)[2])
    body = {"model": "auto", "max_tokens": 16, "messages": [{"role": "user", "content": f"what is {i} plus {i}?"}]}
    return estimate(upstream_body.build(body, long, "chat"), [long]).micro_usd


def test_shadow_calls_respect_their_daily_budget(upstream_sim: SimProcess, redis_url: str, redis_prefix: str,
                                                 tmp_path: Path) -> None:
    # a budget of exactly one shadow call's admission estimate: the first is admitted (nothing spent yet), every
    # later one is refused by admission before it is sent — the daily budget is a hard one, never overshot
    # (before, it was checked before a call and charged after: a day could overshoot by max_concurrency calls)
    budget = _shadow_estimate(upstream_sim, 0)
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(max_usd_day=str(micro_to_usd(budget)))) as gw, \
            httpx.Client(timeout=30) as client:
        shadow = gw.app.state.proxy.shadow
        for i in range(4):
            _, r = _ask(client, gw.base_url, i)
            assert r.status_code == 200
            assert wait_for(lambda n=i + 1: shadow.stats.done + sum(shadow.stats.skipped.values()) == n,
                            timeout_s=5)
        assert shadow.stats.done == 1 and shadow.stats.skipped == {"admission": 3}
        events = usage_events(gw, count=5)
        shadowed = [e for e in events.values() if e.route_reason == "shadow"]
        assert len(shadowed) == 1 and shadowed[0].cost_micro_usd <= budget
        assert len(read_outcomes(redis_url, redis_prefix)) == 1


def test_the_shadow_cap_holds_in_soft_budget_mode(upstream_sim: SimProcess, slow_sim: SimProcess, redis_url: str,
                                                 redis_prefix: str, tmp_path: Path) -> None:
    """``limits.budget_mode: soft`` is the operator's choice for the keys' budgets; the shadow's ``max_usd_day`` caps
    the gateway's own spend (docs/closed-loop.md) and its calls are admitted ``hard`` in either mode. Eight shadowed
    requests in a row, the shadow tier answering 1.5 s late so their shadow calls are in flight together, against a
    cap of one call's estimate + 1 micro-USD: one call fits, the others are refused by admission, and the day's
    shadow spend stays within the cap. Before, soft admission let a second call in while spend + reserved (one
    estimate) was below the cap, and the two calls' spend went past it."""
    n = 8
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[2]["base_url"] = slow_sim.base_url  # long, the shadow tier, answers 1.5 s late
    cap = max(_shadow_estimate(upstream_sim, i) for i in range(n)) + 1
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                            routing=_routing(max_usd_day=str(micro_to_usd(cap)), max_concurrency=16),
                            limits={"budget_mode": "soft"}) as gw, httpx.Client(timeout=30) as client:
        shadow = gw.app.state.proxy.shadow
        t0 = time.monotonic()
        for i in range(n):
            _, r = _ask(client, gw.base_url, i)
            assert r.status_code == 200 and r.headers["x-thinkgate-tier"] == "short"
        assert time.monotonic() - t0 < SHADOW_DELAY_S  # every shadow call was started before the first answered
        assert wait_for(lambda: shadow.stats.done + shadow.stats.failed + sum(shadow.stats.skipped.values()) == n,
                        timeout_s=15)
        assert wait_for(lambda: not shadow._tasks, timeout_s=5)
        events = usage_events(gw, count=n + shadow.stats.done)
        shadowed = [e for e in events.values() if e.route_reason == "shadow"]
        day = time.strftime("%Y-%m-%d", time.gmtime())
        check = redis.Redis.from_url(redis_url)
        try:
            spent = int(check.hget(f"{redis_prefix}usage:key:_shadow:d:{day}", "cost_micro_usd") or 0)
            reserved = check.hgetall(f"{redis_prefix}lim:_shadow:resv")
        finally:
            check.close()
        assert spent == sum(e.cost_micro_usd for e in shadowed) and not reserved
        assert 0 < spent <= cap, (spent, cap, [e.cost_micro_usd for e in shadowed])
        assert shadow.stats.done == 1 and shadow.stats.skipped == {"admission": n - 1}, shadow.stats


def test_shadow_calls_are_admitted_against_the_global_budget(upstream_sim: SimProcess, redis_url: str,
                                                             redis_prefix: str, tmp_path: Path) -> None:
    # the global level has room for the client's request (its estimate) and not for the shadow call after it:
    # the shadow call is refused by admission, never sent, and the global spend stays within its budget
    budget = _shadow_estimate(upstream_sim, 3)  # = the client's own estimate (short, falling back to long)
    limits = {"global_budget": {"usd_day": str(micro_to_usd(budget))}}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(), limits=limits) as gw, httpx.Client(timeout=30) as client:
        shadow = gw.app.state.proxy.shadow
        _, r = _ask(client, gw.base_url, 3)
        assert r.status_code == 200 and r.headers["x-thinkgate-tier"] == "short"
        assert wait_for(lambda: shadow.stats.done + sum(shadow.stats.skipped.values()) == 1, timeout_s=5)
        assert shadow.stats.skipped == {"admission": 1} and shadow.stats.done == 0
        events = usage_events(gw, count=1)
        assert [e.route_reason for e in events.values()] == ["predicted"]
        day = time.strftime("%Y-%m-%d", time.gmtime())
        check = redis.Redis.from_url(redis_url)
        try:
            spent = int(check.hget(f"{redis_prefix}usage:global:d:{day}", "cost_micro_usd") or 0)
        finally:
            check.close()
        assert 0 < spent <= budget


def test_judge_tier_is_asked_and_metered(upstream_sim: SimProcess, redis_url: str, redis_prefix: str,
                                         tmp_path: Path) -> None:
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(judge="tier:none")) as gw, httpx.Client(timeout=30) as client:
        _, r = _ask(client, gw.base_url, 7)
        assert r.status_code == 200
        assert wait_for(lambda: len(read_outcomes(redis_url, redis_prefix)) == 1, timeout_s=5)
        [o] = read_outcomes(redis_url, redis_prefix)
        assert o.judge == "tier:none" and o.sufficed is not None
        events = [e for e in usage_events(gw, count=3).values() if e.route_reason == "shadow"]
        assert sorted(e.tier for e in events) == ["long", "none"]  # the shadow call and the judge's
        assert o.cost_micro_usd == sum(e.cost_micro_usd for e in events)


def test_verifier_judge_uses_the_reference_answer_where_one_exists(upstream_sim: SimProcess, redis_url: str,
                                                                    redis_prefix: str, tmp_path: Path) -> None:
    # the simulator echoes the question, so the cheap answer's last number is the question's: "what is 7 plus
    # 7?" → 7 (wrong for the reference 14), "... answer 9?" → 9 (right); the third has no reference.
    refs = tmp_path / "refs.jsonl"
    refs.write_text('{"question": "What is 7 plus 7?", "answer": "14"}\n\n'
                    '{"question": "what is 9 plus 0, answer 9?", "answer": "9"}\n')
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing(judge="verifier", references=str(refs), verifier="int")) as gw, \
            httpx.Client(timeout=30) as client:
        for q in ("what is 7   plus 7?", "what is 9 plus 0, answer 9?", "what is 5 plus 5?"):
            r = client.post(gw.base_url + "/chat/completions", json={
                "model": "auto", "max_tokens": 16, "messages": [{"role": "user", "content": q}]},
                headers={"authorization": f"Bearer {SECRETS['alice']}"})
            assert r.status_code == 200
        assert wait_for(lambda: len(read_outcomes(redis_url, redis_prefix)) == 3, timeout_s=10)
        by_id = {o.request_id: o for o in read_outcomes(redis_url, redis_prefix)}
        got = sorted((o.judge, o.sufficed, o.other_tier, o.cost_micro_usd > 0) for o in by_id.values()
                     if o.judge == "verifier")
        assert got == [("verifier", False, None, False), ("verifier", True, None, False)]
        assert [(o.other_tier, o.cost_micro_usd > 0) for o in by_id.values() if o.judge == "agreement"] == [
            ("long", True)]  # no reference: the shadow call and agreement, as before
        events = [e for e in usage_events(gw, count=4).values() if e.route_reason == "shadow"]
        assert len(events) == 1  # only the question without a reference was sent to the higher tier


def test_verifier_judge_needs_references() -> None:
    from gateway.config import ShadowConfig

    with pytest.raises(ValueError, match="references"):
        ShadowConfig(judge="verifier")


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_non_streamed_answer_of_the_other_wire_apis_is_shadowed_too(api: str, upstream_sim: SimProcess,
                                                                     redis_url: str, redis_prefix: str,
                                                                     tmp_path: Path) -> None:
    """``/v1/responses`` and ``/v1/messages`` answered in JSON start the sampled shadow comparison after the
    response, as chat does (their JSON answers used to drop the after-response hook: no comparison ever ran)."""
    body: dict[str, Any]
    if api == "responses":
        body = {"model": "auto", "max_output_tokens": 16, "input": "what is 2 plus 2?"}
    else:
        body = {"model": "auto", "max_tokens": 16, "messages": [{"role": "user", "content": "what is 2 plus 2?"}]}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=_routing()) as gw, httpx.Client(timeout=30) as client:
        shadow = gw.app.state.proxy.shadow
        r = client.post(f"{gw.base_url}/{api}", json=body, headers={"authorization": f"Bearer {SECRETS['alice']}"})
        assert r.status_code == 200, r.text
        assert wait_for(lambda: shadow.stats.done + sum(shadow.stats.skipped.values()) == 1, timeout_s=10)
        assert shadow.stats.done == 1, shadow.stats
        assert len(read_outcomes(redis_url, redis_prefix)) == 1


def test_a_shadow_call_cut_by_the_gateway_stopping_is_metered(upstream_sim: SimProcess, redis_url: str,
                                                              redis_prefix: str, tmp_path: Path) -> None:
    """A gateway that stops lets its shadow calls run ``Shadow.close``'s few seconds, then cancels them: the call
    was sent (the upstream has the prompt and is generating), so it is metered — ``partial``, status 499, its prompt
    counted — and its reservation settled at once. Before, a cancelled shadow call left no usage event at all (the
    upstream saw the call, the ledger did not) and its reservation held the shadow and global budgets until its TTL."""
    slow = start_sim("--delay-ms", "8000")  # the shadow tier: longer than Shadow.close waits (5 s)
    try:
        tiers = sim_tiers(upstream_sim.base_url)
        tiers[2]["base_url"] = slow.base_url
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                                routing=_routing()) as gw, httpx.Client(timeout=30) as client:
            shadow = gw.app.state.proxy.shadow
            _, r = _ask(client, gw.base_url, 5)
            assert r.status_code == 200 and r.headers["x-thinkgate-tier"] == "short"
            assert wait_for(lambda: slow.stats()["requests"] == 1, timeout_s=5)  # the shadow call is sent
            assert shadow.stats.started == 1
        # stopped: the shadow call was cancelled after 5 s
        check = redis.Redis.from_url(redis_url)
        try:
            events = [orjson.loads(f[b"e"]) for _, f in check.xrange(redis_prefix + "usage:events")]
            reserved = check.hgetall(f"{redis_prefix}lim:_shadow:resv")
        finally:
            check.close()
        shadowed = [e for e in events if e["route_reason"] == "shadow"]
        assert len(shadowed) == 1, events
        [e] = shadowed
        assert (e["key_id"], e["tier"], e["status"], e["partial"]) == ("_shadow", "long", 499, True)
        assert e["prompt_tokens"] > 0 and e["cost_micro_usd"] > 0 and e["usage_source"] == "counted"
        assert not reserved
    finally:
        slow.stop()


def test_a_shadow_call_has_its_write_ahead_record_while_it_runs(upstream_sim: SimProcess, slow_sim: SimProcess,
                                                                redis_url: str, redis_prefix: str,
                                                                tmp_path: Path) -> None:
    """Like every upstream call, a shadow call is recorded in Redis (``wal:open``) before it is sent, and its usage
    event settles the record: a gateway killed during it has it billed by the next reconcile (to ``_shadow``, on
    the shadow tier). Before, shadow and judge calls had no record: a crash lost their spend."""
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[2]["base_url"] = slow_sim.base_url  # the shadow tier answers 1.5 s late
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                            routing=_routing()) as gw, httpx.Client(timeout=30) as client:
        check = redis.Redis.from_url(redis_url)
        try:
            before = slow_sim.stats()["requests"]
            _, r = _ask(client, gw.base_url, 6)
            assert r.status_code == 200 and r.headers["x-thinkgate-tier"] == "short"
            assert wait_for(lambda: slow_sim.stats()["requests"] == before + 1, timeout_s=5)  # sent, not answered
            records = [orjson.loads(v) for v in check.hvals(redis_prefix + "wal:open")]
            assert [(w["key_id"], w["tier"], w["route_reason"]) for w in records] == [("_shadow", "long", "shadow")]
            assert records[0]["bound_micro_usd"] > 0
            shadow = gw.app.state.proxy.shadow
            assert wait_for(lambda: shadow.stats.done == 1, timeout_s=10)
            assert wait_for(lambda: check.hlen(redis_prefix + "wal:open") == 0, timeout_s=5)  # settled by its event
        finally:
            check.close()


@pytest.mark.slow
def test_the_shadow_budget_reads_what_metering_counted_through_a_redis_timeout(
        upstream_sim: SimProcess, slow_sim: SimProcess, tmp_path: Path) -> None:
    """Today's shadow spend, the one the pre-check compares with ``max_usd_day``, is what metering counted for the
    key ``_shadow`` (``usage:key:_shadow:d:{day}``, written atomically with the usage event and replayed from the
    spool after an outage) — not a second counter. Here a shadow call ends while every Redis write is held (``CLIENT
    PAUSE … WRITE`` on a private Redis, past the 0.25 s socket timeout): its usage event is spooled and replayed,
    the ledger has its cost. A gateway whose ``max_usd_day`` is exactly that spend then skips the next comparison in
    the pre-check (``budget``) — before, the separate ``shadow:d:{day}`` counter had lost that write (756 vs 972
    micro-USD measured), read 0, and the comparison went on to admission, which refused it against the ledger."""
    (tmp_path / "redis").mkdir()
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[2]["base_url"] = slow_sim.base_url  # the shadow tier answers 1.5 s late: the pause begins while it thinks
    day = time.strftime("%Y-%m-%d", time.gmtime())
    ledger = f"tgshadow:usage:key:_shadow:d:{day}"
    # the first gateway's cap admits one comparison (its estimate; shadow calls are admitted hard)
    first_cap = micro_to_usd(_shadow_estimate(upstream_sim, 1))
    with persistent_redis(tmp_path / "redis") as server:
        admin = redis.Redis.from_url(server.url)
        try:
            with accounting_gateway(upstream_sim.base_url, server.url, tmp_path, prefix="tgshadow:", tiers=tiers,
                                    routing=_routing(max_usd_day=str(first_cap))) as gw, \
                    httpx.Client(timeout=30) as client:
                shadow = gw.app.state.proxy.shadow
                _, r = _ask(client, gw.base_url, 1)
                assert r.status_code == 200 and r.headers["x-thinkgate-tier"] == "short"
                # admitted and written ahead: sent, not answered yet — hold every write until well after it answered
                assert wait_for(lambda: any(b'"_shadow"' in v for v in admin.hvals("tgshadow:wal:open")), timeout_s=5)
                admin.execute_command("CLIENT", "PAUSE", 2500, "WRITE")
                assert wait_for(lambda: shadow.stats.done + shadow.stats.failed == 1, timeout_s=10)
                # the event was spooled (the write timed out) and is replayed once Redis takes writes again
                assert wait_for(lambda: int(admin.hget(ledger, "cost_micro_usd") or 0) > 0, timeout_s=10)
                spent = int(admin.hget(ledger, "cost_micro_usd") or 0)
                events = usage_events(gw, count=2)
                assert [e.cost_micro_usd for e in events.values() if e.route_reason == "shadow"] == [spent]
            # the same day's ledger, read by a gateway whose cap is what it counted
            with accounting_gateway(upstream_sim.base_url, server.url, tmp_path, prefix="tgshadow:", tiers=tiers,
                                    routing=_routing(max_usd_day=str(micro_to_usd(spent)))) as gw, \
                    httpx.Client(timeout=30) as client:
                shadow = gw.app.state.proxy.shadow
                _, r = _ask(client, gw.base_url, 2)
                assert r.status_code == 200 and r.headers["x-thinkgate-tier"] == "short"
                assert wait_for(lambda: sum(shadow.stats.skipped.values()) == 1, timeout_s=5)
                # it was {"admission": 1}: the pre-check read the separate counter, which never had the first call's
                # cost
                assert shadow.stats.skipped == {"budget": 1}, shadow.stats.skipped
                assert shadow.stats.done == 0
                assert int(admin.hget(ledger, "cost_micro_usd") or 0) == spent  # nothing more was spent
        finally:
            admin.close()
