"""Recorded reasoning traces as routing data: ladders, per-question outcomes, labels and the held-out split.

A traces folder (``DIR/<dataset>/<MODEL>__<SETTING>.jsonl.gz``, one row per question; see
``data/traces/README.md``) records, for each (model, thinking setting), whether the answer was right
(``correct``), its ``completion_tokens`` (thinking + answer) and the answer text. A **ladder** is one model's
settings, cheapest first (``Qwen3-14B:no_think,exd0``); each setting is a tier of the gateway.

Label of a question on a ladder (:func:`sufficing_labels`): the index of the cheapest setting that answers it
correctly, 0 when none does (nothing is gained by paying more). For two settings this is RouteLLM's outcome
pair: 1 iff the cheap setting is wrong and the top one right.

Held-out questions (:func:`is_heldout`) are chosen by a salted SHA-256 of (dataset, id), so the split is the
same for every model, setting and run, and no fit, vocabulary or threshold ever sees them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from router.fit.jsonl import read_jsonl

HELDOUT_SALT = "thinkgate-heldout-v1"
HELDOUT_FRAC = 0.2


@dataclass(frozen=True)
class Ladder:
    """One model's thinking settings, cheapest first (2 or more)."""

    model: str
    settings: tuple[str, ...]

    @property
    def name(self) -> str:
        """``MODEL:S1,S2`` (the CLI spelling)."""
        return f"{self.model}:{','.join(self.settings)}"

    @property
    def slug(self) -> str:
        """File-name form ``MODEL__S1-S2``."""
        return f"{self.model}__{'-'.join(self.settings)}"


def parse_ladder(spec: str) -> Ladder:
    """Parse ``MODEL:SETTING1,SETTING2[,SETTING3…]`` (cheapest first). Raises ValueError on a bad spec
    (no colon, fewer than two settings, a repeated setting, empty names)."""
    model, sep, rest = spec.partition(":")
    settings = tuple(s.strip() for s in rest.split(","))
    if not sep or not model.strip() or any(not s for s in settings):
        raise ValueError(f"ladder must look like MODEL:SETTING1,SETTING2[,...], got {spec!r}")
    if len(settings) < 2:
        raise ValueError(f"a ladder needs at least two settings, got {spec!r}")
    if len(set(settings)) != len(settings):
        raise ValueError(f"repeated setting in ladder {spec!r}")
    return Ladder(model.strip(), settings)


def trace_path(traces: str | Path, dataset: str, model: str, setting: str) -> Path:
    """``traces/<dataset>/<model>__<setting>.jsonl.gz``."""
    return Path(traces) / dataset / f"{model}__{setting}.jsonl.gz"


def _check_recorded(traces: str | Path, dataset: str, lad: Ladder) -> None:
    """Raise FileNotFoundError naming what the folder does have when ``dataset`` or a ladder setting is missing
    (a typo in ``--dataset`` / ``--ladder`` is the usual cause)."""
    root = Path(traces)
    if not root.is_dir():
        raise FileNotFoundError(f"traces folder not found: {root}")
    if not (root / dataset).is_dir():
        have = sorted(d.name for d in root.iterdir() if d.is_dir())
        raise FileNotFoundError(f"no data set {dataset!r} under {root} (have: {', '.join(have) or 'none'})")
    models = available_models(root, dataset)
    if lad.model not in models:
        raise FileNotFoundError(f"no model {lad.model!r} in {root / dataset} (have: {', '.join(models) or 'none'})")
    missing = [s for s in lad.settings if s not in models[lad.model]]
    if missing:
        raise FileNotFoundError(f"{lad.model} has no setting {', '.join(map(repr, missing))} in {root / dataset} "
                                f"(has: {', '.join(models[lad.model])})")


def read_trace(path: str | Path) -> dict[str, dict[str, Any]]:
    """One trace file as ``{id: row}`` (ids as str). Raises FileNotFoundError naming the file, ValueError for
    a row without ``id``/``question``/``correct``/``completion_tokens``."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace file not found: {p}")
    out: dict[str, dict[str, Any]] = {}
    for row in read_jsonl(p):
        for key in ("id", "question", "correct", "completion_tokens"):
            if key not in row:
                raise ValueError(f"{p}: row lacks {key!r}: {str(row)[:120]}")
        out[str(row["id"])] = row
    return out


def _num(v: Any) -> float:
    return float("nan") if v is None else float(v)


@dataclass
class LadderData:
    """Per-question outcomes of one ladder on one (or several pooled) data sets; rows sorted by (dataset, id).

    ``ids``: question ids (str); ``datasets``: the data set of each row; ``questions``: the text the router
    scores; ``correct``: bool (n, k), setting j answered right; ``tokens``: float (n, k) completion tokens
    (thinking + answer); ``reasoning_tokens``: float (n, k), NaN where the provider did not report them;
    ``responses``: the recorded answer texts, (n) lists of k str (for the cascade estimate — never grading).
    """

    ladder: Ladder
    ids: list[str]
    datasets: list[str]
    questions: list[str]
    correct: np.ndarray
    tokens: np.ndarray
    reasoning_tokens: np.ndarray
    responses: list[list[str]] = field(repr=False)
    #: the recorded thinking texts, (n) lists of k str ("" where the source has none) — escalation features
    thoughts: list[list[str]] = field(default_factory=list, repr=False)

    @property
    def n(self) -> int:
        return len(self.ids)

    def subset(self, idx: Sequence[int] | np.ndarray) -> LadderData:
        """Rows ``idx`` (in that order)."""
        ix = np.asarray(idx, dtype=np.int64)
        return LadderData(
            self.ladder,
            [self.ids[i] for i in ix],
            [self.datasets[i] for i in ix],
            [self.questions[i] for i in ix],
            self.correct[ix],
            self.tokens[ix],
            self.reasoning_tokens[ix],
            [self.responses[i] for i in ix],
            [self.thoughts[i] for i in ix] if self.thoughts else [],
        )

    @property
    def keys(self) -> list[tuple[str, str]]:
        """(dataset, id) per row: the question identity across ladders."""
        return list(zip(self.datasets, self.ids, strict=True))


def load_ladder(traces: str | Path, datasets: str | Iterable[str], ladder: Ladder | str) -> LadderData:
    """The questions every setting of ``ladder`` has, in each of ``datasets``, sorted by (dataset, numeric id).

    A question missing from one setting's file is dropped (the replay needs all settings). Raises
    FileNotFoundError for a missing folder, data set, model or setting (naming what the folder has), ValueError
    when no question is left.
    """
    lad = parse_ladder(ladder) if isinstance(ladder, str) else ladder
    names = [datasets] if isinstance(datasets, str) else list(datasets)
    ids: list[str] = []
    dss: list[str] = []
    qs: list[str] = []
    cor: list[list[bool]] = []
    tok: list[list[float]] = []
    rtok: list[list[float]] = []
    resp: list[list[str]] = []
    thoughts: list[list[str]] = []
    for ds in names:
        _check_recorded(traces, ds, lad)
        files = [read_trace(trace_path(traces, ds, lad.model, s)) for s in lad.settings]
        common = set(files[0]).intersection(*files[1:])
        for qid in sorted(common, key=_id_key):
            rows = [f[qid] for f in files]
            ids.append(qid)
            dss.append(ds)
            qs.append(str(rows[0]["question"]))
            cor.append([bool(r["correct"]) for r in rows])
            tok.append([_num(r["completion_tokens"]) for r in rows])
            rtok.append([_num(r.get("reasoning_tokens")) for r in rows])
            resp.append(["" if r.get("response") is None else str(r["response"]) for r in rows])
            thoughts.append(["" if r.get("thought") is None else str(r["thought"]) for r in rows])
    if not ids:
        raise ValueError(f"no question has every setting of {lad.name} in {names} under {traces}")
    k = len(lad.settings)
    return LadderData(
        lad, ids, dss, qs,
        np.asarray(cor, dtype=bool).reshape(-1, k),
        np.nan_to_num(np.asarray(tok, dtype=np.float64).reshape(-1, k), nan=0.0),
        np.asarray(rtok, dtype=np.float64).reshape(-1, k),
        resp,
        thoughts,
    )


def check_cheapest_first(data: LadderData) -> None:
    """Raise ValueError unless the ladder's mean completion tokens rise strictly from its first setting to its
    last on ``data`` — a ladder is cheapest first: its last setting is "always-top", the cut-off the thresholds are
    certified against, and a reversed ladder fits a router that sends the easy questions to the *dearer* tier. The
    message gives the means (tokens per question) and the ladder in the order they suggest."""
    if data.n == 0:
        return
    means = [float(np.nanmean(data.tokens[:, j])) for j in range(len(data.ladder.settings))]
    if all(a < b for a, b in pairwise(means)):
        return
    lad = data.ladder
    have = ", ".join(f"{s} {m:.0f}" for s, m in zip(lad.settings, means, strict=True))
    order = ",".join(s for _, s in sorted(zip(means, lad.settings, strict=True)))
    raise ValueError(f"ladder {lad.name} is not cheapest first: mean completion tokens per question {have}; "
                     f"list the settings cheapest first (e.g. {lad.model}:{order})")


def _id_key(qid: str) -> tuple[int, float, str]:
    try:
        return (0, float(qid), qid)
    except ValueError:
        return (1, math.inf, qid)


def sufficing_labels(correct: np.ndarray) -> np.ndarray:
    """Per question, the index of the cheapest setting that is correct; 0 when none is (int64, (n,)).

    ``correct``: bool (n, k), settings cheapest first. For k = 2: 1 iff cheap wrong and top right.
    """
    c = np.asarray(correct, dtype=bool)
    if c.ndim != 2 or c.shape[1] < 2:
        raise ValueError("correct must be (n, k >= 2)")
    first = np.argmax(c, axis=1)
    return np.where(c.any(axis=1), first, 0).astype(np.int64)


def heldout_unit(dataset: str, qid: str) -> float:
    """A uniform number in [0, 1) fixed by (dataset, question id): SHA-256 of the salted key."""
    h = hashlib.sha256(f"{HELDOUT_SALT}/{dataset}/{qid}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def is_heldout(dataset: str, qid: str, frac: float = HELDOUT_FRAC) -> bool:
    """True for the ~``frac`` of questions that no fit or threshold may see (same for every model)."""
    return heldout_unit(dataset, str(qid)) < frac


def heldout_mask(data: LadderData, frac: float = HELDOUT_FRAC) -> np.ndarray:
    """Bool (n,): rows of ``data`` in the held-out split."""
    return np.array([is_heldout(d, q, frac) for d, q in data.keys], dtype=bool)


def available_models(traces: str | Path, dataset: str) -> dict[str, list[str]]:
    """``{model: [settings]}`` of the trace files in ``traces/<dataset>`` (for pooling other models' outcomes)."""
    out: dict[str, list[str]] = {}
    for p in sorted((Path(traces) / dataset).glob("*__*.jsonl.gz")):
        model, _, setting = p.name[: -len(".jsonl.gz")].partition("__")
        out.setdefault(model, []).append(setting)
    return out


def outcome_table(traces: str | Path, datasets: Sequence[str] = ("frames", "simpleqa")) -> list[dict[str, Any]]:
    """One row per question of each data set: ``{"dataset", "id", "question", "outcomes": {"MODEL__SETTING":
    bool}, "completion_tokens": {"MODEL__SETTING": int}}`` — the compact label source the shipped default
    router is fitted from (``data/traces/outcomes.jsonl.gz``; no answer texts, no grading letters).
    Every question is kept (the held-out ones too, so the split stays computable); fitting code filters
    them with :func:`is_heldout`."""
    rows: list[dict[str, Any]] = []
    for ds in datasets:
        per_q: dict[str, dict[str, Any]] = {}
        for p in sorted((Path(traces) / ds).glob("*__*.jsonl.gz")):
            name = p.name[: -len(".jsonl.gz")]
            for qid, r in read_trace(p).items():
                e = per_q.setdefault(qid, {"dataset": ds, "id": qid, "question": str(r["question"]),
                                           "outcomes": {}, "completion_tokens": {}})
                e["outcomes"][name] = bool(r["correct"])
                e["completion_tokens"][name] = None if r["completion_tokens"] is None else int(r["completion_tokens"])
        rows.extend(per_q[q] for q in sorted(per_q, key=_id_key))
    return rows
