"""Cost estimate of a GRPO run before launch, per ledger phase, from per-token rates measured on an earlier run.

The formulas (every count from the run file, every rate from the reference run's ledger, ``P`` = parameters):

- sampling: ``steps × rollouts_per_step × oversample × mean_completion_tokens × P × sampling_ms_per_param_token``
  (``oversample`` = rollouts generated / rollouts trained: dynamic sampling's refill rounds);
- reward:   ``steps × rollouts_per_step × oversample × reward_ms_per_rollout``;
- update:   ``P × trained_tokens × update_ms_per_param_token``, ``trained_tokens = steps × rollouts_per_step ×
  mean_trained_tokens`` (completion tokens under the loss mask, counted by the trainer);
- eval:     ``eval_completions × mean_eval_tokens × P × eval_ms_per_param_token`` (before, after, the periodic checks);
- startup:  the reference's start-up time (imports, model load, trainer set-up), a constant (a resumed reference's
  mean per process start: the planned run starts once);
- io:       ``checkpoints × checkpoint_io_ms + final_io_ms`` (the saved model, card, plots).

Device time = wall ms × device count; USD per phase = integer micro-USD (:func:`training.grpo.ledger.micro_usd`,
round half even) at the price per device-hour; the JSON carries USD as floats of those exact micro-USD amounts (at
most 6 decimals) and the integers under ``assumptions.micro_usd``. The low–high range multiplies each phase by the
reference's step-to-step spread of that phase's per-step cost (min/mean, max/mean), widened to at least
``±MIN_BAND`` (the run-to-run noise of a shared machine measured in bench/RESULTS.md).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from router.jsonl import read_jsonl
from training.grpo.ledger import MICRO, PHASES, micro_usd

MIN_BAND = 0.25


def count_parameters(model_dir: str | Path) -> int:
    """Number of parameters in a Hugging Face model directory, read from the safetensors headers (no torch).

    Raises ``FileNotFoundError`` when the directory holds no ``*.safetensors``."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: cannot count the model's parameters")
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            size = 1
            for d in meta["shape"]:
                size *= int(d)
            total += size
    return total


@dataclass
class RunShape:
    """The counts of a run that its run file fixes (no measurement)."""

    steps: int
    rollouts_per_step: int  # trained rollouts per optimizer step (per_device_train_batch_size x grad. accumulation)
    num_generations: int
    dynamic_sampling: bool
    eval_completions: int  # held-out completions generated over the run (before + after + periodic checks)
    checkpoints: int
    parameters: int
    save_steps: int = 0
    device_count: int = 1

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def run_shape(cfg: dict[str, Any], parameters: int, steps: int | None = None, device_count: int = 1) -> RunShape:
    """:class:`RunShape` of a resolved run config (``RunConfig.to_dict()`` with ``trl`` merged)."""
    trl = cfg["trl"]
    s = int(steps if steps is not None else trl.get("max_steps", 20))
    bs = int(trl.get("per_device_train_batch_size", 8)) * int(trl.get("gradient_accumulation_steps", 1))
    ev = cfg["eval"]
    per_full = int(cfg["task"]["n_eval"]) * int(ev.get("samples", 1))
    full = (1 if ev.get("before", True) else 0) + (1 if ev.get("after", True) else 0)
    periodic = 0
    every = ev.get("every_steps")
    if every:
        n = int(ev.get("every_n") or cfg["task"]["n_eval"]) * int(ev.get("samples", 1))
        checks = s // int(every)
        if ev.get("publish_best", True) and s % int(every):
            checks += 1  # the final weights are checked too when the last step was not
        periodic = checks * n
    save = int(trl.get("save_steps", 50) or 0)
    return RunShape(
        steps=s,
        rollouts_per_step=bs,
        num_generations=int(trl.get("num_generations", 8)),
        dynamic_sampling=bool(cfg.get("dynamic_sampling", {}).get("enabled", False)),
        eval_completions=full * per_full + periodic,
        checkpoints=(s // save) if save > 0 else 0,
        parameters=parameters,
        save_steps=save,
        device_count=device_count,
    )


@dataclass
class Rates:
    """Per-token and per-item costs (wall ms) measured on a reference run, with each phase's step-to-step spread."""

    sampling_ms_per_param_token: float
    update_ms_per_param_token: float
    reward_ms_per_rollout: float
    eval_ms_per_param_token: float
    startup_ms: float
    checkpoint_io_ms: float
    final_io_ms: float
    mean_completion_tokens: float
    mean_trained_tokens: float
    mean_eval_tokens: float
    oversample: float
    spread: dict[str, tuple[float, float]] = field(default_factory=dict)  # phase -> (low factor, high factor)
    source: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: (v if k != "spread" else {p: list(b) for p, b in v.items()}) for k, v in vars(self).items()}


def _ledger_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "ledger.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no ledger.jsonl in {run_dir}: not a GRPO run directory")
    return list(read_jsonl(path))


def _mean_eval_tokens(run_dir: Path) -> float | None:
    vals = []
    for name in ("eval_before.json", "eval_after.json"):
        p = run_dir / name
        if p.is_file():
            vals.append(float(json.loads(p.read_text())["overall"]["mean_completion_tokens"]))
    heldout = run_dir / "heldout.jsonl"
    if heldout.is_file():
        for line in heldout.read_text().splitlines():
            if line.strip():
                vals.append(float(json.loads(line)["mean_completion_tokens"]))
    return sum(vals) / len(vals) if vals else None


def reference_rates(run_dir: str | Path, ref_shape: RunShape) -> Rates:
    """:class:`Rates` from a finished (or probe) run directory: its ledger rows and held-out evaluation files.

    ``ref_shape`` is the :class:`RunShape` of that run (its own config and the steps it actually ran). Raises
    ``FileNotFoundError`` / ``ValueError`` when the run has no ledger or no step row."""
    d = Path(run_dir)
    rows = _ledger_rows(d)
    steps = [r for r in rows if r["kind"] == "step"]
    if not steps:
        raise ValueError(f"{d}: the ledger has no step row (the run did not reach an optimizer step)")
    tot = {k: sum(int(r.get(k, 0)) for r in rows) for k in ("sampled_tokens", "trained_tokens", "rollouts")}
    ms = {p: sum(int(r.get(f"{p}_ms", 0)) for r in rows) for p in PHASES}
    p = ref_shape.parameters
    n_steps = len(steps)
    trained_rollouts = n_steps * ref_shape.rollouts_per_step
    finish = [r for r in rows if r["kind"] == "finish"]
    finish_io = float(sum(int(r["io_ms"]) for r in finish))
    step_io = float(sum(int(r["io_ms"]) for r in steps))
    # A checkpoint is saved after its step's row closes: its io is billed in the next step's row, or in the finish
    # row when it is the last step (then together with the saved model, the card and the plots).
    save = ref_shape.save_steps
    in_rows = sum(1 for s in range(1, n_steps) if save and s % save == 0)
    last_is_ckpt = bool(save) and n_steps % save == 0
    if in_rows:
        checkpoint_io = step_io / in_rows
        final_io = max(0.0, finish_io - (checkpoint_io if last_is_ckpt else 0.0))
    elif last_is_ckpt:  # one checkpoint, at the last step: split the finish row's io evenly (both save the weights)
        checkpoint_io = final_io = finish_io / 2
    else:
        checkpoint_io, final_io = finish_io, finish_io
    # One start-up per process: a resumed reference ran 2+ processes, each with its own start-up row (imports, model
    # load, trainer set-up); the run being planned pays one, so the rate is their mean, not their sum.
    starts = sum(1 for r in rows if r["kind"] == "startup" and int(r.get("startup_ms", 0)) > 0)
    eval_tokens = _mean_eval_tokens(d) or (tot["sampled_tokens"] / max(1, tot["rollouts"]))
    eval_work = ref_shape.eval_completions * eval_tokens * p
    spread: dict[str, tuple[float, float]] = {}
    for phase in ("sampling", "reward", "update"):
        per = [int(r[f"{phase}_ms"]) for r in steps]
        mean = sum(per) / len(per)
        spread[phase] = (min(per) / mean, max(per) / mean) if mean > 0 else (1.0, 1.0)
    return Rates(
        sampling_ms_per_param_token=ms["sampling"] / max(1, tot["sampled_tokens"]) / p,
        update_ms_per_param_token=ms["update"] / max(1, tot["trained_tokens"]) / p,
        reward_ms_per_rollout=ms["reward"] / max(1, tot["rollouts"]),
        eval_ms_per_param_token=ms["eval"] / eval_work if eval_work else 0.0,
        startup_ms=ms["startup"] / max(1, starts),
        checkpoint_io_ms=checkpoint_io,
        final_io_ms=final_io,
        mean_completion_tokens=tot["sampled_tokens"] / max(1, tot["rollouts"]),
        mean_trained_tokens=tot["trained_tokens"] / max(1, trained_rollouts),
        mean_eval_tokens=eval_tokens,
        oversample=tot["rollouts"] / max(1, trained_rollouts),
        spread=spread,
        source={
            "run_dir": str(d),
            "steps": n_steps,
            "device_kind": rows[0].get("device_kind"),
            "device_count": int(rows[0].get("device_count", 1)),
            "price_usd_per_device_hour": rows[0].get("price_usd_per_device_hour"),
            "micro_usd": sum(int(r["cost_micro_usd"]) for r in rows),
            "device_hours": sum(int(r["device_ms"]) for r in rows) / 3.6e6,
            "wall_s": sum(int(r["wall_ms"]) for r in rows) / 1000,
        },
    )


def _usd(micro: int) -> float:
    """The float of an exact micro-USD amount (``Decimal(micro) / 1e6`` has at most 6 decimals)."""
    return float(Decimal(micro) / MICRO)


def estimate(shape: RunShape, rates: Rates, price_usd_per_device_hour: Decimal) -> dict[str, Any]:
    """The plan: ``{"phases": {PHASE: {"device_hours", "usd", "low_usd", "high_usd"}}, "total_usd", "low_usd",
    "high_usd", "sampled_tokens", "trained_tokens", "assumptions": {...}}`` (module docstring: formulas, units)."""
    p = shape.parameters
    sampled_rollouts = shape.steps * shape.rollouts_per_step * (rates.oversample if shape.dynamic_sampling else 1.0)
    sampled_tokens = sampled_rollouts * rates.mean_completion_tokens
    trained_tokens = shape.steps * shape.rollouts_per_step * rates.mean_trained_tokens
    wall_ms = {
        "startup": rates.startup_ms,
        "sampling": sampled_tokens * p * rates.sampling_ms_per_param_token,
        "reward": sampled_rollouts * rates.reward_ms_per_rollout,
        "update": p * trained_tokens * rates.update_ms_per_param_token,
        "eval": shape.eval_completions * rates.mean_eval_tokens * p * rates.eval_ms_per_param_token,
        "io": shape.checkpoints * rates.checkpoint_io_ms + rates.final_io_ms,
    }
    price = Decimal(price_usd_per_device_hour)
    phases: dict[str, dict[str, float]] = {}
    micro: dict[str, dict[str, int]] = {}
    tot = {"usd": 0, "low": 0, "high": 0}
    device_ms_total = 0
    for phase in PHASES:
        dev_ms = round(wall_ms[phase] * shape.device_count)
        lo_f, hi_f = rates.spread.get(phase, (1.0, 1.0))
        lo_f, hi_f = min(lo_f, 1 - MIN_BAND), max(hi_f, 1 + MIN_BAND)
        m = {
            "usd": micro_usd(dev_ms, price),
            "low": micro_usd(round(dev_ms * lo_f), price),
            "high": micro_usd(round(dev_ms * hi_f), price),
        }
        for k in tot:
            tot[k] += m[k]
        device_ms_total += dev_ms
        micro[phase] = {"usd": m["usd"], "low_usd": m["low"], "high_usd": m["high"], "device_ms": dev_ms}
        phases[phase] = {
            "device_hours": dev_ms / 3.6e6,
            "usd": _usd(m["usd"]),
            "low_usd": _usd(m["low"]),
            "high_usd": _usd(m["high"]),
        }
    return {
        "phases": phases,
        "total_usd": _usd(tot["usd"]),
        "low_usd": _usd(tot["low"]),
        "high_usd": _usd(tot["high"]),
        "sampled_tokens": round(sampled_tokens),
        "trained_tokens": round(trained_tokens),
        "assumptions": {
            "money": "usd fields are floats of exact micro-USD amounts (<= 6 decimals); the integers are in micro_usd",
            "micro_usd": {**micro, "total": tot["usd"], "low": tot["low"], "high": tot["high"]},
            "device_hours": device_ms_total / 3.6e6,
            "price_usd_per_device_hour": str(price),
            "run": shape.as_dict(),
            "rates": rates.as_dict(),
            "wall_ms": {k: round(v) for k, v in wall_ms.items()},
            "min_band": MIN_BAND,
            "formulas": {
                "sampling": "steps * rollouts_per_step * oversample * mean_completion_tokens * P * ms_per_param_token",
                "reward": "steps * rollouts_per_step * oversample * reward_ms_per_rollout",
                "update": "P * trained_tokens * update_ms_per_param_token",
                "eval": "eval_completions * mean_eval_tokens * P * eval_ms_per_param_token",
                "startup": "reference startup_ms",
                "io": "checkpoints * checkpoint_io_ms + final_io_ms",
            },
        },
    }
