"""The retrain label is "the cheaper tier sufficed", whatever graded the answer (issue 24, item 2): a hand-made
outcome set — client feedback, shadow calls with a judge, verifier checks, escalations — with the label each
routing window must get. Under the old rule (a top-tier answer graded wrong → "easy") the hard windows with
wrong top answers flip to easy and a window answered only on the top tier becomes a training item."""

from __future__ import annotations

from typing import Any

from router.fit.retrain import boundary_labels, items_from_outcomes, label_counts


def _o(window: str, source: str, tier: str, sufficed: bool | None, judge: str) -> dict[str, Any]:
    return {"source": source, "tier": tier, "sufficed": sufficed, "judge": judge, "window_digest": window,
            "text": f"the question of window {window}"}


# window → the label it must get (1 = the cheaper tier did not suffice; absent = nothing to learn)
EXPECTED = {"easy-feedback": 0, "easy-verifier": 0, "hard-shadow": 1, "hard-escalated": 1, "hard-top-wrong": 1}
OUTCOMES = [
    _o("easy-feedback", "feedback", "short", True, "client"),            # a thumbs-up on a cheap answer
    _o("easy-verifier", "shadow", "short", True, "verifier"),            # cheap answer checked right
    _o("easy-verifier", "feedback", "long", True, "client"),             # a top answer graded right: no label
    _o("hard-shadow", "shadow", "short", False, "agreement"),            # the next tier disagreed
    _o("hard-escalated", "escalation", "short", False, "escalation:empty_answer"),
    _o("hard-top-wrong", "shadow", "short", False, "verifier"),          # cheap wrong ...
    _o("hard-top-wrong", "feedback", "long", False, "client"),           # ... and top wrong twice: still hard
    _o("hard-top-wrong", "feedback", "long", False, "client"),
    _o("top-only", "feedback", "long", False, "client"),                 # only the top tier answered: nothing
    _o("top-only", "feedback", "long", True, "client"),
    _o("ungraded", "feedback", "short", None, "client"),                 # no grade: nothing
]


def test_hand_made_outcomes_get_the_cheaper_tier_sufficed_label() -> None:
    items = items_from_outcomes(OUTCOMES, "long")
    assert {it.id: it.label for it in items} == EXPECTED
    by_id = {it.id: it for it in items}
    assert by_id["hard-top-wrong"].meta["n"] == 1  # the two top-tier grades were dropped, not averaged in
    assert by_id["easy-verifier"].meta["by_source"] == {"shadow": 1}


def test_label_counts_per_source() -> None:
    assert label_counts(OUTCOMES, "long") == {
        "feedback": {"cheap_sufficed": 1, "cheap_failed": 0, "dropped": 6},
        "shadow": {"cheap_sufficed": 1, "cheap_failed": 2, "dropped": 0},
        "escalation": {"cheap_sufficed": 0, "cheap_failed": 1, "dropped": 0},
    }


# Three routed tiers, cheapest first: boundary 1 = none|short, boundary 2 = short|long. Answered on tier i: sufficed
# → 0 at every boundary above i; not sufficed → 1 at every boundary up to i + 1; the top tier (or a tier outside the
# ladder) → nothing. window → (label per boundary, pooled label)
TIERS = ["none", "short", "long"]
EXPECTED_3 = {
    "easy": ([0, 0], 0),              # right on none: none is enough, so is short
    "mid": ([1, 0], 1),               # wrong on none, right on short: a tie pools to 1 (the cautious side)
    "mid-short-only": ([None, 0], 0),  # right on short: nothing learnt about none
    "hard": ([1, 1], 1),              # wrong on short: neither none nor short is enough
    "hard-none-only": ([1, None], 1),  # wrong on none: nothing learnt about short
    "mixed": ([1, 0], 0),             # none right and wrong (a tie at none|short: 1), short right; pooled 1 of 4 → 0
}
OUTCOMES_3 = [
    _o("easy", "feedback", "none", True, "client"),
    _o("mid", "shadow", "none", False, "agreement"),
    _o("mid", "feedback", "short", True, "client"),
    _o("mid-short-only", "shadow", "short", True, "verifier"),
    _o("hard", "escalation", "short", False, "escalation:empty_answer"),
    _o("hard", "feedback", "long", False, "client"),                 # the top tier: no label
    _o("hard-none-only", "feedback", "none", False, "client"),
    _o("mixed", "feedback", "none", True, "client"),
    _o("mixed", "feedback", "none", False, "client"),
    _o("mixed", "feedback", "short", True, "client"),
    _o("top-only", "feedback", "long", True, "client"),
    _o("outside", "feedback", "xl", False, "client"),                # not a routed tier: its place is unknown
    _o("ungraded", "feedback", "none", None, "client"),
]


def test_three_tier_outcomes_get_one_label_per_boundary() -> None:
    assert boundary_labels({"tier": "none", "sufficed": True}, TIERS) == [0, 0]
    assert boundary_labels({"tier": "none", "sufficed": False}, TIERS) == [1, None]
    assert boundary_labels({"tier": "short", "sufficed": True}, TIERS) == [None, 0]
    assert boundary_labels({"tier": "short", "sufficed": False}, TIERS) == [1, 1]
    assert boundary_labels({"tier": "long", "sufficed": False}, TIERS) == [None, None]
    items = items_from_outcomes(OUTCOMES_3, TIERS)
    assert {it.id: (it.meta["by_boundary"], it.label) for it in items} == EXPECTED_3
    assert {it.id: it.meta["n"] for it in items}["hard"] == 1  # the top answer was dropped, not counted
    # two tiers: the same rule as before, given the top tier's name or both names (another tier is the cheap one)
    for tiers in ("long", ["short", "long"]):
        assert {it.id: it.label for it in items_from_outcomes(OUTCOMES, tiers)} == EXPECTED
        assert {it.id: it.meta["by_boundary"] for it in items_from_outcomes(OUTCOMES, tiers)} == {
            k: [v] for k, v in EXPECTED.items()}
