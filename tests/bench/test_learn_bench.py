"""``thinkgate bench learn`` end to end, tiny: the real stack (Redis, the replay upstream, the gateway replicas),
a few dozen requests with feedback, the JSON contract and a consistent run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gateway.cli.main import app

TRACES = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
if not (TRACES / "frames").is_dir():
    TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"

SERVED = {"accuracy_ratio", "token_share", "savings", "holds_floor"}


@pytest.mark.skipif(not (TRACES / "frames").is_dir(), reason="the traces data set is not here")
def test_bench_learn_smoke(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TG_NO_PROGRESS", "1")
    cfg = tmp_path / "base.yaml"
    cfg.write_text(f"redis:\n  url: {redis_url}\n")
    out, details = tmp_path / "learn.json", tmp_path / "details.json"
    res = CliRunner().invoke(app, ["bench", "learn", "--traces", str(TRACES), "--dataset", "frames", "--ladder",
                                   "Qwen3-8B:no_think,exd0", "--feedback-rate", "0.5", "--steps", "30,60",
                                   "--every-outcomes", "15", "--json", str(out), "--png", str(tmp_path / "l.png"),
                                   "--details", str(details), "--config", str(cfg), "--time-budget-s", "240"])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert set(report) == {"dataset", "ladder", "feedback_rate", "steps", "offline_fit", "length"}
    assert (report["dataset"], report["ladder"], report["feedback_rate"]) == ("frames", "Qwen3-8B:no_think,exd0", 0.5)
    assert [s["requests"] for s in report["steps"]] == [30, 60]
    for s in report["steps"]:
        assert set(s) == {"requests", "outcomes", "router_version", "served", "shadow_cost_usd"}
        assert set(s["served"]) == SERVED and 0 <= s["served"]["token_share"] <= 1.5
        assert s["router_version"]
    assert report["steps"][1]["outcomes"] > report["steps"][0]["outcomes"] > 0  # feedback and shadow outcomes
    assert report["steps"][1]["shadow_cost_usd"] > 0
    assert set(report["offline_fit"]) == SERVED and set(report["length"]) == SERVED
    d = json.loads(details.read_text())
    assert d["answered"] == 60 and d["errors"] == 0 and d["feedback"] > 10
    assert (tmp_path / "l.png").stat().st_size > 1000
    assert "bench learn" not in res.output or "ThinkGate learning" in res.output


def test_the_png_draws_equal_reference_lines_once(tmp_path: Path) -> None:
    """When the offline fit and length serve the same savings (most ladders: both always-top, 0%), one reference
    line is named for both — drawn twice, the second hid the first and a reader saw no offline fit."""
    from bench.learn import plot

    def served(savings: float) -> dict[str, object]:
        return {"accuracy_ratio": 1.0, "token_share": 1 - savings, "savings": savings, "holds_floor": True}

    report = {"dataset": "frames", "ladder": "m:a,b", "feedback_rate": 0.25,
              "steps": [{"requests": 100, "served": served(0.0)}], "offline_fit": served(0.0), "length": served(0.0)}
    labels = plot(report, tmp_path / "same.png", {"served": served(0.03)})
    assert [x for x in labels if "offline fit" in x or "length" in x] == \
        ["offline fit = prompt length (calibrated): 0.0%"]
    labels = plot({**report, "offline_fit": served(0.306)}, tmp_path / "apart.png")
    assert sum("offline fit" in x for x in labels) == 1 and sum("prompt length" in x for x in labels) == 1
    assert (tmp_path / "same.png").read_bytes()[:4] == b"\x89PNG"
