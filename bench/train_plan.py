"""The planner against the ledger: ``thinkgate train plan`` (a probe of N steps) then the run, then ``train report``,
on the shipped GRPO configs; prints estimate vs actual USD per phase and the total error.

A config whose full run is too long for this machine is run as a shortened copy (``--max-steps NAME=N``: the same
run file with ``trl.max_steps`` set to N; the plan is made for that copy, so planned and run steps agree).

    python -m bench.train_plan [--configs smoke,short_tier,bench] [--probe-steps 2]
        [--max-steps short_tier=8,bench=8] [--out /tmp/train_plan] [--json bench/results/train_plan.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from training.grpo.config import REPO_ROOT

CONFIGS = REPO_ROOT / "training" / "configs"


def _run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=str(REPO_ROOT), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="smoke,short_tier,bench")
    ap.add_argument("--probe-steps", type=int, default=2)
    ap.add_argument("--max-steps", default="short_tier=8,bench=8", help="NAME=N,... shortened copies")
    ap.add_argument("--out", default="/tmp/train_plan")
    ap.add_argument("--json", default=None, help="Write all reports here.")
    a = ap.parse_args()
    short = dict(kv.split("=") for kv in a.max_steps.split(",") if kv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    results = {}
    for name in a.configs.split(","):
        src = CONFIGS / f"{name}.yaml"
        run_dir = out / name
        if run_dir.exists():
            sys.exit(f"{run_dir} exists: choose another --out")
        d = yaml.safe_load(src.read_text())
        d["output_dir"] = str(run_dir)
        if name in short:
            d["trl"]["max_steps"] = int(short[name])
        cfg_path = out / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(d, sort_keys=False))
        plan_path = out / f"{name}.plan.json"
        plan_s = _run(
            [
                py,
                "-m",
                "gateway",
                "train",
                "plan",
                "--config",
                str(cfg_path),
                "--json",
                str(plan_path),
                "--probe-steps",
                str(a.probe_steps),
            ]
        )
        run_s = _run([py, "-m", "training.grpo", "--config", str(cfg_path), "--quiet", "--allow-dirty"])
        (run_dir / "plan.json").write_text(plan_path.read_text())
        rep_path = out / f"{name}.report.json"
        _run([py, "-m", "gateway", "train", "report", str(run_dir), "--json", str(rep_path)])
        rep = json.loads(rep_path.read_text())
        rep["config"] = name
        rep["shortened_to_steps"] = int(short[name]) if name in short else None
        rep["plan_wall_s"], rep["run_wall_s"] = round(plan_s, 1), round(run_s, 1)
        rep["probe"] = json.loads(plan_path.read_text())["assumptions"]["probe"]
        results[name] = rep
        print(
            f"\n== {name} (steps {rep['steps']['actual']}{' shortened' if name in short else ''}; "
            f"plan {plan_s:.0f} s incl. probe, run {run_s:.0f} s)"
        )
        phases = rep["phases"]
        print(f"{'phase':<9}" + "".join(f"{p:>10}" for p in phases) + f"{'total':>11}")
        print(
            f"{'est USD':<9}"
            + "".join(f"{v['estimate_usd']:>10.6f}" for v in phases.values())
            + f"{rep['total']['estimate_usd']:>11.6f}"
        )
        print(
            f"{'act USD':<9}"
            + "".join(f"{v['actual_usd']:>10.6f}" for v in phases.values())
            + f"{rep['total']['actual_usd']:>11.6f}"
        )
        print(
            f"{'error':<9}"
            + "".join(f"{'n/a' if v['error'] is None else format(v['error'], '+.0%'):>10}" for v in phases.values())
            + f"{rep['total']['error']:>+11.1%}"
        )
    print("\n| config | steps | probe USD | estimate USD (low-high) | actual USD | error |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        t = r["total"]
        print(
            f"| {name} | {r['steps']['actual']}{' (shortened)' if r['shortened_to_steps'] else ''} | "
            f"{r['probe']['usd']:.6f} | {t['estimate_usd']:.6f} ({t['low_usd']:.6f}-{t['high_usd']:.6f}) | "
            f"{t['actual_usd']:.6f} | {t['error']:+.1%} |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
