"""``thinkgate train dial-sft`` and ``thinkgate train tiny`` are billed like the other training jobs: a cost ledger
beside the model, listed by ``train runs``."""

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


def test_train_tiny_bills_its_stages_as_one_run(tmp_path: Path) -> None:
    """``train tiny`` wrote no ledger (three stages of CPU time in no bill, the run not in ``train runs``). Its
    three stages are one run: steps numbered on across stages (each optimizer step once), the time between
    stages billed as ``io``, the finish row after the model is saved; a second run into the directory refused."""
    from typer.testing import CliRunner

    from gateway.cli.main import app

    out = tmp_path / "tiny"
    args = ["train", "tiny", "--output-dir", str(out), "--steps", "3", "--steps2", "2", "--steps3", "2",
            "--eval-n", "0", "--max-minutes", "1", "--max-minutes2", "1", "--max-minutes3", "1"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [
        ("startup", 0), ("step", 1), ("step", 2), ("step", 3),
        ("startup", 3), ("step", 4), ("step", 5),
        ("startup", 5), ("step", 6), ("step", 7),
        ("finish", 7),
    ]
    assert rows[0]["startup_ms"] > 0 and rows[4]["io_ms"] > 0 and rows[4]["startup_ms"] == 0
    prompts = [r["prompts"] for r in rows if r["kind"] == "step"]
    assert prompts == [24, 24, 24, 16, 16, 16, 16]  # stage 1 batches of 24, stages 2 and 3 of 16
    assert all(r["trained_tokens"] > 0 for r in rows if r["kind"] == "step")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 7
    assert summary["totals"]["cost_micro_usd"] == sum(r["cost_micro_usd"] for r in rows)
    assert (out / "model.safetensors").is_file() and not (out / "stage2").exists()
    (rec,) = list_runs(tmp_path)
    assert rec.status == "finished" and rec.steps == 7 and rec.tags["method"] == "tiny-sft"
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "already holds a run" in again.output, again.output
