"""Session-sticky routing through a real gateway: a 5-turn conversation stays on the tier of its first routed
turn while the router (the length baseline) would have flipped it, on chat, Responses and Messages; forced
and effort routes bypass sessions; the Prometheus counter counts the flips avoided."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.pipeline.sessions import session_of
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, accounting_gateway, cleanup
from tests.fixtures.upstream import GatewayServer, SimProcess, sim_tiers

# The length baseline scores characters / 2000 over system + last user turn: 0.6 > the 0.5 cut → "long".
LONG_TURN = "now refactor the module and explain every step in detail " * 21
TURNS = 5


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    routing = {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5], "default_tier": "long",
               "session_ttl_s": 600}
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("sessgw"), prefix,
                                routing=routing) as g:
            yield g
    finally:
        cleanup(redis_url, prefix)


def oai(gw: GatewayServer, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=SECRETS[who], max_retries=0, timeout=30)


def route(headers: Any) -> tuple[str, str | None, float]:
    return headers["x-thinkgate-tier"], headers.get("x-thinkgate-session"), float(headers["x-thinkgate-difficulty"])


def assert_stayed(seen: list[tuple[str, str | None, float]]) -> None:
    assert [t for t, _, _ in seen] == ["short"] * TURNS
    assert [s for _, s, _ in seen] == ["new"] + ["sticky"] * (TURNS - 1)
    assert seen[0][2] < 0.5 and all(d >= 0.5 for _, _, d in seen[1:])  # the router alone: short, then long


def test_chat_conversation_stays_on_its_first_tier(gw: GatewayServer) -> None:
    client = oai(gw)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                  {"role": "user", "content": f"start task {uuid.uuid4().hex[:8]}"}]
    seen = []
    for turn in range(TURNS):
        if turn == 2:  # a streamed turn carries the header too
            with client.chat.completions.with_streaming_response.create(model="auto", messages=msgs,  # type: ignore[arg-type]
                                                                        stream=True) as raw:
                seen.append(route(raw.headers))
                answer = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        else:
            raw = client.chat.completions.with_raw_response.create(model="auto", messages=msgs)  # type: ignore[arg-type]
            seen.append(route(raw.headers))
            answer = raw.parse().choices[0].message.content or ""
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": LONG_TURN}]
    assert_stayed(seen)
    # another key with the same conversation is another session: routed on its own
    raw = oai(gw, "bob").chat.completions.with_raw_response.create(model="auto", messages=msgs)  # type: ignore[arg-type]
    assert route(raw.headers)[:2] == ("long", "new")


def test_forced_and_effort_routes_bypass_the_session(gw: GatewayServer) -> None:
    msgs = [{"role": "user", "content": f"pinned {uuid.uuid4().hex[:8]}"}]
    first = oai(gw).chat.completions.with_raw_response.create(model="auto", messages=msgs)  # type: ignore[arg-type]
    assert route(first.headers)[:2] == ("short", "new")
    forced = oai(gw).chat.completions.with_raw_response.create(model="long", messages=msgs)  # type: ignore[arg-type]
    assert forced.headers["x-thinkgate-tier"] == "long" and "x-thinkgate-session" not in forced.headers
    effort = oai(gw).chat.completions.with_raw_response.create(model="auto", messages=msgs,  # type: ignore[arg-type]
                                                              reasoning_effort="high")
    assert effort.headers["x-thinkgate-tier"] == "long" and "x-thinkgate-session" not in effort.headers
    again = oai(gw).chat.completions.with_raw_response.create(model="auto", messages=msgs)  # type: ignore[arg-type]
    assert route(again.headers)[:2] == ("short", "sticky")


def test_metadata_session_id_names_the_session(gw: GatewayServer) -> None:
    sid = uuid.uuid4().hex
    a = oai(gw).chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "first question"}], metadata={"session_id": sid})
    b = oai(gw).chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": LONG_TURN}], metadata={"session_id": sid})
    assert (route(a.headers)[:2], route(b.headers)[:2]) == (("short", "new"), ("short", "sticky"))
    named = {"metadata": {"session_id": sid}}
    assert session_of("alice", named) != session_of("bob", named)  # a session never spans two keys


def test_responses_chain_by_previous_response_id_is_one_session(gw: GatewayServer) -> None:
    client = oai(gw)
    seen = []
    raw = client.responses.with_raw_response.create(model="auto", instructions="You are a coding agent.",
                                                    input=f"start task {uuid.uuid4().hex[:8]}")
    seen.append(route(raw.headers))
    prev = raw.parse().id
    for _ in range(TURNS - 1):  # later turns: no instructions (OpenAI does not carry them over), a long turn
        raw = client.responses.with_raw_response.create(model="auto", previous_response_id=prev, input=LONG_TURN)
        seen.append(route(raw.headers))
        prev = raw.parse().id
    assert_stayed(seen)


def test_messages_conversation_stays(gw: GatewayServer) -> None:
    client = anthropic.Anthropic(base_url=gw.url, api_key=SECRETS["alice"], max_retries=0, timeout=30)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"start task {uuid.uuid4().hex[:8]}"}]
    seen = []
    for _ in range(TURNS):
        raw = client.messages.with_raw_response.create(model="auto", max_tokens=64, messages=msgs,  # type: ignore[arg-type]
                                                       system="You are a coding agent.")
        seen.append(route(raw.headers))
        msgs += [{"role": "assistant", "content": raw.parse().content[-1].text},  # type: ignore[union-attr]
                 {"role": "user", "content": LONG_TURN}]
    assert_stayed(seen)


def test_prometheus_counts_sessions(gw: GatewayServer) -> None:
    msgs = [{"role": "user", "content": f"count me {uuid.uuid4().hex[:8]}"}]
    oai(gw).chat.completions.create(model="auto", messages=msgs)  # type: ignore[arg-type]
    oai(gw).chat.completions.create(model="auto", messages=[*msgs, {"role": "user", "content": LONG_TURN}])  # type: ignore[arg-type]
    text = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {ADMIN_SECRET}"}, timeout=10).text
    counts = {m.group(1): float(m.group(2))
              for m in re.finditer(r'^thinkgate_session_routes_total\{state="(\w+)"\} (\S+)$', text, re.M)}
    assert counts["new"] >= 1 and counts["sticky"] >= 1 and counts["flip_avoided"] >= 1


def test_an_escalated_turn_moves_the_session(upstream_sim: SimProcess, redis_url: str,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"escalate_on": ["empty_answer"], "max_tokens": 4})  # the tier's cap cuts its thought
    routing = {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5], "session_ttl_s": 600}
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("sessesc"), prefix,
                                tiers=tiers, routing=routing) as gw:
            msgs = [{"role": "user", "content": f"short question {uuid.uuid4().hex[:6]}"}]
            # short's 4 tokens: its answer is cut in its thought (empty) → escalated to long
            first = oai(gw).chat.completions.with_raw_response.create(model="auto", messages=msgs)  # type: ignore[arg-type]
            assert (first.headers["x-thinkgate-tier"], first.headers["x-thinkgate-route-reason"],
                    first.headers["x-thinkgate-session"]) == ("long", "escalated", "new")
            again = oai(gw).chat.completions.with_raw_response.create(model="auto", messages=msgs)  # type: ignore[arg-type]
            assert route(again.headers)[:2] == ("long", "sticky")  # the router alone: short
            assert route(again.headers)[2] < 0.5
    finally:
        cleanup(redis_url, prefix)
