"""Run configuration for `thinkgate train grpo`: pydantic models, TRL style.

Every knob is a field with a default and a description (its help text). A run file (YAML) mirrors
:class:`RunConfig` and is parsed by pydantic; unknown keys are errors (a typo must not silently fall back to a
default) and every error names the field (``task.n_train: expected an integer, got 'many'``). TRL's own
``GRPOConfig`` options go under ``trl:`` and are passed through after validation against ``GRPOConfig``'s fields.

Units: lengths and budgets are tokens; prices are USD (``Decimal``); durations are seconds.
"""

from __future__ import annotations

import hashlib
import json
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.errors import ThinkGateError
from training.grpo.tier_prices import check_prices
from training.models import TINY_MODEL_DIR

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = TINY_MODEL_DIR


class ConfigError(ThinkGateError, ValueError):
    """Raised for an invalid run configuration; the message names the offending field."""


def resolve_model_path(path: str | Path) -> Path:
    """``model.path`` as a Hugging Face model directory: as given, or relative to the checkout when it is not one
    from the working directory. Raises ConfigError when there is no ``config.json`` there."""
    model_path = Path(path)
    if not model_path.is_dir() and not model_path.is_absolute() and (REPO_ROOT / model_path).is_dir():
        model_path = REPO_ROOT / model_path
    if not (model_path / "config.json").is_file():
        raise ConfigError(f"model.path: no Hugging Face model directory at {model_path}")
    return model_path


def _f(default: Any, help: str, **constraints: Any) -> Any:
    """A field with a default (value, or a zero-argument factory for sections and lists), a help text and pydantic
    constraints (``ge=1``: the error names the field and the bound)."""
    if callable(default):
        return Field(default_factory=default, description=help, **constraints)
    return Field(default=default, description=help, **constraints)


class _Section(BaseModel):
    """Base of every config section: unknown keys forbidden, numbers accepted where strings are expected (prices
    written bare), and positional construction in field order (``RewardSpec("correctness", 1.0)``)."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args:
            names = list(type(self).model_fields)
            if len(args) > len(names):
                raise TypeError(f"{type(self).__name__}: {len(args)} positional values for {len(names)} fields")
            kwargs.update(zip(names, args, strict=False))
        super().__init__(**kwargs)


class ModelConfig(_Section):
    path: str = _f(str(DEFAULT_MODEL_DIR), "Hugging Face model directory (policy and tokenizer).")
    dtype: Literal["float32", "bfloat16"] = _f(
        "float32",
        "Dtype the policy's weights are loaded in. Keep float32 and set trl.bf16: true for bf16 mixed precision "
        "(autocast; AdamW keeps fp32 master weights). bfloat16 weights need DeepSpeed (trl.deepspeed or an "
        "accelerate DeepSpeed config), which keeps its own fp32 master copy.",
    )
    thinks: bool | None = _f(
        None,
        "The policy generates inside a thought (the chat template's generation prompt opens <think>, or the model "
        "writes it itself as Qwen3 and DeepSeek-R1 do): a completion without </think> is a cut-off thought and "
        "scores wrong in every reward and in evaluation. None = detect from the chat template "
        "(training.grpo.reward_utils.thought_opener).",
    )


class TaskConfig(_Section):
    # the names router.tasks.load_task knows (router.tasks.TASKS): a typo is a config error, not a traceback after
    # the model loaded
    name: Literal["arith", "gsm8k", "math"] = _f("arith", "Task name for router.tasks.load_task: arith | gsm8k | math.")
    train_split: str = _f("train", "Split used for RL prompts.")
    eval_split: str = _f("test", "Held-out split for accuracy/length evaluation.")
    n_train: int = _f(256, "Number of training problems.", ge=1)
    n_eval: int = _f(64, "Number of held-out problems.", ge=1)
    seed: int = _f(0, "Seed for problem generation/selection.")
    difficulties: list[int] | None = _f(None, "Restrict to these difficulty buckets (None = all).")


class BudgetPromptConfig(_Section):
    """L1-style token budgets stated in the prompt (arXiv 2503.04697)."""

    enabled: bool = _f(False, "Append a 'think for N tokens' instruction and a budget_tokens column.")
    min_tokens: int = _f(16, "Smallest budget N (tokens), sampled uniformly per problem.")
    max_tokens: int = _f(96, "Largest budget N (tokens).")
    template: str = _f(
        "Think for {budget} tokens.",
        "Instruction appended to the question; {budget} = N. With l1_max this default becomes the paper's L1-Max "
        "wording 'Think for maximum {budget} tokens.'",
    )
    seed: int = _f(0, "Seed for the budget draw.")
    distribution: Literal["uniform", "log_uniform"] = _f(
        "uniform", "How N is drawn from [min_tokens, max_tokens]: uniform, or log_uniform (the dial model)."
    )
    unlimited_fraction: float = _f(
        0.0, "Share of prompts with no instruction (budget_tokens None: 'unlimited'; L1 rewards then refuse)."
    )


class RewardSpec(_Section):
    name: str = _f("correctness", "Reward name (see training.grpo.rewards.REWARD_REGISTRY).")
    weight: float = _f(1.0, "Weight of this reward in the advantage (TRL reward_weights).")
    params: dict[str, Any] = _f(dict, "Keyword parameters of the reward factory.")


def _default_rewards() -> list[RewardSpec]:
    return [RewardSpec(name="correctness", weight=1.0), RewardSpec(name="format", weight=0.2)]


class AdvantageConfig(_Section):
    aggregation: Literal["sum_then_normalize", "decoupled"] = _f(
        "sum_then_normalize",
        "sum_then_normalize: GRPO on the weighted sum (arXiv 2402.03300). decoupled: normalise each reward per "
        "group, sum, then normalise over the batch (GDPO, arXiv 2601.05242; TRL's normalize_then_sum).",
    )
    scale: Literal["group", "batch", "none"] = _f(
        "group", "sum_then_normalize only: divide by the group std, the batch std, or nothing (Dr. GRPO 2503.20783)."
    )
    epsilon: float = _f(1e-4, "Added to the std before dividing (TRL uses 1e-4).")
    pass_reward: str = _f("correctness", "Reward whose value decides 'solved' (accuracy signal, pass-rate history).")
    pass_threshold: float = _f(0.5, "A rollout counts as solved when pass_reward >= this.")
    signal: Literal["accuracy", "reward"] = _f(
        "accuracy",
        "What makes a group informative, for signal/effective_ratio (the no_signal monitor) and the dynamic-sampling "
        "filter. accuracy: some but not all rollouts solved (DAPO, arXiv 2503.14476; verl filter_groups metric=acc) "
        "-- a length reward alone does not make an all-solved group informative. reward: the total-reward advantages "
        "are not all equal.",
    )


class DynamicSamplingConfig(_Section):
    enabled: bool = _f(False, "Drop zero-variance groups and refill by over-sampling (DAPO, arXiv 2503.14476).")
    max_rounds: int = _f(4, "Rollout rounds per generation batch (the first included); bounds the refill loop.")
    oversample: float = _f(1.5, "Refill rounds roll out ceil(missing_groups * oversample) prompts.")
    skip_predicted: bool = _f(True, "Skip prompts predicted zero-variance before rollout (GRESO-like, 2506.02177).")
    skip_after: int = _f(2, "A prompt is predicted zero-variance after this many consecutive zero-variance groups.")
    skip_probability: float = _f(0.9, "Probability to skip a predicted all-solved prompt (the rest explore).")
    hard_keep_share: float = _f(
        0.25, "Probability to still roll out a predicted all-failed (hard) prompt, so the model can grow on it."
    )
    seed: int = _f(0, "Seed of the refill pool order and of skip decisions.")


class MonitorRule(_Section):
    name: str = _f("rule", "Name shown in alerts.")
    metric: str = _f(
        "entropy", "Logged metric key, e.g. entropy, signal/effective_ratio, eval_rewards/correctness/mean."
    )
    condition: Literal["below", "above", "slope_below", "no_gain", "drop_from_best"] = _f(
        "below",
        "below/above threshold; slope_below: least-squares slope per step over `window`; no_gain; drop_from_best: "
        "the value is more than `threshold` below the best seen so far (early stop on held-out accuracy).",
    )
    threshold: float = _f(0.0, "Threshold (for slope_below: units of the metric per optimizer step).")
    patience: int = _f(1, "Consecutive observations meeting the condition before the rule fires.")
    window: int = _f(5, "Observations in the slope window.")
    min_delta: float = _f(0.0, "no_gain: an improvement must exceed this.")
    action: Literal["warn", "stop"] = _f("warn", "warn: log an alert. stop: checkpoint, then stop training.")
    repeat: bool = _f(True, "Alert again each time the condition holds for `patience` observations; False = once.")
    hint: str = _f("", "Advice appended to the alert message (what to change).")


_TRUNCATION_HINT = (
    "completions are cut by trl.max_completion_length before they finish: raise it (or shorten the model's "
    "thoughts first); a cut-off thought scores wrong, so the run learns little but to stop early"
)


def _default_rules() -> list[MonitorRule]:
    return [
        MonitorRule("entropy_floor", "entropy", "below", 0.05, patience=3, action="warn"),
        MonitorRule("entropy_falling", "entropy", "slope_below", -0.05, patience=2, window=8, action="warn"),
        MonitorRule("no_signal", "signal/effective_ratio", "below", 0.05, patience=8, action="stop"),
        MonitorRule("no_eval_gain", "eval_rewards/correctness/mean", "no_gain", 0.0, patience=4, action="warn"),
        # TRL's completions/clipped_ratio: the share of rollouts that hit max_completion_length without EOS
        MonitorRule(
            "truncation", "completions/clipped_ratio", "above", 0.3, action="warn", repeat=False, hint=_TRUNCATION_HINT
        ),
        MonitorRule(
            "truncation_stop",
            "completions/clipped_ratio",
            "above",
            0.8,
            patience=5,
            action="stop",
            hint=_TRUNCATION_HINT,
        ),
        # early stop on the periodic held-out check (eval.every_steps); the best checkpoint is published as model/
        MonitorRule("heldout_drop", "heldout/accuracy", "drop_from_best", 0.05, patience=2, action="stop"),
    ]


class MonitorConfig(_Section):
    rules: list[MonitorRule] = _f(_default_rules, "Monitor rules (evaluated at every log).")


def _default_prices() -> dict[str, str]:
    # Placeholder list prices, USD per device-hour; set your own contract prices in the run file.
    return {"cpu": "0.05", "nvidia-h200": "3.50", "nvidia-h100": "2.50", "nvidia-a100": "1.30", "nvidia-l4": "0.70"}


class LedgerConfig(_Section):
    device_kind: str | None = _f(None, "Price-table key; None = detect (cpu or nvidia-<model>).")
    price_usd_per_device_hour: dict[str, str] = _f(_default_prices, "USD per device-hour by device kind.")
    extra_devices: int = _f(0, "Devices billed besides the training processes (e.g. GPUs serving vLLM in server mode).")
    budget_usd: str | None = _f(None, "Hard budget in USD (Decimal string); None = unlimited.")
    budget_device_hours: float | None = _f(None, "Hard budget in device-hours.")
    budget_sampled_tokens: int | None = _f(None, "Hard budget in sampled (generated) tokens.")
    warn_fraction: float = _f(0.8, "Warn once when a budget is this fraction spent.")
    stop_on_projection: bool = _f(
        True,
        "Stop before a step that is projected (the costliest of the last 3, plus the finish phase after it) to exceed "
        "a budget.",
    )
    quality_floor: float | None = _f(
        None,
        "Held-out accuracy (the periodic check, heldout/accuracy) the run is meant to reach. A budget stop before it "
        "is recorded as 'stopped below quality floor'.",
    )
    past_warning: Literal["continue", "stop", "continue_below_floor"] = _f(
        "continue",
        "At the warning line (warn_fraction of a budget): continue to the hard budget, stop there, or continue only "
        "while the best held-out accuracy is below quality_floor (spend the reserve to reach the floor).",
    )

    def prices(self) -> dict[str, Decimal]:
        return {k: Decimal(str(v)) for k, v in self.price_usd_per_device_hour.items()}


class EvalConfig(_Section):
    before: bool = _f(True, "Evaluate the initial model on the held-out set (for cost per accuracy point).")
    after: bool = _f(True, "Evaluate the trained model on the held-out set (model card).")
    max_new_tokens: int | None = _f(None, "Generation cap for evaluation; None = trl.max_completion_length.")
    batch_size: int = _f(32, "Prompts per generate() call.")
    temperature: float = _f(0.0, "0 = greedy; > 0 samples (deployment-like lengths), seeded.")
    samples: int = _f(1, "Completions per problem when sampling (accuracy = mean over samples).")
    every_steps: int | None = _f(
        None, "Also evaluate greedily every N optimizer steps (heldout.jsonl; metric heldout/accuracy for monitors)."
    )
    every_n: int | None = _f(None, "Held-out problems used by the periodic evaluation (None = all n_eval).")
    publish_best: bool = _f(
        True,
        "With every_steps: keep the weights of the best periodic held-out accuracy (best/) and publish them as model/ "
        "when they beat the last weights (the final weights are checked too).",
    )


class OutputConfig(_Section):
    tier_name: str = _f("short", "Gateway tier name in the tier snippet.")
    served_model_name: str = _f("thinkgate-tiny-short", "Model name the engine serves the output under.")
    base_url: str = _f(
        "http://127.0.0.1:8002/v1", "Upstream base URL in the tier snippet (8001 is the embedded engine)."
    )
    tier_prices: dict[str, dict[str, str]] = _f(
        dict,
        "Token prices per tier in the tier snippet: tier name -> {input_usd_per_mtok, cached_input_usd_per_mtok, "
        "output_usd_per_mtok} (USD per 1M tokens, decimal strings). A tier not named here gets the shipped default "
        "tier of the same name's prices (none/short/long); the gateway meters a tier without prices at $0.",
    )


class StorageConfig(_Section):
    """Rollout storage lifecycle (training/storage.py): hot JSONL, cold Parquet, then per-step statistics only."""

    rollouts: bool = _f(True, "Write every step's rollouts to <run>/rollouts/ (prompt id, completion, rewards, ...).")
    hot_steps: int = _f(20, "The rollouts of the last N steps stay hot (JSONL).")
    cold_after_steps: int | None = _f(
        None, "Compress a step's rollouts to Parquet (zstd) when it is this many steps old; None = hot_steps."
    )
    stats_only_after_steps: int | None = _f(
        None, "Delete a step's raw rollouts (its per-step statistics stay) when this many steps old; None = never."
    )


def _default_trl() -> dict[str, Any]:
    return {
        "num_generations": 4,
        "per_device_train_batch_size": 8,
        "max_completion_length": 64,
        "learning_rate": 1e-5,
        "beta": 0.0,
        "loss_type": "dapo",
        "epsilon_high": 0.28,
        "temperature": 1.0,
        "max_steps": 20,
        "logging_steps": 1,
        "save_steps": 50,
        "report_to": "none",
        "seed": 0,
    }


class RunConfig(_Section):
    run_name: str = _f("grpo", "Run name (model card, tags).")
    output_dir: str = _f("runs/grpo", "Run directory: config, metrics, ledger, plots, checkpoints, model/.")
    threads: int | None = _f(1, "torch.set_num_threads; keep 1 on a shared CPU box. None = torch default.")
    model: ModelConfig = _f(ModelConfig, "Policy model.")
    task: TaskConfig = _f(TaskConfig, "Training and held-out problems.")
    budget_prompt: BudgetPromptConfig = _f(BudgetPromptConfig, "L1 budgets in the prompt.")
    rewards: list[RewardSpec] = _f(_default_rewards, "Reward functions and weights.")
    advantages: AdvantageConfig = _f(AdvantageConfig, "Multi-reward advantage computation.")
    dynamic_sampling: DynamicSamplingConfig = _f(DynamicSamplingConfig, "DAPO dynamic sampling + GRESO skipping.")
    monitors: MonitorConfig = _f(MonitorConfig, "Monitor rules.")
    ledger: LedgerConfig = _f(LedgerConfig, "Cost ledger, prices and budgets.")
    eval: EvalConfig = _f(EvalConfig, "Held-out evaluation.")
    output: OutputConfig = _f(OutputConfig, "Model card and gateway tier snippet.")
    storage: StorageConfig = _f(StorageConfig, "Rollout storage lifecycle.")
    trl: dict[str, Any] = _f(_default_trl, "GRPOConfig keyword arguments (merged over the defaults above).")
    tags: dict[str, str] = _f(
        dict, "Free-form run tags (owner, team, purpose, ...): in every ledger row, summary.json and `train runs`."
    )

    def reward_names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def trl_kwargs(self) -> dict[str, Any]:
        """The merged TRL options (defaults overlaid by the run file)."""
        merged = _default_trl()
        merged.update(self.trl)
        return merged

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


# ---------------------------------------------------------------------------------------------------------------------
# dict/YAML -> models


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_TYPE_WORDS = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true/false",
    "bool_type": "true/false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


_BOUND_WORDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def _message(err: Any, cls: type[BaseModel]) -> str:
    """One pydantic error as ``field: what is wrong`` in the words the run-file docs use."""
    loc = _loc(tuple(err["loc"])) or cls.__name__
    kind, got = err["type"], err.get("input")
    if kind == "extra_forbidden":
        parent: Any = cls
        for part in err["loc"][:-1]:
            if isinstance(part, int):
                continue
            ann = parent.model_fields[part].annotation if hasattr(parent, "model_fields") else None
            inner = [a for a in getattr(ann, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)]
            parent = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else (inner[0] if inner else None)
        known = sorted(parent.model_fields) if parent is not None and hasattr(parent, "model_fields") else []
        return f"{loc}: unknown key; known: {known}"
    if kind == "literal_error":
        return f"{loc}: {got!r} is not one of {err.get('ctx', {}).get('expected', '')}"
    if kind in _TYPE_WORDS:
        return f"{loc}: expected {_TYPE_WORDS[kind]}, got {got!r}"
    if kind in _BOUND_WORDS:
        op, bound = _BOUND_WORDS[kind]
        return f"{loc}: must be {op} {err.get('ctx', {}).get(bound)}, got {got!r}"
    return f"{loc}: {err['msg']}"


def from_dict(cls: type[Any], data: Any, path: str = "") -> Any:
    """Parse ``data`` into the model ``cls`` (pydantic); raises :class:`ConfigError` naming the field(s)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        msgs = [_message(err, cls) for err in e.errors()]
        prefix = f"{path}." if path else ""
        raise ConfigError("; ".join(prefix + m for m in msgs)) from None


def validate(cfg: RunConfig) -> RunConfig:
    """Cross-field checks that need no heavy imports (TRL keys are checked in the trainer), section by section in
    a fixed order (the first failing check is the one reported). Returns ``cfg``; raises :class:`ConfigError`
    naming the field."""
    names = _check_rewards(cfg)
    g = cfg.trl_kwargs().get("num_generations", 8)
    if not isinstance(g, int) or g < 2:
        raise ConfigError(f"trl.num_generations: GRPO needs a group of at least 2, got {g!r}")
    _check_reward_params(cfg, g, _positive_int_option(cfg.trl_kwargs(), "max_completion_length"))
    _check_dynamic_sampling(cfg.dynamic_sampling)
    _check_budget_prompt(cfg.budget_prompt, names)
    trl = cfg.trl_kwargs()
    if cfg.model.dtype == "bfloat16" and not trl.get("deepspeed") and not _deepspeed_launch():
        raise ConfigError(
            "model.dtype: bfloat16 weights with plain AdamW have no fp32 master copy (measured on an H200: 1.9% of "
            "the weights changed in 20 steps at lr 1e-6, against 99.99% in fp32); load float32 and set "
            "trl.bf16: true (autocast), or train with DeepSpeed"
        )
    adv = cfg.advantages
    if adv.signal == "accuracy" and adv.pass_reward not in names:
        raise ConfigError(
            f"advantages.signal: 'accuracy' needs advantages.pass_reward ({adv.pass_reward!r}) among the rewards "
            f"{names}: name the reward that decides 'solved' (e.g. pass_reward: cosine, pass_threshold: 0.5) or set "
            "advantages.signal: reward"
        )
    _check_scale_preserving(cfg, names)
    _check_ledger_money(cfg.ledger)
    for tier, tp in cfg.output.tier_prices.items():
        problem = check_prices(f"output.tier_prices.{tier}", tp)
        if problem:
            raise ConfigError(problem)
    if cfg.eval.temperature < 0 or cfg.eval.samples < 1 or (cfg.eval.samples > 1 and cfg.eval.temperature == 0):
        raise ConfigError("eval: temperature >= 0, samples >= 1, and samples > 1 only with temperature > 0")
    _check_ledger_limits(cfg)
    st = cfg.storage
    try:
        from training.storage import Policy

        Policy(st.hot_steps, st.cold_after_steps, st.stats_only_after_steps)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    for r in cfg.monitors.rules:
        if r.patience < 1 or r.window < 2:
            raise ConfigError(f"monitors.rules.{r.name}: patience >= 1 and window >= 2 required")
    return cfg


def _check_rewards(cfg: RunConfig) -> list[str]:
    """At least one reward, unique names, each registered; returns the names."""
    from training.grpo.rewards import REWARD_REGISTRY

    if not cfg.rewards:
        raise ConfigError("rewards: at least one reward is required")
    names = cfg.reward_names()
    if len(set(names)) != len(names):
        raise ConfigError(f"rewards: names must be unique, got {names}")
    for r in cfg.rewards:
        if r.name not in REWARD_REGISTRY:
            raise ConfigError(f"rewards.{r.name}: unknown reward; known: {sorted(REWARD_REGISTRY)}")
    return names


def _positive_int_option(trl: dict[str, Any], key: str) -> int:
    """``trl.<key>`` as an integer >= 1 (a numeric string, as YAML 1.1 may give, is read as a number). Raises
    :class:`ConfigError` naming ``trl.<key>``."""
    value = trl.get(key)
    try:
        number = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or not number.is_integer():
        raise ConfigError(f"trl.{key}: expected an integer, got {value!r}")
    if number < 1:
        raise ConfigError(f"trl.{key}: must be >= 1, got {value!r}")
    return int(number)


def _check_reward_params(cfg: RunConfig, num_generations: int, max_len: int) -> None:
    """Build every reward once with a stand-in verifier, so unknown or out-of-range ``params`` are config errors
    before any model loads (they raised TypeError/ValueError tracebacks after it had). Raises ConfigError."""
    from training.grpo.rewards import RewardContext, build_rewards

    try:
        build_rewards(cfg.rewards, RewardContext(lambda row, text: False, max_len, num_generations))
    except ValueError as e:  # names the reward and its params
        raise ConfigError(str(e)) from e


def _check_dynamic_sampling(ds: DynamicSamplingConfig) -> None:
    """Rounds and skip counts >= 1, oversampling >= 1, probabilities in [0, 1]."""
    if ds.max_rounds < 1:
        raise ConfigError("dynamic_sampling.max_rounds: must be >= 1")
    if ds.oversample < 1.0:
        raise ConfigError("dynamic_sampling.oversample: must be >= 1.0")
    for p in ("skip_probability", "hard_keep_share"):
        if not 0.0 <= getattr(ds, p) <= 1.0:
            raise ConfigError(f"dynamic_sampling.{p}: must be in [0, 1]")
    if ds.skip_after < 1:
        raise ConfigError("dynamic_sampling.skip_after: must be >= 1")


def _check_budget_prompt(bp: BudgetPromptConfig, names: list[str]) -> None:
    """Token range, and the budget column that the budget-reading rewards (``l1_*``, ``dial_length``) need."""
    if bp.min_tokens < 1 or bp.max_tokens < bp.min_tokens:
        raise ConfigError("budget_prompt: need 1 <= min_tokens <= max_tokens")
    l1 = any(n in names for n in ("l1_exact", "l1_max"))
    if l1 and not bp.enabled:
        raise ConfigError("rewards: l1_exact/l1_max need budget_prompt.enabled: true (the budget column)")
    if "dial_length" in names and not bp.enabled:
        raise ConfigError("rewards: dial_length needs budget_prompt.enabled: true (the budget column)")
    if not 0.0 <= bp.unlimited_fraction < 1.0:
        raise ConfigError("budget_prompt.unlimited_fraction: must be in [0, 1)")
    if bp.unlimited_fraction > 0 and l1:
        raise ConfigError("budget_prompt.unlimited_fraction: l1_exact/l1_max need a budget on every row (dial_length)")


def _check_ledger_money(lc: LedgerConfig) -> None:
    """Device-hour prices are finite decimals >= 0; each budget, when set, finite and > 0 (USD a decimal,
    device-hours a number, sampled tokens an integer). Raises :class:`ConfigError` naming the field."""
    try:
        prices = lc.prices()
    except Exception as e:  # decimal.InvalidOperation
        raise ConfigError(f"ledger.price_usd_per_device_hour: not a decimal ({e})") from e
    if any(not p.is_finite() or p < 0 for p in prices.values()):
        raise ConfigError("ledger.price_usd_per_device_hour: prices must be finite and >= 0")
    if lc.budget_usd is not None:
        try:
            usd = Decimal(lc.budget_usd)
        except Exception as e:
            raise ConfigError(f"ledger.budget_usd: not a decimal: {lc.budget_usd!r}") from e
        _check_budget("budget_usd", usd, 1_000_000, "1 micro-USD ($0.000001), the ledger's unit of money")
    if lc.budget_device_hours is not None:
        _check_budget("budget_device_hours", Decimal(str(lc.budget_device_hours)), 3_600_000,
                      "1 device-millisecond (2.78e-7 device-hours), the ledger's unit of time")
    if lc.budget_sampled_tokens is not None:
        _check_budget("budget_sampled_tokens", Decimal(lc.budget_sampled_tokens))


def _check_budget(name: str, value: Decimal, units_per: int = 1, unit_name: str = "") -> None:
    """A hard budget must be finite and > 0: NaN made the first budget check raise after start-up was paid, and
    0 or a negative one stops every run before its first step (unlimited is ``null``). ``units_per``: the ledger's
    integer units per budget unit (micro-USD per USD, device-ms per device-hour); the budget must hold at least one
    of them, as the ledger counts it (``int(value * units_per)``, rounded down: CostLedger.check): one under a unit
    became 0, and the run paid its start-up and stopped before its first step. Refused rather than rounded up,
    which would raise a hard limit past what the run file says. Raises ConfigError."""
    if not value.is_finite() or value <= 0:
        raise ConfigError(f"ledger.{name}: must be finite and > 0 (null = unlimited), got {value}")
    if int(value * units_per) < 1:
        raise ConfigError(f"ledger.{name}: {value} is under {unit_name}: it counts as 0 and would stop the run "
                          "before its first step, after paying its start-up (null = unlimited)")


def _check_ledger_limits(cfg: RunConfig) -> None:
    """Extra devices >= 0, warning fraction in (0, 1], and the quality floor with what it needs."""
    lc = cfg.ledger
    if lc.extra_devices < 0:
        raise ConfigError("ledger.extra_devices: must be >= 0")
    if not 0 < lc.warn_fraction <= 1:
        raise ConfigError("ledger.warn_fraction: must be in (0, 1]")
    if lc.past_warning == "continue_below_floor" and lc.quality_floor is None:
        raise ConfigError("ledger.past_warning: continue_below_floor needs ledger.quality_floor")
    if lc.quality_floor is not None and not cfg.eval.every_steps:
        raise ConfigError("ledger.quality_floor: needs eval.every_steps (the floor is read from the periodic check)")


def _deepspeed_launch() -> bool:
    """True under ``accelerate launch`` with a DeepSpeed config (accelerate exports ACCELERATE_USE_DEEPSPEED)."""
    import os

    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true")


# Rewards whose per-group scale is the point: ALP's solve-rate factor max(p, 1/K) (larger pushes on easy prompts)
# and L1-Exact's alpha (the weight of the budget error against correctness). Dividing each group by its own std
# cancels them.
_SCALE_CARRYING = {
    "alp_length": "ALP's solve-rate scaling max(p_solved, 1/K)",
    "l1_exact": "L1-Exact's alpha",
}


def _check_scale_preserving(cfg: RunConfig, names: list[str]) -> None:
    """Refuse aggregations that cancel a reward's per-group scale (see ``_SCALE_CARRYING``).

    ``decoupled`` divides every reward by its own group std: ALP's factor and L1's alpha vanish. ``sum_then_normalize``
    with ``scale: group`` divides the total by the group std: in an all-solved group (where ALP's factor is largest)
    only the length varies and the factor vanishes too. ``scale: batch`` / ``none`` keep both.
    """
    adv = cfg.advantages
    for name in names:
        if name not in _SCALE_CARRYING:
            continue
        what = _SCALE_CARRYING[name]
        if adv.aggregation == "decoupled":
            raise ConfigError(
                f"advantages.aggregation: decoupled normalises {name} within each group and cancels {what}; use "
                "aggregation: sum_then_normalize with scale: batch (or none), or a group-relative length reward "
                "(kimi_length)"
            )
        if name == "alp_length" and adv.scale == "group":
            raise ConfigError(
                f"advantages.scale: group divides each group by its own std and cancels {what} (an all-solved "
                "group then gets the same push as a hard one); use scale: batch (or none) with alp_length"
            )


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key repeated in one mapping: plain PyYAML keeps the last silently, so
    ``budget_usd`` written twice ran under the second value unnoticed. Merge keys (``<<``) may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_run_file(path: str | Path) -> dict[str, Any]:
    """A run file (YAML) as a mapping (empty file: ``{}``). Raises :class:`ConfigError` for a missing file,
    unparsable YAML or a key repeated in one mapping (the parser's line and column), or a top level that is not a
    mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        loaded = yaml.load(p.read_text(), Loader=_UniqueKeyLoader) or {}  # a SafeLoader subclass: safe
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        ctx, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
        opened = f" ({ctx} opened at line {cmark.line + 1}, column {cmark.column + 1})" if ctx and cmark else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {problem or e}{opened}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    return loaded


def load_config(path: str | Path | None) -> RunConfig:
    """Read a run file (YAML) into a validated :class:`RunConfig`; ``None`` gives the defaults.

    Raises :class:`ConfigError` for a missing file, unparsable YAML or a duplicate key (the parser's line and
    column) or an invalid field (its dotted name)."""
    data = read_run_file(path) if path is not None else {}
    if isinstance(data, dict) and "traces" in data:  # else: "traces: unknown key; known: [...]", not what to run
        raise ConfigError(f"{path} is an SFT run file (it has `traces:`): run it with `thinkgate train sft --config "
                          f"{path}`; `train grpo` takes a GRPO run file (training/configs/smoke.yaml)")
    return validate(from_dict(RunConfig, data))


def stable_hash(obj: Any) -> str:
    """First 16 hex digits of the SHA-256 of ``obj`` as canonical JSON (sorted keys)."""
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
