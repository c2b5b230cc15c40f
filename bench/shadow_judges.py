"""Label noise of the shadow judges against the recorded grading on the traces.

    python -m bench.shadow_judges [--traces DIR] [--json bench/results/shadow_judges.json]

For every two-setting ladder of the traces README (cheapest setting → most expensive, per model) and both data
sets, each question's recorded cheap and top answers are given to each judge — ``agreement``
(:func:`gateway.control.shadow.answers_agree`) and ``normalised``
(:class:`gateway.control.shadow_normalised.NormalisedJudge`) — exactly as a shadow call would (cheap answer,
higher answer). A judge's "sufficed" is compared with two recorded truths:

- ``cheap_correct``: the cheap answer graded right (what ``POST /v1/feedback`` teaches: the label rule);
- ``sufficed``: the cheap answer right, or the top answer not right either (the traces README's "the short tier
  suffices").

Per judge: ``noise_vs_cheap_correct`` and ``noise_vs_sufficed`` (share of questions where the judge's label
differs), ``false_sufficed`` (the judge says the cheap answer sufficed where it was wrong and the top answer was
right: the error that costs accuracy) and ``judge_sufficed_rate``. Pooled over ladders, weighted by questions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from gateway.control.shadow import answers_agree, normalise_answer
from gateway.control.shadow_normalised import NormalisedJudge
from router.fit.traces import load_ladder

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
LADDERS = ("Qwen3-14B:no_think,exd0", "Qwen3-8B:no_think,exd0", "claude-sonnet4:no_think,budget1024",
           "gemini-2.5-flash:no_think,budget1024", "gpt-5-mini:low_effort,high_effort",
           "o3-mini:low_effort,high_effort", "o4-mini:low_effort,high_effort")


def judge_rows(traces: Path, datasets: tuple[str, ...] = ("frames", "simpleqa")) -> list[dict[str, Any]]:
    """One row per (data set, ladder, judge) with the noise measures of the module doc."""
    norm = NormalisedJudge(normalise_answer)
    judges = {"agreement": answers_agree, "normalised": norm}
    rows = []
    for ds in datasets:
        for lad in LADDERS:
            d = load_ladder(traces, ds, lad)
            cheap_ok, top_ok = d.correct[:, 0], d.correct[:, -1]
            suff = cheap_ok | ~top_ok
            for name, fn in judges.items():
                j = np.array([bool(fn(r[0] or "", r[-1] or "")) for r in d.responses])
                rows.append({"dataset": ds, "ladder": lad, "judge": name, "n": d.n,
                             "judge_sufficed_rate": round(float(j.mean()), 4),
                             "noise_vs_cheap_correct": round(float(np.mean(j != cheap_ok)), 4),
                             "noise_vs_sufficed": round(float(np.mean(j != suff)), 4),
                             "false_sufficed": round(float(np.mean(j & ~cheap_ok & top_ok)), 4)})
    return rows


def pooled(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per judge (and data set): the question-weighted means of the measures."""
    out: dict[str, dict[str, float]] = {}
    keys = ("judge_sufficed_rate", "noise_vs_cheap_correct", "noise_vs_sufficed", "false_sufficed")
    for group in sorted({(r["judge"], r["dataset"]) for r in rows} | {(r["judge"], "all") for r in rows}):
        sel = [r for r in rows if r["judge"] == group[0] and group[1] in ("all", r["dataset"])]
        n = sum(r["n"] for r in sel)
        out[f"{group[0]}/{group[1]}"] = {k: round(sum(r[k] * r["n"] for r in sel) / n, 4) for k in keys}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rows = judge_rows(a.traces)
    report = {"rows": rows, "pooled": pooled(rows)}
    print(f"{'judge/dataset':<22}{'sufficed rate':>14}{'vs cheap_correct':>18}{'vs sufficed':>13}{'false suff.':>13}")
    for k, v in report["pooled"].items():
        print(f"{k:<22}{v['judge_sufficed_rate']:>14.3f}{v['noise_vs_cheap_correct']:>18.3f}"
              f"{v['noise_vs_sufficed']:>13.3f}{v['false_sufficed']:>13.3f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
