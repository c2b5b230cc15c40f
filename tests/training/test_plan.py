"""The cost planner: formulas on a hand-computed config, estimate vs actual, and a real probe's bill counted."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from training.grpo.config import REPO_ROOT, RunConfig, from_dict, validate
from training.grpo.ledger import CostLedger, StepCounters
from training.plan.estimate import count_parameters
from training.plan.planner import make_plan, report
from training.registry import list_runs

PRICE = Decimal("3.6")  # USD per device-hour: exactly 1 micro-USD per device-millisecond


def write_model(d: Path, shapes: dict[str, list[int]]) -> Path:
    """A safetensors file whose header declares ``shapes`` (zero-filled float32 data)."""
    d.mkdir(parents=True, exist_ok=True)
    header, off = {}, 0
    for name, shape in shapes.items():
        n = 4
        for s in shape:
            n *= s
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(off))
    (d / "config.json").write_text("{}")
    return d


def run_cfg(model: Path, **trl: object) -> dict:
    return {
        "run_name": "hand",
        "model": {"path": str(model)},
        "task": {"n_train": 16, "n_eval": 4},
        "dynamic_sampling": {"enabled": True},
        "eval": {"before": True, "after": False},
        "ledger": {"price_usd_per_device_hour": {"cpu": str(PRICE)}},
        "trl": {"num_generations": 2, "per_device_train_batch_size": 4, "save_steps": 1, "max_steps": 2, **trl},
    }


def reference_run(tmp: Path, model: Path) -> Path:
    """A 2-step reference run billed by the real ledger with hand-picked phase times (ms = micro-USD at PRICE)."""
    d = tmp / "ref"
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump(run_cfg(model)))
    led = CostLedger(d, "cpu", 1, PRICE, tags={"owner": "ana"})
    led.record_overhead("startup", 0, {"startup": 1.0, "eval": 0.4})
    c = StepCounters(rollouts=6, sampled_tokens=60, trained_tokens=40, generation_s=0.6, reward_s=0.006)
    led.record(1, c, 0.6 + 0.006 + 0.4)
    c2 = StepCounters(rollouts=6, sampled_tokens=60, trained_tokens=40, generation_s=0.6, reward_s=0.006, io_s=0.05)
    led.record(2, c2, 0.6 + 0.006 + 0.4 + 0.05)  # the io of checkpoint-1
    led.record_overhead("finish", 2, {"io": 0.15})  # checkpoint-2 + the saved model
    (d / "eval_before.json").write_text(json.dumps({"overall": {"mean_completion_tokens": 10.0}}))
    return d


def test_count_parameters_reads_the_safetensors_header(tmp_path: Path) -> None:
    m = write_model(tmp_path / "m", {"a": [10, 50], "b": [500]})
    assert count_parameters(m) == 1000


def test_plan_formulas_on_a_hand_computed_config(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", {"w": [1000]})  # P = 1000
    ref = reference_run(tmp_path, model)
    # Reference rates (by hand): sampling 1200 ms / 120 tokens / 1000 P = 0.01 ms per param-token; update 800 / 80 /
    # 1000 = 0.01; reward 12 ms / 12 rollouts = 1; eval 400 ms / (4 completions x 10 tokens x 1000) = 0.01;
    # oversample 12 rollouts / 8 trained = 1.5; trained length 80 / 8 = 10; checkpoint io 50, final io 150 - 50 = 100.
    target = run_cfg(model, max_steps=10, per_device_train_batch_size=8, save_steps=5)
    target["task"]["n_eval"] = 8
    target["eval"] = {"before": True, "after": True, "every_steps": 4, "every_n": 2}
    plan = make_plan(validate(from_dict(RunConfig, target)), reference=ref)
    m = plan["assumptions"]["micro_usd"]
    # sampling: 10 steps x 8 rollouts x 1.5 x 10 tokens = 1200 tokens x 1000 x 0.01 = 12000 ms
    assert plan["sampled_tokens"] == 1200 and m["sampling"]["usd"] == 12000
    assert m["reward"]["usd"] == 120  # 120 rollouts x 1 ms
    # update: trained 10 x 8 x 10 = 800 tokens x 1000 x 0.01 = 8000 ms
    assert plan["trained_tokens"] == 800 and m["update"]["usd"] == 8000
    # eval: (before + after) x 8 + (10 // 4 = 2 checks + the final weights) x 2 = 22 completions x 10 x 1000 x 0.01
    assert plan["assumptions"]["run"]["eval_completions"] == 22 and m["eval"]["usd"] == 2200
    assert m["startup"]["usd"] == 1000
    assert m["io"]["usd"] == 2 * 50 + 100
    assert m["total"] == 23520 and plan["total_usd"] == 0.02352
    assert set(plan) == {"phases", "total_usd", "low_usd", "high_usd", "sampled_tokens", "trained_tokens",
                         "assumptions"}  # fmt: skip
    assert set(plan["phases"]["sampling"]) == {"device_hours", "usd", "low_usd", "high_usd"}
    assert plan["phases"]["sampling"]["device_hours"] == 12000 / 3.6e6
    # no step-to-step spread in the reference: the band is the +-25% floor
    assert m["sampling"]["low_usd"] == 9000 and m["sampling"]["high_usd"] == 15000
    assert plan["low_usd"] < plan["total_usd"] < plan["high_usd"]
    # an explicit price overrides the run file's price list: $7.2/h doubles every phase
    plan2 = make_plan(validate(from_dict(RunConfig, target)), reference=ref, price_usd_per_device_hour=Decimal("7.2"))
    assert plan2["assumptions"]["micro_usd"]["total"] == 2 * 23520


def test_a_resumed_reference_run_counts_one_start_up(tmp_path: Path) -> None:
    """A reference run resumed once has two start-up rows (two processes); the planned run starts once."""
    model = write_model(tmp_path / "m", {"w": [1000]})
    d = tmp_path / "resumed"
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump(run_cfg(model)))
    led = CostLedger(d, "cpu", 1, PRICE)
    led.record_overhead("startup", 0, {"startup": 1.0, "eval": 0.4})
    led.record(1, StepCounters(rollouts=6, sampled_tokens=60, trained_tokens=40, generation_s=0.6), 1.0)
    led.save_state(d / "checkpoint-1")
    led.record(2, StepCounters(rollouts=6, sampled_tokens=60, trained_tokens=40, generation_s=0.6), 1.0)
    # killed after step 2; the resume from checkpoint-1 starts a second process with its own start-up
    led2 = CostLedger(d, "cpu", 1, PRICE)
    led2.resume(d / "checkpoint-1")
    led2.record_overhead("startup", 1, {"startup": 1.0})
    led2.record(2, StepCounters(rollouts=6, sampled_tokens=60, trained_tokens=40, generation_s=0.6), 1.0)
    led2.record_overhead("finish", 2, {"io": 0.1})
    starts = [r for r in led2.rows() if r["kind"] == "startup"]
    assert [r["startup_ms"] for r in starts] == [1000, 1000]
    plan = make_plan(validate(from_dict(RunConfig, run_cfg(model))), reference=d)
    assert plan["assumptions"]["micro_usd"]["startup"]["usd"] == 1000  # one start-up (1 s at 1 micro-USD/ms), not 2


def test_a_reference_run_of_another_model_is_named_in_a_warning(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", {"w": [1000]})
    ref = reference_run(tmp_path, model)
    same = make_plan(validate(from_dict(RunConfig, run_cfg(model))), reference=ref)
    assert same["assumptions"]["warnings"] == []
    other = write_model(tmp_path / "m2", {"w": [2000]})
    plan = make_plan(validate(from_dict(RunConfig, run_cfg(other))), reference=ref)
    [w] = plan["assumptions"]["warnings"]
    assert str(model) in w and str(other) in w and "--probe-steps" in w
    # the size is in the rates (per parameter-token): twice the parameters, twice the sampling cost
    m1, m2 = same["assumptions"]["micro_usd"], plan["assumptions"]["micro_usd"]
    assert m2["sampling"]["usd"] == 2 * m1["sampling"]["usd"]


def test_report_of_a_run_planned_from_itself_has_no_error(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", {"w": [1000]})
    ref = reference_run(tmp_path, model)
    cfg = validate(from_dict(RunConfig, run_cfg(model)))
    rep = report(make_plan(cfg, reference=ref), ref)
    for phase, r in rep["phases"].items():
        assert r["actual_usd"] == r["estimate_usd"], phase
    assert rep["total"]["actual_usd"] == 0.003612 and rep["total"]["error"] == 0.0
    assert rep["tokens"]["sampled"] == {"estimate": 120, "actual": 120}


def test_probe_billing_is_counted(tmp_path: Path) -> None:
    """A real 1-step probe (subprocess) on the shipped tiny model: its whole bill is in the plan and the registry."""
    cfg = {
        "run_name": "probe-test",
        "output_dir": str(tmp_path / "unused"),
        "task": {"n_train": 8, "n_eval": 2, "difficulties": [1]},
        "rewards": [{"name": "correctness", "weight": 1.0}],
        "eval": {"max_new_tokens": 16, "batch_size": 2},
        "tags": {"owner": "ana"},
        "trl": {"num_generations": 2, "per_device_train_batch_size": 2, "max_completion_length": 16, "max_steps": 9},
    }
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "train", "plan", "--config", str(cfg_path), "--json", str(out),
         "--probe-steps", "1", "--usd-per-device-hour", "3.6"],
        cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(out.read_text())
    probe = plan["assumptions"]["probe"]
    probe_dir = Path(probe["run_dir"])
    rows = [json.loads(x) for x in (probe_dir / "ledger.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["startup", "step", "finish"]
    assert probe["steps"] == 1
    assert probe["micro_usd"] == sum(r["cost_micro_usd"] for r in rows) > 0
    # start-up (imports, model load) and the evaluation before training are billed, not only the step
    assert rows[0]["startup_ms"] > 0 and rows[0]["eval_ms"] > 0
    assert "probe:" in proc.stdout and f"${probe['usd']:.6f}" in proc.stdout
    # the probe is a run of its own in the registry, tagged, with the same bill
    (rec,) = list_runs(tmp_path)
    assert rec.tags["purpose"] == "probe" and rec.tags["owner"] == "ana"
    assert rec.micro_usd == probe["micro_usd"] and rec.status == "finished"
    # the probe's rollouts are stored, and the ledger counts their bytes in the step's row
    roll = probe_dir / "rollouts" / "step-000001.jsonl"
    first = json.loads(roll.read_text().splitlines()[0])
    assert set(first) == {"step", "problem_id", "completion", "rewards", "advantage", "prompt_tokens",
                          "completion_tokens", "truncated"}  # fmt: skip
    assert set(first["rewards"]) == {"correctness"}
    stats = probe_dir / "rollouts" / "stats.jsonl"
    assert rows[1]["stored_bytes"] == roll.stat().st_size + stats.stat().st_size > 0
    # the plan is for the full 9 steps of the run file, with the probe's rates
    assert plan["assumptions"]["run"]["steps"] == 9 and plan["total_usd"] > 0


def test_plan_cli_rejects_bad_input(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "gateway", "train", "plan", "--config", "training/configs/smoke.yaml",
            "--json", str(tmp_path / "p.json")]  # fmt: skip
    for extra, msg in (
        (["--probe-steps", "1", "--from-run", str(tmp_path)], "give one of them"),
        (["--from-run", str(tmp_path), "--usd-per-device-hour", "abc"], "not a decimal"),
        (["--from-run", str(tmp_path)], "config.yaml"),
    ):
        proc = subprocess.run(base + extra, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and msg in proc.stderr, (extra, proc.stderr)
    # options the run would refuse make no plan (it used to print one)
    bad = tmp_path / "bad.yaml"
    bad.write_text("trl:\n  learning_rate: fast\n")
    proc = subprocess.run([*base[:5], "--config", str(bad), "--from-run", str(tmp_path), "--json",
                           str(tmp_path / "p.json")], cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "trl.learning_rate: expected a number, got 'fast'" in proc.stderr, proc.stderr
    # an SFT run file: said plainly (it failed on "traces: unknown key")
    proc = subprocess.run([*base[:5], "--config", "training/configs/sft_smoke.yaml", "--from-run", str(tmp_path),
                           "--json", str(tmp_path / "p.json")], cwd=str(REPO_ROOT), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "is an SFT run file" in proc.stderr and "GRPO runs only" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", ["smoke", "short_tier", "bench"])
def test_shipped_configs_have_a_shape(name: str) -> None:
    from training.grpo.config import load_config
    from training.plan.estimate import run_shape
    from training.plan.planner import resolved

    cfg = load_config(REPO_ROOT / "training" / "configs" / f"{name}.yaml")
    shape = run_shape(resolved(cfg), 1)
    assert shape.steps == cfg.trl_kwargs()["max_steps"] and shape.eval_completions > 0


def test_report_phase_actuals_add_up_to_the_total_at_each_rows_price(tmp_path: Path) -> None:
    """N6 D4: ``train report``'s phases read 278 micro-USD against a total of 277 (each phase's summed ms rounded
    once, not per row), and took every row's price from the first row. Rows here: the smoke run's shape at the
    cpu price ($0.05/h = 1/72 micro-USD per ms), then a segment resumed on a device at $3.6/h (the real resume).
    The actual total is all the run spent, the row the resume rolled back included (it left it out, and read less
    than ``summary.json``'s ``spent_usd``): shown apart as ``rolled_back``."""
    from training.grpo.ledger import phase_costs
    from training.plan.planner import actual_by_phase, format_report

    d = tmp_path / "run"
    led = CostLedger(d, "cpu", 1, Decimal("0.05"))
    led.record_overhead("startup", 0, {"startup": 0.100, "eval": 0.050})
    c = StepCounters(generation_s=0.030, reward_s=0.030, io_s=0.030)
    led.record(1, c, 0.130)
    led.save_state(d / "checkpoint-1")
    led.record(2, StepCounters(generation_s=0.030, reward_s=0.030), 0.100)  # rolled back by the resume below
    led2 = CostLedger(d, "nvidia-x", 1, PRICE)  # resumed on another device kind: 1 micro-USD per ms
    led2.resume(d / "checkpoint-1")
    led2.record_overhead("startup", 1, {"startup": 0.007})
    led2.record(2, StepCounters(generation_s=0.003, reward_s=0.002), 0.006)
    led2.record_overhead("finish", 2, {"eval": 0.001, "io": 0.002})
    rows = led2.rows()
    [rolled] = [json.loads(x) for x in (d / "ledger_discarded.jsonl").read_text().splitlines()]
    assert rolled["cost_micro_usd"] == 1  # 100 ms at 1/72 micro-USD per ms
    act = actual_by_phase(d)
    assert sum(act[p]["micro_usd"] for p in ("startup", "sampling", "reward", "update", "eval", "io")) == (
        act["total_micro_usd"]) == sum(r["cost_micro_usd"] for r in [*rows, rolled]) == 2 + 2 + 1 + 7 + 6 + 3
    # the report's actual is the ledger's own spend (summary.json's spent_usd), the rolled-back part shown apart
    assert Decimal(led2.summary()["spent_usd"]) * 1_000_000 == act["total_micro_usd"]
    assert act["rolled_back"] == {"micro_usd": 1, "device_hours": 100 / 3.6e6, "rows": 1}
    assert act["steps"] == 2  # the steps the model went through: the rolled-back step 2 was redone
    # each row's price is its own: the resumed segment's 7 ms of start-up are 7 micro-USD, not 7/72
    assert act["startup"]["micro_usd"] == phase_costs(rows[0])["startup"] + 7
    for r in [*rows, rolled]:
        assert sum(phase_costs(r).values()) == r["cost_micro_usd"]
    zero = {"usd": 0, "low_usd": 0, "high_usd": 0}
    plan = {"assumptions": {"micro_usd": {**{p: zero for p in ("startup", "sampling", "reward", "update", "eval",
                                                                 "io")}, "total": 20, "low": 15, "high": 25},
                            "run": {"steps": 2}}, "sampled_tokens": 0, "trained_tokens": 0}
    rep = report(plan, d)
    assert rep["total"]["actual_usd"] == 21e-6 and rep["rolled_back"] == {"actual_usd": 1e-6, "rows": 1}
    assert "of which rolled back by a resume" in format_report(rep)


def test_report_names_only_the_missing_file(tmp_path: Path) -> None:
    """N6 D11: with the ledger there and no plan.json, the error named both files."""
    from typer.testing import CliRunner

    from gateway.cli.main import app

    model = write_model(tmp_path / "m", {"w": [1000]})
    ref = reference_run(tmp_path, model)  # a real ledger, no plan.json
    r = CliRunner().invoke(app, ["train", "report", str(ref)])
    assert r.exit_code == 2
    assert f"no {ref / 'plan.json'}" in r.output and "ledger.jsonl" not in r.output
    r = CliRunner().invoke(app, ["train", "report", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "plan.json" in r.output and "and no" in r.output and "ledger.jsonl" in r.output
