"""The realised floor (``router/fit/realised.py``) on hand-made feedback where the truth is known: a router that
sends the easy questions cheap fools the nesting estimate, the spot-check arm does not, and neither does the explored
arm."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from router.fit.realised import realised, spot_check_ratio


def _fb(i: int, tier: str, right: bool, reason: str = "predicted", version: str | None = "v") -> dict[str, Any]:
    return {"source": "feedback", "request_id": f"r{i}", "tier": tier, "sufficed": right, "route_reason": reason,
            "router_version": version}


def _day(rng: np.random.Generator, n: int, spot_check: float, explore: float = 0.0
         ) -> tuple[list[dict[str, Any]], float]:
    """``n`` graded requests from a population where the top tier is right on 90% of the easy half and 50% of
    the hard half, the cheap tier right on 80% of the easy half and only where the top tier is right too (nesting
    holds exactly) — the router sends the easy half cheap, ``spot_check`` of it goes to the top tier, and ``explore``
    of the hard half it sends up goes to the cheap tier. Returns (outcomes, the true served / always-top ratio)."""
    out = []
    for i in range(n):
        easy = i % 2 == 0
        top_right = rng.random() < (0.9 if easy else 0.5)
        cheap_right = top_right and rng.random() < 0.8 / 0.9 if easy else False
        if easy and rng.random() < spot_check:
            out.append(_fb(i, "long", top_right, "spot_check"))
        elif easy:
            out.append(_fb(i, "short", cheap_right))
        elif rng.random() < explore:
            out.append(_fb(i, "short", cheap_right, "explore"))
        else:
            out.append(_fb(i, "long", top_right))
    truth = (0.5 * 0.8 + 0.5 * 0.5) / (0.5 * 0.9 + 0.5 * 0.5)  # 0.9286: the floor is broken
    return out, truth


def test_the_spot_check_arm_sees_a_loss_the_nesting_estimate_reads_as_none() -> None:
    rng = np.random.default_rng(0)
    outcomes, truth = _day(rng, 6000, spot_check=0.2)
    a = realised(outcomes, "v", "long", 0.98, spot_check_min=30)
    n = realised(outcomes, "v", "long", 0.98, spot_check_min=10**9)
    assert a["method"] == "spot_check" and n["method"] == "nesting"
    assert a["n_spot_check"] > 500 and a["n_cheap"] > 2000
    # the control arm: within 0.02 of the truth, and the floor reads broken
    assert abs(a["accuracy_ratio"] - truth) < 0.02 and a["holds_floor"] is False
    assert a["ratio_low"] < a["accuracy_ratio"]
    # nesting (which holds here question by question): the cheap tier is graded on the easy questions (0.8), the
    # top tier mostly on the hard ones (~0.55) — q clips to 0 and a 7-point loss reads as none
    assert n["q"] == 0.0 and n["accuracy_ratio"] == 1.0 and n["holds_floor"] is True


def test_without_spot_checks_the_explored_arm_sees_the_loss_too() -> None:
    """No spot checks, exploration on: q from the explored cheap answers against the router's own top answers on the
    questions it sends up (0 right against ~50%) reads the loss — conservatively, below the truth — where the pooled
    nesting estimate reads none."""
    rng = np.random.default_rng(1)
    outcomes, truth = _day(rng, 6000, spot_check=0.0, explore=0.3)
    e = realised(outcomes, "v", "long", 0.98, spot_check_min=30)
    assert e["method"] == "explore" and 0.4 < e["q"] < 0.7
    assert e["holds_floor"] is False and truth - 0.1 < e["accuracy_ratio"] < truth
    n = realised([o for o in outcomes if o["route_reason"] != "explore"], "v", "long", 0.98, spot_check_min=30)
    assert n["method"] == "nesting" and n["holds_floor"] is True


def test_spot_check_ratio_is_the_formula_and_needs_both_arms() -> None:
    # s = (40 + 30) / 90, a_c = 39/40, a_a = 1, a_t = 0.5: top = s + (1 - s) / 2, loss = s / 40
    s = 70 / 90
    point, low = spot_check_ratio(40, 39, 30, 30, 20, 10)
    assert point == pytest.approx(1 - s * (1 - 39 / 40) / (s + (1 - s) * 0.5))
    assert low < point
    assert spot_check_ratio(10, 5, 10, 5, 0, 0)[0] == pytest.approx(1.0)  # same accuracy on the same questions
    assert spot_check_ratio(10, 0, 10, 0, 0, 0)[0] == 1.0  # always-top right on nothing: nothing to lose
    with pytest.raises(ValueError):
        spot_check_ratio(0, 0, 10, 5, 10, 5)
    with pytest.raises(ValueError):
        spot_check_ratio(10, 5, 0, 0, 10, 5)


def test_too_few_spot_check_answers_fall_back_to_nesting_and_other_versions_do_not_count() -> None:
    outcomes = ([_fb(i, "short", True) for i in range(40)]
                + [_fb(100 + i, "long", True, "spot_check") for i in range(29)]
                + [_fb(200 + i, "long", False, "spot_check", version="other") for i in range(50)])
    r = realised(outcomes, "v", "long", 0.98, spot_check_min=30)
    assert r["method"] == "nesting" and r["n_spot_check"] == 29 and r["n"] == 69
    assert realised(outcomes, "v", "long", 0.98, spot_check_min=29)["method"] == "spot_check"
    assert realised([], "v", "long", 0.98)["accuracy_ratio"] is None
    explored = [_fb(300 + i, "short", False, "explore") for i in range(100)]  # not the router's choice
    assert realised(outcomes + explored, "v", "long", 0.98, spot_check_min=29) == realised(outcomes, "v", "long", 0.98,
                                                                                      spot_check_min=29)


def test_no_graded_answer_is_no_reading() -> None:
    """Nothing graded for the version yet: the floor is not measured — not "holds" (it read True, shown as such in
    ``/v1/models`` with n 0)."""
    r = realised([_fb(0, "short", True)], "other-version", "long", 0.98)
    assert r["n"] == 0 and r["accuracy_ratio"] is None and r["holds_floor"] is None


def test_answers_the_router_did_not_choose_do_not_count() -> None:
    """A router that sent nothing cheap, and 40 cheap answers graded wrong that the client forced (or the cache,
    an effort hint, a fallback or a shadow call chose): its realised floor is unmeasured by them, not broken — the
    rollback read them as its own and undid a router that had made none of those decisions (a new-user helper's
    walk of docs/closed-loop.md)."""
    own = [_fb(i, "long", i % 3 != 0) for i in range(3)]
    others = [_fb(100 + i, "short", False, reason)
              for i, reason in enumerate(["forced", "cache", "effort", "fallback", "shadow"] * 8)]
    r = realised(own + others, "v", "long", 0.98)
    assert (r["n"], r["n_cheap"], r["n_top"]) == (3, 0, 3)
    assert r["accuracy_ratio"] == 1.0 and r["holds_floor"] is True
    # the router's own cheap answers and its escalated ones do count
    mine = own + [_fb(200 + i, "short", False) for i in range(4)] + [_fb(300, "long", True, "escalated")]
    assert realised(mine + others, "v", "long", 0.98)["n"] == 8
    # an escalation counts when the router chose the escalated attempt, not when the client forced it or the
    # router explored (the retry's own reason is "escalated" either way; ``escalated_from`` says which)
    chosen = [{**_fb(400 + i, "long", False, "escalated"), "escalated_from": "predicted"} for i in range(3)]
    not_chosen = [{**_fb(500 + i, "long", False, "escalated"), "escalated_from": why}
                  for i, why in enumerate(["forced", "explore", "effort", "fallback"] * 5)]
    r = realised(mine + others + chosen + not_chosen, "v", "long", 0.98)
    assert (r["n"], r["n_top"]) == (11, 7)


def test_the_nesting_ratio_is_never_negative() -> None:
    """Few graded top answers, most wrong, many cheap answers wrong: the formula's loss passes 1; a ratio of two
    accuracies is still ≥ 0 (it read −0.42 in ``thinkgate router history``)."""
    outcomes = ([_fb(i, "long", i == 0) for i in range(3)]
                + [_fb(10 + i, "short", False) for i in range(40)])
    r = realised(outcomes, "v", "long", 0.98, spot_check_min=10**9)
    assert r["method"] == "nesting" and r["accuracy_ratio"] == 0.0 and r["holds_floor"] is False
