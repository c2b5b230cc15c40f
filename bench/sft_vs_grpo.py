"""SFT vs GRPO at equal cost, from the same model: held-out accuracy, mean thought length and USD per accuracy
point, in distribution and on a shifted set (more operations than trained).

1. GRPO (``thinkgate train grpo``): the short-tier recipe (correctness + format + the Kimi length reward, decoupled
   advantages, dynamic sampling) on arith with ``--train-difficulties`` operations, ``--grpo-steps`` steps.
2. SFT (``thinkgate train sft``): verified terse teacher traces of the same training problems, with
   ``ledger.budget_usd`` = what GRPO spent before its finish row (the finish — saving, the evaluation after
   training — is billed on top in both), so both bills end level; ``max_steps`` is large: the budget stops it.
3. Both runs evaluate before/after on the in-distribution held-out set (billed in their ledgers); then this script
   evaluates the start model and both results on the shifted set (``--shift-difficulties``; not billed: the same
   work for each).

USD per accuracy point = the run's ledger total / (accuracy after - accuracy before, in percentage points).

    python -m bench.sft_vs_grpo [--out /tmp/sft_vs_grpo] [--grpo-steps 8] [--n-train 128] [--n-eval 48]
        [--json bench/results/sft_vs_grpo.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import yaml

from training.grpo.config import REPO_ROOT

MODEL = "models/thinkgate-tiny"


def _run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=str(REPO_ROOT), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def _ledger_micro(run_dir: Path) -> tuple[int, int]:
    rows = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines() if x.strip()]
    total = sum(int(r["cost_micro_usd"]) for r in rows)
    finish = sum(int(r["cost_micro_usd"]) for r in rows if r["kind"] == "finish")
    return total, finish


def shifted_eval(model_dirs: dict[str, Path], difficulties: list[int], n: int, max_new: int) -> dict[str, dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.grpo import data as data_mod
    from training.grpo.config import TaskConfig
    from training.grpo.evaluate import generate_and_score, summarize
    from training.grpo.reward_utils import task_verifier

    torch.set_num_threads(1)
    rows = data_mod.problem_rows(data_mod.load_problems(TaskConfig(n_eval=n, difficulties=difficulties), "test", n))
    verifier = task_verifier()
    out = {}
    for name, d in model_dirs.items():
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        out[name] = summarize(generate_and_score(model, tok, rows, verifier, max_new, 48))["overall"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/sft_vs_grpo")
    ap.add_argument("--grpo-steps", type=int, default=8)
    ap.add_argument("--n-train", type=int, default=128)
    ap.add_argument("--n-eval", type=int, default=48)
    ap.add_argument("--train-difficulties", default="1,2,3,4")
    ap.add_argument("--shift-difficulties", default="5,6")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    train_d = [int(x) for x in a.train_difficulties.split(",")]
    shift_d = [int(x) for x in a.shift_difficulties.split(",")]
    py = sys.executable
    t_all = time.perf_counter()
    task = {"name": "arith", "n_train": a.n_train, "n_eval": a.n_eval, "difficulties": train_d}
    ev = {"max_new_tokens": a.max_new_tokens, "batch_size": a.n_eval, "temperature": 0.0}
    grpo_dir, sft_dir = out / "grpo", out / "sft"
    for d in (grpo_dir, sft_dir):
        if d.exists():
            sys.exit(f"{d} exists: choose another --out")
    grpo_cfg = yaml.safe_load((REPO_ROOT / "training" / "configs" / "short_tier.yaml").read_text())
    grpo_cfg.update(
        run_name="sft-vs-grpo-grpo", output_dir=str(grpo_dir), task=task, eval=ev,
        tags={"purpose": "sft_vs_grpo", "method": "grpo"}, ledger={},
    )  # fmt: skip
    grpo_cfg["trl"] = {**grpo_cfg["trl"], "max_steps": a.grpo_steps, "save_steps": 1000}
    (out / "grpo.yaml").write_text(yaml.safe_dump(grpo_cfg, sort_keys=False))
    grpo_s = _run([py, "-m", "training.grpo", "--config", str(out / "grpo.yaml"), "--quiet", "--allow-dirty"])
    grpo_total, grpo_finish = _ledger_micro(grpo_dir)
    budget = Decimal(grpo_total - grpo_finish) / Decimal(1_000_000)
    sft_cfg = {
        "run_name": "sft-vs-grpo-sft", "output_dir": str(sft_dir), "model": {"path": MODEL}, "task": task,
        "traces": {"style": "terse"}, "eval": ev, "ledger": {"budget_usd": str(budget)},
        "tags": {"purpose": "sft_vs_grpo", "method": "sft"},
        "trl": {"per_device_train_batch_size": 8, "learning_rate": 5e-5, "max_steps": 100000, "logging_steps": 10},
    }  # fmt: skip
    (out / "sft.yaml").write_text(yaml.safe_dump(sft_cfg, sort_keys=False))
    sft_s = _run([py, "-m", "gateway", "train", "sft", "--config", str(out / "sft.yaml")])
    sft_total, _ = _ledger_micro(sft_dir)
    shifted = shifted_eval(
        {"start": REPO_ROOT / MODEL, "grpo": grpo_dir / "model", "sft": sft_dir / "model"}, shift_d, a.n_eval,
        a.max_new_tokens,
    )  # fmt: skip
    res: dict = {"budget_usd_sft": str(budget), "wall_s": {"grpo": round(grpo_s), "sft": round(sft_s)}}
    base_in = json.loads((grpo_dir / "eval_before.json").read_text())["overall"]
    rows = {"start": {"usd": 0, "in": base_in, "shift": shifted["start"], "steps": 0}}
    for name, d, total in (("grpo", grpo_dir, grpo_total), ("sft", sft_dir, sft_total)):
        summ = json.loads((d / "summary.json").read_text())
        rows[name] = {
            "usd": total,
            "in": json.loads((d / "eval_after.json").read_text())["overall"],
            "shift": shifted[name],
            "steps": summ["global_step"],
            "stop_reason": summ.get("stop_reason"),
        }
    res["rows"] = rows
    res["total_wall_s"] = round(time.perf_counter() - t_all)
    print(f"\nSFT vs GRPO at equal cost (train difficulties {train_d}, shifted {shift_d}, n_eval {a.n_eval}, "
          f"greedy, max {a.max_new_tokens} new tokens; {res['total_wall_s']} s)\n")  # fmt: skip
    print("| model | steps | USD (ledger) | acc in-dist | thought tokens in-dist | USD / pp in-dist "
          "| acc shifted | thought tokens shifted | USD / pp shifted |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        usd = Decimal(r["usd"]) / Decimal(1_000_000)
        cells = []
        for key in ("in", "shift"):
            gain = (r[key]["accuracy"] - rows["start"][key]["accuracy"]) * 100
            per = f"{usd / Decimal(str(round(gain, 4))):.6f}" if name != "start" and gain > 0 else "n/a"
            cells.append(f"{r[key]['accuracy']:.3f} | {r[key]['mean_thought_tokens']:.1f} | {per}")
        print(f"| {name} | {r['steps']} | {usd:.6f} | {cells[0]} | {cells[1]} |")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
