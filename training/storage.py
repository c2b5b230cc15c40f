"""Rollout storage and its lifecycle: every step's rollouts in the run directory, hot, then cold, then statistics.

Layout under ``<run>/rollouts/``:

- ``step-000012.jsonl`` — hot: one JSON object per rollout ``{"step", "problem_id", "completion", "rewards":
  {name: value}, "advantage", "prompt_tokens", "completion_tokens", "truncated"}`` (``truncated``: the completion
  hit the length cap without an end-of-sequence token);
- ``step-000012.parquet`` — cold: the same rows, a zstd-compressed Parquet file (pyarrow, the ``report`` extra);
- ``stats.jsonl`` — one aggregate row per step, written with the hot file and kept forever: ``{"step", "rollouts",
  "mean_completion_tokens", "max_completion_tokens", "truncated_rate", "mean_abs_advantage",
  "reward_mean": {name: mean}}``; in the stats-only class nothing else of the step is left.

Policy (``storage:`` in the run file; ``age = current step - step``): hot while ``age < cold_after_steps``, cold
while ``age < stats_only_after_steps``, then stats only (None = never). The run applies it after writing each
step; ``thinkgate train storage RUN_DIR --apply`` applies it to a finished run. What the policy never touches: the
final model (``model/``), the best model (``best/``), ``config.yaml``, ``summary.json``, the ledger, the logs and
the per-step statistics (``stats.jsonl``).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLLOUT_DIR = "rollouts"
STATS_FILE = "stats.jsonl"
_STEP_FILE = re.compile(r"^step-(\d{6,})\.(jsonl|parquet)$")
CLASSES = ("hot", "cold", "stats_only", "kept", "checkpoints", "other")
KEPT = ("model", "best", "config.yaml", "summary.json", "ledger.jsonl", "ledger.parquet", "ledger_discarded.jsonl")


@dataclass
class Policy:
    """Lifecycle thresholds in optimizer steps (see the module docstring); ``None`` = that transition never."""

    hot_steps: int = 20
    cold_after_steps: int | None = None  # None: = hot_steps
    stats_only_after_steps: int | None = None

    def __post_init__(self) -> None:
        if self.hot_steps < 0:
            raise ValueError("storage.hot_steps: must be >= 0")
        cold = self.cold_after
        if cold is not None and cold < self.hot_steps:
            raise ValueError("storage.cold_after_steps: must be >= hot_steps (the hot window is kept)")
        so = self.stats_only_after_steps
        if so is not None and so < (cold if cold is not None else self.hot_steps):
            raise ValueError("storage.stats_only_after_steps: must be >= cold_after_steps")

    @property
    def cold_after(self) -> int | None:
        return self.hot_steps if self.cold_after_steps is None else self.cold_after_steps

    def target(self, step: int, current: int) -> str:
        """``hot`` / ``cold`` / ``stats_only`` for the rollouts of ``step`` when the run stands at ``current``."""
        age = current - step
        if self.stats_only_after_steps is not None and age >= self.stats_only_after_steps:
            return "stats_only"
        cold = self.cold_after
        if cold is not None and age >= cold:
            return "cold"
        return "hot"


def _hot(d: Path, step: int) -> Path:
    return d / f"step-{step:06d}.jsonl"


def _cold(d: Path, step: int) -> Path:
    return d / f"step-{step:06d}.parquet"


def _stats(step: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    lens = [int(r["completion_tokens"]) for r in rows]
    names = sorted({k for r in rows for k in r["rewards"]})
    means = {}
    for k in names:
        vals = [float(r["rewards"][k]) for r in rows if r["rewards"].get(k) is not None]
        means[k] = sum(vals) / len(vals) if vals else None
    return {
        "step": step,
        "rollouts": n,
        "mean_completion_tokens": sum(lens) / n if n else 0.0,
        "max_completion_tokens": max(lens, default=0),
        "truncated_rate": sum(1 for r in rows if r["truncated"]) / n if n else 0.0,
        "mean_abs_advantage": sum(abs(float(r["advantage"])) for r in rows) / n if n else 0.0,
        "reward_mean": means,
    }


class RolloutStore:
    """Writes rollouts per step and applies a :class:`Policy`; ``write`` returns the bytes it stored."""

    def __init__(self, run_dir: str | Path, policy: Policy | None = None) -> None:
        self.dir = Path(run_dir) / ROLLOUT_DIR
        self.policy = policy or Policy()

    def write(self, step: int, rows: list[dict[str, Any]]) -> int:
        """Append ``rows`` (the module docstring's shape, without ``step``) to the hot file of ``step`` and its
        statistics row; returns the bytes written (what the ledger's ``stored_bytes`` counts)."""
        if not rows:
            return 0
        self.dir.mkdir(parents=True, exist_ok=True)
        data = "".join(json.dumps({"step": step, **r}) + "\n" for r in rows).encode()
        stats = (json.dumps(_stats(step, rows)) + "\n").encode()
        with _hot(self.dir, step).open("ab") as f:
            f.write(data)
        with (self.dir / STATS_FILE).open("ab") as f:
            f.write(stats)
        return len(data) + len(stats)

    def steps(self) -> dict[int, str]:
        """``{step: "hot" | "cold"}`` of the raw files present (stats-only steps have none)."""
        out: dict[int, str] = {}
        if self.dir.is_dir():
            for p in self.dir.iterdir():
                m = _STEP_FILE.match(p.name)
                if m:
                    out[int(m.group(1))] = "hot" if m.group(2) == "jsonl" else "cold"
        return out

    def apply(self, current: int) -> list[tuple[int, str, str, int, int]]:
        """Move every step to its policy class at ``current``: ``[(step, from, to, bytes before, bytes after)]``.
        Transitions only go forward (hot -> cold -> stats_only); a cold file is never made hot again."""
        order = {"hot": 0, "cold": 1, "stats_only": 2}
        done = []
        for step, now in sorted(self.steps().items()):
            want = self.policy.target(step, current)
            if order[want] <= order[now]:
                continue
            src = _hot(self.dir, step) if now == "hot" else _cold(self.dir, step)
            before = src.stat().st_size
            after = 0
            if want == "cold":
                after = _to_parquet(src, _cold(self.dir, step))
            src.unlink()
            done.append((step, now, want, before, after))
        return done

    def drop_after(self, step: int) -> int:
        """Resume from the checkpoint of ``step``: delete the rollouts and statistics of later steps (the abandoned
        segment re-runs them); returns the step files removed."""
        removed = 0
        for s, cls in self.steps().items():
            if s > step:
                (_hot(self.dir, s) if cls == "hot" else _cold(self.dir, s)).unlink()
                removed += 1
        stats = self.dir / STATS_FILE
        if stats.is_file():
            keep = [x for x in stats.read_text().splitlines() if x.strip() and json.loads(x)["step"] <= step]
            stats.write_text("".join(x + "\n" for x in keep))
        return removed

    def read(self, step: int) -> list[dict[str, Any]]:
        """The rollouts of ``step`` from its hot or cold file ([] when stats-only)."""
        hot, cold = _hot(self.dir, step), _cold(self.dir, step)
        if hot.is_file():
            return [json.loads(x) for x in hot.read_text().splitlines() if x.strip()]
        if cold.is_file():
            import pyarrow.parquet as pq

            rows: list[dict[str, Any]] = pq.read_table(cold).to_pylist()
            for r in rows:
                r["rewards"] = json.loads(r["rewards"])
            return rows
        return []


def _to_parquet(src: Path, dst: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(x) for x in src.read_text().splitlines() if x.strip()]
    for r in rows:  # reward names differ between runs: one JSON column keeps the schema fixed
        r["rewards"] = json.dumps(r["rewards"])
    tmp = dst.with_suffix(".parquet.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp, compression="zstd")
    tmp.replace(dst)
    return dst.stat().st_size


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0


def bytes_by_class(run_dir: str | Path) -> dict[str, int]:
    """Bytes on disk per class: ``hot``, ``cold``, ``stats_only`` (the statistics file), ``kept`` (models, config,
    summary, ledger), ``checkpoints`` and ``other`` (logs, plots, evaluations); nested run directories are skipped."""
    d = Path(run_dir)
    out = dict.fromkeys(CLASSES, 0)
    store = RolloutStore(d)
    for step, cls in store.steps().items():
        out[cls] += (_hot(store.dir, step) if cls == "hot" else _cold(store.dir, step)).stat().st_size
    out["stats_only"] = _size(store.dir / STATS_FILE)
    for p in d.iterdir() if d.is_dir() else []:
        if p.name == ROLLOUT_DIR or (p.is_dir() and (p / "ledger.jsonl").is_file()):
            continue  # a nested run (e.g. the planner's probe in <run>/plan.probe) is a run of its own
        if p.name in KEPT:
            out["kept"] += _size(p)
        elif p.name.startswith("checkpoint-"):
            out["checkpoints"] += _size(p)
        else:
            out["other"] += _size(p)
    return out


def attach(trainer: Any, store: RolloutStore, counters: Any, is_main: bool = True) -> None:
    """Record every training generation of a ``ThinkGateGRPOTrainer`` into ``store`` (main process only; the bytes
    go to ``counters.stored_bytes``) and apply the policy. Wraps the trainer's ``_generate_and_score_completions``
    on this instance: the rollouts, rewards per function and final advantages are read from its output."""
    inner = trainer._generate_and_score_completions
    tok = trainer.processing_class
    eos = getattr(tok, "eos_token_id", None)
    max_len = int(trainer.args.max_completion_length)

    def generate_and_score(inputs: list[dict[str, Any]]) -> dict[str, Any]:
        out = inner(inputs)
        if is_main and trainer.model.training:
            t0 = time.perf_counter()
            step = int(trainer.state.global_step) + 1
            counters.stored_bytes += store.write(step, _rows(trainer, inputs, out, tok, eos, max_len))
            store.apply(step)
            counters.io_s += time.perf_counter() - t0  # billed as io, not as sampling
        return out

    trainer._generate_and_score_completions = generate_and_score


def _rows(trainer: Any, inputs: list[dict[str, Any]], out: dict[str, Any], tok: Any, eos: Any, max_len: int) -> list:
    ids = out["completion_ids"].tolist()
    mask = out["completion_mask"].tolist()
    prompt_len = out["prompt_mask"].sum(dim=1).tolist()
    adv = out["advantages"].tolist()
    n = len(ids)
    pids = getattr(trainer, "last_batch_problem_ids", None) if trainer.dynamic_sampler is not None else None
    rewards = trainer.last_batch_rewards if trainer.dynamic_sampler is not None else trainer._last_rewards
    if pids is None or len(pids) != n:
        pids = [str(r.get("problem_id", "")) for r in inputs[:n]]
    rewards = rewards[:n] if rewards is not None and len(rewards) >= n else None  # rank 0 rows come first
    names = list(trainer.reward_func_names)
    rows = []
    for i in range(n):
        length = int(sum(mask[i]))
        comp = ids[i][:length]
        rows.append(
            {
                "problem_id": pids[i],
                "completion": tok.decode(comp, skip_special_tokens=False),
                "rewards": {}
                if rewards is None
                else {k: (None if v != v else float(v)) for k, v in zip(names, rewards[i].tolist(), strict=False)},
                "advantage": float(adv[i]),
                "prompt_tokens": int(prompt_len[i]),
                "completion_tokens": length,
                "truncated": length >= max_len and (eos is None or eos not in comp),
            }
        )
    return rows
