"""Per-boundary cuts of automatic retraining with three routed tiers (``router/fit/promote.py``): each boundary's
floor is its share of the budget, a boundary without labelled windows is never crossed downwards, cuts are made
monotone by lowering (never raising) a cut, and the composed estimate adds the boundaries' losses."""

from __future__ import annotations

import numpy as np

from router.fit.labels import LabelledItem
from router.fit.promote import Rates, boundary_floor, boundary_rates, fit_cuts, policy_estimate


def _item(i: int, by_boundary: list[int | None]) -> LabelledItem:
    known = [x for x in by_boundary if x is not None]
    return LabelledItem(id=f"w{i}", text=f"w{i}", label=int(np.mean(known) >= 0.5), source="outcomes",
                        meta={"by_boundary": by_boundary})


SURE = Rates(1.0, 0.0, 1000, 1000)  # q = 1 at the bounds: every label-1 window sent below costs a right answer
M = 300  # copies of each hand-made window: holds_floor reads the lost count at an upper 90% bound, and at 0 wrong
# of the 2 of 6 windows sent cheap that bound alone (0.9 windows) breaks a 0.99 floor; of 1,800 it is 0.001 of them


def _tiled(scores: list[float], items: list[LabelledItem]) -> tuple[np.ndarray, list[LabelledItem]]:
    """``M`` copies of each (score, window), each copy its own window."""
    out = [LabelledItem(id=f"{it.id}.{j}", text=f"{it.text}.{j}", label=it.label, source=it.source, meta=it.meta)
           for it in items for j in range(M)]
    return np.repeat(np.asarray(scores, dtype=np.float64), M), out


def test_boundary_floor_splits_the_budget() -> None:
    assert boundary_floor(0.98, 2) == 0.98
    assert abs(boundary_floor(0.98, 3) - 0.99) < 1e-12
    assert abs(boundary_floor(0.97, 4) - 0.99) < 1e-12


def test_cuts_hold_each_boundary_and_are_monotone() -> None:
    raw = [0.1, 0.2, 0.5, 0.6, 0.9, 0.95]
    # boundary 1 needs crossing from 0.5 up; boundary 2 only from 0.9 — but its labels sit lower than boundary 1's
    scores, items = _tiled(raw, [_item(0, [0, 0]), _item(1, [0, 0]), _item(2, [1, 0]), _item(3, [1, 0]),
                                 _item(4, [1, 1]), _item(5, [1, 1])])
    assert fit_cuts(scores, items, [SURE, SURE], 0.98) == [0.5, 0.9]
    # boundary 2's evidence alone would allow 0.9, boundary 1's only 0.95: boundary 1 is lowered to 0.9, not 2 raised
    _, late = _tiled(raw, [_item(0, [0, 0]), _item(1, [0, 0]), _item(2, [0, 0]), _item(3, [0, 0]),
                           _item(4, [0, 1]), _item(5, [1, 1])])
    assert fit_cuts(scores, late, [SURE, SURE], 0.98) == [0.9, 0.9]
    # no window labelled at boundary 2: nothing may stay below it, so both cuts go to 0
    _, blind = _tiled(raw, [_item(i, [i // 3, None]) for i in range(6)])
    assert fit_cuts(scores, blind, [SURE, SURE], 0.98) == [0.0, 0.0]


def test_few_windows_hold_no_floor_at_the_bound() -> None:
    """The same six windows without copies: no label-1 window goes below 0.5 at boundary 1, but 0 wrong of the 2
    sent cheap is read at its upper 90% Wilson bound (0.9 windows, a ratio of 0.85): no cut that sends a window
    cheap holds 0.99, while the point estimate says 1.0. This is the guard against promoting on a handful of
    held-back windows; sending nothing cheap still holds (nothing lost)."""
    scores = np.array([0.1, 0.2, 0.5, 0.6, 0.9, 0.95])
    items = [_item(0, [0, 0]), _item(1, [0, 0]), _item(2, [1, 0]), _item(3, [1, 0]), _item(4, [1, 1]),
             _item(5, [1, 1])]
    total, per = policy_estimate(scores, items, [0.5, 0.9], [SURE, SURE], 0.98)
    assert per[0].accuracy_ratio == 1.0 and per[0].ratio_low is not None and per[0].ratio_low < 0.9
    assert total.holds_floor is False
    cuts = fit_cuts(scores, items, [SURE, SURE], 0.98)
    assert all(c <= scores.min() for c in cuts), cuts  # every window up
    nothing, _ = policy_estimate(scores, items, cuts, [SURE, SURE], 0.98)
    assert nothing.holds_floor and nothing.ratio_low == 1.0 and nothing.cheap_share == 0.0


def test_the_composed_estimate_adds_the_boundaries_losses() -> None:
    scores, items = _tiled([0.1, 0.2, 0.5, 0.6, 0.9, 0.95],
                           [_item(0, [0, 0]), _item(1, [0, 0]), _item(2, [1, 0]), _item(3, [1, 0]), _item(4, [1, 1]),
                            _item(5, [1, 1])])
    total, per = policy_estimate(scores, items, [0.55, 0.92], [SURE, SURE], 0.98)  # one loss at each boundary
    assert [e.holds_floor for e in per] == [False, False]
    assert abs(total.accuracy_ratio - (1 - (1 - per[0].accuracy_ratio) - (1 - per[1].accuracy_ratio))) < 1e-6
    assert total.holds_floor is False and total.n == 6 * M
    # tiers 0, 0, 0, 1, 1, 2: boundaries below the top not crossed, averaged over (k - 1) = 2
    assert abs(total.cheap_share - (2 + 2 + 2 + 1 + 1 + 0) / 12) < 1e-6
    ok, _ = policy_estimate(scores, items, [0.5, 0.9], [SURE, SURE], 0.98)
    assert ok.holds_floor and ok.accuracy_ratio == 1.0


def test_each_boundary_reads_q_from_its_own_explored_arm() -> None:
    """Three tiers: boundary b's rates are the explored answers on ``tiers[b-1]`` (decisions for ``tiers[b]``)
    against the router's own answers on ``tiers[b]``; a boundary without both arms reads none (q = 1) — never the
    pooled feedback of the two tiers."""
    def fb(tier: str, ok: bool, reason: str, version: str = "v1") -> dict[str, object]:
        return {"source": "feedback", "tier": tier, "sufficed": ok, "route_reason": reason, "router_version": version}

    outs = [fb("none", i % 4 == 0, "explore") for i in range(40)]   # cheap arm of none|short: 25% right
    outs += [fb("short", i % 4 != 0, "predicted") for i in range(40)]  # its top arm: 75% right
    outs += [fb("short", True, "predicted", "v0") for _ in range(40)]  # another version's: not this router's arm
    outs += [fb("long", True, "predicted") for _ in range(40)]  # short|long has no explored answers on short
    lower, upper = boundary_rates(outs, ["none", "short", "long"], "v1", 30)
    assert (lower.source, lower.n_cheap, lower.n_top, lower.p_cheap, lower.p_top) == ("explore", 40, 40, 0.25, 0.75)
    assert 0.5 < lower.q < 1.0
    assert (upper.source, upper.q) == ("none", 1.0)
    assert (upper.n_top, upper.n_cheap) == (40, 0)  # how far the arms are from the minimum, shown in the event


def test_a_window_without_evidence_at_a_boundary_sent_below_it_counts_as_lost() -> None:
    """Three tiers: the window at 0.15 was only ever answered on ``short`` (sufficed: 0 at short|long, nothing at
    none|short). A cut that sends it to ``none`` counts it as a loss there (the strict reading), so the first cut
    stays at it; ignoring it, the cut went to 0.8 and the window to ``none`` unseen."""
    scores, items = _tiled([0.1, 0.15, 0.2, 0.8],
                           [_item(0, [0, 0]), _item(1, [None, 0]), _item(2, [0, 0]), _item(3, [1, 1])])
    assert fit_cuts(scores, items, [SURE, SURE], 0.98) == [0.15, 0.8]
    total, per = policy_estimate(scores, items, [0.8, 0.8], [SURE, SURE], 0.98)
    assert total.holds_floor is False
    assert per[0].holds_floor is False and per[0].n == 4 * M and per[1].holds_floor is True
    _, per_ok = policy_estimate(scores, items, [0.15, 0.8], [SURE, SURE], 0.98)
    assert per_ok[0].holds_floor is True and per_ok[0].n == 3 * M  # the unlabelled window is sent up: not counted
