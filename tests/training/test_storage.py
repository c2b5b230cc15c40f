"""Rollout storage lifecycle: hot JSONL -> cold Parquet -> stats only, with the bytes of every transition."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from training.grpo.config import REPO_ROOT
from training.storage import Policy, RolloutStore, bytes_by_class


def rows(step: int, n: int = 64) -> list[dict]:
    return [
        {
            "problem_id": f"arith-{i // 8}",
            "completion": f"<think>step {step}: " + "3 + 4 = 7, then 7 * 2 = 14. " * 6 + "</think>14",
            "rewards": {"correctness": float(i % 2), "format": 1.0},
            "advantage": (i % 2) - 0.5,
            "prompt_tokens": 20,
            "completion_tokens": 40 + i,
            "truncated": i % 16 == 0,
        }
        for i in range(n)
    ]


def test_policy_transitions_with_bytes(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path, Policy(hot_steps=2, cold_after_steps=3, stats_only_after_steps=5))
    written: dict[int, int] = {}
    moves = []
    for step in range(1, 9):
        stats_before = (tmp_path / "rollouts" / "stats.jsonl").stat().st_size if step > 1 else 0
        written[step] = store.write(step, rows(step))
        hot = tmp_path / "rollouts" / f"step-{step:06d}.jsonl"
        # the bytes the ledger counts = the hot file + its statistics row
        assert (
            written[step] == hot.stat().st_size + (tmp_path / "rollouts" / "stats.jsonl").stat().st_size - stats_before
        )
        moves += store.apply(step)
    # at step 8: age 0-2 hot (8, 7, 6), 3-4 cold (5, 4), >= 5 stats only (3, 2, 1)
    assert store.steps() == {8: "hot", 7: "hot", 6: "hot", 5: "cold", 4: "cold"}
    by_step = {(s, a, b): (b0, b1) for s, a, b, b0, b1 in moves}
    assert {k[:3] for k in by_step} >= {(1, "hot", "cold"), (1, "cold", "stats_only"), (5, "hot", "cold")}
    for (_, a, b), (b0, b1) in by_step.items():
        if b == "cold":  # compressed Parquet is smaller than the JSONL it replaces
            assert a == "hot" and 0 < b1 < b0 / 3
        else:
            assert b1 == 0  # stats only: the raw file is gone
    sizes = bytes_by_class(tmp_path)
    d = tmp_path / "rollouts"
    assert sizes["hot"] == sum((d / f"step-{s:06d}.jsonl").stat().st_size for s in (6, 7, 8))
    assert sizes["cold"] == sum((d / f"step-{s:06d}.parquet").stat().st_size for s in (4, 5))
    assert sizes["stats_only"] == (d / "stats.jsonl").stat().st_size
    # every step keeps its statistics, raw or not
    stats = [json.loads(x) for x in (d / "stats.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stats] == list(range(1, 9))
    assert stats[0]["rollouts"] == 64 and stats[0]["truncated_rate"] == 4 / 64
    assert stats[0]["reward_mean"] == {"correctness": 0.5, "format": 1.0}
    # cold rows read back equal to what was written; stats-only steps have no rows
    back = store.read(4)
    assert [{k: v for k, v in r.items() if k != "step"} for r in back] == rows(4)
    assert store.read(2) == []
    # applying again at the same step moves nothing; a later step moves the next ones on
    assert store.apply(8) == []
    assert [(s, b) for s, _, b, _, _ in store.apply(9)] == [(4, "stats_only"), (6, "cold")]


def test_resume_drops_the_abandoned_steps(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path, Policy(hot_steps=10))
    for step in range(1, 6):
        store.write(step, rows(step, 4))
    assert store.drop_after(3) == 2
    assert sorted(store.steps()) == [1, 2, 3]
    stats = (tmp_path / "rollouts" / "stats.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in stats] == [1, 2, 3]


@pytest.mark.parametrize(
    ("policy", "msg"),
    [((-1, None, None), "hot_steps"), ((5, 2, None), "cold_after_steps"), ((2, 4, 3), "stats_only_after_steps")],
)
def test_invalid_policies_are_refused(policy: tuple, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        Policy(*policy)


def test_storage_cli_shows_and_applies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "model.safetensors").write_bytes(b"x" * 1000)
    (run / "config.yaml").write_text("storage: {hot_steps: 1, stats_only_after_steps: 3}\n")
    store = RolloutStore(run)
    for step in range(1, 5):
        store.write(step, rows(step, 16))
    cmd = [sys.executable, "-m", "gateway", "train", "storage", str(run)]
    shown = subprocess.run(cmd, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert sorted(RolloutStore(run).steps()) == [1, 2, 3, 4]  # without --apply nothing moves
    applied = subprocess.run([*cmd, "--apply"], cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=120)
    assert applied.returncode == 0, applied.stderr
    assert RolloutStore(run).steps() == {4: "hot", 3: "cold", 2: "cold"}
    assert "step 1: hot -> stats_only" in applied.stdout
    assert bytes_by_class(run)["kept"] == 1000 + (run / "config.yaml").stat().st_size  # models/config untouched
    other = bytes_by_class(run)["other"]
    (run / "plan.probe").mkdir()  # the planner's probe inside the run directory is a run of its own
    (run / "plan.probe" / "ledger.jsonl").write_text("{}\n" * 1000)
    assert bytes_by_class(run)["other"] == other
