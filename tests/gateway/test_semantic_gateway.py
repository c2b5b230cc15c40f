"""The semantic cache through a real gateway, the real Redis and the upstream simulator: a paraphrase is
answered from the cache (JSON and SSE), changed numbers, other tenants, tiers and thinking settings are not,
Cache-Control is honoured, hits are metered with the matched request, and a Redis outage bypasses."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from gateway.ledger.event import cost_micro_usd
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, accounting_gateway, usage_events
from tests.fixtures.redis_stack import PersistentRedis
from tests.fixtures.upstream import GatewayServer, SimProcess

SEMANTIC = {"cache": {"semantic": {"enabled": True}}}
LONG_Q = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
          "her friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh "
          "duck egg. How much in dollars does she make every day at the farmers' market?")


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("semgw"), **SEMANTIC) as g:
        yield g


def client(gw: GatewayServer, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=SECRETS[who], max_retries=0, timeout=30)


def ask(question: str, tag: str, model: str = "short", **extra: Any) -> dict[str, Any]:
    """A deterministic request; ``tag`` (the simulator's request tag) is part of the context, so each test has
    its own, and the simulator counts how often the upstream was really called."""
    return {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "extra_body": {"sim": {"tag": tag}, **extra}}


def test_paraphrase_is_a_semantic_hit_metered_with_the_matched_request(gw: GatewayServer,
                                                                       upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    c = client(gw)
    first = c.chat.completions.with_raw_response.create(**ask("What is 17 * 23?", tag))
    assert first.headers["x-thinkgate-cache"] == "miss"
    second = c.chat.completions.with_raw_response.create(**ask("what is 17×23 ?", tag))
    assert second.headers["x-thinkgate-cache"] == "semantic-hit"
    assert float(second.headers["x-thinkgate-cache-similarity"]) == 1.0
    assert second.headers["x-thinkgate-route-reason"] == "cache"
    a, b = first.parse(), second.parse()
    assert b.choices[0].message.content == a.choices[0].message.content == "echo: What is 17 * 23?"
    assert getattr(b.choices[0].message, "reasoning", None) == getattr(a.choices[0].message, "reasoning", None)
    assert upstream_sim.tag(tag)["attempts"] == 1  # the paraphrase never reached the upstream
    rid1, rid2 = first.headers["x-request-id"], second.headers["x-request-id"]
    events = usage_events(gw, [rid1, rid2])
    miss_ev, hit_ev = events[rid1], events[rid2]
    price = cost_micro_usd(gw.settings.tier("short").prices, prompt_tokens=miss_ev.prompt_tokens,
                           cached_tokens=miss_ev.cached_tokens, completion_tokens=miss_ev.completion_tokens)
    assert (hit_ev.cached, hit_ev.cost_micro_usd, hit_ev.saved_micro_usd) == (True, 0, price) and price > 0
    assert hit_ev.cache_request_id == rid1 and hit_ev.cache_similarity == 1.0
    assert miss_ev.cache_request_id is None and hit_ev.route_reason == "cache"


def test_changed_number_misses_and_changed_name_is_guard_rejected(gw: GatewayServer,
                                                                   upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    c = client(gw)
    before = _metric(gw, 'thinkgate_semantic_cache_requests_total{result="guard_rejected"}')
    assert c.chat.completions.with_raw_response.create(**ask("What is 17 * 23?", tag)).headers[
        "x-thinkgate-cache"] == "miss"
    other = c.chat.completions.with_raw_response.create(**ask("What is 17 * 24?", tag))
    assert other.headers["x-thinkgate-cache"] == "miss"
    assert other.parse().choices[0].message.content == "echo: What is 17 * 24?"
    c.chat.completions.create(**ask(LONG_Q, tag))
    changed = c.chat.completions.with_raw_response.create(**ask(LONG_Q.replace("16 eggs", "17 eggs"), tag))
    assert changed.headers["x-thinkgate-cache"] == "miss"
    assert "17 eggs" in (changed.parse().choices[0].message.content or "")
    renamed = c.chat.completions.with_raw_response.create(**ask(LONG_Q.replace("Janet's", "Maria's"), tag))
    assert renamed.headers["x-thinkgate-cache"] == "miss"
    assert "Maria's" in (renamed.parse().choices[0].message.content or "")
    assert upstream_sim.tag(tag)["attempts"] == 5
    assert _metric(gw, 'thinkgate_semantic_cache_requests_total{result="guard_rejected"}') == before + 1
    assert _metric(gw, 'thinkgate_semantic_cache_requests_total{result="hit"}') >= 0


def test_other_tenant_tier_and_thinking_setting_miss(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    assert client(gw).chat.completions.with_raw_response.create(**ask(LONG_Q, tag)).headers[
        "x-thinkgate-cache"] == "miss"
    para = LONG_Q.lower()
    for who, kwargs in (("bob", {}),  # another tenant
                        ("alice", {"model": "long"}),  # another tier
                        ("alice", {"chat_template_kwargs": {"enable_thinking": False}}),  # thinking off
                        ("alice", {"reasoning_effort": "none"})):  # thinking off by effort
        r = client(gw, who).chat.completions.with_raw_response.create(**ask(para, tag, **kwargs))
        assert r.headers["x-thinkgate-cache"] == "miss", (who, kwargs)
    assert upstream_sim.tag(tag)["attempts"] == 5
    assert client(gw).chat.completions.with_raw_response.create(**ask(para, tag)).headers[
        "x-thinkgate-cache"] == "semantic-hit"


def test_cache_control_is_honoured(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    c = client(gw)
    c.chat.completions.create(**ask("What is 6 * 7?", tag))
    no_cache = c.chat.completions.with_raw_response.create(**ask("what is 6×7", tag),
                                                           extra_headers={"cache-control": "no-cache"})
    assert no_cache.headers["x-thinkgate-cache"] == "miss"
    no_store = c.chat.completions.with_raw_response.create(**ask("WHAT IS 6 x 7", tag),
                                                           extra_headers={"cache-control": "no-store"})
    assert no_store.headers["x-thinkgate-cache"] == "bypass"
    assert upstream_sim.tag(tag)["attempts"] == 3
    # not deterministic: the exact cache would not store it, so the semantic cache neither looks up nor stores
    hot = c.chat.completions.with_raw_response.create(**{**ask("what is 6 * 7", tag), "temperature": 0.7})
    assert hot.headers["x-thinkgate-cache"] == "bypass"


def test_streamed_semantic_hit_is_valid_sse_with_reasoning(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    c = client(gw)
    plain = c.chat.completions.create(**ask(LONG_Q, tag)).choices[0].message
    raw = c.chat.completions.with_raw_response.create(**ask("  " + LONG_Q.upper() + " ", tag), stream=True,
                                                       stream_options={"include_usage": True})
    assert raw.headers["x-thinkgate-cache"] == "semantic-hit"
    assert raw.headers["content-type"].startswith("text/event-stream")
    content, reasoning, usage = [], [], None
    for chunk in raw.parse():  # the SDK's own SSE parser: it raises on malformed streams
        usage = chunk.usage or usage
        for ch in chunk.choices:
            content.append(ch.delta.content or "")
            reasoning.append(getattr(ch.delta, "reasoning", None) or "")
    assert "".join(content) == plain.content and "".join(reasoning) == getattr(plain, "reasoning", None)
    assert usage is not None and usage.completion_tokens > 0
    body = {"model": "short", "messages": [{"role": "user", "content": LONG_Q.lower()}], "temperature": 0,
            "sim": {"tag": tag}, "stream": True}
    r = httpx.post(gw.base_url + "/chat/completions", json=body, timeout=30,
                   headers={"authorization": f"Bearer {SECRETS['alice']}"})
    assert r.headers["x-thinkgate-cache"] == "semantic-hit"
    events = r.content.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(ch["object"] == "chat.completion.chunk" and ch["choices"] for ch in chunks)
    assert upstream_sim.tag(tag)["attempts"] == 1


def test_redis_down_bypasses_the_semantic_cache(upstream_sim: SimProcess, tmp_path: Path) -> None:
    server = PersistentRedis(tmp_path / "redis")
    server.workdir.mkdir()
    server.start()
    tag = uuid.uuid4().hex
    try:
        with accounting_gateway(upstream_sim.base_url, server.url, tmp_path, "tgsemdown:", **SEMANTIC) as g:
            c = client(g)
            c.chat.completions.create(**ask(LONG_Q, tag))
            assert c.chat.completions.with_raw_response.create(**ask(LONG_Q.lower(), tag)).headers[
                "x-thinkgate-cache"] == "semantic-hit"
            server.stop()
            t0 = time.monotonic()
            r = c.chat.completions.with_raw_response.create(**ask(LONG_Q.lower() + " ", tag))
            assert r.headers["x-thinkgate-cache"] == "bypass"
            assert r.parse().choices[0].message.content
            assert time.monotonic() - t0 < 3.0
            assert upstream_sim.tag(tag)["attempts"] == 2
    finally:
        server.stop()


def _metric(gw: GatewayServer, series: str) -> float:
    text = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {ADMIN_SECRET}"}, timeout=10).text
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def test_openai_embedder_hits_a_synonym_and_meters_the_embedding_calls(upstream_sim: SimProcess, redis_url: str,
                                                                         tmp_path: Path) -> None:
    """``openai:<tier>``: the simulator's ``/v1/embeddings`` knows ``buy`` = ``purchase``; every embedding call is
    one usage event of the embedding tier (its input price)."""
    from decimal import Decimal

    from tests.fixtures.upstream import sim_tiers

    embed = {"name": "embed", "base_url": upstream_sim.base_url, "model": "sim-words",
             "prices": {"input_usd_per_mtok": Decimal("10")}}
    semantic = {"cache": {"semantic": {"enabled": True, "embedder": "openai:embed", "threshold": 0.95}}}
    tag = uuid.uuid4().hex
    tiers = [embed, *sim_tiers(upstream_sim.base_url)]
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, tiers=tiers, **semantic) as g:
        c = client(g)
        q = "How many apples did Tom buy at the market on Monday if he had 12 and ate 3?"
        first = c.chat.completions.with_raw_response.create(**ask(q, tag))
        syn = c.chat.completions.with_raw_response.create(**ask(q.replace("buy", "purchase"), tag))
        other = c.chat.completions.with_raw_response.create(**ask(q.replace("12", "13"), tag))
        assert [r.headers["x-thinkgate-cache"] for r in (first, syn, other)] == ["miss", "semantic-hit", "miss"]
        assert upstream_sim.tag(tag)["attempts"] == 2
        ids = [r.headers["x-request-id"] for r in (first, syn, other)]
        events = usage_events(g, ids, count=6)
        assert events[ids[1]].cache_request_id == ids[0]
        emb = [e for e in events.values() if e.endpoint == "embeddings"]
        assert len(emb) == 3 and all(e.key_id == "alice" and e.tier == "embed" for e in emb)
        words = len(q.split())
        assert sorted(e.prompt_tokens for e in emb) == [words, words, words]
        assert all(e.cost_micro_usd == words * 10 and e.saved_micro_usd == 0 for e in emb)


def test_responses_api_gets_semantic_hits_in_its_own_scope(gw: GatewayServer) -> None:
    """``/v1/responses`` is served through chat: its questions are cached semantically too, apart from chat's."""
    c = client(gw)
    q = LONG_Q.replace("16 eggs", "19 eggs")
    first = c.responses.with_raw_response.create(model="short", input=q, temperature=0)
    assert first.headers["x-thinkgate-cache"] == "miss"
    second = c.responses.with_raw_response.create(model="short", input=q.lower(), temperature=0)
    assert second.headers["x-thinkgate-cache"] == "semantic-hit"
    assert second.parse().output_text == first.parse().output_text
    chat = c.chat.completions.with_raw_response.create(model="short", temperature=0,
                                                       messages=[{"role": "user", "content": q.upper()}])
    assert chat.headers["x-thinkgate-cache"] == "miss"


def test_an_embedding_call_is_admitted_before_it_is_made(upstream_sim: SimProcess, redis_url: str, redis_prefix: str,
                                                         tmp_path: Path) -> None:
    """The embedding call is reserved against the key's budget like any upstream call: a budget that the request
    itself fills leaves no room for it, so it is not made (the semantic lookup is skipped: a plain miss) and the
    key's spend stays within its budget. (Before, it was billed to the key after the fact, unchecked.)"""
    from decimal import Decimal

    from gateway.config import TierConfig
    from gateway.ledger.event import micro_to_usd
    from gateway.state.limits import estimate
    from tests.fixtures.gateway import create_key
    from tests.fixtures.upstream import sim_tiers

    embed = {"name": "embed", "base_url": upstream_sim.base_url, "model": "sim-words",
             "prices": {"input_usd_per_mtok": Decimal("10")}}
    semantic = {"cache": {"semantic": {"enabled": True, "embedder": "openai:embed", "threshold": 0.95}}}
    tiers = [embed, *sim_tiers(upstream_sim.base_url)]
    q = "How many pears did Ann pick in the orchard on Friday if she had 12 and gave away 5?"
    body = {"model": "none", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": q}]}
    budget = estimate(body, [TierConfig(**tiers[1])]).micro_usd  # the request's own bound, nothing more
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                            **semantic) as g:
        kid = f"emb-{uuid.uuid4().hex[:8]}"
        secret = create_key(redis_url, redis_prefix, kid, budget_usd_day=micro_to_usd(budget), allowed_tiers=["none"])
        before = upstream_sim.stats()["requests"]
        r = httpx.post(g.base_url + "/chat/completions", json=body, timeout=30,
                       headers={"authorization": f"Bearer {secret}"})
        assert r.status_code == 200, r.text
        assert r.headers["x-thinkgate-cache"] == "miss"
        assert upstream_sim.stats()["requests"] == before + 1  # the chat call only: no embedding call was made
        time.sleep(0.3)  # an embedding event would be written with the request's
        events = usage_events(g, [r.headers["x-request-id"]])
        mine = [e for e in events.values() if e.key_id == kid]
        assert [e.endpoint for e in mine] == ["chat"]  # no embedding call billed
        assert 0 < sum(e.cost_micro_usd for e in mine) <= budget


@pytest.mark.parametrize("usage", ["omit", {"prompt_tokens": -100000, "total_tokens": -100000},
                                   {"prompt_tokens": 10 ** 12, "total_tokens": 10 ** 12}])
def test_an_embedding_call_with_a_usage_it_cannot_trust_is_billed_its_input(redis_url: str, redis_prefix: str,
                                                                              tmp_path: Path, usage: Any) -> None:
    """The semantic cache's embedding call is metered as ``POST /v1/embeddings`` is: a usage missing, negative or
    absurd is none to meter, and the input is counted instead (``usage_source: counted``). Before, a missing usage
    was a $0 event with status 502 for a call that ran (its embedding was used), and a negative or absurd count
    was booked as sent: a credit of spend under a hard budget, or $10,000,000 for one lookup."""
    from decimal import Decimal

    from gateway.openai.usage import estimate_tokens
    from tests.fixtures.upstream import sim_tiers, start_sim

    sim = start_sim()
    try:
        sim.set_mode(embed_usage=usage)
        embed = {"name": "embed", "base_url": sim.base_url, "model": "sim-words",
                 "prices": {"input_usd_per_mtok": Decimal("10")}}
        semantic = {"cache": {"semantic": {"enabled": True, "embedder": "openai:embed", "threshold": 0.95}}}
        tiers = [embed, *sim_tiers(sim.base_url)]
        q = "How many plums did Lee pick in the garden on Sunday if he had 14 and gave away 6?"
        with accounting_gateway(sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                                **semantic) as g:
            r = client(g).chat.completions.with_raw_response.create(**ask(q, uuid.uuid4().hex))
            assert r.headers["x-thinkgate-cache"] == "miss"
            events = usage_events(g, count=2)
            [emb] = [e for e in events.values() if e.endpoint == "embeddings"]
            counted = estimate_tokens(q)
            assert (emb.status, emb.usage_source, emb.prompt_tokens) == (200, "counted", counted)
            assert emb.cost_micro_usd == counted * 10
            day = time.strftime("%Y-%m-%d", time.gmtime())
            spent = int(redis.Redis.from_url(redis_url).hget(f"{redis_prefix}usage:key:alice:d:{day}",
                                                             "cost_micro_usd") or 0)
            assert spent == sum(e.cost_micro_usd for e in events.values())
    finally:
        sim.stop()


def test_an_embedding_call_has_its_write_ahead_record_while_it_runs(redis_url: str, redis_prefix: str,
                                                                    tmp_path: Path) -> None:
    """The semantic cache's embedding call is recorded in Redis (``wal:open``) before it is sent, like every
    upstream call, and settled by its usage event: a gateway killed during it has it billed by the next
    reconcile (to the request's key and tags, on the embedding tier). Before, it had no record: a crash lost it."""
    import threading
    from decimal import Decimal

    from tests.fixtures.upstream import sim_tiers, start_sim, wait_for

    sim, slow = start_sim(), start_sim("--delay-ms", "1500")
    try:
        embed = {"name": "embed", "base_url": slow.base_url, "model": "sim-words",
                 "prices": {"input_usd_per_mtok": Decimal("10")}}
        semantic = {"cache": {"semantic": {"enabled": True, "embedder": "openai:embed", "threshold": 0.95,
                                           "embed_timeout_s": 5.0}}}
        tiers = [embed, *sim_tiers(sim.base_url)]
        q = "How many figs did Max pick in the yard on Tuesday if he had 15 and gave away 7?"
        with accounting_gateway(sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                                **semantic) as g:
            check = redis.Redis.from_url(redis_url)
            try:
                done: list[Any] = []
                t = threading.Thread(target=lambda: done.append(
                    client(g).chat.completions.with_raw_response.create(**ask(q, uuid.uuid4().hex))))
                t.start()
                assert wait_for(lambda: slow.stats()["requests"] == 1, timeout_s=5)  # the embedding call is out
                records = [orjson.loads(v) for v in check.hvals(redis_prefix + "wal:open")]
                emb = [w for w in records if w["endpoint"] == "embeddings"]
                assert [(w["key_id"], w["tier"], w["tags"]) for w in emb] == [("alice", "embed", {"team": "a"})]
                assert emb[0]["bound_micro_usd"] > 0
                t.join(timeout=15)
                assert done and done[0].headers["x-thinkgate-cache"] == "miss"
                assert wait_for(lambda: check.hlen(redis_prefix + "wal:open") == 0, timeout_s=5)  # all settled
                events = usage_events(g, count=2)
                assert sorted(e.endpoint for e in events.values()) == ["chat", "embeddings"]
            finally:
                check.close()
    finally:
        sim.stop()
        slow.stop()


def test_an_embedding_call_cancelled_in_flight_is_metered_and_settled(redis_url: str, redis_prefix: str,
                                                                     tmp_path: Path) -> None:
    """A request cancelled while its embedding call is out (the gateway's own lookup, before the request's upstream
    call) still meters that call — status 499, ``partial``, nothing known of it, cost 0 — so its reservation and
    write-ahead record are settled at once. Before, the admitted call was never metered: its reservation held the
    key's, tags' and global budgets until ``limits.reservation_ttl_s``."""
    import asyncio
    from decimal import Decimal

    from gateway.auth.keys import KeyInfo
    from gateway.ledger.record import UsageRecord
    from gateway.pipeline.accounting import Accounting
    from gateway.pipeline.upstream_body import build
    from tests.fixtures.gateway import gateway_settings
    from tests.fixtures.upstream import sim_tiers, start_sim

    slow = start_sim("--delay-ms", "5000")
    try:
        embed = {"name": "embed", "base_url": slow.base_url, "model": "sim-words",
                 "prices": {"input_usd_per_mtok": Decimal("10")}}
        settings = gateway_settings(slow.base_url, redis_url, redis_prefix, tmp_path / "spool.jsonl",
                                    tiers=[embed, *sim_tiers(slow.base_url)],
                                    cache={"semantic": {"enabled": True, "embedder": "openai:embed",
                                                        "embed_timeout_s": 10.0}})
        tier = settings.tier("short")
        body = {"model": "short", "temperature": 0,
                "messages": [{"role": "user", "content": "How many limes did Zoe pick on Monday if she had 9?"}]}

        async def go() -> None:
            acct = Accounting(settings)
            await acct.start()
            try:
                key = KeyInfo(id="alice", tags={"team": "a"})
                record = UsageRecord(key_id="alice", tags={"team": "a"}, endpoint="chat", requested_model="short")
                await acct.admit(key, body, record, [tier])
                task = asyncio.create_task(acct.cache_begin(key, record, tier, build(body, tier, "chat"), {}))
                for _ in range(100):  # until the embedding call is out
                    await asyncio.sleep(0.05)
                    if slow.stats()["requests"] == 1:
                        break
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                acct.abandon(record, tier, 499, "client_disconnected")
                await acct.flush()
            finally:
                await acct.close()

        asyncio.run(go())
        check = redis.Redis.from_url(redis_url)
        try:
            events = [orjson.loads(f[b"e"]) for _, f in check.xrange(redis_prefix + "usage:events")]
            emb = [e for e in events if e["endpoint"] == "embeddings"]
            assert [(e["key_id"], e["tier"], e["status"], e["partial"], e["cost_micro_usd"]) for e in emb] == [
                ("alice", "embed", 499, True, 0)]
            assert check.hgetall(redis_prefix + "lim:alice:resv") == {}
            assert check.hlen(redis_prefix + "wal:open") == 0
        finally:
            check.close()
    finally:
        slow.stop()
