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


def test_ctrl_c_on_dial_sft_is_billed_and_the_run_is_listed_interrupted(tmp_path: Path) -> None:
    """``train dial-sft`` (and ``train tiny``, the same bill) had no Ctrl-C billing: a SIGINT mid-training left the
    step in flight billed nowhere, and the run said ``running`` until its heartbeat went stale. Here a real SIGINT
    to this process once a step is billed (a watcher thread reads the heartbeat): an ``interrupted`` row for the
    time since the last row, and the run ``interrupted``."""
    import os
    import signal
    import threading
    import time

    from training.tiny.dial_sft import dial_stage, run_dial_sft

    out = tmp_path / "dial"
    stop = threading.Event()

    def interrupt_after_step_1() -> None:
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                if json.loads((out / "heartbeat.json").read_text()).get("step", 0) >= 1:
                    os.kill(os.getpid(), signal.SIGINT)  # the main thread raises KeyboardInterrupt where it is
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.02)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher = threading.Thread(target=interrupt_after_step_1, daemon=True)
    try:
        watcher.start()
        with pytest.raises(KeyboardInterrupt):
            run_dial_sft(dial_stage(steps=100_000, max_minutes=1.0), out, log=lambda _: None)
    finally:
        stop.set()
        watcher.join(timeout=5)
        signal.signal(signal.SIGINT, previous)
    rows = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in rows]
    assert kinds[0] == "startup" and kinds[-1] == "interrupted" and "step" in kinds, kinds
    assert rows[-1]["wall_ms"] > 0 and rows[-1]["step"] == max(r["step"] for r in rows if r["kind"] == "step")
    assert rows[-1]["spent_micro_usd"] == sum(r["cost_micro_usd"] for r in rows)
    (rec,) = list_runs(tmp_path)
    assert rec.status == "interrupted" and rec.micro_usd == sum(r["cost_micro_usd"] for r in rows)


def test_an_error_in_train_tiny_is_billed(tmp_path: Path) -> None:
    """An error once the bill has started — here stage 3's model does not load (a directory with an empty
    config.json) — left the start-up billed nowhere. The ``startup`` row bills it, then the error propagates."""
    from typer.testing import CliRunner

    from gateway.cli.main import app

    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    out = tmp_path / "tiny"
    r = CliRunner().invoke(app, ["train", "tiny", "--output-dir", str(out), "--from-stage2", str(broken),
                                 "--steps3", "2", "--eval-n", "0"])
    assert r.exit_code != 0 and r.exception is not None and not isinstance(r.exception, SystemExit), r.output
    [row] = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert row["kind"] == "startup" and row["startup_ms"] > 0 and row["method"] == "tiny-sft"
    (rec,) = list_runs(tmp_path)
    assert rec.micro_usd == row["cost_micro_usd"] > 0
    # listed failed with the error (it said `running`, then `abandoned`)
    assert rec.status == "failed" and rec.stop_reason == f"{type(r.exception).__name__}: {r.exception}"


@pytest.mark.parametrize("command", ["tiny", "dial-sft"])
def test_a_model_path_that_is_no_model_directory_is_refused_before_the_bill(tmp_path: Path, command: str) -> None:
    """Now that an error is billed, a mistyped ``--from-stage2`` / ``--init-from`` would leave a ledger, and the
    directory then refuses the corrected command: refused first (exit 2), nothing written."""
    from typer.testing import CliRunner

    from gateway.cli.main import app

    flag = "--from-stage2" if command == "tiny" else "--init-from"
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["train", command, "--output-dir", str(out), flag, str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "no Hugging Face model directory" in r.output, r.output
    assert not out.exists()


def test_train_tiny_without_output_dir_leaves_the_shipped_model_alone(tmp_path: Path, monkeypatch) -> None:
    """A plain ``thinkgate train tiny`` (the README's command) wrote its ledger into the tracked models/thinkgate-tiny
    at once: a Ctrl-C left the shipped model directory holding an interrupted run, refused by every later
    ``train tiny``. It now writes to ./runs/tiny: here a runs/tiny that already holds a run is the one refused."""
    import inspect

    from typer.testing import CliRunner

    from gateway.cli.main import app
    from training.cli import tiny
    from training.models import TINY_MODEL_DIR

    default = Path(inspect.signature(tiny).parameters["output_dir"].default.default)
    assert not default.is_absolute() and default.resolve() != TINY_MODEL_DIR.resolve()  # (fails fast without the fix)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "runs" / "tiny" / "ledger.jsonl").write_text("")
    shipped = sorted(p.name for p in TINY_MODEL_DIR.iterdir())
    r = CliRunner().invoke(app, ["train", "tiny", "--from-stage2", str(TINY_MODEL_DIR)])
    assert r.exit_code == 2 and "runs/tiny already holds a run" in r.output, r.output
    assert sorted(p.name for p in TINY_MODEL_DIR.iterdir()) == shipped
