"""Choose the cascade's abstention phrases on the recorded traces (questions outside the held-out split).

    python -m bench.traces.calibrate_abstention --traces ../shared/data/traces [--min-hits 3] [--max-correct 0.05]

For every trace file's setting that is not the most expensive of its model (the answers a cascade would see),
on the non-held-out questions (``is_heldout`` is False), it prints per candidate phrase (default: the serving
list :data:`gateway.pipeline.abstention.DEFAULT_PHRASES`, or ``--phrase P`` repeated) how many answers it flags
and which share of those was graded correct anyway (a false alarm: escalating it pays for nothing), and
whether it is kept (≤ ``--max-correct`` correct; fewer than ``--min-hits`` flags is marked "low evidence": a
plain English expression with nothing against it, kept). Then the totals of the kept list: answers flagged
(blank answers included), correct among them, and the share of "not attempted" (grading C) answers it catches.
Grading is read here, offline, to choose the list; the gateway never reads it.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from bench.router_traces import check_traces_folder, fail
from gateway.pipeline.abstention import DEFAULT_PHRASES, abstains, final_part
from router.fit.traces import is_heldout

TOP = ("exd0", "budget1024", "high_effort")


def rows(traces: Path) -> list[tuple[str, dict]]:
    out = []
    for f in sorted(traces.glob("*/*__*.jsonl.gz")):
        setting = f.name[: -len(".jsonl.gz")].partition("__")[2]
        if setting in TOP:
            continue
        ds = f.parent.name
        with gzip.open(f, "rt") as fh:
            out += [(ds, r) for r in map(json.loads, fh) if not is_heldout(ds, str(r["id"]))]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--traces", type=Path, required=True)
    ap.add_argument("--min-hits", type=int, default=3)
    ap.add_argument("--max-correct", type=float, default=0.05)
    ap.add_argument("--phrase", action="append", default=[], help="a candidate phrase (repeatable)")
    args = ap.parse_args(argv)
    check_traces_folder(args.traces)
    data = rows(args.traces)
    if not data:  # "0 answers", exit 0, read as a finding; it is a folder without trace files
        fail(f"--traces {args.traces}: no trace rows of a non-top setting (DIR/<dataset>/<MODEL>__<SETTING>.jsonl.gz)")
    tails = [(final_part(str(r.get("response") or "")), bool(r["correct"]), r.get("grading")) for _, r in data]
    kept = []
    print(f"{len(data)} answers (non-top settings, non-held-out questions)")
    print(f"{'phrase':40s} {'flags':>6s} {'correct':>8s}  kept")
    for p in args.phrase or DEFAULT_PHRASES:
        hits = [c for t, c, _ in tails if p in t]
        share = sum(hits) / len(hits) if hits else 0.0
        keep = share <= args.max_correct
        kept += [p] if keep else []
        note = " (low evidence)" if len(hits) < args.min_hits else ""
        print(f"{p:40s} {len(hits):6d} {share:8.1%}  {'yes' if keep else 'no'}{note}")
    flagged = [(c, g) for (_, r), (t, c, g) in zip(data, tails, strict=True)
               if abstains(str(r.get("response") or ""), kept)]
    n_c = sum(1 for _, _, g in tails if g == "C")
    print(f"kept {len(kept)} phrases: flags {len(flagged)} answers, {sum(c for c, _ in flagged)} of them correct "
          f"({sum(c for c, _ in flagged) / max(1, len(flagged)):.1%}); catches "
          f"{sum(1 for _, g in flagged if g == 'C')}/{n_c} not-attempted answers")


if __name__ == "__main__":
    main()
