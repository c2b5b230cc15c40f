"""GRPO end to end on a random-init tiny Llama (seconds): smoke run, resume (mid-epoch and at the epoch boundary),
budget stop, monitor stop, clean stop on all-solved data, CLI."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.toy_problems import PROBLEMS, Toy
from training.grpo.config import RunConfig, from_dict
from training.grpo.reward_utils import exact_answer_verifier

pytestmark = pytest.mark.slow




@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from tests.fixtures.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The ledger's optimizer-step rows (not the start-up / finish rows)."""
    rows = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind", "step") == "step"]


def make_cfg(model_path: Path, **over: Any) -> RunConfig:
    data: dict[str, Any] = {
        "model": {"path": str(model_path)},
        "rewards": [{"name": "correctness"}, {"name": "format", "weight": 0.2}],
        "eval": {"before": False, "after": False},
        "trl": {
            "num_generations": 2,
            "per_device_train_batch_size": 4,
            "max_completion_length": 12,
            "max_steps": 2,
            "save_steps": 100,
            "seed": 0,
        },
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    return from_dict(RunConfig, data)


def run(
    cfg: RunConfig, out: Path, problems: list[Toy] = PROBLEMS, verifier: Any = exact_answer_verifier, **kw: Any
) -> dict[str, Any]:
    from training.grpo.run import run_grpo

    return run_grpo(
        cfg,
        output_dir=out,
        verifier=verifier,
        train_problems=problems,
        eval_problems=problems[:4],
        progress=False,
        **kw,
    )


def ledger_steps(run_dir: Path, name: str = "ledger.jsonl") -> list[int]:
    p = run_dir / name
    rows = [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
    return [r["step"] for r in rows if r.get("kind", "step") == "step"]


def test_smoke_run_writes_the_run_directory(tiny: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        tiny,
        rewards=[
            {"name": "correctness"},
            {"name": "format", "weight": 0.2},
            {"name": "kimi_length", "weight": 0.1},
            {"name": "dapo_overlong", "params": {"cache": 4}},
        ],
        advantages={"signal": "reward"},  # a random-init model solves nothing: keep groups whose other rewards vary
        dynamic_sampling={"enabled": True, "max_rounds": 3},
        eval={"before": True, "after": True, "every_steps": 2, "every_n": 2},
        trl={"max_steps": 3, "num_generations": 4, "per_device_train_batch_size": 8},
    )
    s = run(cfg, tmp_path)
    assert s["global_step"] == 3 and s["stop_reason"] is None
    assert ledger_steps(tmp_path) == [1, 2, 3]
    rows = step_rows(tmp_path)
    assert all(r["rollouts"] >= 8 and r["sampled_tokens"] > 0 and r["trained_tokens"] > 0 for r in rows)
    assert all(r["rollouts"] == r["prompts"] * 4 for r in rows)
    assert all(r["sampled_tokens"] <= r["rollouts"] * 12 for r in rows)  # max_completion_length = 12 tokens
    assert s["totals"]["sampled_tokens"] == sum(r["sampled_tokens"] for r in rows)
    assert {"data_hash", "reward_hash", "hparam_hash", "git_commit"} <= set(rows[0])
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_logs = [m for m in metrics if "loss" in m]
    assert len(train_logs) == 3
    for key in (
        "entropy",
        "signal/effective_ratio",
        "completions/mean_length",
        "completions/clipped_ratio",
        "rewards/kimi_length/mean",
        "dynamic_sampling/rounds",
    ):
        assert key in train_logs[0], key
    assert sorted(p.name for p in (tmp_path / "plots").glob("*.png")) == [
        "cost.png",
        "entropy.png",
        "length.png",
        "reward.png",
        "signal.png",
    ]
    assert (tmp_path / "ledger.parquet").is_file()
    card = (tmp_path / "model" / "README.md").read_text()
    assert "| all |" in card and "Cost" in card
    tier = yaml.safe_load((tmp_path / "tier.yaml").read_text())["tiers"][0]
    assert tier["name"] == "short" and tier["budget_mode"] == "native"
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "model").num_parameters() > 0
    heldout = [json.loads(x) for x in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    # every 2 steps on 2 problems, and the final weights (step 3) so that the best of them is published
    assert [(h["step"], h["n"]) for h in heldout] == [(2, 2), (3, 2)]
    assert heldout[0]["cum_sampled_tokens"] == rows[1]["cum_sampled_tokens"]
    assert rows[2]["eval_ms"] > 0  # the periodic evaluation is booked as eval time in the next row
    after = json.loads((tmp_path / "eval_after.json").read_text())
    assert after["overall"]["n"] == 4 and set(after["by_difficulty"]) == {"1", "2"}


def test_resume_mid_epoch_continues_without_double_counting(tiny: Path, tmp_path: Path) -> None:
    # 8 problems, 2 per step -> 4 steps per epoch; checkpoint at 2 is mid-epoch.
    run(make_cfg(tiny, trl={"max_steps": 3, "save_steps": 2}), tmp_path)
    assert ledger_steps(tmp_path) == [1, 2, 3]
    s = run(make_cfg(tiny, trl={"save_steps": 2}), tmp_path, resume=str(tmp_path / "checkpoint-2"), max_steps=4)
    assert s["global_step"] == 4
    assert ledger_steps(tmp_path) == [1, 2, 3, 4]  # each step once
    assert ledger_steps(tmp_path, "ledger_discarded.jsonl") == [3]  # the abandoned step 3, kept apart
    assert s["discarded"]["rollouts"] == 4 and s["totals"]["rollouts"] == 16
    # the logs of the abandoned step 3 are gone: each step logged once (plots read these)
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3, 4]
    state = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4


def test_resume_at_epoch_boundary(tiny: Path, tmp_path: Path) -> None:
    probs = PROBLEMS[:4]  # 4 problems, 2 per step -> exactly 2 steps per epoch
    run(make_cfg(tiny, trl={"max_steps": 2, "save_steps": 2}), tmp_path, problems=probs)
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["epoch"] == pytest.approx(1.0)
    s = run(make_cfg(tiny, trl={"save_steps": 2}), tmp_path, problems=probs, resume="auto", max_steps=4)
    assert s["global_step"] == 4
    assert ledger_steps(tmp_path) == [1, 2, 3, 4]
    # nothing on the training path was abandoned; only the first segment's finish row (saving, plots) is discarded
    assert ledger_steps(tmp_path, "ledger_discarded.jsonl") == []
    end = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert end["epoch"] == pytest.approx(2.0)
    rows = step_rows(tmp_path)
    assert [r["segment"] for r in rows] == [0, 0, 1, 1] and all(r["prompts"] == 2 for r in rows)


def test_fresh_run_refuses_a_used_run_dir(tiny: Path, tmp_path: Path) -> None:
    from training.grpo.config import ConfigError

    run(make_cfg(tiny, trl={"max_steps": 1}), tmp_path)
    with pytest.raises(ConfigError, match="resume"):
        run(make_cfg(tiny, trl={"max_steps": 1}), tmp_path)


def test_resume_refuses_another_run_directorys_checkpoint(tiny: Path, tmp_path: Path) -> None:
    """``--output-dir B --resume A/checkpoint-1`` started B's ledger from A's totals: A's spend counted in both
    runs (``train runs`` and summary.json disagreed). Refused before B is created."""
    from training.grpo.config import ConfigError

    first = tmp_path / "a"
    run(make_cfg(tiny, trl={"max_steps": 1, "save_steps": 1}), first)
    foreign = tmp_path / "b"
    with pytest.raises(ConfigError, match=r"^--resume: .*checkpoint-1 is not a checkpoint of the run directory"):
        run(make_cfg(tiny, trl={"max_steps": 2}), foreign, resume=str(first / "checkpoint-1"))
    assert not foreign.exists()


@pytest.mark.parametrize("resume", ["auto", "missing/checkpoint-3", "not-a-checkpoint"])
def test_resume_of_nothing_exits_2_and_writes_nothing(tmp_path: Path, resume: str) -> None:
    """A missing checkpoint raised FileNotFoundError (exit 1) after config.yaml and heartbeat.json were written;
    ``--resume auto`` on a missing directory created it before failing."""
    from typer.testing import CliRunner

    from gateway.cli.main import app

    (tmp_path / "not-a-checkpoint").mkdir()
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "grpo", "--output-dir", str(out), "--allow-dirty",
                                 "--resume", resume if resume == "auto" else str(tmp_path / resume)])
    assert r.exit_code == 2 and r.output.startswith("config error: --resume"), r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists()


def test_budget_stop_checkpoints_first(tiny: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny, ledger={"budget_sampled_tokens": 1}, trl={"max_steps": 5})
    s = run(cfg, tmp_path)
    assert s["global_step"] == 1
    assert "sampled_tokens" in s["stop_reason"]
    assert (tmp_path / "checkpoint-1" / "ledger_state.json").is_file()
    assert ledger_steps(tmp_path) == [1]


def test_a_usd_budget_stop_ends_within_the_budget_and_the_cost_plot_shows_every_row(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The smoke config with budget_usd 0.0005 stopped on projection at $0.000494, then billed the finish row (the
    checkpoint, the model, the plots) to $0.000522: 4.4% over a hard budget, and plots/cost.png, drawn before the
    finish row, ended at $0.000494."""
    from training.grpo import plots

    # start-up from run_grpo's start, not from this pytest process's (the documented fallback where /proc is not)
    monkeypatch.setattr("training.grpo.ledger.seconds_since_process_start", lambda: None)
    drawn: dict[str, list[float]] = {}

    def spy(path: Path, title: str, ylabel: str, lines: Any, **kw: Any) -> Any:
        drawn.update({f"{path.name}:{label}": list(ys) for label, (_, ys) in lines})
        return plots.line_plot(path, title, ylabel, lines, **kw)

    monkeypatch.setattr(plots, "_plot", spy)
    budget = "0.012"  # at $3.60 per device-hour: 12 s of the CPU, some steps after a start-up of a few seconds
    cfg = make_cfg(tiny, ledger={"budget_usd": budget, "price_usd_per_device_hour": {"cpu": "3.60"}},
                   monitors={"rules": []}, trl={"max_steps": 5000, "save_steps": 5})
    s = run(cfg, tmp_path)  # the budget ends it (~12 s): a fast box ran 200 steps well inside it
    assert "projected" in s["stop_reason"] and "to finish" in s["stop_reason"], s["stop_reason"]
    assert 0 < s["global_step"] < 5000
    assert Decimal(s["spent_usd"]) <= Decimal(budget), s
    rows = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert rows[-1]["kind"] == "finish"
    assert drawn["cost.png:spent (micro-USD)"] == [float(r["spent_micro_usd"]) for r in rows]


def test_a_budget_spent_by_start_up_trains_no_step(tiny: Path, tmp_path: Path) -> None:
    """Start-up and the evaluation before training used the budget up: the run ends before its first step. The
    Trainer reads should_training_stop only after a step, so a stop set at train begin still trained and billed
    one (31x a tiny budget, seen); nor is the evaluation after training run past a budget."""
    cfg = make_cfg(tiny, ledger={"budget_device_hours": 1e-6}, trl={"max_steps": 3})  # 3.6 ms of device time
    s = run(cfg, tmp_path)
    assert s["global_step"] == 0 and s["stop_reason"].startswith("budget device_hours reached"), s["stop_reason"]
    assert ledger_steps(tmp_path) == []
    assert not (tmp_path / "eval_after.json").exists()
    # the finish saves the model but leaves out the metric plots the budget cannot cover (and says so)
    assert (tmp_path / "model" / "config.json").is_file()
    assert not (tmp_path / "plots" / "reward.png").exists()
    assert len(s["finish_skipped"]) == 1 and "metric plots left out" in s["finish_skipped"][0], s["finish_skipped"]
    assert any("metric plots left out" in a for a in s["alerts"])
    # the finish row bills the time after the start-up row only: raised at train begin, it billed from the
    # ledger callback's creation again (start-up twice)
    startup, finish = (json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines())
    assert (startup["kind"], finish["kind"]) == ("startup", "finish")
    assert finish["wall_ms"] <= (finish["ts"] - startup["ts"]) * 1000 + 2, (startup, finish)


def test_monitor_stop_rule(tiny: Path, tmp_path: Path) -> None:
    rule = {"name": "always", "metric": "entropy", "condition": "above", "threshold": 0.0, "action": "stop"}
    s = run(make_cfg(tiny, monitors={"rules": [rule]}, trl={"max_steps": 5}), tmp_path)
    assert s["global_step"] == 1 and "always" in s["stop_reason"]
    assert (tmp_path / "checkpoint-1").is_dir()


def test_all_solved_data_stops_cleanly(tiny: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        tiny,
        model={"thinks": False},  # the random-init model never closes a thought: let the verifier alone decide
        # ... and it always runs into the length cap: cap: null turns the length-cut rule off (all solved)
        rewards=[{"name": "correctness", "params": {"cap": None}}],
        dynamic_sampling={"enabled": True, "max_rounds": 3},
        trl={"max_steps": 5},
    )
    s = run(cfg, tmp_path, verifier=lambda row, text: True)
    assert s["global_step"] == 0
    assert "no learning signal" in s["stop_reason"] and "all solved" in s["stop_reason"]
    assert (tmp_path / "checkpoint-0" / "ledger_state.json").is_file()  # checkpoint before stopping
    rows = step_rows(tmp_path)
    assert len(rows) == 1 and rows[0]["trained_tokens"] == 0 and rows[0]["dropped_rollouts"] == 0
    # the aborted step was paid: 3 rounds of 2 + 3 + 3 prompts (refills of ceil(2 * 1.5)) x 2 rollouts
    assert rows[0]["rollouts"] == 16 and rows[0]["prompts"] == 8


def test_cli_registered_and_config_error_exit_code(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gateway.cli.main import app

    r = CliRunner().invoke(app, ["train", "grpo", "--help"])
    assert r.exit_code == 0 and "--max-steps" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("rewardz: []\n")
    r = CliRunner().invoke(app, ["train", "grpo", "--config", str(bad)])
    assert r.exit_code == 2 and "unknown key" in r.output


def test_quiet_prints_no_log_dicts_nor_progress_bars(tiny: Path, tmp_path: Path) -> None:
    """``--quiet`` swapped TRL's progress bar for HF Trainer's PrinterCallback: a metrics dict on stdout per step
    (and transformers' weight-loading bars stayed). Now only the warnings and the summary are printed."""
    from transformers.utils import logging as hf_logging
    from typer.testing import CliRunner

    from gateway.cli.main import app

    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({"model": {"path": str(tiny)}, "eval": {"before": False, "after": False},
                               "trl": {"num_generations": 2, "per_device_train_batch_size": 4,
                                       "max_completion_length": 12, "max_steps": 2, "seed": 0}}))
    try:
        r = CliRunner().invoke(app, ["train", "grpo", "--config", str(cfg), "--output-dir", str(tmp_path / "run"),
                                     "--allow-dirty", "--quiet"])
    finally:
        hf_logging.enable_progress_bar()
    assert r.exit_code == 0, r.output
    assert "'loss'" not in r.output and "Loading weights" not in r.output, r.output
    assert '"global_step": 2' in r.output  # the summary
    logs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logs if "loss" in m] == [1, 2]  # the logs are kept


def test_sampled_evaluation_returns_one_row_per_sample(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.grpo.data import problem_rows
    from training.grpo.evaluate import generate_and_score, summarize

    model = AutoModelForCausalLM.from_pretrained(tiny)
    tok = AutoTokenizer.from_pretrained(tiny)
    rows = problem_rows(PROBLEMS[:2])
    out = generate_and_score(model, tok, rows, exact_answer_verifier, 6, temperature=1.0, samples=3, seed=1)
    assert [r.problem_id for r in out] == ["t0"] * 3 + ["t1"] * 3
    assert all(1 <= r.completion_tokens <= 6 for r in out)
    again = generate_and_score(model, tok, rows, exact_answer_verifier, 6, temperature=1.0, samples=3, seed=1)
    assert [r.completion_tokens for r in again] == [r.completion_tokens for r in out]  # seeded
    assert summarize(out)["overall"]["n"] == 6


def test_evaluation_scores_cut_off_thoughts_wrong(tiny: Path) -> None:
    """Held-out accuracy uses the rewards' rule: no ``</think>`` -> wrong, even for a verifier that accepts anything."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.grpo.data import problem_rows
    from training.grpo.evaluate import generate_and_score, summarize

    model = AutoModelForCausalLM.from_pretrained(tiny)
    tok = AutoTokenizer.from_pretrained(tiny)
    out = generate_and_score(model, tok, problem_rows(PROBLEMS), lambda row, text: True, 3)
    assert any(not r.thought_closed for r in out)  # 3 tokens of a random-init model: cut off
    assert [r.correct for r in out] == [r.thought_closed for r in out]
    s = summarize(out)["overall"]
    assert s["accuracy"] == pytest.approx(1 - s["unclosed_thought_rate"])


def test_smoke_config_on_the_shipped_model(tmp_path: Path) -> None:
    """training/configs/smoke.yaml on the local reasoning model and the arith task (2 steps here)."""
    from training.grpo.config import DEFAULT_MODEL_DIR, load_config
    from training.grpo.run import run_grpo

    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.fail(f"the shipped model is missing: {DEFAULT_MODEL_DIR}")
    cfg = load_config(Path(__file__).resolve().parents[2] / "training" / "configs" / "smoke.yaml")
    cfg.task.n_eval = 6
    cfg.eval.before = False
    # The config's $0.01 is priced from wall-clock device time, so a loaded machine (CI next to other jobs)
    # reached it at step 0 once; the budget stop has tests of its own (test_grpo_train below, test_sft).
    cfg.ledger.budget_usd = None
    s = run_grpo(cfg, max_steps=2, output_dir=tmp_path, progress=False)
    assert s["global_step"] == 2 and s["stop_reason"] is None
    assert ledger_steps(tmp_path) == [1, 2]
    after = json.loads((tmp_path / "eval_after.json").read_text())
    assert after["overall"]["n"] == 6 and after["overall"]["accuracy"] > 0  # the SFT model solves some


class FirstTokenParity:
    """A reward that varies within every group whatever the answers (stands in for a length or style reward)."""

    __name__ = "parity"

    def __call__(self, prompts: Any, completions: Any, completion_ids: Any = None, **kw: Any) -> list[float]:
        return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]


@pytest.fixture
def parity(monkeypatch: pytest.MonkeyPatch) -> None:
    from training.grpo.rewards import REWARD_REGISTRY

    monkeypatch.setitem(REWARD_REGISTRY, "parity", lambda ctx, p: FirstTokenParity())


def test_signal_is_accuracy_so_a_length_reward_does_not_hide_solved_data(
    tiny: Path, tmp_path: Path, parity: None
) -> None:
    """All-solved data with a second reward that varies: the accuracy does not. DAPO's filter (accuracy) drops
    every group and stops with 'all solved'; total-reward variance would have trained on the second reward alone."""
    cfg = make_cfg(
        tiny,
        model={"thinks": False},
        # the random-init model always runs into the length cap: cap: null turns the length-cut rule off (all solved)
        rewards=[{"name": "correctness", "params": {"cap": None}}, {"name": "parity", "weight": 0.5}],
        dynamic_sampling={"enabled": True, "max_rounds": 2},
        trl={"max_steps": 3, "num_generations": 4, "per_device_train_batch_size": 8},
    )
    s = run(cfg, tmp_path, verifier=lambda row, text: True)
    assert s["global_step"] == 0 and "all solved" in s["stop_reason"]
    rows = step_rows(tmp_path)
    assert rows[0]["zero_signal_rollouts"] == rows[0]["rollouts"] > 0
    assert rows[0]["zero_signal_micro_usd"] == rows[0]["cost_micro_usd"]  # all of that step's money taught nothing


def test_effective_signal_ratio_reads_accuracy_without_dynamic_sampling(
    tiny: Path, tmp_path: Path, parity: None
) -> None:
    cfg = make_cfg(
        tiny,
        model={"thinks": False},
        rewards=[{"name": "correctness"}, {"name": "parity", "weight": 0.5}],
        trl={"max_steps": 2, "num_generations": 4, "per_device_train_batch_size": 8},
    )
    run(cfg, tmp_path, verifier=lambda row, text: True)
    logs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in logs if "loss" in m]
    assert [m["signal/effective_ratio"] for m in train] == [0.0, 0.0]  # nothing to learn about correctness
    assert any(m["signal/reward_variance_ratio"] > 0 for m in train)  # what the old criterion counted
    rows = step_rows(tmp_path)
    assert all(r["zero_signal_rollouts"] == r["rollouts"] == 8 for r in rows)
    assert sum(r["zero_signal_micro_usd"] for r in rows) == sum(r["cost_micro_usd"] for r in rows)


def test_resume_refuses_a_changed_run_file_unless_forced(tiny: Path, tmp_path: Path) -> None:
    from training.grpo.config import ConfigError

    run(make_cfg(tiny, trl={"max_steps": 2, "save_steps": 2}), tmp_path)
    changed = make_cfg(tiny, trl={"max_steps": 3, "save_steps": 2, "learning_rate": 1e-3})
    with pytest.raises(ConfigError, match=r"trl.learning_rate .*--force"):
        run(changed, tmp_path, resume="auto")
    more_steps = make_cfg(tiny, trl={"max_steps": 3, "save_steps": 2})  # max_steps is not a hyper-parameter
    assert run(more_steps, tmp_path, resume="auto", max_steps=3)["global_step"] == 3
    s = run(
        make_cfg(tiny, trl={"save_steps": 2, "learning_rate": 1e-3}),
        tmp_path,
        resume="auto",
        force=True,
        max_steps=4,
    )
    assert s["global_step"] == 4 and (tmp_path / "config.previous.yaml").is_file()


def test_resume_keeps_the_runs_max_steps_and_never_trains_past_it(tiny: Path, tmp_path: Path) -> None:
    """A run started with --max-steps 4 over a run file's 2, resumed without the flag (the old SIGINT hint): it went
    on to the run file's 2 — training one step past it, to 3 — and rewrote config.yaml with 2. It keeps the
    recorded 4 now; a resume with nothing left to train is refused before anything is written."""
    from training.grpo.config import ConfigError

    run(make_cfg(tiny, trl={"max_steps": 2, "save_steps": 2}), tmp_path, max_steps=4)
    s = run(make_cfg(tiny, trl={"max_steps": 2, "save_steps": 2}), tmp_path, resume=str(tmp_path / "checkpoint-2"))
    assert s["global_step"] == 4 and ledger_steps(tmp_path) == [1, 2, 3, 4]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trl"]["max_steps"] == 4
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    for max_steps in (None, 4, 3):
        with pytest.raises(ConfigError, match=r"^--resume: checkpoint-4 is at step 4 and trl.max_steps is \d: nothing"):
            run(make_cfg(tiny, trl={"max_steps": 2, "save_steps": 2}), tmp_path, resume="auto", max_steps=max_steps)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_the_interrupt_hint_repeats_the_original_flags(tmp_path: Path) -> None:
    from training.grpo.cli import _again_flags, _interrupted
    from training.registry import write_heartbeat

    run_dir = tmp_path / "my run"
    (run_dir / "checkpoint-3").mkdir(parents=True)
    write_heartbeat(run_dir, 4)
    flags = _again_flags(Path("training/configs/smoke.yaml"), 12, allow_dirty=True, quiet=False)
    hint = _interrupted(str(run_dir), flags)
    assert hint.endswith(
        "thinkgate train grpo --config training/configs/smoke.yaml --max-steps 12 --allow-dirty "
        f"--output-dir '{run_dir}' --resume auto"
    ), hint


def test_dirty_git_tree_is_refused_unless_allowed(tmp_path: Path) -> None:
    import subprocess

    from training.grpo.config import ConfigError
    from training.grpo.run import check_clean_tree

    def git(*a: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f.txt").write_text("a\n")
    git("add", "f.txt")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    assert not check_clean_tree(tmp_path).endswith("-dirty")
    (tmp_path / "f.txt").write_text("b\n")
    with pytest.raises(ConfigError, match="--allow-dirty"):
        check_clean_tree(tmp_path)
    assert check_clean_tree(tmp_path, allow_dirty=True).endswith("-dirty")


def test_truncation_alarm_is_on_by_default(tiny: Path, tmp_path: Path) -> None:
    """A new user's run whose cap is far below the model's length: every completion is cut (clipped_ratio = 1).
    The default rules warn at once (log + alerts.jsonl), then stop with the advice after 5 steps above 0.8."""
    cfg = make_cfg(tiny, trl={"max_steps": 10, "max_completion_length": 4})
    s = run(cfg, tmp_path, verifier=lambda row, text: True)
    alerts = [json.loads(x) for x in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    warns = [a for a in alerts if a["rule"] == "truncation"]
    assert len(warns) == 1 and warns[0]["step"] == 1 and "max_completion_length" in warns[0]["message"]
    assert s["global_step"] == 5 and "truncation_stop" in s["stop_reason"]
    assert "raise it" in s["stop_reason"]
    logs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in logs if "loss" in m]
    assert all(m["completions/clipped_ratio"] == 1.0 for m in train)
    # an accept-anything verifier, yet most cut-off rollouts score 0: only those that closed a thought can count
    assert all(m["rewards/correctness/mean"] < 0.5 for m in train)


def test_budget_stop_below_the_quality_floor_says_so(tiny: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        tiny,
        ledger={"budget_sampled_tokens": 1, "quality_floor": 0.9},
        eval={"before": False, "after": False, "every_steps": 1, "every_n": 2},
        trl={"max_steps": 3},
    )
    s = run(cfg, tmp_path)  # stops at step 1, before its periodic check ran: no accuracy measured yet
    assert s["stop_reason"].startswith("stopped below quality floor (best held-out accuracy none < 0.9): budget")
    assert s["below_quality_floor"] is True


def test_past_warning_continue_below_floor_stops_once_the_floor_is_met(tiny: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        tiny,
        ledger={
            "budget_sampled_tokens": 100_000,
            "warn_fraction": 0.00001,
            "quality_floor": 0.0,
            "past_warning": "continue_below_floor",
        },
        eval={"before": False, "after": True, "every_steps": 1, "every_n": 2},
        trl={"max_steps": 3},
    )
    s = run(cfg, tmp_path)  # floor 0.0 is met at the check after step 1: the warning line stops the run at step 2
    assert s["global_step"] == 2 and "warning line reached" in s["stop_reason"]
    assert s["below_quality_floor"] is False
    # a warning-line stop keeps its reserve for this: the evaluation after training runs (a hard stop skips it)
    assert (tmp_path / "eval_after.json").is_file() and s["accuracy_after"] is not None


def test_sigint_says_how_to_resume_and_the_registry_says_interrupted(tiny: Path, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) on ``train grpo``: exit 130 with the step and the resume command; ``train runs`` shows the
    run ``interrupted`` (it said ``running`` for ten minutes, with no message)."""
    import signal
    import subprocess
    import sys
    import time

    import yaml

    from training.registry import load_run

    cfg = tmp_path / "run.yaml"
    # no monitor rules: the tiny model's cut completions would stop the run itself at step 5 (truncation_stop), a
    # race with the SIGINT on a fast box (seen in CI: exit 0)
    cfg.write_text(yaml.safe_dump({"model": {"path": str(tiny)}, "eval": {"before": False, "after": False},
                                   "monitors": {"rules": []},
                                   "trl": {"num_generations": 2, "per_device_train_batch_size": 4,
                                           "max_completion_length": 12, "max_steps": 2, "save_steps": 1,
                                           "seed": 0}}))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "train", "grpo", "--config", str(cfg), "--output-dir",
                             str(out), "--allow-dirty", "--quiet", "--max-steps", "500"],
                            cwd=str(Path(__file__).resolve().parents[2]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a shell's background job (CI started with `&`) ignores SIGINT, and Python keeps an
                            # inherited SIG_IGN: the default disposition, as at a terminal
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            beat = out / "heartbeat.json"
            # step 1's heartbeat comes before its checkpoint is saved: interrupted between the two, the run has
            # nothing to resume and says so (a race seen under load); wait for the checkpoint too
            if (beat.is_file() and json.loads(beat.read_text()).get("step", 0) >= 1
                    and any(out.glob("checkpoint-*"))):
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted at step" in err and "--max-steps 500 --allow-dirty --quiet" in err and "--resume auto" in err
    assert load_run(out).status == "interrupted"
    # the step the SIGINT cut short was paid for: billed as an `interrupted` row after the last finished step's (only
    # finished steps had rows, so it was billed nowhere)
    rows = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["kind"] == "interrupted" and last["step"] == max(r["step"] for r in rows if r["kind"] == "step")
    assert last["wall_ms"] > 0 and last["seq"] == max(r["seq"] for r in rows)


class _InterruptingToy(Toy):
    """A held-out problem whose question sends this process a real SIGINT when the run reads it (building the
    evaluation rows, inside ``build_run``: before the run's ledger exists)."""

    def __getattribute__(self, name: str) -> Any:
        if name == "question":
            import os
            import signal

            os.kill(os.getpid(), signal.SIGINT)  # Python's default handler raises KeyboardInterrupt right here
        return super().__getattribute__(name)


@pytest.mark.parametrize("where", ["build", "eval_before"])
def test_ctrl_c_during_start_up_is_billed_and_the_run_is_listed_interrupted(
    tiny: Path, tmp_path: Path, where: str
) -> None:
    """N6 D2: a SIGINT before the first step left no ledger row — start-up billed nowhere — and, without a ledger,
    ``train runs`` did not list the run. Here a real SIGINT to this process while the run is being built (its
    ledger not made yet) or during the evaluation before training: the start-up row is written (process start to
    the interrupt) and the run is ``interrupted``."""
    import os
    import signal

    from training.grpo.cli import _interrupted
    from training.grpo.ledger import micro_usd
    from training.registry import list_runs

    def interrupting_verifier(row: Any, text: str) -> bool:
        os.kill(os.getpid(), signal.SIGINT)
        return exact_answer_verifier(row, text)

    out = tmp_path / "run"
    # thinks: false — the verifier is asked about every completion, cut-off thoughts included
    cfg = make_cfg(tiny, model={"path": str(tiny), "thinks": False}, eval={"before": True, "after": False})
    kw: dict[str, Any] = {"verifier": interrupting_verifier}
    if where == "build":
        kw = {"eval_problems": [_InterruptingToy("x", "What is 1 + 1?", "2", 1)]}
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            from training.grpo.run import run_grpo

            run_grpo(cfg, output_dir=out, train_problems=PROBLEMS, progress=False,
                     **{"verifier": exact_answer_verifier, "eval_problems": PROBLEMS[:4], **kw})
    finally:
        signal.signal(signal.SIGINT, previous)
    rows = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    [row] = rows
    assert row["kind"] == "startup" and row["step"] == 0 and row["startup_ms"] > 0
    assert (row["eval_ms"] == 0) is (where == "build")  # an unfinished evaluation is billed as start-up
    assert row["cost_micro_usd"] == micro_usd(row["device_ms"], Decimal(row["price_usd_per_device_hour"]))
    assert row["spent_micro_usd"] == row["cost_micro_usd"]
    assert "before the first checkpoint" in _interrupted(str(out), [])  # what the CLI does on KeyboardInterrupt
    [rec] = list_runs(tmp_path)
    assert rec.status == "interrupted" and rec.micro_usd == row["cost_micro_usd"]


class _BrokenToy(Toy):
    """A held-out problem whose question cannot be read (a data set that fails to load): the run fails while it
    is built (``build_run``), before its ledger exists."""

    def __getattribute__(self, name: str) -> Any:
        if name == "question":
            raise ValueError("held-out data: corrupt row")
        return super().__getattribute__(name)


@pytest.mark.parametrize("where", ["build", "eval_before"])
def test_an_error_during_start_up_is_billed_as_a_ctrl_c_is(tiny: Path, tmp_path: Path, where: str) -> None:
    """An error before the first step — the held-out data failing to load while the run is built, or writing the
    evaluation before training failing (its path taken by a directory) — left the start-up (imports, model load,
    that evaluation) billed nowhere: only a Ctrl-C there, or an error past start-up, was billed. Now the
    ``startup`` row a Ctrl-C writes, then the error propagates."""
    from training.grpo.ledger import micro_usd
    from training.grpo.run import run_grpo
    from training.registry import list_runs

    out = tmp_path / "run"
    cfg = make_cfg(tiny, eval={"before": True, "after": False})
    eval_problems: list[Toy] = PROBLEMS[:4]
    if where == "build":
        eval_problems = [_BrokenToy("x", "What is 1 + 1?", "2", 1)]
    else:
        (out / "eval_before.json").mkdir(parents=True)
    with pytest.raises((ValueError, OSError), match=r"corrupt row|Is a directory"):
        run_grpo(cfg, output_dir=out, train_problems=PROBLEMS, eval_problems=eval_problems, progress=False,
                 verifier=exact_answer_verifier)
    [row] = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert row["kind"] == "startup" and row["step"] == 0 and row["startup_ms"] > 0
    assert (row["eval_ms"] == 0) is (where == "build")  # the evaluation done is billed as eval
    assert row["cost_micro_usd"] == micro_usd(row["device_ms"], Decimal(row["price_usd_per_device_hour"]))
    assert row["data_hash"] and row["data_hash"] != "unknown"  # the training problems loaded
    [rec] = list_runs(tmp_path)
    assert rec.micro_usd == row["cost_micro_usd"] > 0


def test_ctrl_c_during_the_evaluation_after_training_is_billed(tiny: Path, tmp_path: Path) -> None:
    """A SIGINT after the last step — saving the model, the evaluation after training (minutes on a real held-out
    set), the plots — left the time since the last step's row billed nowhere: only build and train were covered
    by the interrupt's billing. Here a real SIGINT to this process while the evaluation after training scores its
    first completion: an ``interrupted`` row bills the time since the last step row."""
    import os
    import signal

    from training.grpo.run import run_grpo

    held_out = [Toy("after", "What is 40 + 2?", "42", 1)]  # scored only by the evaluation after training

    def interrupting_verifier(row: Any, text: str) -> bool:
        if row.get("problem_id") == "after":
            os.kill(os.getpid(), signal.SIGINT)
        return exact_answer_verifier(row, text)

    out = tmp_path / "run"
    cfg = make_cfg(tiny, model={"path": str(tiny), "thinks": False}, eval={"before": False, "after": True})
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_grpo(cfg, output_dir=out, train_problems=PROBLEMS, eval_problems=held_out, progress=False,
                     verifier=interrupting_verifier)
    finally:
        signal.signal(signal.SIGINT, previous)
    rows = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["startup", "step", "step", "interrupted"]
    assert rows[-1]["step"] == 2 and rows[-1]["wall_ms"] > 0
    assert rows[-1]["spent_micro_usd"] == sum(r["cost_micro_usd"] for r in rows)


def test_a_crash_after_the_last_step_is_billed_as_an_interruption_is(tiny: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that fails past start-up — here writing its plots after the last step fails (a full disk) — bills the
    time since the last row as a Ctrl-C does (an ``interrupted`` row), then the error propagates. Only a Ctrl-C was
    billed: an out-of-memory error or a failed save left the step in flight, or the finish, billed nowhere."""
    from training.grpo import plots

    def full_disk(*a: Any, **kw: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plots, "_plot", full_disk)
    out = tmp_path / "run"
    with pytest.raises(OSError, match="No space left"):
        run(make_cfg(tiny), out)
    rows = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["startup", "step", "step", "interrupted"]
    assert rows[-1]["step"] == 2 and rows[-1]["wall_ms"] > 0
    assert rows[-1]["spent_micro_usd"] == sum(r["cost_micro_usd"] for r in rows)


def test_resume_refuses_changed_tier_prices_unless_forced(tiny: Path, tmp_path: Path) -> None:
    """``output.tier_prices`` was not compared on resume: a changed value silently replaced ``config.yaml``'s, and
    the run's ``tier.yaml`` priced the trained tier at it. Refused like the other resume-critical settings (same
    message, ``--force`` to go on, the old file kept); the same prices written differently (0.1, 0.10) are no change.
    No training: a real run directory and a checkpoint with the ledger's state are enough for the check."""
    from training.grpo.config import ConfigError
    from training.grpo.ledger import CostLedger
    from training.grpo.run import prepare_run_dir

    prices = {"input_usd_per_mtok": "0.1", "cached_input_usd_per_mtok": "0.05", "output_usd_per_mtok": "0.4"}
    run_dir, _ = prepare_run_dir(make_cfg(tiny, output={"tier_prices": {"short": prices}}), output_dir=tmp_path)
    CostLedger(run_dir, "cpu", 1, Decimal("0.05")).save_state(run_dir / "checkpoint-1")
    same = {**prices, "input_usd_per_mtok": "0.10"}
    _, ckpt = prepare_run_dir(make_cfg(tiny, output={"tier_prices": {"short": same}}), output_dir=tmp_path,
                              resume="auto", max_steps=2)
    assert ckpt is not None and not (run_dir / "config.previous.yaml").exists()
    dearer = {**prices, "output_usd_per_mtok": "4.0"}
    with pytest.raises(ConfigError, match=r"^--resume: the run file differs .* in output\.tier_prices\.short "
                                          r"\(\{.*'0\.4'.*\} -> \{.*'4\.0'.*\}\): .*--force"):
        prepare_run_dir(make_cfg(tiny, output={"tier_prices": {"short": dearer}}), output_dir=tmp_path,
                        resume="auto", max_steps=2)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["output"]["tier_prices"]["short"] == same
    prepare_run_dir(make_cfg(tiny, output={"tier_prices": {"short": dearer}}), output_dir=tmp_path, resume="auto",
                    max_steps=2, force=True)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["output"]["tier_prices"]["short"] == dearer
    assert (run_dir / "config.previous.yaml").is_file()


def test_a_late_config_error_keeps_its_billed_start_up_and_a_corrected_rerun_continues_the_ledger(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A configuration error found only once the run is built (``eval.every_steps`` under DeepSpeed ZeRO-3: the
    check needs the trainer's arguments) billed start-up into the run directory's ledger and then left that
    directory unusable: a fresh run there was refused ("pass --resume auto"), and ``--resume auto`` was refused too
    (no checkpoint). Now the error says what was billed and how to rerun; ``--resume auto`` under the corrected run
    file starts again from step 0 with the ledger kept — the failed start-up moved to ``ledger_discarded.jsonl``,
    still spent — and the summary, the ledger files and ``train runs`` agree on the spend."""
    from training.grpo import run as run_mod
    from training.grpo.config import ConfigError
    from training.registry import load_run

    out = tmp_path / "run"
    # DeepSpeed is not installed on the CPU box: the probe of the trainer's arguments says ZeRO-3 as a launch would
    monkeypatch.setattr(run_mod, "_zero3_enabled", lambda: True)
    wrong = make_cfg(tiny, eval={"before": False, "after": False, "every_steps": 1})
    with pytest.raises(ConfigError, match=r"^eval\.every_steps: .* \(found after start-up: \d+ micro-USD billed in "
                                          r".*ledger\.jsonl; fix the run file and rerun with --output-dir .* "
                                          r"--resume auto"):
        run(wrong, out)
    [first] = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert first["kind"] == "startup" and first["cost_micro_usd"] > 0
    with pytest.raises(ConfigError, match=rf"saved no checkpoint \(its ledger: {first['cost_micro_usd']} micro-USD "
                                          r"spent\): pass --resume auto"):
        run(make_cfg(tiny), out)
    # rerun unfixed: the second failed start-up follows the first in the same ledger (not a second seq 1)
    with pytest.raises(ConfigError, match="found after start-up"):
        run(wrong, out, resume="auto")
    monkeypatch.undo()
    [second] = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert (second["kind"], second["seq"], second["segment"]) == ("startup", 2, 1)

    s = run(make_cfg(tiny), out, resume="auto")

    assert s["global_step"] == 2
    rows = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["startup", "step", "step", "finish"]
    assert [r["seq"] for r in rows] == [3, 4, 5, 6] and {r["segment"] for r in rows} == {2}
    moved = [json.loads(x) for x in (out / "ledger_discarded.jsonl").read_text().splitlines()]
    assert moved == [{**first, "discarded_at_resume_from_step": 0}, {**second, "discarded_at_resume_from_step": 0}]
    failed = first["cost_micro_usd"] + second["cost_micro_usd"]
    total = sum(r["cost_micro_usd"] for r in rows) + failed
    assert rows[-1]["spent_micro_usd"] == total
    assert s["discarded"]["cost_micro_usd"] == failed
    assert Decimal(s["spent_usd"]) * 1_000_000 == total == load_run(out).micro_usd
    assert yaml.safe_load((out / "config.previous.yaml").read_text())["eval"]["every_steps"] == 1


def test_a_run_that_fails_is_listed_failed_with_its_error(tiny: Path, tmp_path: Path) -> None:
    """A run that raised (not a budget or monitor stop, not a Ctrl-C) left its directory saying nothing: no summary,
    a fresh heartbeat — ``train runs`` listed it ``running`` for ten minutes, then ``abandoned``, the error nowhere;
    a resume of a finished run that failed was even listed ``finished`` (the earlier segment's summary.json). Now
    the heartbeat is marked ``failed`` with the error, after the failure was billed, so the listed spend is still
    the ledger's to the micro-USD."""
    from typer.testing import CliRunner

    from gateway.cli.main import app
    from training.grpo.run import run_grpo
    from training.registry import load_run

    out = tmp_path / "run"
    run(make_cfg(tiny, trl={"max_steps": 2, "save_steps": 2}), out)
    assert load_run(out).status == "finished"
    with pytest.raises(ValueError, match="corrupt row"):  # the held-out data of the resumed segment fails to load
        run_grpo(make_cfg(tiny, trl={"max_steps": 2, "save_steps": 2}), output_dir=out, resume="auto", max_steps=3,
                 train_problems=PROBLEMS, eval_problems=[_BrokenToy("x", "What is 1 + 1?", "2", 1)],
                 verifier=exact_answer_verifier, progress=False)
    rec = load_run(out)
    assert rec.status == "failed" and rec.stop_reason == "ValueError: held-out data: corrupt row"
    rows = sorted((json.loads(x) for name in ("ledger.jsonl", "ledger_discarded.jsonl") if (out / name).is_file()
                   for x in (out / name).read_text().splitlines()), key=lambda r: r["seq"])
    assert rows[-1]["kind"] == "startup" and rows[-1]["segment"] == 1  # the failed resume's start-up, billed
    assert rec.micro_usd == sum(r["cost_micro_usd"] for r in rows) == rows[-1]["spent_micro_usd"]
    listed = CliRunner().invoke(app, ["train", "runs", "--root", str(tmp_path)])
    assert listed.exit_code == 0 and "failed" in listed.output, listed.output
    assert "  error: ValueError: held-out data: corrupt row" in listed.output


@pytest.mark.parametrize(("field", "over", "shown"), [
    ("output.tier_name", {"output": {"tier_name": "long"}}, r"output\.tier_name \('short' -> 'long'\)"),
    ("output.served_model_name", {"output": {"served_model_name": "mine"}},
     r"output\.served_model_name \('thinkgate-tiny-short' -> 'mine'\)"),
    ("run_name", {"run_name": "other"}, r"run_name \('grpo' -> 'other'\)"),
    ("tags", {"tags": {"owner": "bo"}}, r"tags \(\{'owner': 'ana'\} -> \{'owner': 'bo'\}\)"),
])
def test_resume_refuses_a_changed_tier_name_model_name_or_ledger_tags_unless_forced(
    tiny: Path, tmp_path: Path, field: str, over: dict[str, Any], shown: str
) -> None:
    """Only ``output.tier_prices`` of the fields that say what the ledger's spend is and what the model is sold as
    was compared on resume. A resume could switch ``output.tier_name`` from ``short`` to ``long`` — ``tier.yaml``
    then priced the model at the long tier's default prices, 5x, with ``tier_prices`` unchanged — or rename the
    served model, or change ``run_name`` / ``tags``, which every ledger row carries (``train runs --by`` attributes
    the whole run by its last row's). Refused like the other resume-critical settings, ``--force`` to go on.
    No training: a run directory and a checkpoint with the ledger's state are enough for the check."""
    from training.grpo.config import ConfigError
    from training.grpo.ledger import CostLedger
    from training.grpo.run import prepare_run_dir

    run_dir, _ = prepare_run_dir(make_cfg(tiny, tags={"owner": "ana"}), output_dir=tmp_path)
    CostLedger(run_dir, "cpu", 1, Decimal("0.05")).save_state(run_dir / "checkpoint-1")
    _, ckpt = prepare_run_dir(make_cfg(tiny, tags={"owner": "ana"}), output_dir=tmp_path, resume="auto", max_steps=2)
    assert ckpt is not None  # the same run file resumes
    changed = make_cfg(tiny, **{"tags": {"owner": "ana"}, **over})
    with pytest.raises(ConfigError, match=rf"^--resume: the run file differs from the run's config\.yaml in {shown}: "
                                          r".*--force"):
        prepare_run_dir(changed, output_dir=tmp_path, resume="auto", max_steps=2)
    prepare_run_dir(changed, output_dir=tmp_path, resume="auto", max_steps=2, force=True)
    assert (run_dir / "config.previous.yaml").is_file()


def test_a_resume_forgets_the_best_model_of_the_abandoned_steps(tiny: Path, tmp_path: Path) -> None:
    """The first attempt's ``best.json`` names step 3 (as if step 3 had scored best); resumed from checkpoint-2,
    step 3 is abandoned (its evaluation line dropped, its spend discarded), so that best is not this run's: the
    best published at the end is one of the evaluations ``heldout.jsonl`` shows. It was kept and published."""
    ev = {"before": False, "after": False, "every_steps": 1, "every_n": 2, "publish_best": True}
    run(make_cfg(tiny, eval=ev, trl={"max_steps": 3, "save_steps": 2}), tmp_path)
    best_json = tmp_path / "best" / "best.json"
    assert best_json.is_file()
    best_json.write_text(json.dumps({"step": 3, "accuracy": 1.5}))  # beaten by no accuracy a resumed step can reach
    s = run(make_cfg(tiny, eval=ev, trl={"save_steps": 2}), tmp_path, resume=str(tmp_path / "checkpoint-2"),
            max_steps=4)
    assert s["global_step"] == 4
    heldout = [json.loads(x) for x in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert [h["step"] for h in heldout] == [1, 2, 3, 4]
    best = json.loads(best_json.read_text()) if best_json.is_file() else None
    assert best is None or (best["step"], best["accuracy"]) in {(h["step"], h["accuracy"]) for h in heldout}, best
