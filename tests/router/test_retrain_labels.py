"""The retrain label is "the cheaper tier sufficed", whatever graded the answer (issue 24, item 2): a hand-made
outcome set — client feedback, shadow calls with a judge, verifier checks, escalations — with the label each
routing window must get. Under the old rule (a top-tier answer graded wrong → "easy") the hard windows with
wrong top answers flip to easy and a window answered only on the top tier becomes a training item."""

from __future__ import annotations

from typing import Any

from router.fit.retrain import items_from_outcomes, label_counts


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
