"""How wrong is the realised-floor estimate that decides a rollback? The nesting estimate vs the spot-check arm, on
the recorded traces (issue 24: "an unbiased realised-floor estimate").

``python -m bench.realised_floor [--traces data/traces] [--requests 800] [--feedback-rate 0.25] [--spot-check 0.05]
[--spot-check-min 30] [--runs 300] [--json bench/results/realised_floor.json]``

Per two-tier ladder and per router, ``--runs`` simulated days of traffic: ``--requests`` questions drawn with
replacement from the ladder's recorded questions; the router sends the half with the lower score to the cheap
setting; the spot-check arm serves ``--spot-check`` of those with the top setting (route reason ``spot_check``); a
``--feedback-rate`` share of the answers is graded with the recorded grade of the setting that answered. The
outcomes are the gateway's (``source: feedback``, ``tier``, ``route_reason``, ``sufficed``, ``router_version``)
and both estimates are the product's own :func:`router.fit.realised.realised` (``--spot-check-min``, the gateway's
default 30; the nesting reading forced with ``spot_check_min`` above any count). The truth of each run: the router's
served accuracy over always-top's on the same drawn questions, from the recorded grades of both settings.

Routers: ``length`` (longer questions up; no knowledge of the outcomes) and ``informed`` (a router that does
find the easy questions: score = cheap setting wrong + Gaussian noise, σ = 0.5) — the case where nesting's
optimism shows: the cheap tier's graded accuracy rises, the top tier's falls, ``q`` → 0.

Prints per ladder and router: the mean truth, the bias and RMSE of the nesting estimate and of the estimate as
the gateway serves it (the spot-check reading once ``--spot-check-min`` spot-check answers are graded, else nesting —
the column "spot-check reading in force" says on how many days, with the mean number of graded spot-check answers),
and how often
each says "holds the 98% floor" when the truth does not (false reassurance) or the other way round (false alarm).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from router.fit.realised import SPOT_CHECK, realised
from router.fit.traces import load_ladder

LADDERS = [("frames", "Qwen3-14B:no_think,exd0"), ("frames", "Qwen3-8B:no_think,exd0"),
           ("frames", "gemini-2.5-flash:no_think,budget1024"), ("frames", "gemini-2.5-flash:budget256,budget1024"),
           ("frames", "gpt-5-mini:low_effort,high_effort"), ("frames", "o3-mini:low_effort,high_effort"),
           ("simpleqa", "gemini-2.5-flash:no_think,budget1024"), ("simpleqa", "claude-sonnet4:no_think,budget1024")]
FLOOR = 0.98
VERSION = "v1"


def simulate(cheap_ok: np.ndarray, top_ok: np.ndarray, score: np.ndarray, rng: np.random.Generator, *,
             requests: int, feedback_rate: float, spot_check: float, spot_check_min: int
             ) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """One simulated day (module doc): (truth, spot-check reading, nesting reading)."""
    q = rng.integers(0, cheap_ok.size, requests)
    cheap = score[q] < np.median(score)
    checked = cheap & (rng.random(requests) < spot_check)
    served_cheap = cheap & ~checked
    graded = rng.random(requests) < feedback_rate
    outcomes = [{"source": "feedback", "request_id": f"r{j}", "router_version": VERSION,
                 "tier": "cheap" if served_cheap[j] else "top",
                 "route_reason": SPOT_CHECK if checked[j] else "predicted",
                 "sufficed": bool(cheap_ok[i] if served_cheap[j] else top_ok[i])}
                for j, i in enumerate(q) if graded[j]]
    top_right = float(top_ok[q].sum())
    policy_right = float(np.where(cheap, cheap_ok[q], top_ok[q]).sum())
    truth = policy_right / top_right if top_right else 1.0
    return (truth, realised(outcomes, VERSION, "top", FLOOR, spot_check_min=spot_check_min),
            realised(outcomes, VERSION, "top", FLOOR, spot_check_min=10**9))


def summarise(truths: list[float], reads: list[dict[str, Any]]) -> dict[str, Any]:
    """Bias, RMSE, false reassurance and false alarm of one estimate over the runs it read."""
    pairs = [(t, r["accuracy_ratio"]) for t, r in zip(truths, reads, strict=True) if r["accuracy_ratio"] is not None]
    t = np.array([p[0] for p in pairs])
    e = np.array([p[1] for p in pairs])
    broken = t < FLOOR
    holds = e >= FLOOR
    return {"runs": len(pairs), "method": sorted({r["method"] for r in reads}),
            "bias": round(float(np.mean(e - t)), 4), "rmse": round(float(np.sqrt(np.mean((e - t) ** 2))), 4),
            "false_reassurance": round(float(np.mean(holds[broken])), 3) if broken.any() else None,
            "false_alarm": round(float(np.mean(~holds[~broken])), 3) if (~broken).any() else None,
            "truth_broken_share": round(float(np.mean(broken)), 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="data/traces", help="trace folder (default: the shipped data/traces)")
    ap.add_argument("--requests", type=int, default=800, help="requests per simulated day")
    ap.add_argument("--feedback-rate", type=float, default=0.25, help="share of answers graded")
    ap.add_argument("--spot-check", type=float, default=0.05,
                    help="share of cheap decisions the top tier serves (routing.retrain.spot_check)")
    ap.add_argument("--spot-check-min", type=int, default=30,
                    help="graded spot-check answers before their reading is used (routing.retrain.spot_check_min)")
    ap.add_argument("--runs", type=int, default=300, help="simulated days per ladder and router")
    ap.add_argument("--seed", type=int, default=0, help="draws of questions, spot checks and grades")
    ap.add_argument("--json", type=Path, default=None, help="write the rows and the run's settings here")
    args = ap.parse_args(argv)
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    print("| data | ladder | router | truth (mean) | nesting bias / RMSE | as served: bias / RMSE | "
          "spot-check reading in force (graded spot-check answers) | false reassurance nesting / served | "
          "false alarm nesting / served |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for ds, spec in LADDERS:
        data = load_ladder(args.traces, ds, spec)
        cheap_ok, top_ok = data.correct[:, 0].astype(bool), data.correct[:, -1].astype(bool)
        rng = np.random.default_rng(args.seed)
        routers = {"length": np.array([len(x) for x in data.questions], dtype=np.float64),
                   "informed": (~cheap_ok).astype(np.float64) + rng.normal(0.0, 0.5, cheap_ok.size)}
        for name, score in routers.items():
            truths: list[float] = []
            aud: list[dict[str, Any]] = []
            nest: list[dict[str, Any]] = []
            for _ in range(args.runs):
                t, a, n = simulate(cheap_ok, top_ok, score, rng, requests=args.requests,
                                   feedback_rate=args.feedback_rate, spot_check=args.spot_check,
                                   spot_check_min=args.spot_check_min)
                truths.append(t)
                aud.append(a)
                nest.append(n)
            row = {"dataset": ds, "ladder": spec, "router": name, "truth_mean": round(float(np.mean(truths)), 4),
                   "nesting": summarise(truths, nest), "spot_check": summarise(truths, aud),
                   "spot_check_method_share": round(float(np.mean([a["method"] == "spot_check" for a in aud])), 3),
                   "mean_graded_spot_check": round(float(np.mean([a["n_spot_check"] for a in aud])), 1)}
            rows.append(row)
            ns, au = row["nesting"], row["spot_check"]

            def pct(x: float | None) -> str:
                return "—" if x is None else f"{100 * x:.0f}%"

            print(f"| {ds} | {spec} | {name} | {row['truth_mean']:.3f} | {ns['bias']:+.3f} / {ns['rmse']:.3f} | "
                  f"{au['bias']:+.3f} / {au['rmse']:.3f} | {pct(row['spot_check_method_share'])} of days "
                  f"({row['mean_graded_spot_check']:.0f}) | {pct(ns['false_reassurance'])} / "
                  f"{pct(au['false_reassurance'])} | {pct(ns['false_alarm'])} / {pct(au['false_alarm'])} |",
                  flush=True)
    meta = {"requests": args.requests, "feedback_rate": args.feedback_rate, "spot_check": args.spot_check,
            "spot_check_min": args.spot_check_min, "runs": args.runs,
            "seed": args.seed, "floor": FLOOR, "seconds": round(time.time() - t0, 1),
            "utc": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())}
    print(json.dumps(meta), file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
