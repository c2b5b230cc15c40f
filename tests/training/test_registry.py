"""The run registry: statuses (an abandoned run among them) and cost by tag summing exactly to the ledgers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

from training.grpo.config import REPO_ROOT
from training.grpo.ledger import CostLedger, StepCounters
from training.registry import attribute, list_runs, load_run, mark_failed, mark_interrupted, write_heartbeat

PRICE = Decimal("2.50")


def make_run(root: Path, name: str, tags: dict[str, str], steps: int, wall_s: float) -> Path:
    d = root / name
    led = CostLedger(d, "cpu", 1, PRICE, tags={"run_name": name, **tags})
    led.record_overhead("startup", 0, {"startup": 1.234567, "eval": 0.3})
    for s in range(1, steps + 1):
        led.record(s, StepCounters(rollouts=8, sampled_tokens=100 + s, trained_tokens=50, generation_s=0.1), wall_s)
    return d


def finish(d: Path, stop_reason: str | None = None, accuracy: float = 0.5) -> None:
    (d / "summary.json").write_text(json.dumps({"stop_reason": stop_reason, "accuracy_after": accuracy}))
    write_heartbeat(d, 1)


def ledger_micro_usd(d: Path) -> int:
    total = 0
    for name in ("ledger.jsonl", "ledger_discarded.jsonl"):
        p = d / name
        if p.is_file():
            total += sum(json.loads(x)["cost_micro_usd"] for x in p.read_text().splitlines() if x.strip())
    return total


def test_statuses_include_an_abandoned_run(tmp_path: Path) -> None:
    done = make_run(tmp_path, "done", {"owner": "ana"}, 2, 0.7)
    finish(done)
    stopped = make_run(tmp_path, "stopped", {"owner": "ana"}, 1, 0.7)
    finish(stopped, "budget usd reached")
    live = make_run(tmp_path, "live", {"owner": "bo"}, 1, 0.7)
    write_heartbeat(live, 1)
    zombie = make_run(tmp_path, "zombie", {"owner": "bo"}, 3, 0.7)
    write_heartbeat(zombie, 3)
    hb = json.loads((zombie / "heartbeat.json").read_text())
    hb["ts"] -= 3600  # its process died an hour ago
    (zombie / "heartbeat.json").write_text(json.dumps(hb))
    recs = {Path(r.run_dir).name: r for r in list_runs(tmp_path)}
    assert {k: r.status for k, r in recs.items()} == {
        "done": "finished", "stopped": "stopped", "live": "running", "zombie": "abandoned"
    }  # fmt: skip
    assert recs["zombie"].steps == 3 and recs["zombie"].micro_usd == ledger_micro_usd(zombie)
    assert recs["done"].heldout_accuracy == 0.5 and recs["done"].tags["owner"] == "ana"
    # "running" only while the heartbeat is fresh: an hour later the live run counts as abandoned too
    assert load_run(live, now=time.time() + 3600).status == "abandoned"
    # interrupted (SIGINT): said so, not "running"; its resume's first heartbeat makes it running again
    assert mark_interrupted(live) == 1 and load_run(live).status == "interrupted"
    write_heartbeat(live, 2)
    assert load_run(live).status == "running"
    assert mark_interrupted(tmp_path / "no-such-run") is None
    # another process's heartbeat (a Ctrl-C before this run's directory was prepared) is left alone
    beat = json.loads((live / "heartbeat.json").read_text())
    (live / "heartbeat.json").write_text(json.dumps({**beat, "pid": beat["pid"] + 1}))
    assert mark_interrupted(live) is None and load_run(live).status == "running"
    # failed (an error): said so with the error, not "running" and then "abandoned"; its resume clears it
    write_heartbeat(live, 2)
    assert mark_failed(live, "OSError: [Errno 28] No space left on device") == 2
    rec = load_run(live, now=time.time() + 3600)
    assert (rec.status, rec.stop_reason) == ("failed", "OSError: [Errno 28] No space left on device")
    write_heartbeat(live, 2)
    assert load_run(live).status == "running"
    # a tag filter keeps only the matching runs
    assert sorted(Path(r.run_dir).name for r in list_runs(tmp_path, {"owner": "bo"})) == ["live", "zombie"]


def test_tag_attribution_sums_to_the_ledgers_exactly(tmp_path: Path) -> None:
    # odd wall times so that every row's micro-USD is rounded (half even) on its own
    dirs = [
        make_run(tmp_path, "a", {"team": "rl", "purpose": "sweep"}, 3, 0.333333),
        make_run(tmp_path, "b", {"team": "rl", "purpose": "probe"}, 1, 1.777777),
        make_run(tmp_path, "c", {"team": "eval"}, 2, 2.123457),
        make_run(tmp_path, "d", {}, 1, 0.5),
    ]
    # run a was resumed once: its rolled-back rows were paid for and count
    (dirs[0] / "ledger_discarded.jsonl").write_text(json.dumps({"cost_micro_usd": 777, "device_ms": 1118}) + "\n")
    recs = list_runs(tmp_path)
    by_team = attribute(recs, "team")
    assert by_team["rl"]["micro_usd"] == ledger_micro_usd(dirs[0]) + ledger_micro_usd(dirs[1])
    assert by_team["eval"]["micro_usd"] == ledger_micro_usd(dirs[2])
    assert by_team["(none)"]["micro_usd"] == ledger_micro_usd(dirs[3])
    assert sum(e["micro_usd"] for e in by_team.values()) == sum(ledger_micro_usd(d) for d in dirs)
    by_purpose = attribute(recs, "purpose")
    assert sum(e["micro_usd"] for e in by_purpose.values()) == sum(ledger_micro_usd(d) for d in dirs)
    assert by_purpose["probe"]["runs"] == 1


def test_runs_cli_lists_filters_and_writes_csv(tmp_path: Path) -> None:
    finish(make_run(tmp_path, "a", {"owner": "ana"}, 1, 0.5))
    make_run(tmp_path, "z", {"owner": "ana"}, 1, 0.5)  # no heartbeat, ledger written now: running
    csv_path = tmp_path / "runs.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "train", "runs", "--root", str(tmp_path), "--tag", "owner=ana",
         "--csv", str(csv_path), "--by", "owner"],
        cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "finished" in proc.stdout and "running" in proc.stdout and "cost by owner" in proc.stdout
    lines = csv_path.read_text().splitlines()
    assert lines[0].startswith("run_dir,status,usd,micro_usd") and len(lines) == 3
    bad = subprocess.run(
        [sys.executable, "-m", "gateway", "train", "runs", "--root", str(tmp_path), "--tag", "owner"],
        cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr


def test_the_shipped_short_models_ledger_counts_its_steps() -> None:
    """models/thinkgate-tiny-short's ledger predates the `kind` column: its 20 rows are its 20 steps."""
    d = REPO_ROOT / "models" / "thinkgate-tiny-short"
    rec = load_run(d)
    assert rec.steps == json.loads((d / "summary.json").read_text())["steps"] == 20
    assert rec.status == "finished"


def test_a_root_that_is_no_directory_is_an_error(tmp_path: Path) -> None:
    """A typo'd --root printed "0 run(s), $0" as if nothing had been spent there."""
    from typer.testing import CliRunner

    from gateway.cli.main import app

    r = CliRunner().invoke(app, ["train", "runs", "--root", str(tmp_path / "rnus")])
    assert r.exit_code == 2 and f"no directory {tmp_path / 'rnus'}" in r.output and "0 run(s)" not in r.output
    r = CliRunner().invoke(app, ["train", "runs", "--root", str(tmp_path)])  # an empty directory: no runs, no error
    assert r.exit_code == 0 and "0 run(s), $0" in r.output
