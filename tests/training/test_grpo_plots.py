"""The run plots' budget hooks: the start-up warm-up the ledger measures a figure by, and the finish's metric plots
drawn figure by figure while the budget left covers them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.grpo.ledger import METRIC_FIGURES
from training.grpo.plots import plot_metrics, warm_up


def _metrics(run_dir: Path) -> None:
    rows = [
        {"step": s, "loss": 0.1, "reward": 0.1 * s, "completions/mean_length": 10.0 + s, "entropy": 1.0,
         "signal/effective_ratio": 0.5}
        for s in range(1, 6)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_metrics_asks_before_each_figure_and_stops_at_the_first_no(tmp_path: Path) -> None:
    _metrics(tmp_path)
    asked: list[float] = []
    everything = plot_metrics(tmp_path, fits=lambda s: asked.append(s) is None)
    assert [p.name for p in everything] == ["reward.png", "length.png", "entropy.png", "signal.png"]
    assert len(asked) == METRIC_FIGURES == 4  # the ledger reserves this many figures
    assert asked[0] == 0.0 and all(s > 0 for s in asked[1:])  # the slowest figure drawn so far, in seconds

    out = tmp_path / "later"
    out.mkdir()
    _metrics(out)
    answers = iter([True, False, True])
    drawn = plot_metrics(out, fits=lambda s: next(answers))
    assert [p.name for p in drawn] == ["reward.png"]  # once it says no, no figure after it is drawn
    assert sorted(p.name for p in (out / "plots").glob("*.png")) == ["reward.png"]


def test_warm_up_renders_a_figure_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a figure saved by mistake would land here
    took = warm_up()
    assert 0.0 < took < 60.0
    assert list(tmp_path.iterdir()) == []
