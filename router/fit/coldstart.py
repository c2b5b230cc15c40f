"""The shipped default's cold start: which scorer a fresh gateway serves, decided on real outcome sets it was not
fitted on (issue 24, item 1). ``thinkgate router cold-start`` runs it; ``thinkgate router info`` prints the table.

Real outcome sets (a cheap and a strong answer per question, each graded; label 1 = cheap wrong, strong right):

* ``routellm-mmlu held-out subjects`` — RouteLLM's MMLU pairs (Mixtral-8x7B vs GPT-4), the fixed ~20% of subjects
  the learned default never sees (:func:`router.fit.default.mmlu_heldout_subject`);
* the trace ladders (``data/traces/outcomes.jsonl.gz``: per model its cheapest vs its top setting), the fixed
  held-out questions, one set per data set and one per model. The learned candidate scored there is the default's
  recipe **fitted without any trace rows** (``transfer_router``: held out by data set and by model at once); without
  that file the shipped candidate itself is scored (held-out questions only) and the row says so.

Scorers per set: the learned candidate, prompt length (:func:`router.model.length_prior`) and random. Metrics:
ROC AUC of the score against the label; ``savings_95`` = the share of strong calls saved at 95% of strong-only
quality (best operating point on the set; random: its expected curve); ``served`` = (accuracy ratio vs
strong-only, share sent to the cheap tier) at the file's own threshold (random: at the learned candidate's cheap
share, expected value).

Choice (:func:`choose`): the learned candidate is shipped only when on every set its AUC and its ``savings_95``
are no worse than length's; otherwise the shipped default is the length scorer (``metadata.serving.policy:
length``), its threshold calibrated like the learned one's (95% of always-long label quality on MATH-500 + the
arithmetic test split), and ``metadata.cold_start`` carries the table and the reason.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

import numpy as np

from router.fit.calibrate import threshold_for_quality_loss
from router.fit.evaluate import evaluate_scores, outcomes_of
from router.fit.labels import LabelledItem
from router.model import TrainedRouter, length_prior

TOL = 1e-9
SCORERS = ("learned", "length", "random")


def served(scores: np.ndarray, cut: float, qs: np.ndarray, ql: np.ndarray) -> dict[str, float]:
    """At threshold ``cut`` (score ≥ cut → strong): accuracy / strong-only accuracy, and the cheap share."""
    up = scores >= cut
    q_top = float(ql.mean())
    acc = float(np.where(up, ql, qs).mean())
    return {"accuracy_ratio": round(acc / q_top, 4) if q_top > 0 else float("nan"),
            "savings": round(float(1.0 - up.mean()), 4)}


def _num(x: float) -> float | None:
    return round(float(x), 4) if np.isfinite(x) else None


def set_row(name: str, kind: str, items: list[LabelledItem], learned_scores: np.ndarray, learned_cut: float,
            length_cut: float, learned_note: str) -> dict[str, Any]:
    """One evaluation set: per scorer AUC, savings at 95% of strong-only quality and the served point."""
    qs, ql, _ = outcomes_of(items)
    length_scores = np.array([length_prior(it.text) for it in items], dtype=np.float64)
    lr = evaluate_scores(name, items, learned_scores)
    le = evaluate_scores(name, items, length_scores)
    s_learned = served(learned_scores, learned_cut, qs, ql)
    f = s_learned["savings"]  # random at the learned candidate's cheap share: expected accuracy
    q_top = float(ql.mean())
    rnd_acc = f * float(qs.mean()) + (1 - f) * q_top
    return {
        "set": name, "kind": kind, "n": len(items), "learned_scored_by": learned_note,
        "strong_only_accuracy": round(q_top, 4), "cheap_only_accuracy": round(float(qs.mean()), 4),
        "learned": {"auc": _num(lr.auc), "savings_95": _num(lr.cost_reduction_95), "served": s_learned},
        "length": {"auc": _num(le.auc), "savings_95": _num(le.cost_reduction_95),
                   "served": served(length_scores, length_cut, qs, ql)},
        "random": {"auc": 0.5, "savings_95": _num(lr.random_cost_reduction_95),
                   "served": {"accuracy_ratio": round(rnd_acc / q_top, 4) if q_top > 0 else None, "savings": f}},
    }


def learned_not_worse(row: dict[str, Any]) -> bool:
    """The learned candidate's AUC and savings at 95% are each ≥ length's on this set (None = not measurable
    there, e.g. a one-class set: counts as no worse)."""
    for metric in ("auc", "savings_95"):
        a, b = row["learned"][metric], row["length"][metric]
        if a is not None and b is not None and a < b - TOL:
            return False
    return True


def choose(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """``("learned", [])`` when the learned candidate is no worse than length on every set, else
    ``("length", [the sets where it is worse])``."""
    worse = [r["set"] for r in rows if not learned_not_worse(r)]
    return ("length" if worse else "learned"), worse


def outcome_sets() -> list[tuple[str, str, list[LabelledItem]]]:
    """(name, kind, items) of every real outcome set (see the module docstring)."""
    from router.fit.default import mmlu_split, trace_items

    _, mmlu_held = mmlu_split()
    traces = trace_items(heldout=True)
    sets = [("routellm-mmlu held-out subjects", "held-out subjects", mmlu_held)]
    for ds in sorted({it.source for it in traces}):
        sets.append((f"{ds} held-out questions, all models", "trace data set",
                     [it for it in traces if it.source == ds]))
    for model in sorted({str(it.meta["model"]) for it in traces}):
        sets.append((f"traces {model} held-out questions", "trace model",
                     [it for it in traces if it.meta["model"] == model]))
    return sets


def length_threshold() -> float:
    """The length scorer's threshold, calibrated as the learned default's (router.fit.default): the highest cut
    keeping ≥ 95% of always-long label quality on MATH-500 + the arithmetic test split."""
    from router.fit.default import MAX_QUALITY_LOSS, evaluation_sets

    evals = evaluation_sets()
    calib = evals[0][3] + evals[1][3]
    qs, ql, _ = outcomes_of(calib)
    return threshold_for_quality_loss(np.array([length_prior(it.text) for it in calib]), qs, ql, MAX_QUALITY_LOSS)


def cold_start_table(learned: TrainedRouter, transfer_router: TrainedRouter | None,
                     length_cut: float) -> list[dict[str, Any]]:
    """Every real outcome set's row (:func:`set_row`); ``transfer_router`` scores the trace sets (see the module
    docstring)."""
    rows = []
    cut = learned.thresholds[0]
    for name, kind, items in outcome_sets():
        texts = [it.text for it in items]
        if kind != "held-out subjects" and transfer_router is not None:
            scores, note = transfer_router.predict_proba(texts), "the default recipe fitted without any trace rows"
        elif kind != "held-out subjects":
            scores, note = learned.predict_proba(texts), "the shipped candidate (its questions held out only)"
        else:
            scores, note = learned.predict_proba(texts), "the shipped candidate (subjects never fitted)"
        rows.append(set_row(name, kind, items, np.asarray(scores), cut, length_cut, note))
    return rows


def build_cold_start_default(learned_path: Path, out: Path, transfer_path: Path | None = None,
                             say: Any = print, refit: bool = True) -> tuple[str, list[dict[str, Any]]]:
    """Measure :func:`cold_start_table`, :func:`choose`, write the shipped default to ``out`` (the learned
    candidate with ``metadata.cold_start``, or a length-scorer file carrying the same table). ``transfer_path``:
    a saved :func:`fit_without_traces` (else it is fitted here; ``refit=False``: the candidate itself scores the
    trace sets, and the rows say so). Returns (choice, rows)."""
    from router.persistence import load_router, save_router

    learned = load_router(learned_path)
    transfer = (load_router(transfer_path) if transfer_path is not None
                else fit_without_traces(learned) if refit else None)
    length_cut = length_threshold()
    rows = cold_start_table(learned, transfer, length_cut)
    choice, worse = choose(rows)
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    sets = [r["set"] for r in rows]
    reason = ("the learned candidate is no worse than prompt length (AUC and savings at 95%) on every real outcome "
              "set" if choice == "learned" else
              f"the learned candidate is worse than prompt length on {len(worse)} of {len(rows)} real outcome sets "
              f"({'; '.join(worse)}): the default serves prompt length")
    block = {"choice": choice, "reason": reason, "worse_than_length": worse, "validated_on": sets,
             "rows": rows, "measured_utc": now, "learned_candidate": str(learned_path.name),
             "learned_version": learned.metadata.get("router_version"),
             "rule": "router.fit.coldstart.choose: learned only if its AUC and savings_95 >= length's on every set"}
    if choice == "learned":
        learned.metadata["cold_start"] = block
        save_router(learned, out)
    else:
        shipped = TrainedRouter(pipeline=None, scorer="length", thresholds=[round(length_cut, 6)])
        shipped.metadata = {
            "router": "length-prior", "router_version": "default-length-1", "created_utc": now,
            "policy_description": "baseline: score = log1p(characters) / log1p(100000), longer prompts go to the "
                                  "long tier",
            "serving": {"policy": "length", "scorer": "length", "thresholds": [round(length_cut, 6)],
                        "cascade": None, "guarantee": None},
            "thresholds_calibration": {"method": "max_quality_loss", "target": 0.05,
                                       "data_files": ["router/tasks/data/math/test.jsonl", "router.tasks arith test"],
                                       "note": "as the learned default's (router.fit.default)"},
            "cold_start": block,
        }
        save_router(shipped, out)
    say(f"cold start: {reason}; wrote {out}")
    return choice, rows


def table_lines(meta: dict[str, Any]) -> list[str]:
    """The cold-start table of a router file's ``metadata.cold_start`` as plain text lines (empty without it)."""
    cs = meta.get("cold_start")
    if not isinstance(cs, dict):
        return []
    served = "the learned router" if cs["choice"] == "learned" else "prompt length"
    reason = str(cs["reason"]).rsplit(f": the default serves {served}", 1)[0]  # said once, at the start
    lines = [f"cold start: serves {served} — {reason}",
             f"{'evaluation set':<46}{'n':>6}  {'AUC learned/length/random':<27}{'savings at 95% (same)':<24}"
             "at the file's cut: (accuracy ratio, savings) learned | length"]

    def f(x: Any) -> str:
        return "  —  " if x is None else f"{x:.3f}"

    for r in cs.get("rows", []):
        le, ln, rd = r["learned"], r["length"], r["random"]
        mark = "" if learned_not_worse(r) else "  ← learned worse than length"
        lines.append(
            f"{r['set']:<46}{r['n']:>6}  {f(le['auc'])}/{f(ln['auc'])}/{f(rd['auc'])}      "
            f"{f(le['savings_95'])}/{f(ln['savings_95'])}/{f(rd['savings_95'])}     "
            f"({f(le['served']['accuracy_ratio'])}, {f(le['served']['savings'])}) | "
            f"({f(ln['served']['accuracy_ratio'])}, {f(ln['served']['savings'])}){mark}")
    lines.append("the learned candidate's scores come from: "
                 + "; ".join(sorted({r["learned_scored_by"] for r in cs.get("rows", [])})))
    return lines



def fit_without_traces(learned: TrainedRouter, seed: int = 0) -> TrainedRouter:
    """The default's recipe fitted on every training source but the traces (no validation split, the learned
    candidate's length weight and threshold): the learned scorer of the trace sets, never having seen a trace
    data set or model (a few minutes)."""
    from dataclasses import replace

    from router.fit.default import DEFAULT_CONFIG, add_length_weight, training_sources
    from router.fit.fitter import fit_router

    rest = [it for k, v in training_sources(seed).items() if k != "traces" for it in v]
    r, _ = fit_router(rest, replace(DEFAULT_CONFIG, seed=seed), val_frac=0.0, platt_frac=0.15)
    add_length_weight(r, float(learned.metadata.get("length_weight", {}).get("delta_coef_log_chars", 0.0)))
    r.thresholds = list(learned.thresholds)
    return r
