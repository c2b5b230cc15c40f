"""An escalation the cascade asked for but could not make — refused by the budget (``x-thinkgate-escalation:
skipped; …``) or failed (``failed; …``: the next tier down) — is an ``escalation`` outcome all the same, through a
real gateway on loopback, real Redis and the upstream simulator: the routed cheap tier's answer was judged too weak
by its ``escalate_on`` rule, the evidence a successful escalation records ("the cheaper tier did not suffice"),
whether or not the next tier could be reached. It used to leave no outcome (docs/closed-loop.md, *Outcomes*).
The answer served stays gradable: the client's feedback on it is a second outcome."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import TierConfig
from gateway.engine.redis_server import free_port
from gateway.ledger.event import micro_to_usd
from gateway.ledger.outcome import window_digest
from gateway.state.limits import estimate
from tests.fixtures.gateway import SECRETS, accounting_gateway, keys_config
from tests.fixtures.redis_db import read_outcomes
from tests.fixtures.upstream import GatewayServer, SimProcess, sim_tiers, wait_for

AUTH = {"authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store"}
ROUTING = {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.9], "default_tier": "long",
           "outcomes": {"retain_text": True}}


def _body(question: str, stream: bool) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": question}], "stream": stream}


@pytest.fixture(params=["skipped", "failed"])
def gw(request: pytest.FixtureRequest, upstream_sim: SimProcess, redis_url: str, tmp_path: Path,
       redis_prefix: str) -> Iterator[tuple[GatewayServer, str]]:
    """``auto`` is routed to ``short`` (threshold 0.9), whose thought is cut by the tier's 4 tokens: its
    ``escalate_on: [length_in_thought]`` asks for ``long``. ``skipped``: alice's daily budget holds the first call
    and not the escalation's reservation beside it. ``failed``: ``long`` is a port nobody listens on."""
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"thinking_budget": 100, "max_tokens": 4, "escalate_on": ["length_in_thought"]})
    alice: dict[str, Any] = {"budget_usd_day": "1"}
    if request.param == "failed":
        tiers[2].update({"base_url": f"http://127.0.0.1:{free_port()}/v1", "max_retries": 1})
    else:
        routed = [TierConfig(**t) for t in tiers[1:]]
        first = estimate(_body("x" * 64, False), routed).micro_usd  # short, falling back to long
        alice = {"budget_usd_day": str(micro_to_usd(first + first // 2))}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=tiers,
                            routing=ROUTING, auth=keys_config(alice=alice)) as g:
        yield g, request.param


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_escalation_not_taken_is_an_escalation_outcome(gw: tuple[GatewayServer, str], redis_url: str,
                                                          redis_prefix: str, stream: bool) -> None:
    gw_, mode = gw
    question = f"name the {mode} {'streamed' if stream else 'plain'} escalation"
    with httpx.stream("POST", gw_.base_url + "/chat/completions", json=_body(question, stream), headers=AUTH,
                      timeout=30) as r:
        text = r.read().decode()
    assert r.status_code == 200, text
    note = r.headers["x-thinkgate-escalation"]
    expected = ("skipped; tier=long; reason=budget_exceeded" if mode == "skipped"
                else "failed; tier=long; reason=upstream_unavailable")
    assert note == expected
    assert (r.headers["x-thinkgate-tier"], r.headers["x-thinkgate-route-reason"]) == ("short", "predicted")
    rid = r.headers["x-request-id"]

    # it was: no outcome at all (the escalated_<why> attempt that records one never existed)
    assert wait_for(lambda: any(o.request_id == rid for o in read_outcomes(redis_url, redis_prefix)), timeout_s=5), \
        read_outcomes(redis_url, redis_prefix)
    [o] = [o for o in read_outcomes(redis_url, redis_prefix) if o.request_id == rid]
    assert (o.source, o.key_id, o.tier, o.route_reason, o.sufficed, o.judge) == (
        "escalation", "alice", "short", "predicted", False, "escalation:length_in_thought")
    assert (o.other_tier, o.comment) == ("long", note)
    assert o.text == question and o.window_digest == window_digest(question) and o.score is not None

    # the answer served is still the request's: the client may grade it (its request index entry is written too)
    fb = httpx.post(gw_.base_url + "/feedback", headers=AUTH, timeout=30, json={"request_id": rid, "correct": True})
    assert fb.status_code == 200, fb.text
    graded = [x for x in read_outcomes(redis_url, redis_prefix) if x.request_id == rid]
    assert sorted((x.source, x.sufficed) for x in graded) == [("escalation", False), ("feedback", True)]
