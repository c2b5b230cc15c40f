"""A stream keeps its budget reservation while it runs (renewed past ``limits.reservation_ttl_s``) and is cut at
``limits.max_stream_s``: ``finish_reason: "length"``, ``[DONE]``, metered as partial, reservation settled — through a
real gateway over the upstream simulator and a real Redis."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.ledger.event import micro_to_usd
from gateway.ledger.record import UsageRecord
from tests.fixtures.gateway import accounting_gateway, create_key, usage_events
from tests.fixtures.ports import leased_port
from tests.fixtures.upstream import TEST_KEY, GatewayServer, SimProcess, StreamRead, sim_settings, sim_tiers, wait_for


def test_a_long_stream_renews_its_reservation_and_is_cut_at_its_bound(upstream_sim: SimProcess, redis_url: str,
                                                                      tmp_path: Path) -> None:
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    limits = {"reservation_ttl_s": 1.2, "max_stream_s": 2.5}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix, limits=limits) as gw:
        kid = f"stream-{uuid.uuid4().hex[:8]}"
        secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(1_000_000))
        t = uuid.uuid4().hex
        body = {"model": "long", "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "a slow stream of words"}],
                "sim": {"tag": t, "chunk_delay_ms": 200}}  # ~25 chunks: ~5 s unbounded, finish_reason "stop"
        events: list[dict[str, Any]] = []
        head: dict[str, str] = {}

        def consume() -> None:
            with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, timeout=30,
                              headers={"authorization": f"Bearer {secret}", "cache-control": "no-store"}) as r:
                head.update(r.headers)
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))

        worker = threading.Thread(target=consume)
        started = time.monotonic()
        worker.start()
        client = redis.Redis.from_url(redis_url)
        samples: list[tuple[float, int | None]] = []  # (epoch s, the reservation's expiry in ms or None)
        try:
            while worker.is_alive() and time.monotonic() - started < 20:
                rid = head.get("x-request-id")
                if rid:
                    raw = client.hget(f"{prefix}lim:{kid}:resv", rid)
                    text = raw.decode() if isinstance(raw, bytes) else raw
                    samples.append((time.time(), int(text.split("|")[2]) if text is not None else None))
                time.sleep(0.05)
            worker.join(timeout=20)
        finally:
            client.close()
        finishes = [c["finish_reason"] for e in events for c in e.get("choices") or () if c.get("finish_reason")]
        assert finishes == ["length"] and events[-1] == {"done": True}
        assert events[-2]["usage"]["completion_tokens"] > 0  # the usage chunk the client asked for
        rid = head["x-request-id"]
        ev = usage_events(gw, [rid])[rid]
        # renewed: past the TTL of the reservation made at admission, it was still there and unexpired
        late = [(at, exp) for at, exp in samples if ev.ts + 1.4 < at < ev.ts + 2.3]
        assert late and all(exp is not None and exp > at * 1000 for at, exp in late), (ev.ts, samples)
        assert ev.partial and ev.status == 200 and ev.error_code == "stream_max_duration"
        assert 0 < ev.completion_tokens < 25 and ev.cost_micro_usd > 0
        rec = upstream_sim.wait_tag_status(t, {"cancelled", "completed"}, timeout_s=10)
        assert rec is not None and rec["status"] == "cancelled"  # the upstream request was closed
        check = redis.Redis.from_url(redis_url)
        try:
            assert check.hlen(f"{prefix}lim:{kid}:resv") == 0  # settled, not left to expire
        finally:
            check.close()


MAX_STREAM_S = 2.0


@pytest.fixture(scope="module")
def bounded(upstream_sim: SimProcess, redis_url: str) -> Iterator[tuple[GatewayServer, list[UsageRecord]]]:
    """Streams under ``limits.max_stream_s`` (2 s; read timeouts 10 s): ``short`` peeked for escalation up to its
    answer's start (``empty_answer``), ``whole`` peeked to its end (``abstain``), ``forced`` budget-forced and
    relayed; with the usage records the gateway sinks."""
    none, short, long = sim_tiers(upstream_sim.base_url)
    short.update({"thinking_budget": None, "max_tokens": 256, "escalate_on": ["empty_answer"]})
    whole = {**short, "name": "whole", "escalate_on": ["abstain"]}
    forced = {**short, "name": "forced", "budget_mode": "forced", "thinking_budget": 8, "max_tokens": 64}
    del forced["escalate_on"]
    settings = sim_settings(upstream_sim.base_url, redis_url, tiers=[none, short, whole, forced, long],
                            limits={"max_stream_s": MAX_STREAM_S})
    with GatewayServer(settings) as gw:
        records: list[UsageRecord] = []
        gw.app.state.proxy.usage_sinks.append(records.append)
        yield gw, records


@pytest.mark.parametrize(("tier", "sim", "thought"), [
    ("short", {"fail": "stall", "fail_at": 1 + 3}, 3),  # the thought stalls under the peek after 3 deltas
    ("whole", {"chunk_delay_ms": 150}, None),  # peeked to its end, ~40 chunks: ~6 s
    ("forced", {"delay_ms": 1500}, None),  # each phase answered 1.5 s after it was sent
], ids=["peeked-stall", "peeked-slow", "forced-opening"])
def test_the_bound_counts_from_the_first_upstream_call_not_from_the_relay(
        bounded: tuple[GatewayServer, list[UsageRecord]], upstream_sim: SimProcess, tier: str, sim: dict[str, Any],
        thought: int | None) -> None:
    """The time before the relay's first batch — the escalation peek holding a stream back (a thought that stalls, an
    answer read whole), a forced stream's phase 1 still opening — counts against ``limits.max_stream_s``: the stream
    is cut 2 s after it was sent, what the peek read relayed, ``finish_reason: "length"``, ``[DONE]``, 200
    ``stream_max_duration``, partial, and no escalation. The relay's clock started at its first batch: the stalled
    peek ran to the read timeout (a 504 at 10 s), the slow one read the whole answer (a complete 200 at ~6 s), the
    forced stream was cut 1.5 s late."""
    gw, records = bounded
    before = len(records)
    tag = uuid.uuid4().hex
    client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=30)
    started = time.monotonic()
    got = StreamRead().read(client.chat.completions.create(
        model=tier, messages=[{"role": "user", "content": "Think about this question for a while, then answer it"}],
        stream=True, stream_options={"include_usage": True}, extra_body={"sim": {**sim, "tag": tag}}))
    took = time.monotonic() - started
    assert got.finish == "length" and MAX_STREAM_S - 0.1 <= took < MAX_STREAM_S + 1.0, (got, took)
    sent = upstream_sim.wait_tag_status(tag, {"cancelled", "completed", "failed"})
    assert sent is not None and sent["status"] == "cancelled"  # the upstream call closed at the bound
    assert sent["attempts"] == (2 if tier == "forced" else 1)  # cut in phase 2's opening; never escalated
    assert wait_for(lambda: len(records) == before + 1, timeout_s=10)
    rec = records[before]
    assert (rec.tier, rec.status, rec.error_code, rec.partial) == (tier, 200, "stream_max_duration", True)
    assert got.usage is not None and got.usage["completion_tokens"] == rec.completion_tokens
    if tier == "forced":  # phase 1 as it reported it, nothing of a phase 2 never answered
        assert rec.usage_source == "upstream" and rec.completion_tokens == rec.reasoning_tokens > 0
    else:  # what the peek read reached the client and is billed: its deltas, the prompt counted
        assert got.reasoning and got.content == ""
        assert rec.usage_source == "counted" and rec.prompt_tokens > 0
        assert rec.completion_tokens == rec.reasoning_tokens == len(got.reasoning.split())
        if thought is not None:
            assert rec.completion_tokens == thought


@pytest.mark.parametrize("tier", ["none", "short", "forced"], ids=["relayed", "peeked", "forced"])
def test_a_stream_whose_first_call_is_still_opening_at_the_bound_fails_there(
        bounded: tuple[GatewayServer, list[UsageRecord]], upstream_sim: SimProcess, tier: str) -> None:
    """The upstream takes the call and sends no response head (a forced tier: its thought phase's), with a read
    timeout (10 s) far past ``limits.max_stream_s`` (2 s): the call is closed at the bound and the client gets a 504
    ``stream_max_duration`` there, metered as the failed call it was (504 ``stream_max_duration``, partial, nothing
    billed: no 200 came). The opening was bounded only by the tier's timeouts: a 504 ``upstream_timeout`` at 10 s."""
    gw, records = bounded
    before = len(records)
    tag = uuid.uuid4().hex
    client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=30)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        StreamRead().read(client.chat.completions.create(
            model=tier, messages=[{"role": "user", "content": "Answer this"}], stream=True,
            extra_body={"sim": {"fail": "timeout", "tag": tag}}))  # the simulator's hang: 30 s, or until closed
    took = time.monotonic() - started
    assert info.value.status_code == 504 and MAX_STREAM_S - 0.1 <= took < MAX_STREAM_S + 1.0, (info.value, took)
    assert info.value.body["code"] == "stream_max_duration"  # type: ignore[index]
    sent = upstream_sim.wait_tag_status(tag, {"cancelled", "completed", "failed"})
    assert sent is not None and sent["status"] == "cancelled" and sent["attempts"] == 1  # closed at the bound
    assert wait_for(lambda: len(records) == before + 1, timeout_s=10)
    rec = records[before]
    assert (rec.tier, rec.status, rec.error_code, rec.partial) == (tier, 504, "stream_max_duration", True)
    assert (rec.prompt_tokens, rec.completion_tokens, rec.cost_micro_usd) == (0, 0, 0)
    assert rec.request_id == info.value.response.headers["x-request-id"]


@pytest.mark.parametrize("asked", ["short", "down"], ids=["routed", "fallback"])
def test_a_stream_held_back_by_the_escalation_peek_keeps_its_reservation(
        upstream_sim: SimProcess, redis_url: str, tmp_path: Path, asked: str) -> None:
    """A tier that escalates on an abstention reads its stream to the end before the client gets a byte (~3 s here),
    past ``limits.reservation_ttl_s`` (1.2 s): the reservation is renewed meanwhile, as the relay renews a stream's
    and a timer a long non-streamed answer's. Nothing renewed it before the relay began: it lapsed under the peek
    (no longer counted against the budget while the call ran on). Also when the escalating tier is the fallback of
    one that does not escalate (``down``: nothing listens) — only the routed tier's ``escalate_on`` chose the timer."""
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    _, short, long = sim_tiers(upstream_sim.base_url)
    short.update({"thinking_budget": None, "max_tokens": 256, "escalate_on": ["abstain"]})
    with leased_port() as dead, accounting_gateway(
            upstream_sim.base_url, redis_url, tmp_path, prefix, limits={"reservation_ttl_s": 1.2},
            tiers=[{**short, "name": "down", "base_url": f"http://127.0.0.1:{dead}/v1", "escalate_on": []},
                   short, long]) as gw:
        kid = f"peek-{uuid.uuid4().hex[:8]}"
        secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(1_000_000))
        body = {"model": asked, "stream": True, "messages": [{"role": "user", "content": "a slow stream of words"}],
                "sim": {"chunk_delay_ms": 100}}  # ~30 chunks, all read by the peek before the 200
        head: dict[str, str] = {}
        answered: list[float] = []

        def consume() -> None:
            with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, timeout=30,
                              headers={"authorization": f"Bearer {secret}", "cache-control": "no-store"}) as r:
                answered.append(time.time())  # the 200 comes once the peek read the whole answer
                head.update(r.headers)
                for _ in r.iter_lines():
                    pass

        worker = threading.Thread(target=consume)
        started = time.monotonic()
        worker.start()
        client = redis.Redis.from_url(redis_url)
        samples: list[tuple[float, list[int]]] = []  # (epoch s, the expiries in ms of the key's reservations)
        try:
            while worker.is_alive() and time.monotonic() - started < 20:
                held = client.hvals(f"{prefix}lim:{kid}:resv")
                samples.append((time.time(), [int(v.decode().split("|")[2]) for v in held]))
                time.sleep(0.05)
            worker.join(timeout=20)
        finally:
            client.close()
        ev = usage_events(gw, [head["x-request-id"]])[head["x-request-id"]]
        assert answered and answered[0] > ev.ts + 2.0, "the peek read for too short a time to tell"
        late = [(at, exps) for at, exps in samples if ev.ts + 1.4 < at < answered[0]]
        assert late and all(exps and all(exp > at * 1000 for exp in exps) for at, exps in late), (ev.ts, late)
        assert ev.status == 200 and ev.tier == "short" and ev.route_reason == ("fallback" if asked == "down" else
                                                                               "forced")


def test_the_bound_does_not_count_a_single_flight_wait(upstream_sim: SimProcess, redis_url: str) -> None:
    """A cacheable stream waits in the cache lookup for an identical one in flight (single-flight), which fails after
    ~2.3 s (its stream ends without ``[DONE]``: nothing cached); it then calls the upstream itself, a ~2.4 s stream
    under a 4 s bound. Its bound counts from that call: it completes (``stop``). Counted from its admission, the wait
    before any upstream call cut it at 4 s. (A bound of its own: under the module's 2 s one the follower's stream
    left 0.5 s of slack, and a loaded box cut it.)"""
    bound = 4.0
    settings = sim_settings(upstream_sim.base_url, redis_url, tiers=list(sim_tiers(upstream_sim.base_url)),
                            limits={"max_stream_s": bound})
    with GatewayServer(settings) as gw:
        tag = uuid.uuid4().hex
        words = " ".join(f"w{i}" for i in range(30))  # the answer: "echo:" and these, ~34 chunks at 70 ms: ~2.4 s
        sim = {"tag": tag, "chunk_delay_ms": 70, "fail": "close", "fail_at": 32, "fail_times": 1}
        client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=30)
        leader_failed: list[BaseException] = []

        def leader() -> None:
            try:
                StreamRead().read(client.chat.completions.create(
                    model="none", messages=[{"role": "user", "content": words}], temperature=0, stream=True,
                    extra_body={"sim": sim}))
            except openai.APIError as exc:
                leader_failed.append(exc)

        first = threading.Thread(target=leader)
        first.start()
        assert wait_for(lambda: (upstream_sim.tag(tag) or {}).get("attempts") == 1, timeout_s=5)
        started = time.monotonic()
        got = StreamRead().read(client.chat.completions.create(
            model="none", messages=[{"role": "user", "content": words}], temperature=0, stream=True,
            extra_body={"sim": sim}))
        took = time.monotonic() - started
        first.join(timeout=10)
        assert leader_failed  # the first one broke: nothing cached, the follower called the upstream itself
        seen = upstream_sim.tag(tag)
        assert seen is not None and seen["attempts"] == 2
        assert got.finish == "stop" and got.content.split()[1:] == words.split(), (got.finish, took)
        assert took > bound + 0.3, f"the follower waited too little ({took:.2f} s) to tell"


@pytest.fixture(scope="module", params=[["empty_answer"], ["abstain"]], ids=["empty_answer", "abstain"])
def cascade(request: pytest.FixtureRequest, upstream_sim: SimProcess,
            redis_url: str) -> Iterator[tuple[GatewayServer, list[UsageRecord]]]:
    """``short`` escalating to ``long`` under ``limits.max_stream_s`` (2 s): peeked up to its answer's start
    (``empty_answer``; an empty answer is so read to its end) or whole (``abstain``); with the usage records."""
    _, short, long = sim_tiers(upstream_sim.base_url)
    short.update({"thinking_budget": None, "max_tokens": 256, "escalate_on": request.param})
    settings = sim_settings(upstream_sim.base_url, redis_url, tiers=[short, long],
                            limits={"max_stream_s": MAX_STREAM_S})
    with GatewayServer(settings) as gw:
        records: list[UsageRecord] = []
        gw.app.state.proxy.usage_sinks.append(records.append)
        yield gw, records


@pytest.mark.parametrize("headless", [False, True], ids=["stalled-after-head", "no-head"])
def test_an_escalation_cut_at_the_bound_before_its_first_content_serves_the_held_answer(
        cascade: tuple[GatewayServer, list[UsageRecord]], upstream_sim: SimProcess, headless: bool) -> None:
    """``short``'s answer, read at 20 ms a chunk, is judged too weak (empty: a ``stop`` string cuts it before its
    first word; or it abstains) ~1.5 s before the 2 s bound (at 60 ms, ~0.6 s: a loaded box read it past the bound,
    undecided, and nothing escalated); ``long`` sends its role chunk and nothing more before
    the bound — or not even its response head (``no-head``: an upstream that queues the call). It was relayed and
    cut there: ``finish_reason: length``, no content, and the client billed both calls; with no head, the client
    waited for ``long``'s read timeout (10 s) and got ``short``'s answer with ``reason=upstream_timeout``. Now the
    escalation failed at the bound: the client is served ``short``'s answer as it was read — whole, ``finish_reason:
    stop``, ``[DONE]`` — with ``failed; tier=long; reason=stream_max_duration``; ``short`` is metered as the request's
    answer, ``long`` as the failed call it was (504 ``stream_max_duration``, partial, nothing generated; its prompt
    counted once its 200 came, nothing billed before)."""
    gw, records = cascade
    empty = gw.app.state.settings.tiers[0].escalate_on == ["empty_answer"]
    before = len(records)
    tag = uuid.uuid4().hex
    # short (attempt 1) streams at 20 ms a chunk; long (attempt 2) sends its role chunk, then nothing — or no head
    # (the simulator's hang: 30 s, cut short when the gateway closes the call)
    fault = {"fail": "timeout"} if headless else {"fail": "stall", "fail_at": 1}
    sim = {"tag": tag, "chunk_delay_ms": 20, "fail_from": 1, **fault}
    body: dict[str, Any] = {"model": "short", "stream": True, "stream_options": {"include_usage": True},
                            "messages": [{"role": "user", "content": "Think about it first" if empty
                                          else "I don't know"}], "sim": sim}
    if empty:
        body["stop"] = ["echo:"]  # the answer ends before its first word
    started = time.monotonic()
    with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {TEST_KEY}", "cache-control": "no-store"}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    took = time.monotonic() - started
    assert r.status_code == 200 and MAX_STREAM_S - 0.1 <= took < MAX_STREAM_S + 1.0, (r.status_code, took)
    assert r.headers["x-thinkgate-tier"] == "short"
    assert r.headers["x-thinkgate-escalation"] == "failed; tier=long; reason=stream_max_duration"
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert not any("error" in c for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    reasoning = "".join(d.get("reasoning") or "" for d in deltas)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["stop"] and reasoning  # short's answer as it ended, not a cut
    assert content == ("" if empty else "echo: I don't know")
    sent = upstream_sim.wait_tag_status(tag, {"cancelled", "completed", "failed"})
    assert sent is not None and sent["attempts"] == 2 and sent["status"] == "cancelled"  # long closed at the bound
    assert wait_for(lambda: len(records) == before + 2, timeout_s=10)
    failed, first = records[before:]
    assert (failed.tier, failed.route_reason, failed.status, failed.error_code, failed.partial) == (
        "long", "escalated", 504, "stream_max_duration", True)
    if headless:  # no 200 came: nothing is known to have run
        assert (failed.prompt_tokens, failed.completion_tokens, failed.cost_micro_usd) == (0, 0, 0)
    else:
        assert failed.usage_source == "counted" and failed.completion_tokens == 0 and failed.prompt_tokens > 0
        assert failed.cost_micro_usd > 0  # its prompt: the upstream had it and began on it
    assert (first.tier, first.status, first.error_code, first.partial, first.escalated_to) == (
        "short", 200, None, False, None)
    assert first.request_id == r.headers["x-request-id"]
    assert first.escalation_not_taken == ("empty_answer" if empty else "abstain", "long",
                                          "failed; tier=long; reason=stream_max_duration")
    assert first.completion_tokens == len(reasoning.split()) + len(content.split()) > 0
    assert chunks[-1]["usage"]["completion_tokens"] == first.completion_tokens
