"""``thinkgate train dial-sft`` is billed like the other training jobs: a cost ledger beside the model, listed by
``train runs``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.registry import list_runs

pytestmark = pytest.mark.slow


def test_dial_sft_writes_a_ledger_and_is_listed(tmp_path: Path) -> None:
    """It wrote no ledger, the one training job that did not: its CPU time was in no bill and ``train runs``
    did not list it. A second run into the same directory is refused (two runs under one bill)."""
    from typer.testing import CliRunner

    from gateway.cli.main import app

    out = tmp_path / "dial"
    args = ["train", "dial-sft", "--output-dir", str(out), "--steps", "3", "--max-minutes", "1"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["startup", "step", "step", "step", "finish"]
    assert rows[0]["startup_ms"] > 0 and rows[-1]["io_ms"] > 0
    steps = [r for r in rows if r["kind"] == "step"]
    assert all(r["prompts"] == 16 and r["trained_tokens"] > 0 and r["wall_ms"] > 0 for r in steps)
    assert rows[0]["method"] == "dial-sft" and rows[0]["git_commit"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 3 and summary["totals"]["cost_micro_usd"] == sum(r["cost_micro_usd"] for r in rows)
    assert (out / "config.json").is_file() and (out / "ledger.parquet").is_file()  # the model, beside its bill
    (rec,) = list_runs(tmp_path)
    assert rec.status == "finished" and rec.steps == 3 and rec.tags["method"] == "dial-sft"
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "already holds a run" in again.output, again.output
