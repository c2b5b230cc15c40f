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
