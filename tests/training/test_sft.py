"""``thinkgate train sft``: TRL's SFTTrainer on verified teacher traces, billed like GRPO, in the registry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training.grpo.config import REPO_ROOT, ConfigError
from training.registry import list_runs


def sft_run(tmp: Path, name: str, **ledger: str) -> tuple[subprocess.CompletedProcess, Path]:
    run = tmp / name
    cfg = {
        "run_name": name,
        "output_dir": str(run),
        "task": {"n_train": 16, "n_eval": 4, "difficulties": [1, 2]},
        "eval": {"max_new_tokens": 48, "batch_size": 4},
        "ledger": {"price_usd_per_device_hour": {"cpu": "3.6"}, **ledger},
        "tags": {"owner": "ana"},
        "trl": {"per_device_train_batch_size": 4, "max_steps": 3},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "train", "sft", "--config", str(path)],
        cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return proc, run


def test_sft_run_is_billed_like_grpo_and_listed(tmp_path: Path) -> None:
    proc, run = sft_run(tmp_path, "sft-a")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["startup", "step", "step", "step", "finish"]
    steps = [r for r in rows if r["kind"] == "step"]
    assert all(r["trained_tokens"] > 0 and r["prompts"] == 4 and r["sampled_tokens"] == 0 for r in steps)
    assert rows[0]["startup_ms"] > 0 and rows[0]["eval_ms"] > 0 and rows[-1]["eval_ms"] > 0
    assert rows[0]["method"] == "sft" and rows[0]["owner"] == "ana" and rows[0]["data_hash"]
    # the training data are the verified traces, written to the run directory
    traces = [json.loads(x) for x in (run / "traces.jsonl").read_text().splitlines()]
    assert len(traces) == 16 and all("</think>" in t["completion"] for t in traces)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 3 and summary["accuracy_after"] is not None
    (rec,) = list_runs(tmp_path)
    assert rec.status == "finished" and rec.micro_usd == sum(r["cost_micro_usd"] for r in rows)
    assert rec.tags["method"] == "sft"


def test_sft_budget_stops_the_run(tmp_path: Path) -> None:
    # a budget below the start-up cost: the run stops before its first step would exceed it
    proc, run = sft_run(tmp_path, "sft-b", budget_usd="0.000001")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] and "budget usd" in summary["stop_reason"]
    assert summary["global_step"] < 3
    (rec,) = list_runs(tmp_path)
    assert rec.status == "stopped"


def test_traces_need_a_chain() -> None:
    from types import SimpleNamespace

    import pytest

    from training.sft.run import SFTRunConfig, teacher_traces

    p = SimpleNamespace(id="gsm8k-1", meta={})
    with pytest.raises(ConfigError, match="no chain"):
        teacher_traces([p], [{"problem_id": "gsm8k-1", "prompt": []}], SFTRunConfig(), None)


def test_ctrl_c_mid_training_is_billed(tmp_path: Path) -> None:
    """SFT had no interrupt billing: a SIGINT in the middle of training left the step in flight (and everything
    since the last step row) billed nowhere. Here a real SIGINT once a step is done: an ``interrupted`` row bills
    the time since the last row, and the registry counts it."""
    import signal
    import time

    run = tmp_path / "sft-i"
    cfg = {
        "run_name": "sft-i", "output_dir": str(run), "task": {"n_train": 16, "n_eval": 4, "difficulties": [1, 2]},
        "eval": {"before": False, "after": False}, "ledger": {"price_usd_per_device_hour": {"cpu": "3.6"}},
        "trl": {"per_device_train_batch_size": 4, "max_steps": 100_000},
    }  # fmt: skip
    path = tmp_path / "sft-i.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "train", "sft", "--config", str(path)],
                            cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        beat = run / "heartbeat.json"
        while time.monotonic() < deadline and proc.poll() is None:
            if beat.is_file() and json.loads(beat.read_text() or "{}").get("step", 0) >= 1:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, err[-2000:]
    rows = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "startup" and rows[-1]["kind"] == "interrupted", [r["kind"] for r in rows]
    assert rows[-1]["wall_ms"] > 0 and rows[-1]["step"] == max(r["step"] for r in rows if r["kind"] == "step")
    (rec,) = list_runs(tmp_path)
    assert rec.micro_usd == sum(r["cost_micro_usd"] for r in rows)
    assert rec.status == "interrupted"  # said `running` until the heartbeat went stale, then `abandoned`


def _sft_cfg(run: Path, **over: object) -> object:
    """A small in-process SFT run (16 problems, batches of 4, no evaluations) into ``run``."""
    from training.grpo.config import from_dict
    from training.sft.run import SFTRunConfig

    data = {"run_name": "sft-e", "output_dir": str(run), "task": {"n_train": 8, "n_eval": 2, "difficulties": [1]},
            "eval": {"before": False, "after": False}, "ledger": {"price_usd_per_device_hour": {"cpu": "3.6"}},
            "trl": {"per_device_train_batch_size": 4, "max_steps": 2}, **over}  # fmt: skip
    return from_dict(SFTRunConfig, data)


def test_an_error_during_start_up_is_billed(tmp_path: Path) -> None:
    """An SFT error was never billed (only its Ctrl-C, and not before the ledger existed): here the model does
    not load (a directory with an empty config.json) after the imports were paid for. The ``startup`` row bills
    process start to the error, then it propagates; the traces were not made, so the row's data hash is unknown."""
    import pytest

    from training.sft.run import run_sft

    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    run = tmp_path / "sft-e"
    with pytest.raises((OSError, ValueError)) as raised:
        run_sft(_sft_cfg(run, model={"path": str(broken)}))  # type: ignore[arg-type]
    [row] = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    assert row["kind"] == "startup" and row["startup_ms"] > 0 and row["cost_micro_usd"] > 0
    assert row["data_hash"] == "unknown" and row["method"] == "sft"
    (rec,) = list_runs(tmp_path)
    assert rec.micro_usd == row["cost_micro_usd"]
    # listed failed with the error (it said `running`, then `abandoned`)
    assert rec.status == "failed" and rec.stop_reason == f"{raised.type.__name__}: {raised.value}"


def test_an_error_after_the_steps_is_billed_as_an_interruption_is(tmp_path: Path) -> None:
    """An error past start-up — here saving the model fails (its path is taken by a file) — left the time since
    the last step row billed nowhere. Now an ``interrupted`` row, as a Ctrl-C writes, then the error propagates."""
    import pytest

    from training.sft.run import run_sft

    run = tmp_path / "sft-e"
    run.mkdir()
    (run / "model").write_text("not a directory")
    with pytest.raises(OSError):
        run_sft(_sft_cfg(run))  # type: ignore[arg-type]
    rows = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("startup", 0), ("step", 1), ("step", 2), ("interrupted", 2)]
    assert rows[-1]["wall_ms"] > 0 and rows[-1]["spent_micro_usd"] == sum(r["cost_micro_usd"] for r in rows)
    assert rows[-1]["data_hash"] == rows[0]["data_hash"] != "unknown"


def test_a_run_file_of_the_other_trainer_names_the_command_to_run() -> None:
    """The shipped smoke files swapped: the error says which command takes the file, not one unknown key per section."""
    from typer.testing import CliRunner

    from gateway.cli.main import app
    from training.grpo.config import load_config
    from training.sft.run import load_sft_config

    grpo_file = REPO_ROOT / "training" / "configs" / "smoke.yaml"
    sft_file = REPO_ROOT / "training" / "configs" / "sft_smoke.yaml"
    with pytest.raises(ConfigError, match=r"is an SFT run file \(it has `traces:`\): run it with `thinkgate train sft"):
        load_config(sft_file)
    with pytest.raises(ConfigError, match=r"GRPO run file \(it has `rewards:`\): run it with `thinkgate train grpo"):
        load_sft_config(grpo_file)
    load_config(grpo_file)  # each loads as its own kind
    load_sft_config(sft_file)
    r = CliRunner().invoke(app, ["train", "sft", "--config", str(grpo_file), "--output-dir", "/nonexistent/x"])
    assert r.exit_code == 2 and "thinkgate train grpo --config" in r.output and "unknown key" not in r.output
