"""Whole-run billing: the smoke config's ledger bills >= 95% of the process's wall time x devices, by phase.

The run is a real ``python -m training.grpo`` process (the command behind ``thinkgate train grpo``) timed from the
outside, so interpreter start, imports, model load, both evaluations, checkpoints, the saved model and the plots
all count against the 95%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_config_ledger_bills_the_whole_process(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "training.grpo", "--config", str(ROOT / "training/configs/smoke.yaml")]
    cmd += ["--max-steps", "2", "--output-dir", str(out), "--quiet", "--allow-dirty"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    wall_ms = (time.perf_counter() - t0) * 1000
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["startup", "step", "step", "finish"]
    devices = summary["device_count"]
    billed_ms = summary["device_hours"] * 3.6e6
    assert billed_ms >= 0.95 * wall_ms * devices, (billed_ms, wall_ms, summary["billed_ms_by_phase"])
    assert billed_ms <= wall_ms * devices  # and never more than the process took
    phases = summary["billed_ms_by_phase"]
    assert set(phases) == {"startup", "sampling", "reward", "update", "eval", "io"}
    assert all(phases[p] > 0 for p in ("startup", "sampling", "update", "eval", "io")), phases
    assert sum(phases.values()) == summary["totals"]["wall_ms"]
    # the evaluations before and after training are billed (they measured the accuracy the USD/point divides by)
    assert rows[0]["eval_ms"] > 0 and rows[-1]["eval_ms"] > 0
    assert rows[-1]["cum_cost_micro_usd"] == summary["totals"]["cost_micro_usd"]
