"""Routing: auto (router score → tier), forced by model or header, reasoning_effort, and a plugged-in scorer."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

import openai
import pytest

from gateway.errors import InvalidRequest, UnknownModel
from gateway.pipeline.routing import Routing, default_thresholds
from router.base import Router
from tests.fixtures.upstream import TEST_KEY, GatewayServer, sim_settings, sim_tiers

SHORT_Q = [{"role": "user", "content": "2+2?"}]
# The length baseline saturates at 2000 characters: this window scores ~0.75, above the 0.5 threshold.
LONG_Q = [{"role": "system", "content": "You are careful."}, {"role": "user", "content": "prove it " * 166}]


def route_of(client: openai.OpenAI, **kwargs: Any) -> tuple[str, str, str | None]:
    raw = client.chat.completions.with_raw_response.create(**kwargs)
    h = raw.headers
    return h["x-thinkgate-tier"], h["x-thinkgate-route-reason"], h.get("x-thinkgate-difficulty")


def test_auto_routes_by_router_score(openai_client: openai.OpenAI) -> None:
    tier, reason, diff = route_of(openai_client, model="auto", messages=SHORT_Q)
    assert (tier, reason) == ("short", "predicted") and diff is not None and float(diff) < 0.5
    tier, reason, diff = route_of(openai_client, model="auto", messages=LONG_Q)
    assert (tier, reason) == ("long", "predicted") and diff is not None and float(diff) >= 0.5


def test_forced_by_model_name_and_header(openai_client: openai.OpenAI) -> None:
    assert route_of(openai_client, model="long", messages=SHORT_Q) == ("long", "forced", None)
    assert route_of(openai_client, model="auto", messages=LONG_Q,
                    extra_headers={"X-ThinkGate-Tier": "short"}) == ("short", "forced", None)
    # The header wins over a tier named in the body.
    assert route_of(openai_client, model="long", messages=SHORT_Q,
                    extra_headers={"X-ThinkGate-Tier": "none"}) == ("none", "forced", None)


@pytest.mark.parametrize(("effort", "tier"), [("none", "none"), ("low", "short"), ("high", "long"),
                                             ("xhigh", "long"), ("max", "long")])  # the SDK's efforts above high
def test_reasoning_effort_maps_to_tier(openai_client: openai.OpenAI, upstream_sim: Any, effort: str, tier: str) -> None:
    tag = uuid.uuid4().hex
    assert route_of(openai_client, model="auto", messages=LONG_Q, reasoning_effort=effort,
                    extra_body={"sim": {"tag": tag}}) == (tier, "effort", None)
    sent = upstream_sim.tag(tag)["body"]
    assert sent["reasoning_effort"] == effort  # passed on as the client sent it


def test_plugged_in_scorer_and_its_thresholds(upstream_sim: Any, redis_url: str) -> None:
    class Constant(Router):
        name: ClassVar[str] = "constant-test"

        def __init__(self, value: float) -> None:
            self.value = value

        def score(self, text: str) -> float:
            return self.value

    class Broken(Router):
        name: ClassVar[str] = "broken-test"

        def score(self, text: str) -> float:
            raise RuntimeError("model file corrupt")

    settings = sim_settings(upstream_sim.base_url, redis_url,
                            routing={"router_path": None, "routed_tiers": ["short", "long"], "default_tier": "long"})
    with GatewayServer(settings) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0)
        routing: Routing = gw.app.state.routing
        assert routing.thresholds == [0.5]  # no thresholds configured → default
        routing.set_scorer(Constant(0.3), thresholds=[0.2])  # the router file's calibrated cut point
        assert route_of(client, model="auto", messages=SHORT_Q) == ("long", "predicted", "0.3000")
        routing.set_scorer(Constant(0.1))
        assert route_of(client, model="auto", messages=SHORT_Q) == ("short", "predicted", "0.1000")
        routing.set_scorer(Broken())
        assert route_of(client, model="auto", messages=SHORT_Q) == ("long", "predicted", None)
        models = {m.id: m for m in client.models.list()}
        assert models["auto"].model_extra["thinkgate"]["router"] == "broken-test"  # type: ignore[index]


def test_decide_units(upstream_sim: Any, redis_url: str) -> None:
    settings = sim_settings(
        upstream_sim.base_url, redis_url,
        routing={"router_path": None, "routed_tiers": ["none", "short", "long"], "thresholds": [0.2, 0.6],
                 "default_tier": "long"},
    )
    r = Routing(settings)

    class Fixed(Router):
        name: ClassVar[str] = "fixed"
        value = 0.0

        def score(self, text: str) -> float:
            return self.value

    f = Fixed()
    r.set_scorer(f)
    for value, tier in [(0.0, "none"), (0.19, "none"), (0.2, "short"), (0.59, "short"), (0.6, "long"),
                        (1.0, "long"), (7.0, "long"), (-1.0, "none")]:
        f.value = value
        d = r.decide({"model": "auto", "messages": SHORT_Q}, None)
        assert (d.tier.name, d.reason) == (tier, "predicted"), value
    with pytest.raises(UnknownModel):
        r.decide({"model": "huge", "messages": SHORT_Q}, None)
    with pytest.raises(InvalidRequest):
        r.decide({"model": "auto", "reasoning_effort": "ludicrous", "messages": SHORT_Q}, None)
    with pytest.raises(ValueError, match="thresholds"):
        r.set_scorer(f, thresholds=[0.5])
    assert default_thresholds(2) == [0.5]
    assert default_thresholds(4) == [0.25, 0.5, 0.75]
    assert [t.name for t in r.fallbacks(settings.tier("none"))] == ["short", "long"]
    assert r.fallbacks(settings.tier("long")) == []


def test_a_chat_request_never_falls_back_or_escalates_to_an_embedding_tier(upstream_sim: Any, redis_url: str) -> None:
    """An ``embeddings: true`` tier listed after the chat tiers (a new user's config) received a chat request as
    the fallback of a failing one (``upstream of tier 'embed' answered 503``)."""
    tiers = [*sim_tiers(upstream_sim.base_url),
             {"name": "embed", "base_url": upstream_sim.base_url, "model": "sim-embed", "embeddings": True}]
    settings = sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)
    r = Routing(settings)
    assert [t.name for t in r.fallbacks(settings.tier("short"))] == ["long"]
    assert r.fallbacks(settings.tier("long")) == []
    assert r.next_tier(settings.tier("long")) is None
    assert r.next_tier(settings.tier("short")).name == "long"  # type: ignore[union-attr]


def test_a_narrowed_effort_map_narrows_auto_not_what_a_named_tier_passes_on(upstream_sim: Any, redis_url: str) -> None:
    """``routing.effort_tiers`` narrowed to two efforts: under ``auto`` only those route (``medium`` is a 400), but a
    named tier still takes any of OpenAI's values and passes it on (the tier's model reads it, the map is about
    routing) — and a value that is neither is refused there too."""
    settings = sim_settings(upstream_sim.base_url, redis_url,
                            routing={"router_path": None, "effort_tiers": {"low": "short", "high": "long"}})
    r = Routing(settings)
    with pytest.raises(InvalidRequest) as info:
        r.decide({"model": "auto", "reasoning_effort": "medium", "messages": SHORT_Q}, None)
    assert info.value.param == "reasoning_effort"
    assert (r.decide({"model": "auto", "reasoning_effort": "high", "messages": SHORT_Q}, None).tier.name
            == "long")
    for forced in ({"model": "short"}, {"model": "auto"}):
        header = "short" if forced["model"] == "auto" else None
        d = r.decide({**forced, "reasoning_effort": "medium", "messages": SHORT_Q}, header)
        assert (d.tier.name, d.reason) == ("short", "forced")
        with pytest.raises(InvalidRequest):
            r.decide({**forced, "reasoning_effort": "ultra", "messages": SHORT_Q}, header)
