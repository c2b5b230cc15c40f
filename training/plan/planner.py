"""``thinkgate train plan``: the probe run, the reference rates and the plan file; ``train report``: estimate vs
the ledger's actual bill per phase.

The probe is the same run file for ``N`` optimizer steps, run as its own process (``python -m training.grpo``) so
its ledger bills start-up exactly as the real run will: imports, model load, the evaluation before training, the
steps, a checkpoint after every step (to measure a save) and the final save. It skips the evaluation after
training and the periodic checks (the rate per evaluated token comes from the evaluation before), and budgets and
stop rules (a probe must run its N steps). Its bill is reported in the plan (``assumptions.probe``) and counted:
it is a real run directory in the registry (tag ``purpose: probe``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from router.jsonl import read_jsonl
from training.grpo.config import REPO_ROOT, ConfigError, RunConfig, from_dict, validate
from training.grpo.ledger import DISCARDED_FILE, LEDGER_FILE, MICRO, PHASES, phase_costs
from training.plan.estimate import RunShape, count_parameters, estimate, reference_rates, run_shape

PROBE_MARKER = "probe.json"


def resolved(cfg: RunConfig) -> dict[str, Any]:
    """``cfg.to_dict()`` with the TRL options merged over ThinkGate's defaults (what the run actually uses)."""
    d = cfg.to_dict()
    d["trl"] = cfg.trl_kwargs()
    return d


def model_dir(path: str) -> Path:
    """The model directory as the run resolves it (relative paths also against the repository root)."""
    p = Path(path)
    if not p.is_dir() and not p.is_absolute() and (REPO_ROOT / p).is_dir():
        p = REPO_ROOT / p
    return p


def run_config(run_dir: Path) -> RunConfig:
    """The resolved run config a run directory recorded (``config.yaml``)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml (not a run directory)")
    return validate(from_dict(RunConfig, yaml.safe_load(path.read_text()) or {}))


def _shape_of_run(run_dir: Path, cfg: RunConfig) -> RunShape:
    rows = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines() if x.strip()]
    steps = sum(1 for r in rows if r["kind"] == "step")
    count = int(rows[0].get("device_count", 1)) if rows else 1
    return run_shape(resolved(cfg), count_parameters(model_dir(cfg.model.path)), steps=steps, device_count=count)


def probe_config(cfg: RunConfig, steps: int, run_dir: Path) -> dict[str, Any]:
    """The probe's run file: ``cfg`` for ``steps`` steps (see the module docstring for what it leaves out)."""
    d = cfg.to_dict()
    d["output_dir"] = str(run_dir)
    d["run_name"] = f"{cfg.run_name}-probe"
    d["trl"] = {**d["trl"], "max_steps": int(steps), "save_steps": 1}
    d["eval"] = {**d["eval"], "after": False, "every_steps": None, "every_n": None}
    d["monitors"] = {"rules": []}
    d["ledger"] = {
        **d["ledger"],
        "budget_usd": None,
        "budget_device_hours": None,
        "budget_sampled_tokens": None,
        "quality_floor": None,
        "past_warning": "continue",
    }
    d["tags"] = {**d.get("tags", {}), "purpose": "probe"}
    return d


def run_probe(cfg: RunConfig, steps: int, run_dir: Path, timeout_s: float = 3600) -> Path:
    """Run the probe as a subprocess; returns its run directory. Raises :class:`ConfigError` when it fails."""
    if steps < 1:
        raise ConfigError("--probe-steps: must be >= 1")
    if run_dir.exists():
        if not (run_dir / PROBE_MARKER).is_file():
            raise ConfigError(f"{run_dir} exists and is not a probe directory: remove it or choose another --json")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    d = probe_config(cfg, steps, run_dir)
    cfg_path = run_dir.with_name(run_dir.name + ".yaml")
    cfg_path.write_text(yaml.safe_dump(d, sort_keys=False))
    (run_dir / PROBE_MARKER).write_text(json.dumps({"steps": steps, "config": str(cfg_path)}) + "\n")
    cmd = [sys.executable, "-m", "training.grpo", "--config", str(cfg_path), "--quiet", "--allow-dirty"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=str(REPO_ROOT))
    if proc.returncode != 0 or not (run_dir / "ledger.jsonl").is_file():
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise ConfigError(f"the probe run failed (exit {proc.returncode}) in {run_dir}:\n{tail}")
    return run_dir


def make_plan(
    cfg: RunConfig,
    *,
    reference: Path,
    price_usd_per_device_hour: Decimal | None = None,
    probe_steps: int | None = None,
) -> dict[str, Any]:
    """The plan of ``cfg`` with the rates of the run directory ``reference`` (a probe or an earlier run).

    The price is ``price_usd_per_device_hour`` when given, else the run file's price for the reference's device
    kind; the device count is the reference's (the same machine)."""
    ref_cfg = run_config(reference)
    ref_shape = _shape_of_run(reference, ref_cfg)
    rates = reference_rates(reference, ref_shape)
    params = count_parameters(model_dir(cfg.model.path))
    shape = run_shape(resolved(cfg), params, device_count=ref_shape.device_count)
    kind = cfg.ledger.device_kind or rates.source["device_kind"] or "cpu"
    if price_usd_per_device_hour is None:
        prices = cfg.ledger.prices()
        if kind not in prices:
            raise ConfigError(f"ledger.price_usd_per_device_hour: no price for {kind!r}; pass --usd-per-device-hour")
        price_usd_per_device_hour = prices[kind]
    plan = estimate(shape, rates, price_usd_per_device_hour)
    a = plan["assumptions"]
    a["config"] = {"run_name": cfg.run_name, "output_dir": cfg.output_dir, "model": cfg.model.path}
    a["device_kind"] = kind
    a["mean_length_source"] = (
        f"the model's measured completion lengths on the {rates.source['steps']} reference step(s) "
        f"({rates.mean_completion_tokens:.1f} tokens sampled, {rates.mean_trained_tokens:.1f} trained per rollout) "
        f"and its held-out evaluation ({rates.mean_eval_tokens:.1f} tokens)"
    )
    src = rates.source
    ref_info = {
        "run_dir": src["run_dir"],
        "steps": src["steps"],
        "usd": float(Decimal(src["micro_usd"]) / MICRO),
        "micro_usd": src["micro_usd"],
        "device_hours": src["device_hours"],
        "wall_s": src["wall_s"],
    }
    a["probe" if probe_steps else "reference_run"] = ref_info
    a["warnings"] = []
    if not _same_model(ref_cfg.model.path, cfg.model.path):
        # the rates are per parameter-token, so the model's size is accounted for; its lengths are not
        a["warnings"].append(
            f"the reference run trained {ref_cfg.model.path}, this plan is for {cfg.model.path}: the lengths above "
            "are the reference model's, and a model that thinks longer costs more than planned; measure this "
            "model's own with --probe-steps")
    return plan


def _same_model(a: str, b: str) -> bool:
    """Whether two ``model.path`` values name the same model (the same directory, or the same hub id)."""
    try:
        return Path(model_dir(a)).resolve() == Path(model_dir(b)).resolve()
    except (FileNotFoundError, ConfigError, OSError):
        return a == b


# --- report -----------------------------------------------------------------------------------------------------
def actual_by_phase(run_dir: Path) -> dict[str, Any]:
    """The ledger's bill of a run per phase: ``{phase: {device_hours, micro_usd}}`` plus totals, over every row
    billed — those of ``ledger.jsonl`` and the rolled-back ones a resume moved to ``ledger_discarded.jsonl`` (that
    money was spent: ``summary.json``'s ``spent_usd`` and ``train runs`` count it too; a row in both files, a
    resume killed between its two writes, once). A phase's USD is the sum over rows of its share of each row's own
    integer cost (:func:`training.grpo.ledger.phase_costs`, so each row's price is its own), and the phases add up
    to the total exactly. ``rolled_back``: the discarded rows' part, ``{micro_usd, device_hours, rows}``;
    ``steps``: the step rows kept (the steps the trained model went through); tokens count every row."""
    kept = list(read_jsonl(run_dir / LEDGER_FILE, missing_ok=True, skip_invalid=True))
    on_path = {r["seq"] for r in kept if "seq" in r}
    discarded = [r for r in read_jsonl(run_dir / DISCARDED_FILE, missing_ok=True, skip_invalid=True)
                 if r.get("seq") not in on_path]  # fmt: skip
    rows = kept + discarded
    shares = [phase_costs(r) for r in rows]

    def device_ms(r: dict[str, Any], key: str = "wall_ms") -> int:
        return int(r.get(key, 0)) * int(r.get("device_count", 1))

    out: dict[str, Any] = {}
    for p in PHASES:
        out[p] = {"device_hours": sum(device_ms(r, f"{p}_ms") for r in rows) / 3.6e6,
                  "micro_usd": sum(s[p] for s in shares)}
    out["total_micro_usd"] = sum(int(r["cost_micro_usd"]) for r in rows)
    out["rolled_back"] = {
        "micro_usd": sum(int(r["cost_micro_usd"]) for r in discarded),
        "device_hours": sum(device_ms(r) for r in discarded) / 3.6e6,
        "rows": len(discarded),
    }
    out["steps"] = sum(1 for r in kept if r["kind"] == "step")
    out["sampled_tokens"] = sum(int(r["sampled_tokens"]) for r in rows)
    out["trained_tokens"] = sum(int(r["trained_tokens"]) for r in rows)
    return out


def report(plan: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Estimate vs actual per phase: ``{"phases": {p: {estimate_usd, low_usd, high_usd, actual_usd, error}},
    "total": {...}, "rolled_back": {actual_usd, rows}, "steps": {...}, "tokens": {...}}``; ``error`` = (estimate -
    actual) / actual (None when actual is 0). Actual is all the run spent, the rolled-back rows of a resumed run
    included (:func:`actual_by_phase`); ``rolled_back`` is that part alone."""
    act = actual_by_phase(run_dir)
    micro = plan["assumptions"]["micro_usd"]

    def row(est: int, lo: int, hi: int, actual: int) -> dict[str, Any]:
        return {
            "estimate_usd": float(Decimal(est) / MICRO),
            "low_usd": float(Decimal(lo) / MICRO),
            "high_usd": float(Decimal(hi) / MICRO),
            "actual_usd": float(Decimal(actual) / MICRO),
            "error": (est - actual) / actual if actual else None,
            "in_range": lo <= actual <= hi,
        }

    phases = {p: row(micro[p]["usd"], micro[p]["low_usd"], micro[p]["high_usd"], act[p]["micro_usd"]) for p in PHASES}
    total = row(micro["total"], micro["low"], micro["high"], act["total_micro_usd"])
    planned_steps = plan["assumptions"]["run"]["steps"]
    rolled = act["rolled_back"]
    return {
        "phases": phases,
        "total": total,
        "rolled_back": {"actual_usd": float(Decimal(rolled["micro_usd"]) / MICRO), "rows": rolled["rows"]},
        "steps": {"planned": planned_steps, "actual": act["steps"]},
        "tokens": {
            "sampled": {"estimate": plan["sampled_tokens"], "actual": act["sampled_tokens"]},
            "trained": {"estimate": plan["trained_tokens"], "actual": act["trained_tokens"]},
        },
    }


def format_report(rep: dict[str, Any]) -> str:
    """The report as a plain-text table (USD with 6 decimals, error in percent)."""
    lines = [f"{'phase':<10}{'estimate':>12}{'low':>12}{'high':>12}{'actual':>12}{'error':>9}  in range"]
    for name, r in [*rep["phases"].items(), ("total", rep["total"])]:
        err = "n/a" if r["error"] is None else f"{r['error']:+.1%}"
        lines.append(
            f"{name:<10}{r['estimate_usd']:>12.6f}{r['low_usd']:>12.6f}{r['high_usd']:>12.6f}"
            f"{r['actual_usd']:>12.6f}{err:>9}  {'yes' if r['in_range'] else 'no'}"
        )
    rolled = rep["rolled_back"]
    if rolled["rows"]:  # a resumed run: the part of the actual total that a resume rolled back (still spent)
        lines.append(f"{'of which rolled back by a resume':<46}{rolled['actual_usd']:>12.6f}  "
                     f"({rolled['rows']} row(s), ledger_discarded.jsonl)")
    t = rep["tokens"]
    lines.append(
        f"steps planned {rep['steps']['planned']}, run {rep['steps']['actual']}; sampled tokens "
        f"{t['sampled']['estimate']} est / {t['sampled']['actual']} actual; trained tokens "
        f"{t['trained']['estimate']} est / {t['trained']['actual']} actual"
    )
    return "\n".join(lines)
