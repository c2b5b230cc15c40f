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
