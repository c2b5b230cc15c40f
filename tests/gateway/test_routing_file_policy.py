"""A router file that is the whole policy (``metadata.serving``): a gateway configured with only
``routing.router_path`` serves its thresholds and its cascade on routed requests, up the ladder; forced routes and
explicit tier settings are not touched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.config import Settings
from gateway.pipeline.routing import Routing
from router.model import TrainedRouter
from router.persistence import save_router

CASCADE = ["empty_answer", "length_in_thought", "abstain"]
PHRASES = ["i don't know", "no idea"]


def policy_file(path: Path, cascade: bool = True) -> Path:
    meta = {"policy": "length", "tiers": ["a", "b", "c"],
            "serving": {"policy": "length+cascade" if cascade else "length", "scorer": "length",
                        "thresholds": [0.3, 0.6],
                        "cascade": {"escalate_on": CASCADE, "phrases": PHRASES} if cascade else None,
                        "guarantee": {"floor": 0.98, "delta": 0.1, "n_calibration": 200,
                                      "calibration_token_share": 0.7}}}
    return save_router(TrainedRouter(pipeline=None, scorer="length", thresholds=[0.3, 0.6], metadata=meta), path)


def settings(router: Path, tiers: list[dict[str, Any]] | None = None, **routing: Any) -> Settings:
    tiers = tiers or [{"name": n} for n in ("a", "b", "c")]
    return Settings.load(None, engine={"enabled": False}, tiers=tiers,
                         routing={"router_path": str(router), "routed_tiers": ["a", "b", "c"], "default_tier": "c",
                                  "on_router_error": "refuse_start", **routing})


def body(chars: int) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": "x" * chars}]}


def test_only_the_router_file_gives_thresholds_and_cascade(tmp_path: Path) -> None:
    r = Routing(settings(policy_file(tmp_path / "p.skops")))
    assert r.thresholds == [0.3, 0.6]
    d = r.decide(body(5), None)
    assert d.tier.name == "a" and d.reason == "predicted"
    assert d.tier.escalate_on == CASCADE and d.tier.abstain_phrases == PHRASES
    nxt = r.next_tier(d.tier)
    assert nxt is not None and nxt.name == "b" and nxt.escalate_on == CASCADE, "the cascade continues up the ladder"
    top = r.next_tier(nxt)
    assert top is not None and top.name == "c" and top.escalate_on == [] and r.next_tier(top) is None
    # forced routes never get the file's cascade
    forced = r.decide({"model": "a", "messages": body(5)["messages"]}, None)
    assert forced.tier.escalate_on == [] and r.next_tier(forced.tier) is not None
    assert r.next_tier(forced.tier).escalate_on == []  # type: ignore[union-attr]
    assert r.service is not None and "98%" in (r.service.info()["guarantee"] or "")


def test_explicit_settings_override_the_file(tmp_path: Path) -> None:
    tiers: list[dict[str, Any]] = [{"name": "a", "escalate_on": []}, {"name": "b", "abstain_phrases": ["mine"]},
                                   {"name": "c"}]
    r = Routing(settings(policy_file(tmp_path / "p.skops"), tiers, thresholds=[0.0, 0.0]))
    assert r.thresholds == [0.0, 0.0]
    d = r.decide(body(5), None)
    assert d.tier.name == "c", "routing.thresholds replace the file's"
    assert r.auto_tier("a").escalate_on == [], "a tier's own escalate_on (even empty) wins"
    b = r.auto_tier("b")
    assert b.escalate_on == CASCADE and b.abstain_phrases == ["mine"]


def test_a_file_without_a_cascade_serves_none(tmp_path: Path) -> None:
    r = Routing(settings(policy_file(tmp_path / "p.skops", cascade=False)))
    assert r.decide(body(5), None).tier.escalate_on == []


def test_the_files_escalation_models_reach_their_tiers_by_name_or_position(tmp_path: Path) -> None:
    """``cascade.models`` (router/escalation.py): each routed tier below the top gets its model and ``learned``;
    keyed by the ladder's setting names, which a gateway may call otherwise — then by position in the file's
    ``tiers`` (cheapest first; a stored dict's key order is not kept)."""
    from router.escalation import FEATURES

    d = len(FEATURES)
    models = {s: {"features": list(FEATURES), "mean": [0.0] * d, "scale": [1.0] * d, "coef": [0.0] * d,
                  "intercept": 0.0, "threshold": t} for s, t in (("no_think", 0.4), ("budget256", 0.6))}
    meta = {"policy": "length", "tiers": ["no_think", "budget256", "budget1024"],
            "serving": {"policy": "length+escalation", "scorer": "length", "thresholds": [1.0, 1.0],
                        "cascade": {"escalate_on": [*CASCADE, "learned"], "phrases": PHRASES, "models": models},
                        "guarantee": {"floor": 0.98, "delta": 0.1, "n_calibration": 396}}}
    path = save_router(TrainedRouter(pipeline=None, scorer="length", thresholds=[1.0, 1.0], metadata=meta),
                       tmp_path / "e.skops")
    r = Routing(settings(path))  # tiers a, b, c: not the settings' names → by position
    a = r.decide(body(5), None).tier
    assert a.name == "a" and a.escalate_on == [*CASCADE, "learned"] and a.escalation_model == models["no_think"]
    b = r.next_tier(a)
    assert b is not None and b.escalation_model == models["budget256"] and "learned" in b.escalate_on
    top = r.next_tier(b)
    assert top is not None and top.escalate_on == [] and top.escalation_model is None
    named = Routing(settings(path, [{"name": n} for n in ("budget256", "x", "no_think")],
                             routed_tiers=["budget256", "x", "no_think"], default_tier="no_think"))
    first = named.auto_tier("budget256")
    assert first.escalation_model == models["budget256"], "by name when the names match"
    assert "learned" not in named.auto_tier("x").escalate_on, "no model for that name: no learned condition"
