"""Monitors → decisions, as Hugging Face/TRL ``TrainerCallback``s.

- :class:`RuleEngine` (pure): evaluates :class:`~training.grpo.config.MonitorRule`s on logged metrics — entropy
  floor, entropy slope (least squares over a window, units of entropy per optimizer step), effective-signal ratio
  below a floor for N logs, no eval gain for N evals — and returns alerts.
- :class:`MonitorCallback`: feeds every ``on_log`` to the engine, writes ``metrics.jsonl`` (logs + derived slopes
  + alerts) and ``alerts.jsonl``; a ``stop`` rule sets ``should_save`` and ``should_training_stop`` (the Trainer
  saves the checkpoint of that step, then stops).
- :class:`LedgerCallback`: closes one :class:`~training.grpo.ledger.CostLedger` row per optimizer step and applies
  the budget decision (warn, or checkpoint + stop).

Metrics read (TRL 1.16 names): ``entropy``, ``completions/mean_length``, ``completions/clipped_ratio``,
``rewards/<name>/mean``; ours: ``signal/effective_ratio`` (groups with reward variance / groups rolled out).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from router.errors import ThinkGateError
from training.grpo.config import MonitorRule
from training.grpo.ledger import CostLedger, StepCounters

logger = logging.getLogger(__name__)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope dy/dx; 0.0 for fewer than 2 points or constant x."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


@dataclass
class Alert:
    step: int
    rule: str
    metric: str
    value: float
    action: str
    message: str


class _RuleState:
    def __init__(self, window: int) -> None:
        self.count = 0
        self.fired = False
        self.best: float | None = None
        self.points: deque[tuple[float, float]] = deque(maxlen=window)


class RuleEngine:
    """Evaluate monitor rules on successive log dicts (see module docstring)."""

    def __init__(self, rules: Sequence[MonitorRule]) -> None:
        self.rules = list(rules)
        self.states = {r.name: _RuleState(r.window) for r in self.rules}

    def observe(self, step: int, logs: dict[str, Any]) -> tuple[list[Alert], dict[str, float]]:
        """``(alerts, derived)``; derived holds ``monitor/<metric>/slope`` for slope rules with a full window."""
        alerts: list[Alert] = []
        derived: dict[str, float] = {}
        for r in self.rules:
            v = logs.get(r.metric)
            if not isinstance(v, int | float) or v != v:  # missing or NaN
                continue
            st = self.states[r.name]
            value = float(v)
            if r.condition == "below":
                met = value < r.threshold
            elif r.condition == "above":
                met = value > r.threshold
            elif r.condition == "slope_below":
                st.points.append((float(step), value))
                if len(st.points) < r.window:
                    continue
                value = slope([p[0] for p in st.points], [p[1] for p in st.points])
                derived[f"monitor/{r.metric}/slope"] = value
                met = value < r.threshold
            elif r.condition == "no_gain":
                if st.best is None or value > st.best + r.min_delta:
                    st.best = value
                    met = False
                else:
                    met = True
            elif r.condition == "drop_from_best":
                st.best = value if st.best is None else max(st.best, value)
                met = value < st.best - r.threshold
            else:  # pragma: no cover - validated by the config Literal
                raise ValueError(r.condition)
            st.count = st.count + 1 if met else 0
            if st.count >= r.patience and (r.repeat or not st.fired):
                st.count = 0
                st.fired = True
                alerts.append(Alert(step, r.name, r.metric, value, r.action, _message(r, value, st.best)))
        return alerts, derived

    def state_dict(self) -> dict[str, Any]:
        return {
            n: {"count": s.count, "best": s.best, "fired": s.fired, "points": list(s.points)}
            for n, s in self.states.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, s in state.items():
            if name in self.states:
                st = self.states[name]
                st.count, st.best, st.fired = int(s["count"]), s["best"], bool(s.get("fired", False))
                st.points.clear()
                st.points.extend(tuple(p) for p in s["points"])


def _message(r: MonitorRule, value: float, best: float | None = None) -> str:
    what = {
        "below": f"{r.metric} = {value:.4g} below {r.threshold:g}",
        "above": f"{r.metric} = {value:.4g} above {r.threshold:g}",
        "slope_below": f"slope of {r.metric} over {r.window} logs = {value:.4g}/step below {r.threshold:g}",
        "no_gain": f"{r.metric} = {value:.4g}: no gain over the best",
        "drop_from_best": f"{r.metric} = {value:.4g}, more than {r.threshold:g} below its best {best or 0:.4g}",
    }[r.condition]
    msg = f"[{r.name}] {what} for {r.patience} consecutive observation(s) -> {r.action}"
    return f"{msg}: {r.hint}" if r.hint else msg


class AlertLog:
    """Appends alerts (monitor rules and budgets) to ``<run>/alerts.jsonl`` and logs them."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "alerts.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.alerts: list[Alert] = []

    def add(self, alert: Alert) -> None:
        self.alerts.append(alert)
        logger.warning("%s (step %d)", alert.message, alert.step)
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(alert)) + "\n")


class BudgetReachedBeforeTraining(ThinkGateError, RuntimeError):
    """A budget was reached before the first step (start-up and the evaluation before training cost it): the run
    ends without training a step (``train_run`` catches it; the stop reason is the ledger's, ``hint`` what to do)."""

    hint = ("start-up (imports, model load, trainer set-up, the evaluation before training) left no room for a step "
            "and the finish: raise the ledger budget named above (`thinkgate train plan --config RUN.yaml --json "
            "PLAN.json` estimates start-up and every step) and start again in a new --output-dir")


def _stop(control: TrainerControl) -> None:
    control.should_save = True
    control.should_training_stop = True


class MonitorCallback(TrainerCallback):
    """Rule-driven warnings / checkpoint-and-stop, plus ``metrics.jsonl``."""

    def __init__(self, rules: Sequence[MonitorRule], run_dir: str | Path, alert_log: AlertLog | None = None) -> None:
        self.engine = RuleEngine(rules)
        self.run_dir = Path(run_dir)
        self.alert_log = alert_log or AlertLog(run_dir)
        self.stop_reason: str | None = None

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        logs = dict(logs or {})
        alerts, derived = self.engine.observe(state.global_step, logs)
        if state.is_world_process_zero:
            line = {"step": state.global_step, "ts": round(time.time(), 3), **logs, **derived}
            if alerts:
                line["alerts"] = [a.rule for a in alerts]
            with (self.run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(line, default=float) + "\n")
            for a in alerts:
                self.alert_log.add(a)
        for a in alerts:
            if a.action == "stop":
                self.stop_reason = self.stop_reason or a.message
                _stop(control)


class LedgerCallback(TrainerCallback):
    """One ledger row per optimizer step; budget warnings and checkpoint-then-stop.

    ``reduce(counters, wall_s)`` combines the per-process counters and wall time in multi-process runs (sum of counts,
    mean of seconds) so every process takes the same budget decision; rows are written by the main process only.
    """

    def __init__(
        self,
        ledger: CostLedger,
        counters: StepCounters,
        alert_log: AlertLog,
        reduce: Callable[[StepCounters, float], tuple[StepCounters, float]] | None = None,
    ) -> None:
        self.ledger, self.counters, self.alert_log, self.reduce = ledger, counters, alert_log, reduce
        self._t = time.perf_counter()
        # set by the run: perf_counter() at process start, and the evaluation before training (seconds)
        self.startup_t0: float | None = None
        self.pre_eval_s = 0.0
        self.startup_billed = False  # the start-up row is written (a Ctrl-C before it bills start-up itself)
        self.eval_t0: float | None = None  # perf_counter() when the evaluation before training began
        # seconds one plot figure took at start-up (GRPO: plots.warm_up; 0.0 where the finish draws none): the
        # ledger reserves the finish's plots from it (CostLedger.figure_ms)
        self.figure_s = 0.0

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        now = time.perf_counter()
        if self.startup_t0 is not None:  # bill start-up (imports, model load, trainer set-up) and the first eval
            startup, pre_eval = max(0.0, now - self.startup_t0 - self.pre_eval_s), self.pre_eval_s
            figure = self.figure_s
            if self.reduce is not None:  # every process bills (and decides on) the same row, as for steps
                startup = self.reduce(StepCounters(), startup)[1]
                pre_eval = self.reduce(StepCounters(), pre_eval)[1]
                figure = self.reduce(StepCounters(), figure)[1]
            self.ledger.figure_ms = max(0, round(figure * 1000))
            self.ledger.record_overhead("startup", state.global_step, {"startup": startup, "eval": pre_eval})
            self.startup_t0 = None
            self.startup_billed = True
            # the next row starts where this one ends, also when the check below raises: the finish row of a run
            # stopped here billed from this callback's creation again (start-up twice: 4.8-6.9 s, seen)
            self._t = now
            if self._check(state.global_step, state.is_world_process_zero):
                # The Trainer checks should_training_stop only after a step: a stop set here would still train
                # (and bill) one step past a budget that start-up alone used up (31x a tiny budget, seen). Every
                # process raises alike: the row and the ledger they check are the same.
                raise BudgetReachedBeforeTraining(self.ledger.stop_reason or "budget reached")
        else:
            self._t = now

    def since_last_row_s(self) -> float:
        """Seconds since the last row's time was taken: in the finish, how much of it is spent and not billed yet."""
        return time.perf_counter() - self._t

    def close_finish(self, step: int, eval_s: float) -> None:
        """Bill everything after the last step row (saving, the evaluation after training, plots) as a ``finish``
        row: ``eval_s`` of it was evaluation, the rest io."""
        now = time.perf_counter()
        total, self._t = now - self._t, now
        ev = eval_s + self.counters.eval_s
        self.counters.reset()
        self.ledger.record_overhead("finish", step, {"eval": ev, "io": max(0.0, total - ev)})

    def close_interrupted(self, step: int) -> dict[str, Any]:
        """Bill the time since the last row — the step a Ctrl-C cut short, ``step`` the last one finished — as an
        ``interrupted`` row, with the rollouts it had sampled: paid for, though no step row will ever hold them (a
        resume redoes the step, and keeps this row as discarded spend). No collective: the other processes may be
        gone; each bills its own wall time and only the writer writes."""
        now = time.perf_counter()
        wall, self._t = now - self._t, now
        c = self.counters.snapshot()
        self.counters.reset()
        spent = {"sampling": c.generation_s, "reward": c.reward_s, "eval": c.eval_s, "io": c.io_s}
        return self.ledger.record_overhead("interrupted", step,
                                           {**spent, "update": max(0.0, wall - sum(spent.values()))}, c)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.close_step(state.global_step, state.is_world_process_zero):
            _stop(control)

    def close_step(self, step: int, is_main: bool = True) -> bool:
        """Record the counters since the last call as ledger row ``step``; True when a budget says stop.
        Also used for the rollouts of a step aborted by an error (they were paid for)."""
        now = time.perf_counter()
        wall, self._t = now - self._t, now
        snap = self.counters.snapshot()
        self.counters.reset()
        if self.reduce is not None:
            snap, wall = self.reduce(snap, wall)
        self.ledger.record(step, snap, wall)
        return self._check(step, is_main)

    def _check(self, step: int, is_main: bool) -> bool:
        check = self.ledger.check()
        if is_main:
            for w in check.warnings:
                self.alert_log.add(Alert(step, "budget", "ledger", 0.0, "warn", w))
            if check.stop_reason:
                self.alert_log.add(Alert(step, "budget", "ledger", 0.0, "stop", check.stop_reason))
        return check.stop_reason is not None

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if state.is_world_process_zero:
            self.ledger.write_parquet()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if state.is_world_process_zero:
            self.ledger.write_parquet()


class HeldoutEvalCallback(TrainerCallback):
    """Greedy held-out evaluation every ``every_steps`` optimizer steps (after the step's ledger row).

    Appends ``{step, accuracy, mean_completion_tokens, cum_sampled_tokens, cum_wall_ms, …}`` to
    ``heldout.jsonl`` and feeds ``heldout/accuracy`` and ``heldout/mean_completion_tokens`` to the monitor rules.
    Its wall time is booked as ``eval`` in the next ledger row (``counters.eval_s``); saving a best model as ``io``.
    With ``best_dir``: the weights of the best accuracy so far (strictly better; ties keep the earlier, shorter
    trained one) are saved there with ``best.json`` ``{step, accuracy}``; at the end of training the final weights
    are evaluated too when the last step was not.
    """

    def __init__(
        self,
        every_steps: int,
        evaluate: Callable[[Any], dict[str, Any]],
        run_dir: str | Path,
        counters: StepCounters,
        ledger: CostLedger,
        monitor: MonitorCallback | None = None,
        best_dir: Path | None = None,
    ) -> None:
        self.every_steps, self.evaluate, self.run_dir = every_steps, evaluate, Path(run_dir)
        self.counters, self.ledger, self.monitor = counters, ledger, monitor
        self.best_dir = best_dir
        self.best: dict[str, Any] | None = None
        self.last_step = -1
        if best_dir is not None and (best_dir / "best.json").is_file():  # a resumed run keeps its best
            self.best = json.loads((best_dir / "best.json").read_text())

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if state.global_step % self.every_steps or kw.get("model") is None:
            return
        self._run(args, state, control, kw["model"])

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.best_dir is not None and kw.get("model") is not None and 0 < state.global_step != self.last_step:
            self._run(args, state, control, kw["model"])

    def _run(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any) -> None:
        self.last_step = state.global_step
        t0 = time.perf_counter()
        summary = self.evaluate(model)
        self.counters.eval_s += time.perf_counter() - t0
        overall = summary["overall"]
        acc = float(overall["accuracy"])
        self.ledger.best_quality = acc if self.ledger.best_quality is None else max(self.ledger.best_quality, acc)
        last = self.ledger.last_row or {}
        if state.is_world_process_zero:
            line = {
                "step": state.global_step,
                **overall,
                "by_difficulty": summary["by_difficulty"],
                **{k: last.get(k) for k in ("cum_sampled_tokens", "cum_wall_ms", "cum_cost_micro_usd")},
            }
            with (self.run_dir / "heldout.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
            if self.best_dir is not None and (self.best is None or acc > float(self.best["accuracy"])):
                t1 = time.perf_counter()
                self.best = {"step": state.global_step, "accuracy": acc}
                getattr(model, "module", model).save_pretrained(self.best_dir)
                (self.best_dir / "best.json").write_text(json.dumps(self.best))
                self.counters.io_s += time.perf_counter() - t1
        if self.monitor is not None:
            logs = {"heldout/accuracy": acc, "heldout/mean_completion_tokens": overall["mean_completion_tokens"]}
            self.monitor.on_log(args, state, control, logs=logs)
