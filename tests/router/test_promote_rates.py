"""The promotion comparison's ``q`` (``router/fit/promote.py``): from all feedback it compares the top tier on the
questions routed up with the cheap tier on those routed down; with enough spot checks of the router in service it
compares both tiers on the questions that router sends cheap — and a candidate that loses answers there is no longer
promoted."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson

from gateway.ledger.outcome import Outcome, window_digest
from router.fit.promote import fit_candidate, spot_check_rates
from router.persistence import load_router
from tests.fixtures.outcomes import serving_router

HARD = ["prove", "integral", "theorem", "derive", "lemma", "asymptotic"]
EASY = ["capital", "color", "name", "city", "animal", "fruit"]


def _text(hard: bool, i: int) -> str:
    rng = random.Random(i)
    return f"question {i}: " + " ".join(rng.sample(HARD if hard else EASY, 3))


def _fb(rid: str, tier: str, ok: bool, text: str, reason: str = "predicted",
        version: str | None = None) -> dict[str, Any]:
    o = Outcome(source="feedback", request_id=rid, key_id="k", tier=tier, sufficed=ok, judge="client",
                window_digest=window_digest(text), text=text, route_reason=reason, router_version=version)
    return dict(orjson.loads(o.to_json()))


def _outcomes(spot_checks: int) -> list[dict[str, Any]]:
    """Cheap answers: easy right, hard wrong (200); top answers to hard questions routed up, 30% right (60) —
    so p_top (0.3) < p_cheap (0.5) and q from all feedback is 0; the serving router's own cheap answers, half
    right (40), and ``spot_checks`` top answers to the questions it sends cheap, all right."""
    out = [_fb(f"r{i}", "short", i % 2 == 1, _text(i % 2 == 0, i)) for i in range(200)]
    out += [_fb(f"t{i}", "long", i % 10 < 3, _text(True, 5000 + i)) for i in range(60)]
    out += [_fb(f"c{i}", "short", i % 2 == 0, _text(False, 8000 + i), version="old-noise") for i in range(40)]
    out += [_fb(f"s{i}", "long", True, _text(False, 7000 + i), "spot_check", "old-noise") for i in range(spot_checks)]
    out += [_fb(f"e{i}", "short", True, _text(False, 9000 + i), "explore", "old-noise") for i in range(50)]
    return out


def test_spot_checks_give_the_promotion_a_q_on_the_questions_sent_cheap(tmp_path: Path) -> None:
    old = load_router(serving_router(tmp_path / "old.skops", False, _text))
    _, blind = fit_candidate(old, _outcomes(spot_checks=29), "long", version="v")
    # 29 < spot_check_min: q from all feedback, where the top tier answered the hard questions — 0.10
    assert blind.rates["source"] == "feedback" and blind.rates["q"] < 0.2
    assert blind.better and blind.new is not None and blind.new["cheap_share"] > 0.6  # promoted

    new, seen = fit_candidate(old, _outcomes(spot_checks=30), "long", version="v")
    # both tiers on the questions the router in service sends cheap: the top tier right on all, the cheap on half
    assert seen.rates["source"] == "spot_check" and seen.rates["q"] > 0.9
    assert (seen.rates["n_top"], seen.rates["n_cheap"]) == (30, 40)  # explored answers are not the router's
    assert seen.new is not None and seen.new["holds_floor"] is False
    assert not seen.better and "does not hold the floor" in seen.reason  # the same candidate is kept out
    assert new is not None and new.metadata["auto_retrain"]["rates"]["source"] == "spot_check"


def test_spot_check_rates_need_the_minimum_and_the_version() -> None:
    outs = _outcomes(spot_checks=30)
    assert spot_check_rates(outs, "old-noise", "long", 31) is None
    assert spot_check_rates(outs, "other", "long", 1) is None
    assert spot_check_rates(outs, None, "long", 1) is None
    r = spot_check_rates(outs, "old-noise", "long", 30)
    assert r is not None and (r.p_top, r.p_cheap, r.source) == (1.0, 0.5, "spot_check")
