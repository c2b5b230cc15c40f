"""Run registry: every run directory under a root, with status, bill, accuracy, tokens and tags; cost by tag.

A run directory is one with a ``ledger.jsonl`` (GRPO, SFT and dial-sft runs alike). Its record:

- ``status``: ``finished`` (``summary.json`` without a stop reason), ``stopped`` (``summary.json`` with one: a
  budget, a monitor, no learning signal), ``running`` (no summary, heartbeat younger than ``stale_s``),
  ``abandoned`` (no summary and the heartbeat — or, without one, the ledger — older than ``stale_s``: the process
  died or was killed; a zombie that still holds its budget line), ``interrupted`` (stopped by SIGINT / Ctrl-C:
  the heartbeat's ``state``, :func:`mark_interrupted`; resume it with ``--resume auto``), ``failed`` (ended by an
  error — a crash, a configuration error found after start-up: the heartbeat's ``state`` and ``error``,
  :func:`mark_failed`; ``stop_reason`` is that error; ``--resume auto`` goes on from its last checkpoint, or from
  step 0 without one);
- ``micro_usd`` / ``device_hours`` / tokens: sums of the ledger's rows, discarded (rolled-back) rows included — that
  money was spent;
- ``heldout_accuracy``: ``summary.json``'s accuracy after training, else the last periodic check;
- ``tags``: the ledger rows' tags (the run file's free-form ``tags:`` plus the automatic ``run_name``,
  ``data_hash``, ``reward_hash``, ``hparam_hash``, ``git_commit``).

The heartbeat is ``<run>/heartbeat.json`` ``{"ts", "step", "pid", "host"}``, rewritten by the run at start, after
every optimizer step and at the end (:func:`write_heartbeat`, :func:`heartbeat_callback`).
"""

from __future__ import annotations

import csv
import json
import os
import socket
import time
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from router.jsonl import read_jsonl

HEARTBEAT_FILE = "heartbeat.json"
STALE_S = 600.0
AUTO_TAGS = ("run_name", "data_hash", "reward_hash", "hparam_hash", "git_commit")
_ROW_KEYS = {
    "step", "kind", "seq", "segment", "ts", "prompts", "rollouts", "prompt_tokens", "sampled_tokens",
    "trained_tokens", "dropped_rollouts", "zero_signal_rollouts", "wall_ms", "device_kind", "device_count",
    "device_ms", "price_usd_per_device_hour", "cost_micro_usd", "zero_signal_micro_usd", "spent_micro_usd",
    "stored_bytes", "discarded_at_resume_from_step",
}  # fmt: skip


def write_heartbeat(run_dir: str | Path, step: int) -> None:
    """Rewrite ``<run_dir>/heartbeat.json`` (atomically: a reader never sees half a file)."""
    _write_beat(Path(run_dir) / HEARTBEAT_FILE,
                {"ts": round(time.time(), 3), "step": step, "pid": os.getpid(), "host": socket.gethostname()})


def _write_beat(path: Path, beat: dict[str, Any]) -> None:
    # a temporary file of this process's own, then one rename: atomic, and two writers never share a temp file
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(beat))
    tmp.replace(path)


def mark_interrupted(run_dir: str | Path) -> int | None:
    """Mark the run in ``run_dir`` as stopped by an interrupt (SIGINT) — its heartbeat's ``state`` — so the registry
    says ``interrupted`` rather than ``running`` for ``stale_s``; a resumed run's next heartbeat clears it. Only a
    heartbeat this process wrote is marked (a Ctrl-C before the run directory was prepared must not mark another
    run's), and only by the main process (every rank of a launch gets the SIGINT). Returns the step the heartbeat
    recorded, None when nothing was marked. Never raises."""
    return _mark(run_dir, state="interrupted")


def mark_failed(run_dir: str | Path, error: str) -> int | None:
    """Mark the run in ``run_dir`` as ended by an error — its heartbeat's ``state: failed`` and ``error`` (the
    message) — so the registry says ``failed`` with the error rather than ``running`` for ``stale_s`` and then
    ``abandoned``; a resumed run's next heartbeat clears it. Only a heartbeat this process wrote, and only by the
    main process (as :func:`mark_interrupted`). Returns the step the heartbeat recorded, None when nothing was
    marked. Never raises."""
    return _mark(run_dir, state="failed", error=error)


def _mark(run_dir: str | Path, **fields: str) -> int | None:
    if os.environ.get("RANK", "0") != "0":
        return None
    path = Path(run_dir) / HEARTBEAT_FILE
    try:
        beat = json.loads(path.read_text())
        if beat.get("pid") != os.getpid():
            return None
        beat.update(fields, ts=round(time.time(), 3))
        _write_beat(path, beat)
    except (OSError, ValueError):
        return None
    return int(beat.get("step", 0))


def heartbeat_callback(run_dir: str | Path) -> Any:
    """A ``transformers.TrainerCallback`` that writes the heartbeat after every optimizer step (main process)."""
    from transformers import TrainerCallback

    class HeartbeatCallback(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.is_world_process_zero:
                write_heartbeat(run_dir, state.global_step)

    return HeartbeatCallback()


@dataclass
class RunRecord:
    """One run directory's registry entry (see the module docstring)."""

    run_dir: str
    status: str
    micro_usd: int
    device_hours: float
    steps: int
    sampled_tokens: int
    trained_tokens: int
    heldout_accuracy: float | None
    last_seen: float | None
    stop_reason: str | None = None
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def usd(self) -> Decimal:
        return Decimal(self.micro_usd) / Decimal(1_000_000)


def _rows(path: Path) -> list[dict[str, Any]]:
    return list(read_jsonl(path, missing_ok=True, skip_invalid=True))  # a run killed mid-write leaves half a line


def load_run(run_dir: str | Path, now: float | None = None, stale_s: float = STALE_S) -> RunRecord:
    """The :class:`RunRecord` of one run directory."""
    d = Path(run_dir)
    now = time.time() if now is None else now
    rows = _rows(d / "ledger.jsonl")
    # a row in both files (a resume killed between moving it and rewriting ledger.jsonl) was spent once
    on_path = {r["seq"] for r in rows if "seq" in r}
    all_rows = rows + [r for r in _rows(d / "ledger_discarded.jsonl") if r.get("seq") not in on_path]
    tags: dict[str, str] = {}
    for r in rows:
        tags.update({k: str(v) for k, v in r.items() if k not in _ROW_KEYS and not k.startswith("cum_")
                     and not k.endswith("_ms")})  # fmt: skip
    summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else None
    hb_path = d / HEARTBEAT_FILE
    last_seen: float | None = None
    state: str | None = None
    error: str | None = None
    if hb_path.is_file():
        try:
            beat = json.loads(hb_path.read_text())
            last_seen = float(beat["ts"])
            state, error = beat.get("state"), beat.get("error")
        except (json.JSONDecodeError, KeyError, ValueError):
            last_seen = hb_path.stat().st_mtime
    elif (d / "ledger.jsonl").is_file():
        last_seen = (d / "ledger.jsonl").stat().st_mtime
    stop_reason = summary.get("stop_reason") if summary else None
    if state == "failed":  # before the summary: one there is a finished segment's that a resume then failed past
        status, stop_reason = "failed", str(error or "failed")
    elif summary is not None:
        status = "stopped" if stop_reason else "finished"
    elif state == "interrupted":
        status = "interrupted"
    elif last_seen is not None and now - last_seen <= stale_s:
        status = "running"
    else:
        status = "abandoned"
    acc = summary.get("accuracy_after") if summary else None
    if acc is None:
        heldout = _rows(d / "heldout.jsonl")
        acc = heldout[-1].get("accuracy") if heldout else None
    return RunRecord(
        run_dir=str(d),
        status=status,
        micro_usd=sum(int(r.get("cost_micro_usd", 0)) for r in all_rows),
        device_hours=sum(int(r.get("device_ms", 0)) for r in all_rows) / 3.6e6,
        # a row without `kind` predates the column, when every row was a step (models/thinkgate-tiny-short's ledger)
        steps=max((int(r["step"]) for r in rows if r.get("kind", "step") == "step"), default=0),
        sampled_tokens=sum(int(r.get("sampled_tokens", 0)) for r in all_rows),
        trained_tokens=sum(int(r.get("trained_tokens", 0)) for r in all_rows),
        heldout_accuracy=None if acc is None else float(acc),
        last_seen=last_seen,
        stop_reason=stop_reason,
        tags=tags,
    )


def find_runs(root: str | Path) -> list[Path]:
    """Run directories (holding ``ledger.jsonl``) under ``root`` (itself included), sorted; checkpoints skipped."""
    r = Path(root)
    found = {p.parent for p in r.rglob("ledger.jsonl") if not p.parent.name.startswith("checkpoint-")}
    return sorted(found)


def parse_tag_filters(items: list[str]) -> dict[str, str]:
    """``["owner=ana", "team=rl"]`` -> ``{"owner": "ana", "team": "rl"}``; raises ``ValueError`` without ``=``."""
    out: dict[str, str] = {}
    for it in items:
        if "=" not in it:
            raise ValueError(f"--tag {it!r}: expected KEY=VALUE")
        k, v = it.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def list_runs(
    root: str | Path, tags: dict[str, str] | None = None, now: float | None = None, stale_s: float = STALE_S
) -> list[RunRecord]:
    """Every run under ``root`` whose tags include all of ``tags``."""
    want = tags or {}
    recs = [load_run(d, now, stale_s) for d in find_runs(root)]
    return [r for r in recs if all(r.tags.get(k) == v for k, v in want.items())]


def attribute(records: list[RunRecord], key: str) -> dict[str, dict[str, Any]]:
    """Cost by the value of tag ``key`` (runs without it under ``"(none)"``): ``{value: {"runs", "micro_usd",
    "device_hours"}}``. The micro-USD are integer sums, so they add up exactly to the runs' ledger totals."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        v = r.tags.get(key, "(none)")
        e = out.setdefault(v, {"runs": 0, "micro_usd": 0, "device_hours": 0.0})
        e["runs"] += 1
        e["micro_usd"] += r.micro_usd
        e["device_hours"] += r.device_hours
    return dict(sorted(out.items()))


CSV_COLUMNS = (
    "run_dir", "status", "usd", "micro_usd", "device_hours", "steps", "heldout_accuracy", "sampled_tokens",
    "trained_tokens", "stop_reason", "tags",
)  # fmt: skip


def write_csv(records: list[RunRecord], path: str | Path) -> None:
    """One line per run (:data:`CSV_COLUMNS`; ``tags`` as ``k=v;k=v``, ``usd`` as an exact decimal string)."""
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in records:
            w.writerow(
                [
                    r.run_dir, r.status, str(r.usd), r.micro_usd, f"{r.device_hours:.6f}", r.steps,
                    "" if r.heldout_accuracy is None else f"{r.heldout_accuracy:.4f}", r.sampled_tokens,
                    r.trained_tokens, r.stop_reason or "", ";".join(f"{k}={v}" for k, v in sorted(r.tags.items())),
                ]
            )  # fmt: skip
