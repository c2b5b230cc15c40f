"""``thinkgate train sft``: supervised fine-tuning on verified teacher traces with TRL's ``SFTTrainer``, billed by
the same ledger, phases, tags, heartbeat and run directory as GRPO (so ``train runs``, ``train report`` and the
equal-cost comparison in ``bench/sft_vs_grpo.py`` read both alike).

Teacher traces: for every training problem of the task, the exact chain of operations (``router.tasks`` keeps it
in ``problem.meta["chain"]``) written out as a thought in ``traces.style`` (``terse``: one line per operation),
then ``</think>``, then the answer sentence — and kept only when the task's verifier accepts it (``verified``).
Only tasks whose problems carry a chain (``arith``) have teacher traces; others raise :class:`ConfigError`.

Run directory: ``config.yaml``, ``ledger.jsonl``/``.parquet`` (rows ``startup`` / ``step`` / ``finish``; phases
startup, update, eval, io — SFT samples nothing), ``eval_before.json``/``eval_after.json``, ``summary.json``,
``heartbeat.json``, ``traces.jsonl`` (the training data), ``model/``.
"""

from __future__ import annotations

import json
import logging
import random
import time
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import Field

from training.grpo.config import (
    ConfigError,
    EvalConfig,
    LedgerConfig,
    ModelConfig,
    TaskConfig,
    _check_ledger_money,
    _Section,
    from_dict,
    read_run_file,
    resolve_model_path,
    stable_hash,
)

if TYPE_CHECKING:  # torch-free at import: the ledger's callback module imports transformers
    from training.grpo.ledger import CostLedger
    from training.grpo.monitors import LedgerCallback

logger = logging.getLogger(__name__)


def _default_sft_trl() -> dict[str, Any]:
    return {
        "per_device_train_batch_size": 8,
        "learning_rate": 5e-5,
        "lr_scheduler_type": "constant",
        "max_steps": 20,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": 0,
    }


class TracesConfig(_Section):
    style: str = Field("terse", description="Thought style of the teacher traces: terse | medium | verbose.")
    per_problem: int = Field(1, description="Traces per training problem (different wordings of the thought).")
    seed: int = Field(0, description="Seed of the trace wording.")


class SFTRunConfig(_Section):
    run_name: str = Field("sft", description="Run name (model card, tags).")
    output_dir: str = Field("runs/sft", description="Run directory.")
    threads: int | None = Field(1, description="torch.set_num_threads; None = torch default.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Starting model.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="Training and held-out problems.")
    traces: TracesConfig = Field(default_factory=TracesConfig, description="Verified teacher traces.")
    ledger: LedgerConfig = Field(default_factory=LedgerConfig, description="Cost ledger, prices and budgets.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    tags: dict[str, str] = Field(default_factory=dict, description="Free-form run tags (owner, team, purpose).")
    trl: dict[str, Any] = Field(default_factory=_default_sft_trl, description="SFTConfig keyword arguments.")

    def trl_kwargs(self) -> dict[str, Any]:
        merged = _default_sft_trl()
        merged.update(self.trl)
        return merged

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


# sections of a GRPO run file (training.grpo.config.RunConfig) that an SFT run file does not have
_GRPO_ONLY = ("rewards", "advantages", "dynamic_sampling", "budget_prompt", "monitors", "output", "storage")


def load_sft_config(path: str | Path | None) -> SFTRunConfig:
    """Read an SFT run file (YAML); unknown or repeated keys, unparsable YAML and invalid fields raise
    :class:`ConfigError`."""
    data = read_run_file(path) if path is not None else {}
    grpo_only = [k for k in _GRPO_ONLY if isinstance(data, dict) and k in data]
    if grpo_only:  # else one "unknown key; known: [...]" per GRPO section, and not what to run
        raise ConfigError(f"{path} is a GRPO run file (it has `{grpo_only[0]}:`): run it with `thinkgate train grpo "
                          f"--config {path}`; `train sft` takes an SFT run file (training/configs/sft_smoke.yaml)")
    cfg: SFTRunConfig = from_dict(SFTRunConfig, data)
    if cfg.traces.style not in ("terse", "medium", "verbose"):
        raise ConfigError(f"traces.style: {cfg.traces.style!r} is not one of ['terse', 'medium', 'verbose']")
    if cfg.traces.per_problem < 1:
        raise ConfigError("traces.per_problem: must be >= 1")
    _check_ledger_money(cfg.ledger)  # GRPO's rules: prices finite >= 0, budgets finite > 0
    return cfg


def teacher_traces(problems: list[Any], rows: list[dict[str, Any]], cfg: SFTRunConfig, verifier: Any) -> list[dict]:
    """``[{"problem_id", "prompt": [messages], "completion": text}]``: verified traces (module docstring)."""
    from training.grpo.reward_utils import is_correct
    from training.tiny.data import answer_text, thought

    rng = random.Random(f"traces-{cfg.traces.seed}")
    out = []
    for p, row in zip(problems, rows, strict=True):
        chain = (getattr(p, "meta", None) or {}).get("chain")
        if chain is None:
            raise ConfigError(f"task {cfg.task.name!r}: problem {p.id} has no chain: no teacher traces (use arith)")
        for _ in range(cfg.traces.per_problem):
            text = thought(chain, cfg.traces.style, rng) + "</think>\n\n" + answer_text(chain)
            if is_correct(verifier, row, text, True):
                out.append({"problem_id": row["problem_id"], "prompt": row["prompt"], "completion": text})
    return out


def run_sft(cfg: SFTRunConfig, *, output_dir: str | Path | None = None, max_steps: int | None = None) -> dict:
    """Run SFT and return the summary (the ledger's, plus the run's accuracies and wall times).

    Raises :class:`ConfigError` before the run directory is written (:func:`_check_sft_run`); from then on a
    Ctrl-C or an error is billed before it propagates (:func:`_bill_unfinished`)."""
    from training.grpo.ledger import seconds_since_process_start

    since = seconds_since_process_start()
    process_t0 = time.perf_counter() - (since if since is not None else 0.0)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    from training.grpo import data as data_mod
    from training.grpo.evaluate import generate_and_score, summarize
    from training.grpo.ledger import Budgets, CostLedger, StepCounters
    from training.grpo.monitors import AlertLog, BudgetReachedBeforeTraining, LedgerCallback
    from training.grpo.reward_utils import policy_thinks, task_verifier
    from training.grpo.run import git_commit
    from training.registry import heartbeat_callback, write_heartbeat

    if max_steps is not None:
        cfg.trl["max_steps"] = int(max_steps)
    run_dir = Path(output_dir or cfg.output_dir)
    cfg.output_dir = str(run_dir)
    model_path, kind, count, price, args = _check_sft_run(cfg, run_dir)
    lc, trl_kw = cfg.ledger, cfg.trl_kwargs()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    write_heartbeat(run_dir, 0)
    tags = {
        **cfg.tags,
        "run_name": cfg.run_name,
        "method": "sft",
        "data_hash": "unknown",  # the traces' hash once they are made (a row billed before says unknown)
        "reward_hash": "none",
        "hparam_hash": stable_hash({"trl": trl_kw, "model": cfg.model.path, "traces": cfg.traces.model_dump()}),
        "git_commit": git_commit(),
    }
    counters = StepCounters()
    alerts = AlertLog(run_dir)
    budget_usd = Decimal(lc.budget_usd) if lc.budget_usd is not None else None
    ledger = CostLedger(
        run_dir,
        kind,
        count + lc.extra_devices,
        price,
        Budgets(budget_usd, lc.budget_device_hours, lc.budget_sampled_tokens),
        tags,
        lc.warn_fraction,
        lc.stop_on_projection,
    )
    ledger_cb = LedgerCallback(ledger, counters, alerts)
    # from here on a Ctrl-C or an error is billed (GRPO's rule): start-up when no row holds it yet, else the time
    # since the last row as an `interrupted` row (the step in flight, the save, the evaluations) - paid for, in no row
    finished = False  # the finish row is written: it holds the time since the last step
    try:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        verifier = task_verifier()
        thinks = cfg.model.thinks if cfg.model.thinks is not None else policy_thinks(tokenizer)

        train_problems = data_mod.load_problems(cfg.task, cfg.task.train_split, cfg.task.n_train)
        eval_problems = data_mod.load_problems(cfg.task, cfg.task.eval_split, cfg.task.n_eval)
        train_rows = data_mod.problem_rows(train_problems)
        eval_rows = data_mod.problem_rows(eval_problems)
        traces = teacher_traces(list(train_problems), train_rows, cfg, verifier)
        ledger.tags["data_hash"] = stable_hash([(t["problem_id"], t["completion"]) for t in traces])
        (run_dir / "traces.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces))
        # The prompt as the policy sees it at inference (chat template with the generation prompt, which opens the
        # thought); the completion is the trace plus the end-of-turn token, so the loss covers exactly what it
        # generates.
        eos = tokenizer.eos_token or ""
        ds = Dataset.from_list(
            [
                {
                    "prompt": tokenizer.apply_chat_template(t["prompt"], add_generation_prompt=True, tokenize=False),
                    "completion": t["completion"] + eos,
                }
                for t in traces
            ]
        )
        eval_max = cfg.eval.max_new_tokens or 256

        def evaluate(m: Any) -> dict[str, Any]:
            return summarize(
                generate_and_score(
                    m, tokenizer, eval_rows, verifier, eval_max, cfg.eval.batch_size, cfg.eval.temperature,
                    cfg.eval.samples, cfg.task.seed, require_closed_thought=thinks,
                )
            )  # fmt: skip

        class LedgeredSFTTrainer(SFTTrainer):
            """Counts the tokens under the loss (labels != -100) for the ledger's ``trained_tokens``."""

            def compute_loss(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
                if model.training and "labels" in inputs:
                    counters.trained_tokens += int((inputs["labels"][:, 1:] != -100).sum().item())
                    counters.prompts += int(inputs["labels"].shape[0])
                return super().compute_loss(model, inputs, *a, **kw)

        trainer = LedgeredSFTTrainer(
            model=model,
            args=args,
            train_dataset=ds,
            processing_class=tokenizer,
            callbacks=[ledger_cb, heartbeat_callback(run_dir)],
        )
        before = None
        t_eval = 0.0
        if cfg.eval.before:
            t0 = time.perf_counter()
            ledger_cb.eval_t0 = t0  # stopped during it, the part done is billed as eval (_bill_unfinished)
            before = evaluate(trainer.model)
            t_eval = time.perf_counter() - t0
            (run_dir / "eval_before.json").write_text(json.dumps(before, indent=2) + "\n")
        ledger_cb.startup_t0, ledger_cb.pre_eval_s = process_t0, t_eval
        t_train = time.perf_counter()
        try:
            trainer.train()
        except BudgetReachedBeforeTraining as e:  # start-up used the budget: no step trained (ledger.stop_reason says)
            logger.warning("stopped before the first step: %s", e)
        train_wall = time.perf_counter() - t_train
        model_dir = run_dir / "model"
        trainer.save_model(str(model_dir))
        tokenizer.save_pretrained(model_dir)
        after = None
        t_after = 0.0
        if cfg.eval.after and not ledger.hard_stop:  # a budget's hard line: spend nothing more
            t0 = time.perf_counter()
            after = evaluate(trainer.model)
            t_after = time.perf_counter() - t0
            (run_dir / "eval_after.json").write_text(json.dumps(after, indent=2) + "\n")
        ledger_cb.close_finish(trainer.state.global_step, t_after)
        finished = True  # an error after the finish row (writing the summary) is not billed again
        ledger.write_parquet()
        summary = ledger.summary(
            before["overall"]["accuracy"] if before else None, after["overall"]["accuracy"] if after else None
        )
        summary.update(
            {
                "method": "sft",
                "traces": len(traces),
                "train_wall_s": round(train_wall, 3),
                "eval_wall_s": round(t_eval + t_after, 3),
                "global_step": trainer.state.global_step,
                "alerts": [a.message for a in alerts.alerts],
            }
        )
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        write_heartbeat(run_dir, trainer.state.global_step)
        return summary
    except KeyboardInterrupt:
        if not finished:
            _bill_unfinished(ledger, ledger_cb, process_t0, "interrupted")
        raise
    except Exception as e:
        from training.registry import mark_failed

        if not finished:
            _bill_unfinished(ledger, ledger_cb, process_t0, "failed")
        mark_failed(run_dir, f"{type(e).__name__}: {e}")  # else listed `running`, then `abandoned`, the error nowhere
        raise


def _check_sft_run(cfg: SFTRunConfig, run_dir: Path) -> tuple[Path, str, int, Decimal, Any]:
    """The configuration's own refusals, before anything is written (after, the time spent is billed): a run
    directory that holds a run, no model directory at ``model.path``, an unpriced device kind, ``trl:`` options
    ``SFTConfig`` refuses (:class:`ConfigError`). Returns ``(model directory, device kind, device count, USD per
    device-hour, SFTConfig)``."""
    from trl import SFTConfig

    from training.grpo.run import detect_device

    if (run_dir / "ledger.jsonl").exists():
        raise ConfigError(f"{run_dir} already holds a run (ledger.jsonl): choose a new --output-dir")
    model_path = resolve_model_path(cfg.model.path)
    kind, count = detect_device()
    kind = cfg.ledger.device_kind or kind
    prices = cfg.ledger.prices()
    if kind not in prices:
        raise ConfigError(f"ledger.price_usd_per_device_hour: no price for device kind {kind!r}")
    trl_kw = cfg.trl_kwargs()
    if "output_dir" in trl_kw:
        raise ConfigError("trl.output_dir: set by ThinkGate (output_dir)")
    base = {"use_cpu": True, "bf16": False} if kind == "cpu" else {}
    try:
        args = SFTConfig(output_dir=str(run_dir), **{**base, **trl_kw})  # creates no directory
    except (TypeError, ValueError) as e:
        raise ConfigError(f"trl: {e}") from e
    return model_path, kind, count, prices[kind], args


def _bill_unfinished(ledger: CostLedger, ledger_cb: LedgerCallback, process_t0: float, cause: str) -> None:
    """On Ctrl-C or an error (``cause``: ``interrupted`` / ``failed``, for the log): the ``startup`` row (process
    start to now; the evaluation before training, finished or not, as ``eval``) when the first step had not begun,
    else an ``interrupted`` row for the time since the last row; a Ctrl-C marks the run ``interrupted`` for
    ``train runs``. Never raises (the interrupt or error must reach the user)."""
    from training.registry import mark_interrupted

    try:
        if ledger_cb.startup_billed:
            ledger_cb.close_interrupted(ledger.last_step)
        else:
            now = time.perf_counter()
            pre_eval = ledger_cb.pre_eval_s
            if not pre_eval and ledger_cb.eval_t0 is not None:  # stopped during that evaluation
                pre_eval = now - ledger_cb.eval_t0
            wall = max(0.0, now - process_t0)
            ledger.record_overhead("startup", 0, {"startup": max(0.0, wall - pre_eval), "eval": pre_eval})
        ledger.write_parquet()
        if cause == "interrupted":
            mark_interrupted(ledger.run_dir)
    except Exception:
        logger.exception("%s: could not bill it", cause)
