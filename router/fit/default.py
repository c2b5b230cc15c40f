"""The recipe of the shipped router (``router/assets/default.skops``), rebuilt by
``thinkgate router build-default``: every real label source in the repo, one model.

Training data ("long" = needs the long tier; groups = what a split never cuts):

* MATH train (``data/math/train.jsonl.gz``, 11,998 problems): ``level ≥ 4``; groups = subject.
* the project's generated arithmetic task (:mod:`router.tasks`, train split, up to 500 problems per number of
  operations 1–7): ``operations ≥ k``, *k* **measured** from the shipped model's tiers through the gateway
  (``router/assets/tier_outcomes.json``; :func:`arith_threshold_from_outcomes`).
* GSM8K train (``data/gsm8k/train.jsonl.gz``, 7,473 problems): ``calculation steps ≥ 4``.
* RouteLLM's MMLU outcome pairs (``data/routellm``): "Mixtral wrong and GPT-4 right", the subjects **not** in
  the fixed held-out 20% of subjects (:func:`mmlu_heldout_subject`; groups = subject). (Every 3rd row instead:
  MATH-500 AUC 0.811 vs 0.803, MMLU held-out subjects 0.598 vs 0.617.)
* Real reasoning-model traces (``data/traces/outcomes.jsonl.gz``, FRAMES + SimpleQA): one item per (model,
  question), "the model's cheapest setting wrong and its top setting right"; groups = question; the fixed
  held-out questions (:func:`router.fit.traces.is_heldout`) are left out.

Evaluation sets (each also scored by prompt length, the baseline the router must not lose to; AUC and the
cost reduction at 95% of always-long quality, in the file's ``metrics.vs_length`` and ``thinkgate router info``):
held-out *questions* — MATH-500, arithmetic test, GSM8K test, trace held-out questions (FRAMES, SimpleQA);
held-out *subjects* — the MMLU held-out subjects, the MATH validation subjects of the fit; held-out *data sets*
(``transfer=True``) — the same recipe fitted without one source at a time, scored on that source's test set.
Length prior: prompt length ranks MMLU, MATH and GSM8K difficulty well on its own, and one linear model over
all sources dilutes its weight; :func:`choose_length_weight` adds λ · std(logit) × the standardised
``log_chars`` feature (exactly representable: it is a coefficient of the model) with λ chosen on the fit's
validation subjects — the largest minimum over sources of (router AUC − length AUC).
Threshold: the highest cut keeping ≥ 95% of always-long (label) quality on MATH-500 + the arithmetic test split.
"""

from __future__ import annotations

from dataclasses import replace
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from router.fit.calibrate import fraction_at_or_above, threshold_for_quality_loss
from router.fit.evaluate import EvalResult, evaluate_scores, outcomes_of, plot_curves, render_table
from router.fit.fitter import fit_router
from router.fit.jsonl import read_jsonl, sha256_files
from router.fit.labels import LabelledItem, from_difficulty, from_outcome_pairs, items_from_rows
from router.model import ModelConfig
from router.persistence import save_router
from router.tasks.rows import task_rows

REPO = Path(__file__).resolve().parents[2]
MATH_TRAIN = REPO / "data" / "math" / "train.jsonl.gz"
MATH_TEST = Path(str(files("router.tasks").joinpath("data", "math", "test.jsonl")))  # package data
MMLU = REPO / "data" / "routellm" / "mmlu_responses.jsonl.gz"
GSM8K_TRAIN = REPO / "data" / "gsm8k" / "train.jsonl.gz"
TRACE_OUTCOMES = REPO / "data" / "traces" / "outcomes.jsonl.gz"
MMLU_EVERY = 1
LENGTH_WEIGHTS = (0.0, 0.25, 0.5, 1.0, 2.0)
MMLU_HELDOUT_FRAC = 0.2
MMLU_WEAK = "mistralai/Mixtral-8x7B-Instruct-v0.1"
MMLU_STRONG = "gpt-4-1106-preview"
MATH_LEVEL = 4
TIER_OUTCOMES = REPO / "router" / "assets" / "tier_outcomes.json"
SHORT_KEEPS = 0.95
GSM8K_STEPS = 4
MAX_QUALITY_LOSS = 0.05
DEFAULT_CONFIG = ModelConfig()


def math_items(
    path: Path = MATH_TRAIN, threshold: float = MATH_LEVEL, source: str = "math-level"
) -> list[LabelledItem]:
    """MATH problems labelled ``level ≥ threshold`` (source 1), grouped by subject."""
    return list(from_difficulty(read_jsonl(path), threshold=threshold, source=source, id_prefix=f"{source}/"))


def mmlu_items(path: Path = MMLU) -> list[LabelledItem]:
    """RouteLLM MMLU outcome pairs (source 2), grouped by subject."""
    return list(from_outcome_pairs(read_jsonl(path), weak_field=MMLU_WEAK, strong_field=MMLU_STRONG,
                                   source="routellm-mmlu", id_prefix="mmlu/"))


def arith_threshold_from_outcomes(
    path: Path = TIER_OUTCOMES, short: str = "short", long: str = "long", keeps: float = SHORT_KEEPS
) -> int:
    """The number of operations from which ``arith`` problems need the long tier, from measured outcomes.

    ``path``: a ``thinkgate eval tiers --json`` report with both tiers and a ``by_difficulty`` breakdown
    (accuracy per number of operations). Returns the smallest level *k* at which
    ``accuracy(short, k) < keeps * accuracy(long, k)``; every level at and above *k* is then labelled long
    (accuracy falls with the number of operations, so one cut is enough). If the short tier keeps up at every
    measured level, returns one past the largest. Raises ``ValueError`` for a missing file or tier.
    """
    import json

    if not path.is_file():
        raise ValueError(f"{path}: no tier outcomes; run `thinkgate eval tiers --tiers short,long --json {path}`")
    tiers = json.loads(path.read_text())["tiers"]
    if short not in tiers or long not in tiers:
        raise ValueError(f"{path}: needs tiers {short!r} and {long!r}, has {sorted(tiers)}")
    s_by, l_by = tiers[short]["by_difficulty"], tiers[long]["by_difficulty"]
    levels = sorted(int(k) for k in s_by if k in l_by)
    for k in levels:
        if s_by[str(k)]["accuracy"] < keeps * l_by[str(k)]["accuracy"]:
            return k
    return (levels[-1] + 1) if levels else 1


def arith_items(split: str, per_level: int, seed: int = 0, threshold: int | None = None) -> list[LabelledItem]:
    """Generated arithmetic problems labelled ``operations ≥ threshold`` (default: measured, see
    :func:`arith_threshold_from_outcomes`)."""
    k = arith_threshold_from_outcomes() if threshold is None else threshold
    return items_from_rows(task_rows("arith", split, per_level, seed), k, "arith-ops")


def gsm8k_items(split: str = "test") -> list[LabelledItem]:
    """GSM8K ``split`` labelled ``calculation steps ≥ GSM8K_STEPS``."""
    return items_from_rows(task_rows("gsm8k", split, None), GSM8K_STEPS, "gsm8k-steps")


def mmlu_heldout_subject(subject: str) -> bool:
    """The fixed ~20% of MMLU subjects never fitted on (SHA-256 of the subject name)."""
    import hashlib

    h = hashlib.sha256(f"thinkgate-mmlu-heldout-v1/{subject}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64 < MMLU_HELDOUT_FRAC


def mmlu_split(path: Path = MMLU) -> tuple[list[LabelledItem], list[LabelledItem]]:
    """(training rows: every ``MMLU_EVERY``-th of the other subjects, held-out subjects: all rows)."""
    items = mmlu_items(path)
    held = [it for it in items if mmlu_heldout_subject(it.group)]
    rest = [it for it in items if not mmlu_heldout_subject(it.group)]
    return rest[::MMLU_EVERY], held


def trace_items(path: Path = TRACE_OUTCOMES, heldout: bool = False) -> list[LabelledItem]:
    """Trace outcome pairs: per question and model, label 1 iff its cheapest setting is wrong and its top
    setting right (settings ordered by :data:`router.fit.ladder_fit.SETTING_ORDER`). ``heldout``: only the
    fixed held-out questions (else only the others). Source ``traces-<dataset>``; group = the question."""
    from router.fit.ladder_fit import SETTING_ORDER
    from router.fit.traces import is_heldout

    rank = {s: i for i, s in enumerate(SETTING_ORDER)}
    out: list[LabelledItem] = []
    for row in read_jsonl(path):
        ds, qid = str(row["dataset"]), str(row["id"])
        if is_heldout(ds, qid) != heldout:
            continue
        by_model: dict[str, list[tuple[int, bool]]] = {}
        for name, ok in row["outcomes"].items():
            model, _, setting = name.partition("__")
            by_model.setdefault(model, []).append((rank.get(setting, len(rank)), bool(ok)))
        for model, settings in sorted(by_model.items()):
            if len(settings) < 2:
                continue
            settings.sort()
            cheap, top = settings[0][1], settings[-1][1]
            out.append(LabelledItem(id=f"traces/{ds}/{qid}/{model}", text=str(row["question"]),
                                    label=int(top and not cheap), source=f"traces-{ds}", group=f"{ds}/{qid}",
                                    short_correct=cheap, long_correct=top, meta={"model": model}))
    return out


def length_auc(items: list[LabelledItem]) -> float:
    """AUC of ranking ``items`` by prompt length (characters)."""
    from router.fit.evaluate import auc_score

    return auc_score(np.array([it.label for it in items], dtype=float), np.array([len(it.text) for it in items],
                                                                                  dtype=float))


def vs_length(name: str, kind: str, items: list[LabelledItem], scores: np.ndarray) -> dict[str, Any]:
    """The router vs prompt length on one evaluation set: AUC and cost reduction at 95% of always-long."""
    r = evaluate_scores(name, items, scores)
    lr = evaluate_scores(name, items, np.array([len(it.text) for it in items], dtype=float))
    ok = (not np.isfinite(lr.auc)) or r.auc >= lr.auc - 1e-9
    return {"set": name, "kind": kind, "n": len(items), "auc": round(r.auc, 4), "length_auc": round(lr.auc, 4),
            "cost_reduction_95": round(r.cost_reduction_95, 4) if np.isfinite(r.cost_reduction_95) else None,
            "length_cost_reduction_95": round(lr.cost_reduction_95, 4) if np.isfinite(lr.cost_reduction_95)
            else None, "ok": bool(ok)}


def _standardised_log_chars(router: Any, texts: list[str]) -> np.ndarray:
    pipe = router.pipeline
    hand = dict(pipe.named_steps["features"].transformer_list)["hand"]
    return np.asarray(hand.transform(pipe.named_steps["clip"].transform(texts)))[:, 0]


def add_length_weight(router: Any, delta: float) -> None:
    """Add ``delta`` to the coefficient of the standardised ``log_chars`` hand feature (in place)."""
    clf = router.pipeline.named_steps["clf"]
    n_hand = len(dict(router.pipeline.named_steps["features"].transformer_list)["hand"].named_steps["scale"].mean_)
    clf.coef_[0, clf.coef_.shape[1] - n_hand] += delta
    router._fast = None


def choose_length_weight(router: Any, val_items: list[LabelledItem]) -> tuple[float, float, dict[str, float]]:
    """λ in :data:`LENGTH_WEIGHTS` maximising, over the validation items' sources (arithmetic excluded: it is
    separable either way), the smallest (AUC of logit + λ·std(logit)·z_len) − (AUC of length). Ties → the
    smaller λ. Returns (λ, the coefficient change, {λ: that minimum})."""
    from router.fit.evaluate import auc_score

    items = [it for it in val_items if not it.source.startswith("arith")]
    texts = [it.text for it in items]
    z = router.logits(texts)
    zl = _standardised_log_chars(router, texts)
    y = np.array([it.label for it in items], dtype=float)
    src = np.array([it.source for it in items])
    sd = float(z.std()) or 1.0
    out: dict[str, float] = {}
    for lam in LENGTH_WEIGHTS:
        s = z + lam * sd * zl
        gains = []
        for name in sorted(set(src)):
            m = src == name
            if 0 < y[m].sum() < m.sum():
                lengths = np.array([len(t) for t, k in zip(texts, m, strict=True) if k], dtype=float)
                gains.append(auc_score(y[m], s[m]) - auc_score(y[m], lengths))
        out[str(lam)] = round(float(min(gains)), 4) if gains else 0.0
    best = max(LENGTH_WEIGHTS, key=lambda lam: (out[str(lam)], -lam))
    return best, best * sd, out


def training_sources(seed: int = 0, arith_k: int | None = None) -> dict[str, list[LabelledItem]]:
    """The shipped router's training items per source (see the module docstring)."""
    k = arith_threshold_from_outcomes() if arith_k is None else arith_k
    mmlu_train, _ = mmlu_split()
    return {
        "math": math_items(),
        "arith": arith_items("train", 500, seed, k),
        "gsm8k": gsm8k_items("train"),
        "mmlu": mmlu_train,
        "traces": trace_items(),
    }


def evaluation_sets(seed: int = 0, arith_k: int | None = None) -> list[tuple[str, str, str, list[LabelledItem]]]:
    """(name, kind, training source it belongs to, items) of every evaluation set."""
    k = arith_threshold_from_outcomes() if arith_k is None else arith_k
    _, mmlu_held = mmlu_split()
    traces_held = trace_items(heldout=True)
    return [
        ("math500-level>=4", "held-out questions", "math", math_items(MATH_TEST, source="math500-level")),
        (f"arith-test-ops>={k}", "held-out questions", "arith", arith_items("test", 100, seed, k)),
        ("gsm8k-test-steps>=4", "held-out questions", "gsm8k", gsm8k_items("test")),
        ("traces-frames held-out", "held-out questions", "traces",
         [it for it in traces_held if it.source == "traces-frames"]),
        ("traces-simpleqa held-out", "held-out questions", "traces",
         [it for it in traces_held if it.source == "traces-simpleqa"]),
        ("routellm-mmlu held-out subjects", "held-out subjects", "mmlu", mmlu_held),
    ]


def build_default_router(
    out: Path, *, plot: Path | None = None, seed: int = 0, console: Any = None, transfer: bool = False
) -> tuple[Any, list[EvalResult]]:
    """Fit, calibrate, evaluate and save the shipped router (~3–5 min on 2 busy cores; ``transfer`` adds one
    refit per source for the held-out-data-set rows, ~5 more). Returns the router and the held-out results."""
    say = console.print if console is not None else print
    arith_k = arith_threshold_from_outcomes()
    say(f"arith: long from {arith_k} operations (measured in {TIER_OUTCOMES.relative_to(REPO)})")
    sources = training_sources(seed, arith_k)
    train = [it for items in sources.values() for it in items]
    cfg = replace(DEFAULT_CONFIG, seed=seed)
    say("training items: " + ", ".join(f"{k} {len(v)}" for k, v in sources.items()) + f" (total {len(train)})")
    data_files = [str(p.relative_to(REPO)) for p in (MATH_TRAIN, GSM8K_TRAIN, MMLU, TRACE_OUTCOMES)]
    files_ = [*data_files, f"router.tasks arith train (seed {seed})"]
    first, report = fit_router(train, cfg, val_frac=0.2, platt_frac=0.15, refit=False, data_files=files_)
    val_items = [train[i] for i in report.val_index]
    lam, delta, per_lambda = choose_length_weight(first, val_items)
    say(f"length weight λ = {lam} (Δ coefficient {delta:.4f}); validation min(AUC − length AUC) per λ: {per_lambda}")
    del first
    router, _ = fit_router(
        train, cfg, val_frac=0.0, platt_frac=0.15, refit=False, data_files=files_,
        extra_metadata={
            "recipe": "router.fit.default.build_default_router",
            "arith_long_from_operations": arith_k,
            "tier_outcomes": str(TIER_OUTCOMES.relative_to(REPO)),
            "tier_outcomes_sha256": sha256_files([TIER_OUTCOMES]),
            "data_sha256": sha256_files([MATH_TRAIN, GSM8K_TRAIN, MMLU, TRACE_OUTCOMES]),
            "mmlu": {"every": MMLU_EVERY, "heldout_subjects_frac": MMLU_HELDOUT_FRAC},
            "traces_heldout": "router.fit.traces.is_heldout (20% of questions, never fitted)",
            "length_weight": {"lambda": lam, "delta_coef_log_chars": round(delta, 6),
                              "validation_min_auc_gain_per_lambda": per_lambda},
        },
    )
    add_length_weight(router, delta)
    router.metadata["metrics"]["validation"] = [r.summary() for r in report.validation]
    router.metadata["metrics"]["validation_note"] = (
        "held-out groups (20% per source), scored by the model fitted without them (before the length weight); "
        "the shipped model was then fitted on all items with the same recipe")
    router.metadata["split"]["refit_on_all"] = True
    if console is not None:
        console.print(render_table(report.validation, title="Validation (held-out subjects/items, pre-refit)"))

    evals = evaluation_sets(seed, arith_k)
    calib = evals[0][3] + evals[1][3]
    scores = router.predict_proba([it.text for it in calib])
    qs, ql, _ = outcomes_of(calib)
    cut = threshold_for_quality_loss(scores, qs, ql, MAX_QUALITY_LOSS)
    router.thresholds = [cut]
    router.metadata["thresholds_calibration"] = {
        "method": "max_quality_loss",
        "target": MAX_QUALITY_LOSS,
        "achieved_frac_at_or_above": [round(fraction_at_or_above(scores, cut), 4)],
        "quality": round(float(np.mean(np.where(scores >= cut, ql, qs))), 4),
        "always_long_quality": round(float(ql.mean()), 4),
        "n": len(calib),
        "data_files": [str(MATH_TEST.relative_to(REPO)), f"router.tasks arith test (seed {seed})"],
        "sha256": sha256_files([MATH_TEST]),
    }

    results: list[EvalResult] = []
    rows: list[dict[str, Any]] = []
    for name, kind, _, items in evals:
        s = router.predict_proba([it.text for it in items])
        results.append(evaluate_scores(name, items, s))
        rows.append(vs_length(name, kind, items, s))
    # held-out subjects of the fit itself (validation groups, scored by the model fitted without them)
    for src in ("math-level>=4", "routellm-mmlu"):
        vr = next((r for r in report.validation if r.name == src), None)
        part = [it for it in val_items if it.source == src]
        if vr is not None and part:
            auc, l_auc = round(vr.auc, 4), round(length_auc(part), 4)
            row: dict[str, Any] = {"set": f"{src} validation subjects", "kind": "held-out subjects", "n": vr.n,
                                   "auc": auc, "length_auc": l_auc, "cost_reduction_95": None,
                                   "length_cost_reduction_95": None, "ok": bool(auc >= l_auc)}
            rows.append(row)
    if transfer:
        rows.extend(transfer_rows(sources, evals, cfg, say, delta))
    router.metadata["metrics"]["heldout"] = [r.summary() for r in results]
    router.metadata["metrics"]["vs_length"] = rows
    save_router(router, out)
    if console is not None:
        console.print(render_table(results, title="Held-out sets (shipped model)"))
    for row in rows:
        la = "—" if row["length_auc"] is None else f"{row['length_auc']:.3f}"
        verdict = {True: "no worse than length", False: "WORSE than length", None: ""}[row["ok"]]
        say(f"  {row['kind']:>19}: {row['set']:<40} n={row['n']:>6} AUC {row['auc']:.3f} vs length {la}  {verdict}")
    if plot is not None:
        plot_curves(results, plot, title="Shipped router: quality vs % sent to long (held-out sets)")
    say(f"threshold {cut:.4f}; saved {out} ({out.stat().st_size / 1e6:.2f} MB)")
    return router, results


def transfer_rows(
    sources: dict[str, list[LabelledItem]], evals: list[tuple[str, str, str, list[LabelledItem]]],
    cfg: ModelConfig, say: Any, length_delta: float = 0.0,
) -> list[dict[str, Any]]:
    """Held-out data sets: for each source with an evaluation set, the recipe fitted without that source
    (no validation split, no refit; the shipped length weight ``length_delta`` added) scores that source's
    evaluation set(s)."""
    rows = []
    for src in sources:
        sets = [e for e in evals if e[2] == src]
        if not sets or src == "arith":  # arithmetic is the toy model's own task: nothing to transfer from
            continue
        rest = [it for k, items in sources.items() if k != src for it in items]
        r, _ = fit_router(rest, cfg, val_frac=0.0, platt_frac=0.15)
        add_length_weight(r, length_delta)
        for name, _, _, items in sets:
            s = r.predict_proba([it.text for it in items])
            rows.append(vs_length(f"{name} (fit without {src})", "held-out data set", items, s))
            say(f"  transfer: {rows[-1]['set']}: AUC {rows[-1]['auc']:.3f} vs length {rows[-1]['length_auc']:.3f}")
    return rows
