"""Fitting: grouped splits, the Pipeline fit, Platt scaling, validation metrics and the file's metadata.

Splits are made per source and by group (MMLU subject, MATH subject; each item its own group when it has
none), so a validation score never benefits from near-duplicate questions of the same subject in training:

    items ──(per source, by group)──▶ train ∣ validation          (val_frac of each source)
    train ──(per source, by group)──▶ fit ∣ platt                 (platt_frac of the training part)

The Pipeline is fitted on *fit*, Platt's (a, b) on the logits of *platt* (held out from the fit, so the
probabilities are calibrated on unseen data), metrics are computed on *validation*. With ``refit=True`` the
same recipe is then run again on everything (train ∪ validation → fit ∣ platt), and that model is returned:
its metadata carries the validation metrics of the held-out run, labelled as such. Deterministic for a given
item list and seed (liblinear with ``random_state``; splits from ``numpy.random.default_rng``).
"""

from __future__ import annotations

import datetime as _dt
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from router.fit.evaluate import EvalResult, evaluate_grouped
from router.fit.jsonl import sha256_rows
from router.fit.labels import MIN_LABELLED_ITEMS, LabelledItem
from router.model import FEATURE_DESCRIPTION, ModelConfig, Platt, TrainedRouter, build_pipeline

ROUTER_VERSION = "1"


def split_by_group(items: Sequence[LabelledItem], frac: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices (rest, held_out): per source, whole groups are drawn in a seeded random order into the held-out
    part until it holds ≥ ``frac`` of that source's items. ``frac`` = 0 → nothing held out."""
    if not 0 <= frac < 1:
        raise ValueError("frac must be in [0, 1)")
    held: list[int] = []
    by_source: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        by_source.setdefault(it.source, []).append(i)
    for source in sorted(by_source):
        idx = by_source[source]
        if frac == 0:
            continue
        groups: dict[str, list[int]] = {}
        for i in idx:
            g = items[i].group or f"\x00{items[i].id}"
            groups.setdefault(g, []).append(i)
        names = sorted(groups)
        rng = np.random.default_rng([seed, zlib.crc32(source.encode())])
        order = rng.permutation(len(names))
        target = frac * len(idx)
        taken = 0
        for j in order:
            if taken >= target:
                break
            held.extend(groups[names[j]])
            taken += len(groups[names[j]])
    held_set = set(held)
    rest = [i for i in range(len(items)) if i not in held_set]
    return rest, sorted(held_set)


@dataclass
class FitReport:
    """What :func:`fit_router` did: split sizes, seconds, and validation results (overall + per source)."""

    n_fit: int
    n_platt: int
    n_val: int
    fit_seconds: float
    validation: list[EvalResult]
    val_index: list[int]
    refit: bool = False


def _fit_once(items: Sequence[LabelledItem], cfg: ModelConfig, platt_frac: float) -> tuple[TrainedRouter, int, int]:
    fit_rel, platt_rel = split_by_group(items, platt_frac, cfg.seed + 1)
    fit_items = [items[i] for i in fit_rel]
    platt_items = [items[i] for i in platt_rel] or fit_items
    for name, part in (("fit", fit_items), ("platt", platt_items)):
        if len({it.label for it in part}) < 2:
            raise ValueError(f"the {name} split holds a single class; add data or change the split")
    pipeline = build_pipeline(cfg)
    pipeline.fit([it.text for it in fit_items], np.array([it.label for it in fit_items]))
    router = TrainedRouter(pipeline=pipeline)
    router.platt = Platt.fit(router.logits([it.text for it in platt_items]), np.array([it.label for it in platt_items]))
    return router, len(fit_items), len(platt_items)


def fit_router(
    items: Sequence[LabelledItem],
    cfg: ModelConfig | None = None,
    *,
    val_frac: float = 0.2,
    platt_frac: float = 0.15,
    refit: bool = False,
    data_files: Sequence[str] = (),
    extra_metadata: dict[str, Any] | None = None,
) -> tuple[TrainedRouter, FitReport]:
    """Fit a :class:`TrainedRouter` on ``items`` (see the module docstring). Returns it (no thresholds yet:
    run :mod:`router.fit.calibrate`) and a :class:`FitReport`. Raises ValueError when a part would be empty or
    hold a single class."""
    cfg = cfg or ModelConfig()
    items = list(items)
    if len(items) < MIN_LABELLED_ITEMS:
        raise ValueError(f"need at least {MIN_LABELLED_ITEMS} labelled items, got {len(items)}")
    train_idx, val_idx = split_by_group(items, val_frac, cfg.seed)
    t0 = time.perf_counter()
    router, n_fit, n_platt = _fit_once([items[i] for i in train_idx], cfg, platt_frac)
    val_items = [items[i] for i in val_idx]
    validation = (
        evaluate_grouped("validation", val_items, router.predict_proba([it.text for it in val_items]))
        if val_items
        else []
    )
    if refit and val_items:
        router, n_fit, n_platt = _fit_once(items, cfg, platt_frac)
    report = FitReport(n_fit, n_platt, len(val_items), time.perf_counter() - t0, validation, val_idx,
                       refit=refit and bool(val_items))
    router.metadata = build_metadata(items, cfg, report, data_files, extra_metadata)
    return router, report


def build_metadata(
    items: Sequence[LabelledItem],
    cfg: ModelConfig,
    report: FitReport,
    data_files: Sequence[str],
    extra: dict[str, Any] | None,
) -> dict[str, Any]:
    """The JSON metadata saved in the router file (version, features, labels, data hash, metrics)."""
    import sklearn
    import skops

    sources = Counter(it.source for it in items)
    positives = Counter(it.source for it in items if it.label)
    meta: dict[str, Any] = {
        "router": TrainedRouter.name,
        "router_version": ROUTER_VERSION,
        "created_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "sklearn_version": sklearn.__version__,
        "skops_version": skops.__version__,
        "model_config": cfg.to_dict(),
        "features": FEATURE_DESCRIPTION,
        "label_sources": {s: {"n": n, "long_frac": round(positives[s] / n, 4)} for s, n in sorted(sources.items())},
        "training_data_sha256": sha256_rows(
            {"id": it.id, "text": it.text, "label": it.label, "source": it.source, "group": it.group} for it in items
        ),
        "data_files": list(data_files),
        "split": {"n_fit": report.n_fit, "n_platt": report.n_platt, "n_validation": report.n_val,
                  "by": "source, then group", "refit_on_all": report.refit},
        "platt": "fitted on the held-out platt split",
        "fit_seconds": round(report.fit_seconds, 1),
        "metrics": {
            "validation": [r.summary() for r in report.validation],
            "validation_note": (
                "held-out groups, scored by the model fitted without them (the shipped model was then refitted "
                "on all items with the same recipe)" if report.refit else "held-out groups"
            ),
        },
        "thresholds_calibration": None,
    }
    if extra:
        meta.update(extra)
    return meta
