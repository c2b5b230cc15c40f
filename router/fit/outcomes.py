"""Label source 3: outcomes measured through a running ThinkGate (or any OpenAI-compatible) server.

For each input row ``{"id", "question", "answer", ["system"], ["task"], ["group"], ["difficulty"]}`` and each
tier in ``tiers`` (cheapest first), send ``POST {base}/chat/completions`` with ``model = <tier name>`` (a
forced route in ThinkGate), check the answer with a verifier (:mod:`router.tasks.verifiers`) and record, per tier,
correctness and tokens. The output row is a :class:`router.fit.labels.LabelledItem`::

    label = (first tier wrong) and (last tier right)           # RouteLLM's outcome pair
    short_correct / long_correct = first / last tier correct
    meta.tiers[<tier>] = {"correct", "prompt_tokens", "completion_tokens", "reasoning_tokens", "latency_ms"}

Resumable: ids already in the output file are skipped and new rows are appended (one flushed line per
item), so an interrupted run continues where it stopped. An item whose call fails on any tier (after the
client's retries) is not written and is retried by the next run. The calls go through
:class:`router.probe.ProbeClient` (server: ``THINKGATE_URL``, with or without ``/v1``, and ``THINKGATE_API_KEY``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.errors import require
from router.fit.jsonl import open_text, read_jsonl
from router.fit.labels import LabelledItem
from router.probe import ProbeClient, ProbeError
from router.tasks.verifiers import Verifier
from router.window import routing_window


@dataclass
class TierOutcome:
    """One tier's answer to one item. Tokens are the server's ``usage`` counts (None when absent)."""

    correct: bool
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None
    latency_ms: float


@dataclass
class LabelStats:
    """Counts of a labelling run."""

    total: int = 0
    skipped_existing: int = 0
    written: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


def _messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = []
    if row.get("system"):
        msgs.append({"role": "system", "content": str(row["system"])})
    msgs.append({"role": "user", "content": str(row["question"])})
    return msgs


def existing_ids(path: Path) -> set[str]:
    """Ids already written to ``path`` (empty when missing). A torn last line (crash mid-write) is ignored."""
    if not path.exists():
        return set()
    ids = set()
    with open_text(path) as f:
        for line in f:
            try:
                ids.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return ids


def label_row(
    row: dict[str, Any], tiers: Sequence[str], client: ProbeClient, verifier: Verifier, source: str
) -> LabelledItem:
    """Run one input row through every tier and build its labelled item. Raises ProbeError."""
    messages = _messages(row)
    outcomes: dict[str, TierOutcome] = {}
    for tier in tiers:
        answer = client.chat(tier, messages)
        # verifiers read the answer after the thought, as the model wrote it
        text = f"{answer.reasoning}</think>{answer.content}" if answer.reasoning else answer.content
        usage, ms = answer.usage, answer.latency_ms
        details = usage.get("completion_tokens_details") or {}
        outcomes[tier] = TierOutcome(
            correct=bool(verifier(row, text)),
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            reasoning_tokens=details.get("reasoning_tokens") if isinstance(details, dict) else None,
            latency_ms=round(ms, 1),
        )
    short, long_ = outcomes[tiers[0]], outcomes[tiers[-1]]
    meta: dict[str, Any] = {"tiers": {t: o.__dict__ for t, o in outcomes.items()}}
    if row.get("difficulty") is not None:
        meta["difficulty"] = row["difficulty"]
    return LabelledItem(
        id=str(row["id"]),
        text=routing_window(messages),
        label=int((not short.correct) and long_.correct),
        source=source,
        group=str(row.get("group") or row.get("task") or ""),
        short_correct=short.correct,
        long_correct=long_.correct,
        meta=meta,
    )


def label_via_gateway(
    in_path: str | Path,
    out_path: str | Path,
    tiers: Sequence[str],
    verifier: Verifier,
    *,
    client: ProbeClient | None = None,
    concurrency: int = 4,
    limit: int | None = None,
    source: str = "gateway",
    progress: bool = True,
    on_item: Callable[[LabelledItem], None] | None = None,
) -> LabelStats:
    """Label every row of ``in_path`` not yet in ``out_path`` (see the module docstring).

    ``tiers``: at least two tier names, cheapest first. ``concurrency``: parallel items (each item's tiers
    run in sequence). ``limit``: stop after this many new items. Returns :class:`LabelStats`.
    """
    if len(tiers) < 2:
        raise ValueError("need at least two tiers (cheapest first)")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = existing_ids(out)
    stats = LabelStats()
    todo = []
    for row in read_jsonl(in_path):
        for key in ("id", "question", "answer"):
            if key not in row:
                raise ValueError(f"{in_path}: row lacks {key!r}: {str(row)[:120]}")
        stats.total += 1
        if str(row["id"]) in done:
            stats.skipped_existing += 1
            continue
        todo.append(row)
    if limit is not None:
        todo = todo[:limit]
    own_client = client is None
    client = client or ProbeClient.from_env(require_key=False)
    lock = threading.Lock()
    tqdm = require("tqdm", "eval", "labelling through a gateway").tqdm
    bar = tqdm(total=len(todo), desc="labelling", unit="item", disable=not progress)
    try:
        with open(out, "a", encoding="utf-8") as f, ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            futures = {pool.submit(label_row, row, tiers, client, verifier, source): row for row in todo}
            for fut in as_completed(futures):
                row = futures[fut]
                try:
                    item = fut.result()
                except (ProbeError, ValueError, KeyError) as exc:
                    with lock:
                        stats.failed += 1
                        stats.errors.append(f"{row['id']}: {type(exc).__name__}: {exc}")
                    bar.update(1)
                    continue
                with lock:
                    f.write(json.dumps(item.to_dict(), ensure_ascii=False, sort_keys=True) + "\n")
                    f.flush()
                    stats.written += 1
                if on_item is not None:
                    on_item(item)
                bar.update(1)
    finally:
        bar.close()
        if own_client:
            client.close()
    return stats
