"""Labelled routing data: one schema, three sources.

A labelled item (one JSONL line) is::

    {"id": str, "text": str, "label": 0|1, "source": str, "group": str,
     "short_correct": bool|null, "long_correct": bool|null, "meta": {...}}

``label`` 1 means "needs the long tier". ``group`` is what a train/validation split must not cut across
(MMLU subject, MATH subject), so validation scores are not inflated by near-duplicate questions.
``short_correct``/``long_correct`` are per-tier outcomes when known; the quality–cost curves of
:mod:`router.fit.metrics` use them (and fall back to the label, i.e. short wrong and long right iff label=1).

Sources:
1. :func:`from_difficulty`: a dataset's own difficulty field (MATH ``level``, the arithmetic task's
   number of operations) ≥ a threshold → long.
2. :func:`from_outcome_pairs`: weak/strong correctness columns (RouteLLM's MMLU responses,
   arXiv 2406.18665): long iff the weak model is wrong and the strong model right.
3. :mod:`router.fit.outcomes`: correctness measured by calling each tier of a running gateway.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from router.fit.jsonl import read_jsonl

#: the fewest labelled items ``router fit``, ``calibrate`` and ``eval`` work on: below it a threshold or a metric is
#: one or two items' say (and on none, a scikit-learn traceback)
MIN_LABELLED_ITEMS = 10


@dataclass
class LabelledItem:
    """One routing example; see the module docstring for the fields."""

    id: str
    text: str
    label: int
    source: str
    group: str = ""
    short_correct: bool | None = None
    long_correct: bool | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LabelledItem:
        """Parse one JSONL row; raises ValueError naming the missing/invalid field."""
        for key in ("id", "text", "label"):
            if key not in d:
                raise ValueError(f"labelled item lacks {key!r}: {str(d)[:120]} — a labelled JSONL row is "
                                 "{id, text, label}; make one from raw data with `thinkgate router label` "
                                 "(difficulty, outcomes or gateway)")
        label = d["label"]
        if label not in (0, 1, True, False):
            raise ValueError(f"label must be 0 or 1, got {label!r} (id {d['id']!r})")
        return cls(
            id=str(d["id"]),
            text=str(d["text"]),
            label=int(label),
            source=str(d.get("source", "")),
            group=str(d.get("group", "")),
            short_correct=_opt_bool(d.get("short_correct")),
            long_correct=_opt_bool(d.get("long_correct")),
            meta=dict(d.get("meta") or {}),
        )


def _opt_bool(v: Any) -> bool | None:
    return None if v is None else bool(v)


def load_items(paths: Iterable[str | Path]) -> list[LabelledItem]:
    """Read labelled items from JSONL files (``.gz`` allowed), in order. Raises ValueError on a bad row
    or on duplicate ids across the files."""
    items: list[LabelledItem] = []
    seen: set[str] = set()
    for p in paths:
        for row in read_jsonl(p):
            item = LabelledItem.from_dict(row)
            if item.id in seen:
                raise ValueError(f"duplicate id {item.id!r} in {p}")
            seen.add(item.id)
            items.append(item)
    return items


def _get(row: dict[str, Any], dotted: str) -> Any:
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def from_difficulty(
    rows: Iterable[dict[str, Any]],
    *,
    threshold: float,
    text_field: str = "problem",
    difficulty_field: str = "level",
    group_field: str | None = "subject",
    id_field: str | None = "unique_id",
    source: str = "difficulty",
    id_prefix: str = "",
) -> Iterator[LabelledItem]:
    """Source 1: ``label = difficulty ≥ threshold``. Rows whose difficulty is missing/null are skipped.

    Fields may be dotted paths into nested objects (``meta.ops``). Ids default to the row index when
    ``id_field`` is absent. The difficulty value is kept in ``meta.difficulty``.
    """
    for i, row in enumerate(rows):
        diff = _get(row, difficulty_field)
        text = _get(row, text_field)
        if diff is None or text is None:
            continue
        rid = _get(row, id_field) if id_field else None
        group = _get(row, group_field) if group_field else None
        yield LabelledItem(
            id=f"{id_prefix}{rid if rid is not None else i}",
            text=str(text),
            label=int(float(diff) >= threshold),
            source=f"{source}>={threshold:g}",
            group=str(group) if group is not None else "",
            meta={"difficulty": diff},
        )


def items_from_rows(rows: Iterable[dict[str, Any]], threshold: float, source: str) -> list[LabelledItem]:
    """Question rows (:func:`router.tasks.rows.task_rows`: ``{"id", "question", "difficulty", "group", …}``) →
    labelled items with ``label = difficulty ≥ threshold`` (source 1, :func:`from_difficulty` over those fields).
    """
    return list(from_difficulty(rows, threshold=threshold, text_field="question", difficulty_field="difficulty",
                                group_field="group", id_field="id", source=source))


def from_outcome_pairs(
    rows: Iterable[dict[str, Any]],
    *,
    weak_field: str,
    strong_field: str,
    text_field: str = "prompt",
    group_field: str | None = "subject",
    id_field: str | None = None,
    source: str = "outcomes",
    id_prefix: str = "",
) -> Iterator[LabelledItem]:
    """Source 2: ``label = (weak wrong) and (strong right)``; both outcomes kept for quality curves.

    RouteLLM's MMLU file (``data/routellm/mmlu_responses.jsonl.gz``): ``weak_field`` =
    ``mistralai/Mixtral-8x7B-Instruct-v0.1``, ``strong_field`` = ``gpt-4-1106-preview``. Field names are
    used verbatim (they contain dots and slashes). Rows lacking either outcome are skipped.
    """
    for i, row in enumerate(rows):
        weak, strong, text = row.get(weak_field), row.get(strong_field), row.get(text_field)
        if weak is None or strong is None or text is None:
            continue
        rid = row.get(id_field) if id_field else None
        group = row.get(group_field) if group_field else None
        yield LabelledItem(
            id=f"{id_prefix}{rid if rid is not None else i}",
            text=str(text),
            label=int((not bool(weak)) and bool(strong)),
            source=source,
            group=str(group) if group is not None else "",
            short_correct=bool(weak),
            long_correct=bool(strong),
        )
