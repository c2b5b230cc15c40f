"""The shipped router's arithmetic labels come from measured tier outcomes (``router/assets/tier_outcomes.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.fit.default import TIER_OUTCOMES, arith_items, arith_threshold_from_outcomes


def _report(path: Path, short: dict[int, float], long: dict[int, float]) -> Path:
    def tier(acc: dict[int, float]) -> dict:
        by = {str(k): {"accuracy": a} for k, a in acc.items()}
        return {"accuracy": sum(acc.values()) / len(acc), "by_difficulty": by}

    path.write_text(json.dumps({"tiers": {"short": tier(short), "long": tier(long)}}))
    return path


def test_first_level_where_short_falls_behind(tmp_path: Path) -> None:
    p = _report(tmp_path / "t.json", {1: 1.0, 2: 0.95, 3: 0.5, 4: 0.9}, {1: 1.0, 2: 1.0, 3: 0.9, 4: 0.9})
    # 0.95 >= 0.95 * 1.0 keeps level 2 short; level 3: 0.5 < 0.855
    assert arith_threshold_from_outcomes(p) == 3
    assert arith_threshold_from_outcomes(p, keeps=0.99) == 2


def test_short_keeping_up_everywhere_means_nothing_is_long(tmp_path: Path) -> None:
    p = _report(tmp_path / "t.json", {1: 1.0, 2: 1.0}, {1: 1.0, 2: 0.9})
    assert arith_threshold_from_outcomes(p) == 3


def test_missing_file_or_tier_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="thinkgate eval tiers"):
        arith_threshold_from_outcomes(tmp_path / "absent.json")
    (tmp_path / "one.json").write_text(json.dumps({"tiers": {"long": {"by_difficulty": {}}}}))
    with pytest.raises(ValueError, match="needs tiers"):
        arith_threshold_from_outcomes(tmp_path / "one.json")


def test_shipped_outcomes_label_the_arith_items() -> None:
    k = arith_threshold_from_outcomes(TIER_OUTCOMES)
    items = arith_items("test", 5, threshold=None)
    assert {it.label for it in items if it.meta["difficulty"] < k} <= {0}
    assert {it.label for it in items if it.meta["difficulty"] >= k} <= {1}
    assert any(it.label == 1 for it in items) and any(it.label == 0 for it in items)


def test_trace_outcome_items_and_heldout_questions(tmp_path: Path) -> None:
    from router.fit.default import trace_items
    from router.fit.jsonl import write_jsonl
    from router.fit.traces import is_heldout

    ids = [str(i) for i in range(40)]
    rows = [{"dataset": "frames", "id": q, "question": f"q{q}",
             "outcomes": {"m__no_think": i % 3 == 0, "m__budget256": True, "m__budget1024": i % 2 == 0,
                          "solo__no_think": True}} for i, q in enumerate(ids)]
    p = tmp_path / "o.jsonl.gz"
    write_jsonl(p, rows)
    train, held = trace_items(p), trace_items(p, heldout=True)
    assert {it.group for it in held} == {f"frames/{q}" for q in ids if is_heldout("frames", q)}
    assert not {it.group for it in train} & {it.group for it in held} and len(train) + len(held) == 40
    for it in train + held:  # cheapest (no_think) wrong and top (budget1024) right; one-setting models skipped
        i = int(it.group.split("/")[1])
        assert it.label == int(i % 2 == 0 and i % 3 != 0) and it.meta["model"] == "m"
        assert it.short_correct == (i % 3 == 0) and it.long_correct == (i % 2 == 0)


def test_vs_length_compares_auc_with_prompt_length() -> None:
    import numpy as np

    from router.fit.default import mmlu_heldout_subject, vs_length
    from router.fit.labels import LabelledItem

    items = [LabelledItem(id=str(i), text="x" * (i + 1), label=int(i % 2 == 0), source="s") for i in range(10)]
    good = vs_length("s", "held-out questions", items, np.array([it.label for it in items], dtype=float))
    assert good["auc"] == 1.0 and good["length_auc"] == 0.4 and good["ok"]  # (0+1+..+4 wins of 25 pairs)
    bad = vs_length("s", "held-out questions", items, np.array([1 - it.label for it in items], dtype=float))
    assert bad["auc"] == 0.0 and not bad["ok"]
    subjects = [f"subject{i}" for i in range(400)]
    share = sum(map(mmlu_heldout_subject, subjects)) / 400
    assert 0.14 < share < 0.26 and mmlu_heldout_subject("abstract_algebra") == mmlu_heldout_subject("abstract_algebra")
