"""Every ladder of bench/RESULTS.md "Real traces (through the gateway)": ``thinkgate bench traces`` per ladder on
the router's held-out questions, then the section (targets checked).

    python -m bench.traces.results --traces ../shared/data/traces [--routers router/assets/traces]
        [--out bench/results/traces] [--only SLUG ...] [--section-only] [--no-write]

For each ladder the router file is ``<routers>/<dataset>__<MODEL>__<S1>-<S2>[-<S3>].skops``, else
``<routers>/<MODEL>__<S1>-<S2>[-<S3>].skops`` (``thinkgate router fit``'s naming). A missing one is fitted
first with ``thinkgate router fit --traces … --dataset … --ladder … --output <tmp>/<dataset>__<slug>.skops``
(held-out questions excluded, as always) and the section says which routers were fitted here. Each ladder
runs as its own ``thinkgate bench traces … --heldout-only`` process (JSON, PNG and Markdown under ``--out``);
the section is rebuilt from every JSON found there.

Targets (issue 19), on the held-out questions: the best of ``router`` / ``router+cascade`` saves ≥ 35% of
always-top tokens at ≥ 98% of its accuracy on average over the eight two-tier ladders, and on no ladder falls
more than 2 points below max(``random``, ``length``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._lib.results_md import write_section
from bench.router_traces import DEFAULT_TRACES, LADDERS  # the nine ladders, one list

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Real traces (through the gateway)"
TARGET_AVG = 0.35
TARGET_MARGIN = 0.02


def slug(ladder: str) -> str:
    model, _, rest = ladder.partition(":")
    return f"{model}__{'-'.join(rest.split(','))}"


def run_ladder(traces: Path, dataset: str, ladder: str, routers: Path, out: Path,
               fit_dir: Path) -> tuple[Path, bool, float]:
    """(the JSON written, whether the router was fitted here, wall seconds) for one ladder."""
    # a router fitted for this data set wins over one fitted for the ladder on every data set
    router = next((p for p in (routers / f"{dataset}__{slug(ladder)}.skops", routers / f"{slug(ladder)}.skops")
                   if p.is_file()), routers / f"{slug(ladder)}.skops")
    fitted = False
    if not router.is_file():
        router = fit_dir / f"{dataset}__{slug(ladder)}.skops"
        subprocess.run([sys.executable, "-m", "gateway", "router", "fit", "--traces", str(traces), "--dataset", dataset,
                        "--ladder", ladder, "--output", str(router)], cwd=REPO, check=True)
        fitted = True
    base = out / f"{dataset}__{slug(ladder)}"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "gateway", "bench", "traces", "--traces", str(traces), "--dataset", dataset,
                    "--ladder", ladder, "--router", str(router), "--heldout-only", "--json", f"{base}.json",
                    "--png", f"{base}.png", "--markdown", f"{base}.md"], cwd=REPO, check=True,
                   env={**os.environ, "TG_NO_PROGRESS": "1"})
    from router.persistence import load_router

    serving = load_router(router, pipeline=False).metadata.get("serving") or {}
    meta = {"router": str(router.relative_to(REPO) if router.is_relative_to(REPO) else router), "fitted": fitted,
            "wall_s": round(time.monotonic() - t0, 1), "served_policy": serving.get("policy"),
            "guarantee": serving.get("guarantee")}
    Path(f"{base}.meta.json").write_text(json.dumps(meta))
    return Path(f"{base}.json"), fitted, float(meta["wall_s"])  # type: ignore[arg-type]


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def served_table(out: Path) -> list[str]:
    """The deployable numbers first: per ladder what ``auto`` (a gateway with only the router file) served, and
    ``router`` / ``router+cascade`` at the file's thresholds; pooled accuracy ratio and mean savings."""
    rows: list[str] = []
    pooled_c = pooled_top = 0.0
    sav: list[float] = []
    curve: list[float] = []
    worst = 1.0
    for dataset, ladder in LADDERS:
        base = out / f"{dataset}__{slug(ladder)}"
        if not Path(f"{base}.json").is_file():
            continue
        r: dict[str, Any] = json.loads(Path(f"{base}.json").read_text())
        meta = json.loads(Path(f"{base}.meta.json").read_text()) if Path(f"{base}.meta.json").is_file() else {}
        sv = r.get("served") or {}
        if "auto" not in sv or sv["auto"].get("savings") is None:  # None: a run cut before auto answered anything
            continue
        p = r["policies"]
        n = r["n_questions"]
        top = p[f"always:{ladder.split(',')[-1]}"]
        two = len(ladder.split(",")) == 2
        a = sv["auto"]
        if two:
            pooled_c += p["auto"]["accuracy"] * n
            pooled_top += top["accuracy"] * n
            sav.append(a["savings"])
            curve.append(max(r["savings_at_98"]["router"], r["savings_at_98"]["router+cascade"]))
            worst = min(worst, a["accuracy_ratio"])
        cell = {k: (f"{sv[k]['savings']:.1%} / {sv[k]['accuracy_ratio']:.3f}"
                    if sv.get(k, {}).get("savings") is not None else "—")
                for k in ("router", "router+cascade")}
        g = meta.get("guarantee") or {}
        first = (g.get("tested") or [{}])[0]
        auc = "/".join(f"{x:.2f}" for x in g.get("oof_auc_wrong") or [] if x is not None) or "—"
        evidence = (f"{g.get('n_calibration', '—')} q, AUC {auc}, first point p = {first['pvalue']:.2f}, "
                    f"{g.get('rejected', 0)} certified" if "pvalue" in first else "—")
        rows.append(f"| {dataset} | {ladder}{'' if two else ' (3 tiers, not pooled)'} | {n} | "
                    f"{meta.get('served_policy') or '—'} | **{a['savings']:.1%}** | **{a['accuracy_ratio']:.3f}** | "
                    f"{'yes' if a['holds_floor'] else 'no'} | {evidence} | {cell['router']} | "
                    f"{cell['router+cascade']} | "
                    f"{max(r['savings_at_98']['router'], r['savings_at_98']['router+cascade']):.1%} |")
    if not rows:
        return []
    sens: list[str] = []
    offline = out / "served_offline.json"
    if offline.is_file():  # python -m bench.traces.served_offline --delta … --json <out>/served_offline.json
        for e in json.loads(offline.read_text()):
            two = [x for x in e["ladders"] if len(x["ladder"].split(",")) == 2]
            sens.append(f"floor {e.get('floor', 0.98):.0%}, δ = {e['delta']}: pooled ratio "
                        f"{e['pooled_accuracy_ratio']:.3f}, worst "
                        f"{min(x['accuracy_ratio'] for x in two):.3f}, mean savings "
                        f"{sum(x['savings'] for x in two) / len(two):.1%}")
    ratio = pooled_c / pooled_top if pooled_top else 1.0
    mean_sav = sum(sav) / len(sav) if sav else 0.0
    mean_curve = sum(curve) / len(curve) if curve else 0.0
    return [
        "**Served (the deployable number)**: `auto` = a gateway configured with only the router file (`model: auto`,",
        "no thresholds, no `escalate_on`): the policy the file serves — router cut and answer-aware escalation",
        "(`router/escalation.py`) at the point certified by Learn-then-Test (floor 98% of always-top, confidence 90%,",
        "fixed sequence declared in advance, on all non-held-out questions with cross-fitted scores), or always top.",
        "savings = 1 − completion tokens / always-top's (ledger); ratio = accuracy / always-top accuracy.",
        "Evidence: calibration questions, out-of-fold AUC of the escalation model(s) for \"this cheap answer is",
        "wrong\", p-value of the sequence's first point (s = 0, escalate 50%), points certified.",
        "",
        "| data set | ladder | held-out q | file serves | **auto savings** | **auto acc. ratio** | keeps 98% | "
        "evidence (non-held-out) | router served (savings / ratio) | router+cascade served | curve metric "
        "(best savings@98) |",
        "|---|---|---:|---|---:|---:|---|---|---:|---:|---:|",
        *rows,
        "",
        f"Over the {len(sav)} two-tier ladders: pooled accuracy ratio (Σ correct / Σ always-top correct) "
        f"**{ratio:.3f}** (target ≥ 0.98: {'met' if ratio >= 0.98 else 'not met'}), worst ladder {worst:.3f} "
        f"(target ≥ 0.95: {'met' if worst >= 0.95 else 'not met'}), mean served savings of auto **{mean_sav:.1%}** "
        f"(target ≥ 20%: {'met' if mean_sav >= 0.20 else 'not met'}); curve metric mean {mean_curve:.1%} "
        f"(target ≥ 35%: {'met' if mean_curve >= 0.35 else 'not met'}).",
        "",
        "Why most ladders still do not route: the escalation model separates wrong from right cheap answers well "
        "(out-of-fold AUC above), but the floor allows a loss of only 2% of always-top accuracy, and on these "
        "ladders the cheap setting is wrong where the top one is right on 8–40% of the questions. To save tokens a "
        "point must leave some cheap answers un-escalated, and with ≈ 396 calibration questions the losses among "
        "them must be clearly fewer than the gains plus the 2% slack (exact binomial test at δ = 0.1); at every "
        "point of the declared sequence they are not, except where the cheap setting is about as accurate as the "
        "top one (o3-mini; there the certified point escalates only the abstentions — at r ≤ 0.4 the escalation cut "
        "lands on the abstentions, so the model itself adds nothing on that ladder). More calibration data (the "
        "bound narrows as 1/√n) or a floor the operator states lower are what would buy served savings here; the "
        "price of the promise, below, shows what the same fits serve at other floors and confidence levels.",
        "",
        *(["The promise's price — the same fit at other floors and confidence levels, served offline on the same "
           "held-out questions (`python -m bench.traces.served_offline --floor … --delta …`; reporting only, the "
           "shipped floor 98% and δ = 0.1 were fixed before any held-out number was seen): " + "; ".join(sens)
           + ".", ""] if sens else []),
    ]


def section(out: Path) -> str:
    """The RESULTS.md section from every ``<out>/*.json`` of the ladders above."""
    offline: dict[tuple[str, str], dict[str, float]] = {}
    twin = REPO / "bench" / "results" / "router_traces.json"
    if twin.is_file():  # the router engineer's offline evaluation of the same held-out questions
        offline = {(e["dataset"], e["ladder"]): e["savings_at_98"] for e in json.loads(twin.read_text())["ladders"]}
    agree: list[bool] = []
    valid: dict[str, list[bool]] = {}
    served_sav: dict[str, list[float]] = {}
    rows: list[str] = []
    checks: list[tuple[str, float, float, bool]] = []
    fitted: list[str] = []
    walls: list[float] = []
    for dataset, ladder in LADDERS:
        base = out / f"{dataset}__{slug(ladder)}"
        if not Path(f"{base}.json").is_file():
            rows.append(f"| {dataset} | {ladder} | not run | | | | | | | | | |")
            continue
        r: dict[str, Any] = json.loads(Path(f"{base}.json").read_text())
        meta = json.loads(Path(f"{base}.meta.json").read_text()) if Path(f"{base}.meta.json").is_file() else {}
        if meta.get("fitted"):
            fitted.append(ladder)
        walls.append(float(meta.get("wall_s") or 0))
        s = r["savings_at_98"]
        p = r["policies"]
        top = p[f"always:{ladder.split(',')[-1]}"]
        best = max(s["router"], s["router+cascade"])
        base_best = max(s["random"], s["length"])
        two = len(ladder.split(",")) == 2
        ok = best >= base_best - TARGET_MARGIN
        if two:
            checks.append((f"{dataset} {ladder}", best, base_best, ok))
        for k_ in ("router", "router+cascade"):
            keeps = p[k_]["accuracy"] >= 0.98 * top["accuracy"] - 1e-12
            valid.setdefault(k_, []).append(keeps)
            if two:
                served_sav.setdefault(k_, []).append(1 - p[k_]["completion_tokens"] / max(1, top["completion_tokens"]))
        off = offline.get((dataset, ladder))
        if off is not None:
            agree.append(all(abs(off[k] - s[k]) < 5e-4 for k in ("router", "length", "random", "oracle")))
        verdict = ("yes" if ok else "NO") if two else ("yes" if ok else "no") + " (3 tiers, not counted)"
        twin_cell = f"{_pct(off['router'])} / {_pct(off['router+cascade'])}" if off else "—"
        served = {k: f"{p[k]['accuracy']:.1%} / {p[k]['completion_tokens'] / max(1, top['completion_tokens']):.0%}"
                  for k in ("router", "router+cascade")}
        rows.append(f"| {dataset} | {ladder} | {r['n_questions']} | {top['accuracy']:.1%} / {top['completion_tokens']} "
                    f"| **{_pct(s['router'])}** | **{_pct(s['router+cascade'])}** | {_pct(s['random'])} | "
                    f"{_pct(s['length'])} | {_pct(s['oracle'])} | {served['router']} | {served['router+cascade']} | "
                    f"{verdict} | {twin_cell} |")
    stamps = [p.stat().st_mtime for p in out.glob("*.json") if not p.name.endswith(".meta.json")]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(max(stamps))) if stamps else "never"
    avg = sum(c[1] for c in checks) / len(checks) if checks else 0.0
    worst = min(checks, key=lambda c: c[1] - c[2]) if checks else None
    lines = [
        SECTION,
        "",
        *served_table(out),
        "What ran: per ladder `thinkgate router fit --traces data/traces --dataset D --ladder L --output R`, then",
        "`python -m bench.traces.results --routers <those files>` — per ladder one",
        "`thinkgate bench traces --traces data/traces --dataset D --ladder L --router R --heldout-only "
        "--json … --png …`: Redis, the trace-replay upstream and three `thinkgate serve` processes (engine and cache",
        "off; the cascade on gateway B; gateway C with only the router file, policy `auto`) on loopback; every",
        "held-out question (`router.fit.traces.is_heldout`, ~20% of",
        "the folder, never fitted or calibrated on) under each policy; tokens and cost from the metering ledger,",
        "accuracy from the recorded grading of the tier that answered. savings@98 = 1 − tokens / always-top tokens at",
        "the cheapest point of the policy's curve over its thresholds with accuracy ≥ 98% of always-top (0 if none);",
        "the oracle is computed (cheapest correct setting). Served points: the router file's thresholds (router) and",
        "its `cascade_thresholds` (router+cascade), accuracy / token share as served. Prices per",
        "`bench/traces/prices.py` (list prices; Qwen3 nominal 1 USD per 1M tokens).",
        f"Run {when} on 2 shared cores, 24 GiB, no GPU, Python 3.11; "
        f"wall per ladder {min(walls, default=0):.0f}–{max(walls, default=0):.0f} s (budget 280 s each).",
        "",
        "Curve metric (savings@98: each curve's best threshold picked on the questions it scores — not a served "
        "number):",
        "",
        "| data set | ladder | held-out q | always-top acc / tokens | router | router+cascade | random | length | "
        "oracle | router served (acc / tok) | router+cascade served | ≥ max(random, length) − 2 pt | offline twin "
        "router / r+c |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        *rows,
        "",
        f"Targets over the {len(checks)} two-tier ladders (best of router / router+cascade):",
        f"- average savings@98 ≥ 35%: **{avg:.1%} — {'met' if avg >= TARGET_AVG else 'not met'}**;",
    ]
    if worst is not None:
        failing = [c for c in checks if not c[3]]
        lines.append(f"- no ladder more than 2 points below max(random, length): **"
                     f"{'met' if not failing else 'not met'}** (closest: {worst[0]}, {worst[1]:.1%} vs "
                     f"{worst[2]:.1%}" + ("" if not failing else "; below: " + ", ".join(
                         f"{c[0]} {c[1]:.1%} vs {c[2]:.1%}" for c in failing)) + ").")
    if valid:
        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        lines += ["", "Caveat: savings@98 takes each curve's best threshold on the held-out questions themselves (the "
                  "issue's metric, for every policy alike). At the thresholds the files actually serve (chosen on "
                  f"validation), router keeps ≥ 98% of always-top accuracy on {sum(valid['router'])} of "
                  f"{len(valid['router'])} ladders and router+cascade on {sum(valid['router+cascade'])} of "
                  f"{len(valid['router+cascade'])}; served savings over the two-tier ladders: router "
                  f"{mean(served_sav.get('router', [])):.1%}, router+cascade "
                  f"{mean(served_sav.get('router+cascade', [])):.1%} (mean of 1 − served tokens / always-top)."]
    if agree:
        lines += ["", f"Offline twin (`bench/results/router_traces.json`, `python -m bench.router_traces`: the same "
                  "held-out questions scored without a gateway): router, length, random and oracle savings@98 agree "
                  f"to 0.05 points on {sum(agree)} of {len(agree)} ladders — routing, metering and the ledger "
                  "reproduce the recorded outcomes. router+cascade differs where the serving abstention rule "
                  "(`gateway/pipeline/abstention.py`, on the served answers) flags answers the offline estimate's "
                  "regex (`router.fit.ladder_eval.abstains`) does not, and the other way round."]
    lines += ["", "Routers: " + ("the router engineer's files under `router/assets/traces/`" if not fitted else
                                 "per ladder with main's `thinkgate router fit --traces DIR --dataset D --ladder L` "
                                 "(default `--policy auto`: learned, or the length / random fallback chosen on "
                                 "validation; the router side ships the recipe, not per-ladder files) for: "
                                 + ", ".join(fitted)) + ".",
              "Curves: `bench/results/traces/<dataset>__<ladder>.png` (one per ladder); JSON and Markdown tables "
              "next to them.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--routers", type=Path, default=REPO / "router" / "assets" / "traces")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "traces")
    ap.add_argument("--only", action="append", default=[], help="run only this ladder slug (repeatable)")
    ap.add_argument("--section-only", action="store_true", help="rebuild the section from existing JSON")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.section_only:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="tg-routers-") as tmp:
            for dataset, ladder in LADDERS:
                if args.only and slug(ladder) not in args.only and f"{dataset}__{slug(ladder)}" not in args.only:
                    continue
                path, fitted, wall = run_ladder(args.traces.resolve(), dataset, ladder, args.routers, args.out,
                                                 Path(tmp))
                print(f"{dataset} {ladder}: {path} ({'router fitted here, ' if fitted else ''}{wall:.0f} s)",
                      file=sys.stderr)
    text = section(args.out)
    if args.no_write:
        print(text)
    else:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
