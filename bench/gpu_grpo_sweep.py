"""A small GRPO length-penalty sweep on a GPU machine, run once by the device tool next to the CPU
recipe: each variant is ``training/configs/short_tier.yaml`` with a few overrides (larger batches, learning rate,
reward), trained from the shipped SFT model with ``training.grpo.run.run_grpo`` on CUDA (transformers rollouts:
vLLM is not on that machine), then evaluated greedily on the held-out set. Prints one table; writes flat into
``$OUT``: ``sweep.json`` (before/after accuracy and mean thought tokens per difficulty, ledger totals per
variant), ``sweep.log`` lines, and ``best_model.tgz`` (the variant with the fewest greedy thought tokens among
those within 2 points of the SFT model's accuracy).

    PYTHONPATH=/tmp/site:$PWD python3 bench/gpu_grpo_sweep.py --deadline-s 330
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tarfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

VARIANTS: dict[str, dict] = {
    "kimi_lr1e-4_b64": {"trl": {"learning_rate": 1.0e-4, "max_steps": 60}},
    "kimi_lr2e-4_b64": {"trl": {"learning_rate": 2.0e-4, "max_steps": 60}},
    "cosine_lr1e-4_b64": {
        "rewards": [{"name": "cosine", "weight": 1.0}, {"name": "format", "weight": 0.2}],
        "trl": {"learning_rate": 1.0e-4, "max_steps": 60},
    },
}
GPU = {
    "threads": None,
    "ledger": {"budget_usd": None, "price_usd_per_device_hour": {"cpu": "0.05", "nvidia-h200": "3.50"}},
    "eval": {"every_steps": None, "batch_size": 120},
    "trl": {"per_device_train_batch_size": 64, "save_steps": 1000, "report_to": "none"},
    "monitors": {"rules": []},
}


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", default=str(ROOT / "training/configs/short_tier.yaml"))
    ap.add_argument("--work", default="/tmp/gpu-sweep")
    ap.add_argument("--deadline-s", type=float, default=330.0, help="start no variant after this many seconds")
    a = ap.parse_args()
    from training.grpo.config import load_config
    from training.grpo.run import run_grpo

    out = Path(os.environ.get("OUT", "/tmp/gpu-sweep-out"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(Path(a.base).read_text())
    t0 = time.monotonic()
    results: dict[str, dict] = {}
    for name, over in VARIANTS.items():
        if time.monotonic() - t0 > a.deadline_s:
            results[name] = {"skipped": "deadline"}
            continue
        data = merge(merge(base, GPU), over)
        data["output_dir"] = str(work / name)
        data["run_name"] = f"sweep-{name}"
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        t = time.monotonic()
        try:
            summary = run_grpo(load_config(path), progress=False)
        except Exception as e:  # one variant failing must not cost the others
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        run = work / name
        ev = {k: json.loads((run / f"eval_{k}.json").read_text()) for k in ("before", "after")}
        results[name] = {
            "wall_s": round(time.monotonic() - t, 1),
            "summary": {k: summary.get(k) for k in ("global_step", "spent_usd", "device_hours", "stop_reason")},
            "totals": summary.get("totals"),
            "before": ev["before"],
            "after": ev["after"],
        }
        b, f = ev["before"]["overall"], ev["after"]["overall"]
        print(
            f"{name}: accuracy {b['accuracy']:.3f} -> {f['accuracy']:.3f}, thought tokens "
            f"{b['mean_thought_tokens']:.1f} -> {f['mean_thought_tokens']:.1f} ({results[name]['wall_s']} s)",
            flush=True,
        )
        (out / "sweep.json").write_text(json.dumps(results, indent=1, default=str))
    ok = {
        n: r
        for n, r in results.items()
        if "after" in r and r["after"]["overall"]["accuracy"] >= r["before"]["overall"]["accuracy"] - 0.02
    }
    if ok:
        best = min(ok, key=lambda n: ok[n]["after"]["overall"]["mean_thought_tokens"])
        with tarfile.open(out / "best_model.tgz", "w:gz") as tf:
            tf.add(work / best / "model", arcname=f"{best}-model")
        results["_best"] = best
    (out / "sweep.json").write_text(json.dumps(results, indent=1, default=str))
    print(
        json.dumps(
            {
                n: (r if isinstance(r, str) else {k: r.get(k) for k in ("wall_s", "summary")})
                for n, r in results.items()
            },
            indent=1,
            default=str,
        )
    )


if __name__ == "__main__":
    main()
