"""The promotion comparison's ``q`` (``router/fit/promote.py``) comes from a randomised arm of the router in service
only: its spot checks (both tiers on the questions it sends cheap) or its explored answers (both tiers on the questions
it sends up). All feedback pooled compares the top tier on the questions routed up with the cheap tier on those routed
down — there the cheap tier can read better than the top one and ``q`` 0 — so without an arm ``q`` is 1."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from gateway.ledger.outcome import Outcome, window_digest
from router.fit.promote import Z90, Rates, estimate, explore_rates, fit_candidate, look_z, rates, spot_check_rates
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


def test_without_a_randomised_arm_q_is_one_not_the_pooled_feedback(tmp_path: Path) -> None:
    """The cheap tier graded right on half its answers (the easy questions it was sent), the top tier on 30% (the hard
    ones): pooled, q reads 0.10 and a candidate sending hard windows cheap "held the floor" (promoted before this
    rule: seen in bench learn on o3-mini, 0.707 of always-top's accuracy on held-out questions). With 29 spot checks
    (< spot_check_min) and no explored arm the promotion reads no rates: q = 1, and the candidate sends to the cheap
    tier no window whose cheap answer was graded wrong beyond the floor's 2% — this candidate, fitted to send more,
    is kept out."""
    outs = _outcomes(spot_checks=29)
    assert rates(outs, "long").q < 0.2  # what all feedback pooled would say
    old = load_router(serving_router(tmp_path / "old.skops", False, _text))
    _, blind = fit_candidate(old, outs, "long", version="v")
    assert blind.rates["source"] == "none" and blind.rates["q"] == 1.0
    assert blind.new is not None and blind.new["holds_floor"] is False
    assert not blind.better and "does not hold the floor" in blind.reason


def test_spot_checks_give_the_promotion_a_q_on_the_questions_sent_cheap(tmp_path: Path) -> None:
    old = load_router(serving_router(tmp_path / "old.skops", False, _text))
    new, seen = fit_candidate(old, _outcomes(spot_checks=30), "long", version="v")
    # both tiers on the questions the router in service sends cheap: the top tier right on all, the cheap on half
    assert seen.rates["source"] == "spot_check" and seen.rates["q"] > 0.9
    assert (seen.rates["n_top"], seen.rates["n_cheap"]) == (30, 40)  # explored answers are not the router's
    assert seen.new is not None and seen.new["holds_floor"] is False
    assert not seen.better and "does not hold the floor" in seen.reason  # the candidate is kept out
    assert new is not None and new.metadata["auto_retrain"]["rates"]["source"] == "spot_check"


def _explored(n: int) -> list[dict[str, Any]]:
    """Questions the router in service (``old-noise``) sends up, split at random: ``n`` explored answers on the cheap
    tier (1 in 10 right) and ``n`` of its own on the top tier (9 in 10 right)."""
    out = [_fb(f"x{i}", "short", i % 10 == 0, _text(True, 6000 + i), "explore", "old-noise") for i in range(n)]
    return out + [_fb(f"p{i}", "long", i % 10 != 0, _text(True, 6500 + i), "predicted", "old-noise") for i in range(n)]


def test_explored_answers_give_the_promotion_a_q_on_the_questions_sent_up(tmp_path: Path) -> None:
    outs = [o for o in _outcomes(spot_checks=0) if o["route_reason"] != "explore"] + _explored(30)
    old = load_router(serving_router(tmp_path / "old.skops", False, _text))
    _, cmp = fit_candidate(old, outs, "long", version="v")
    assert cmp.rates["source"] == "explore" and (cmp.rates["n_top"], cmp.rates["n_cheap"]) == (30, 30)
    assert cmp.rates["q"] > 0.6  # the Wilson bounds of 0.9 against 0.1
    assert cmp.new is not None and cmp.new["accuracy_ratio"] >= 0.98 and cmp.new["cheap_share"] < 0.6


def test_explore_rates_need_both_arms_the_minimum_and_the_version() -> None:
    outs = _explored(30)
    assert explore_rates(outs, "old-noise", "short", "long", 31) is None
    assert explore_rates(outs, "other", "short", "long", 1) is None
    assert explore_rates(outs, None, "short", "long", 1) is None
    assert explore_rates([o for o in outs if o["tier"] == "short"], "old-noise", "short", "long", 1) is None
    r = explore_rates(outs, "old-noise", "short", "long", 30)
    assert r is not None and (r.p_top, r.p_cheap, r.source) == (0.9, 0.1, "explore")
    assert explore_rates(outs, "old-noise", "", "long", 30) == r  # two tiers named by their top alone


def test_spot_check_rates_need_the_minimum_and_the_version() -> None:
    outs = _outcomes(spot_checks=30)
    assert spot_check_rates(outs, "old-noise", "long", 31) is None
    assert spot_check_rates(outs, "other", "long", 1) is None
    assert spot_check_rates(outs, None, "long", 1) is None
    r = spot_check_rates(outs, "old-noise", "long", 30)
    assert r is not None and (r.p_top, r.p_cheap, r.source) == (1.0, 0.5, "spot_check")


def test_later_looks_need_more_evidence() -> None:
    """The error is spent over a deployment's comparisons (``look_z``): the same slice — 400 windows, 100 sent
    cheap, 1 of them cheap-wrong, q from arms of 200 grades — holds 0.98 at the first look and not at the 50th,
    where a lucky slice among fifty would otherwise get a router promoted."""
    assert look_z(None) == Z90
    zs = [look_z(i) for i in (1, 2, 10, 50, 1000)]
    assert zs == sorted(zs) and abs(zs[0] - 1.96) < 0.01
    labels = np.zeros(400, dtype=np.int64)
    labels[0] = 1
    up = np.ones(400, dtype=bool)
    up[:100] = False
    arms = Rates(0.5, 0.5, 200, 200, source="explore")
    first = estimate(up, labels, Rates(**{**arms.__dict__, "z": look_z(1)}), 0.98)
    later = estimate(up, labels, Rates(**{**arms.__dict__, "z": look_z(50)}), 0.98)
    assert first.holds_floor and not later.holds_floor
    assert first.ratio_low is not None and later.ratio_low is not None and later.ratio_low < 0.98 <= first.ratio_low


def test_a_comparison_not_judged_spends_no_look(tmp_path: Path) -> None:
    """Too few held-back windows: nothing is compared, so the event carries no look (a new user read the look 1
    of such an event as spent); a judged one carries its look and z."""
    old = load_router(serving_router(tmp_path / "old.skops", False, _text))
    outs = _outcomes(spot_checks=0)
    _, few = fit_candidate(old, outs[:20], "long", version="v", look=3)
    assert few.new is None and few.rates["look"] is None
    _, judged = fit_candidate(old, outs, "long", version="v", look=3)
    assert judged.new is not None and judged.rates["look"] == 3 and judged.rates["z"] == round(look_z(3), 4)


def _shadow(rid: str, tier: str, agree: bool, text: str, judge: str = "normalised",
            version: str | None = "old-noise", reason: str = "predicted") -> dict[str, Any]:
    o = Outcome(source="shadow", request_id=rid, key_id="k", tier=tier, sufficed=agree, judge=judge,
                window_digest=window_digest(text), text=text, route_reason=reason, router_version=version)
    return dict(orjson.loads(o.to_json()))


def test_a_disagreement_costs_more_than_a_wrong_grade_when_disagreements_are_rarer_than_wrong_answers() -> None:
    """Every window the top tier gets right and the cheap one wrong is a disagreement (the normalised judge said
    "agree" on 0.1% of such pairs in the traces), so under nesting P(lost | disagree) = (p_top − p_cheap) /
    P(disagree), where a graded-wrong window costs q = (p_top − p_cheap) / (1 − p_cheap): on the traces 0.17–0.20
    against 0.12–0.17. Counted at q, a slice labelled by comparisons reads fewer lost answers than it loses (latent
    while q's bound was loose)."""
    assert Rates(0.6, 0.45, 4000, 4000, source="explore", z=1.96).q_compared == 1.0  # no comparisons: strictest
    r = Rates(0.6, 0.45, 4000, 4000, source="explore", z=1.96, p_disagree=0.40, n_compared=6000)
    assert r.q_compared > (0.6 - 0.45) / 0.40 > r.q  # at the bounds: p_top up, p_cheap and p_disagree down
    agreeing = Rates(0.6, 0.45, 4000, 4000, z=1.96, p_disagree=0.9, n_compared=6000)
    assert agreeing.q_compared == agreeing.q  # never below q

    # 400 windows, 120 sent cheap with 6 labelled 1: graded labels hold the floor, comparison labels do not
    up = np.ones(400, dtype=bool)
    up[:120] = False
    labels = np.zeros(400, dtype=np.int64)
    labels[:6] = 1
    graded = estimate(up, labels, r, 0.98)
    assert estimate(up, labels, r, 0.98, np.zeros(400, dtype=bool)) == graded  # same reading as before
    assert graded.holds_floor
    compared = estimate(up, labels, r, 0.98, np.ones(400, dtype=bool))
    assert not compared.holds_floor and compared.accuracy_ratio < graded.accuracy_ratio


def test_the_disagreement_rate_comes_from_the_arm_behind_q(tmp_path: Path) -> None:
    """Spot checks → the router's own cheap answers' comparisons; explored answers → the explored answers'. A
    verifier's shadow is a grade, not a comparison; items say which of their labels are comparisons only."""
    from router.fit.promote import boundary_rates, compared_only
    from router.fit.retrain import items_from_outcomes

    outs = _outcomes(spot_checks=30)  # old-noise: 30 spot checks, 40 own cheap answers graded
    outs += [_shadow(f"sh{i}", "short", i % 4 == 0, _text(False, 8000 + i)) for i in range(40)]  # 30 disagree
    outs += [_shadow(f"sv{i}", "short", False, _text(False, 8100 + i), judge="verifier") for i in range(10)]
    outs += [_shadow(f"so{i}", "short", False, _text(False, 8200 + i), version="other") for i in range(10)]
    outs += [_shadow(f"sx{i}", "short", False, _text(False, 9000 + i), reason="explore") for i in range(10)]
    [r] = boundary_rates(outs, ["short", "long"], "old-noise", 30, z=1.96)
    assert r.source == "spot_check" and (r.p_disagree, r.n_compared) == (0.75, 40)
    explored = _explored(40) + [_shadow(f"ex{i}", "short", i % 2 == 0, _text(True, 6000 + i), reason="explore")
                                for i in range(20)]
    [r] = boundary_rates(explored + outs[-60:], ["short", "long"], "old-noise", 30, z=1.96)
    assert r.source == "explore" and (r.p_disagree, r.n_compared) == (0.5 * 20 / 30 + 10 / 30, 30)

    items = {it.group: it for it in items_from_outcomes(outs, "long")}
    shadow_only = items[window_digest(_text(False, 8200))]
    both = items[window_digest(_text(False, 8000))]  # graded by feedback and compared by the shadow
    assert shadow_only.meta["compared"] == shadow_only.meta["n"] == 1
    assert both.meta["compared"] == 1 and both.meta["n"] == 2
    assert compared_only([shadow_only, both]).tolist() == [True, False]
    old = load_router(serving_router(tmp_path / "old.skops", False, _text))
    _, cmp = fit_candidate(old, outs, "long", version="v")
    assert cmp.rates["p_disagree"] == 0.75 and cmp.rates["n_compared"] == 40
    assert cmp.rates["q_compared"] >= cmp.rates["q"]  # the event says what a comparison label costs
    # no randomised arm (too few spot checks, nothing explored): no rates, and no disagreement rate either
    [none] = boundary_rates(_outcomes(spot_checks=29) + outs[-60:], ["short", "long"], "old-noise", 30, z=1.96)
    assert none.source == "none" and none.p_disagree is None and none.q_compared == 1.0
