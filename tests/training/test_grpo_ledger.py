"""Cost ledger: exact arithmetic, budgets (warn, projected and reached stop), resume without double counting."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from training.grpo.ledger import Budgets, CostLedger, StepCounters, device_kind_from_name, micro_usd


def counters(**kw: float) -> StepCounters:
    base = dict(
        prompts=2,
        rollouts=8,
        prompt_tokens=100,
        sampled_tokens=240,
        trained_tokens=200,
        dropped_rollouts=4,
        generation_s=0.010,
        reward_s=0.002,
        eval_s=0.0,
    )
    base.update(kw)
    return StepCounters(**base)  # type: ignore[arg-type]


def test_micro_usd_exact_and_half_even() -> None:
    assert micro_usd(3_600_000, Decimal("0.05")) == 50_000  # one device-hour at $0.05
    assert micro_usd(1234, Decimal("3.50")) == 1200  # 1234 ms * 3.5 $/h = 1199.72 micro-USD
    # $0.0018/h = 0.0005 micro-USD per ms: 1000 ms -> 0.5 -> 0 (half even), 3000 ms -> 1.5 -> 2
    assert micro_usd(1000, Decimal("0.0018")) == 0
    assert micro_usd(3000, Decimal("0.0018")) == 2


def test_rows_and_cumulative_totals(tmp_path: Path) -> None:
    # $3.60 per device-hour = 1 micro-USD per device-ms; 2 devices
    led = CostLedger(tmp_path, "nvidia-h200", 2, Decimal("3.60"), tags={"data_hash": "d1", "git_commit": "abc"})
    r1 = led.record(1, counters(), 0.040)
    assert r1["wall_ms"] == 40 and r1["device_ms"] == 80 and r1["cost_micro_usd"] == 80
    assert (r1["sampling_ms"], r1["reward_ms"], r1["update_ms"]) == (10, 2, 28)  # update = wall - gen - reward
    assert r1["data_hash"] == "d1" and r1["git_commit"] == "abc"
    r2 = led.record(2, counters(sampled_tokens=60, generation_s=0.05), 0.030)
    assert r2["update_ms"] == 0  # clamped, never negative
    assert r2["cum_sampled_tokens"] == 300 and r2["cum_cost_micro_usd"] == 80 + 60 and r2["cum_device_ms"] == 140
    rows = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    with pytest.raises(ValueError, match="double counting"):
        led.record(2, counters(), 0.01)
    pq = led.write_parquet()
    import pyarrow.parquet as papq

    assert papq.read_table(pq).num_rows == 2
    s = led.summary(accuracy_before=0.20, accuracy_after=0.30)
    assert s["usd"] == "0.00014"
    assert s["accuracy_gain_pp"] == pytest.approx(10.0)
    assert s["usd_per_accuracy_point"] == "0.000014"  # $0.00014 / 10 points
    assert led.summary(0.3, 0.2)["usd_per_accuracy_point"] is None  # no gain, no ratio


def test_usd_budget_warns_then_stops_on_projection(tmp_path: Path) -> None:
    # $3.60/h = 1 micro-USD per device-ms; the finish is reserved at FINISH_FLOOR_MS = 2000 ms here
    led = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"), Budgets(usd=Decimal("0.0025")), warn_fraction=0.15)
    led.record(1, counters(), 0.200)  # 200 micro-USD of 2500
    c1 = led.check()
    assert c1.stop_reason is None and c1.warnings == []  # 200 + 200 next step + 2000 finish = 2400 <= 2500
    led.record(2, counters(), 0.200)  # 400 of 2500
    c2 = led.check()
    assert len(c2.warnings) == 1 and "16%" in c2.warnings[0]
    assert c2.stop_reason == (
        "budget usd: the next step is projected to exceed it ($0.000400 spent + $0.000200 per step + $0.002000 to "
        "finish > $0.002500)"
    )
    assert led.check().warnings == []  # warned once


def test_a_budget_stop_leaves_room_for_the_finish_row(tmp_path: Path) -> None:
    """The stop projected one step only; the finish row billed after it (checkpoint, model, plots) ended a *hard*
    budget 4.4% over (0.000522 of 0.0005, the smoke config). The projection now adds the costliest of the last 3
    steps and the finish; a resumed run reserves the finish it has seen."""
    from training.grpo.ledger import FINISH_FLOOR_MS

    budget = Decimal("0.006")  # 6000 micro-USD at 1 micro-USD per device-ms
    led = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"), Budgets(usd=budget))
    led.record_overhead("startup", 0, {"startup": 1.0})
    step = 0
    for wall in (0.9, 0.3, 0.3, 0.3, 0.3, 0.3):
        step += 1
        led.record(step, counters(), wall)
        if led.check().stop_reason:
            break
    # 1000 + 900 + 300 + 300 = 2500 after step 3: + 900 (step 1 is still among the last 3) + 2000 = 5400 <= 6000;
    # after step 4 (2800): + 300 + 2000 = 5100, after step 5 (3100): 5400, after step 6 (3400): 5700 - all go on
    assert step == 6 and led.stop_reason is None
    led.record(7, counters(), 0.3)  # 3700 + 300 + 2000 = 6000: not over
    assert led.check().stop_reason is None
    led.record(8, counters(), 0.3)  # 4000 + 300 + 2000 > 6000
    assert "to finish" in (led.check().stop_reason or "")
    led.record_overhead("finish", 8, {"io": FINISH_FLOOR_MS / 1000})
    assert led.spent()["cost_micro_usd"] <= budget * 1_000_000  # ends within the hard budget
    led.save_state(tmp_path / "checkpoint-8")

    again = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"), Budgets(usd=Decimal("0.1")))
    led.record_overhead("finish", 8, {"io": 3.0})  # a slower finish seen once: a resume reserves it
    again.resume(tmp_path / "checkpoint-8")
    assert again.finish_reserve_device_ms() == 3000 and again.next_step("cost_micro_usd") == 300
    slow = CostLedger(tmp_path / "s", "cpu", 2, Decimal("3.60"))
    slow.record_overhead("startup", 0, {"startup": 40.0, "eval": 9.0})  # a loaded box: the finish slows down too
    assert slow.finish_reserve_device_ms() == 2 * 5000  # 1/8 of the start-up phase, on each of 2 devices
    tokens = CostLedger(tmp_path / "t", "cpu", 1, Decimal("3.60"), Budgets(sampled_tokens=720))
    tokens.record(1, counters(), 0.1)  # 240 tokens + 240 next step <= 720: the finish samples none
    assert tokens.check().stop_reason is None


def test_the_finish_is_reserved_from_its_measured_parts(tmp_path: Path) -> None:
    """The finish was reserved at a guess (2 s, or 1/8 of start-up) and took 2.8 s on a loaded box: 6.8% over a hard
    budget. Now from what the run measured of it — two checkpoint saves (the last 3 saves' costliest) at 1.5x how
    much the same work varied lately, and the metric figures at the start-up figure's time at that spread — with
    the spread over the steps' own work (sampling, reward, update) and the saves, capped at 3."""
    from fractions import Fraction

    from training.grpo.ledger import FINISH_FLOOR_MS, METRIC_FIGURES

    led = CostLedger(tmp_path, "cpu", 2, Decimal("3.60"), Budgets(usd=Decimal("1")))
    led.record_overhead("startup", 0, {"startup": 4.0})
    led.figure_ms = 150  # one figure at start-up (plots.warm_up)
    # no save measured yet: the guess (2 s; it covered the plots and matplotlib's import), or the figures if more
    assert led.finish_reserve_device_ms() == 2 * FINISH_FLOOR_MS
    led.figure_ms = 600
    assert led.finish_reserve_device_ms() == 2 * METRIC_FIGURES * 600
    led.figure_ms = 150
    led.record(1, counters(), 0.100)  # work 100 ms (10 sampling, 2 reward, 88 update)
    led.record(2, counters(io_s=0.040, save_s=0.040), 0.140)  # the save after step 1: work 100 ms again
    assert led.saves == [40] and led.finish_spread() == 1
    assert led.finish_reserve_device_ms() == 2 * (120 + 600)  # 1.5 * 2 saves of 40 ms + 4 figures of 150 ms
    led.record(3, counters(), 0.150)  # the same work took 150 ms: spread 3/2
    assert led.finish_spread() == Fraction(3, 2)
    assert led.finish_reserve_device_ms() == 2 * (180 + 900)
    led.record(4, counters(io_s=0.060, save_s=0.060), 0.160)  # work 100 ms; saves 40 then 60 ms: 3/2 as well
    assert led.finish_reserve_device_ms() == 2 * (270 + 900)  # 1.5 * 1.5 * 2 * 60 + 1.5 * 600
    led.record(5, counters(), 1.000)  # work 1000 ms among 150 and 100: 10x, capped at 3
    assert led.finish_spread() == 3 and led.finish_reserve_device_ms() == 2 * (540 + 1800)
    assert led.next_step("cost_micro_usd") == 2000  # the projection of a step is unchanged (costliest of the 3)
    led.save_state(tmp_path / "checkpoint-5")
    again = CostLedger(tmp_path, "cpu", 2, Decimal("3.60"), Budgets(usd=Decimal("1")))
    again.resume(tmp_path / "checkpoint-5")  # the saves and the steps' work come back; the figure is re-measured
    assert again.saves == [40, 60] and again.finish_spread() == 3
    assert again.finish_reserve_device_ms() == 2 * 540


def test_the_finish_leaves_out_what_the_budget_left_cannot_cover(tmp_path: Path) -> None:
    """In the finish, an optional part (a plot figure) is drawn only while its expected time, at the spread, fits
    the budget left after the finish so far: headroom in wall ms per device, against every hard budget in time or
    money; None without one."""
    led = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"), Budgets(usd=Decimal("0.010")))
    led.record_overhead("startup", 0, {"startup": 9.0})  # 9000 of 10000 micro-USD (1 per device-ms)
    assert led.finish_headroom_ms(0.5) == 500  # 500 ms of the finish spent, not billed yet
    assert led.finish_fits(0.5, 500) and not led.finish_fits(0.5, 501)
    assert led.finish_headroom_ms(1.2) == -200 and not led.finish_fits(1.2, 0)
    led.record(1, counters(), 0.100)
    led.record(2, counters(), 0.200)  # the same work took 100 and 200 ms: a figure is expected at 2x
    assert led.finish_headroom_ms(0.0) == 700 and led.finish_fits(0.0, 350) and not led.finish_fits(0.0, 351)
    # device-hours, on 2 devices: (18000 - 16000 spent - 2 * 500 elapsed) device-ms = 500 ms of each device
    hours = CostLedger(tmp_path / "h", "cpu", 2, Decimal("0"), Budgets(device_hours=0.005))
    hours.record_overhead("startup", 0, {"startup": 8.0})
    assert hours.finish_headroom_ms(0.5) == 500
    # both budgets: the tighter one; no budget in time or money (or a price of 0 for USD): no limit
    both = CostLedger(tmp_path / "b", "cpu", 1, Decimal("7.20"), Budgets(usd=Decimal("0.010"), device_hours=1.0))
    both.record_overhead("startup", 0, {"startup": 4.0})  # 8000 of 10000 micro-USD at 2 micro-USD per ms
    assert both.finish_headroom_ms(0.0) == 1000
    free = CostLedger(tmp_path / "f", "cpu", 1, Decimal("0"), Budgets(usd=Decimal("0.010"), sampled_tokens=10))
    assert free.finish_headroom_ms(5.0) is None and free.finish_fits(5.0, 10**9)


def test_budget_reached_without_projection(tmp_path: Path) -> None:
    led = CostLedger(tmp_path, "cpu", 1, Decimal("0"), Budgets(sampled_tokens=500), stop_on_projection=False)
    led.record(1, counters(), 0.01)
    led.record(2, counters(), 0.01)
    assert led.check().stop_reason is None  # 480 < 500
    led.record(3, counters(), 0.01)
    reason = led.check().stop_reason
    assert reason is not None and "sampled_tokens reached" in reason and "720 tokens" in reason


def test_device_hours_budget(tmp_path: Path) -> None:
    led = CostLedger(tmp_path, "cpu", 4, Decimal("1"), Budgets(device_hours=0.0001), stop_on_projection=False)
    led.record(1, counters(), 0.05)  # 4 devices * 50 ms = 200 device-ms < 360
    assert led.check().stop_reason is None
    led.record(2, counters(), 0.05)  # 400 >= 0.0001 h = 360 device-ms
    assert "device_hours" in (led.check().stop_reason or "")


def test_resume_mid_run_discards_abandoned_rows_once(tmp_path: Path) -> None:
    led = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    ckpt = tmp_path / "checkpoint-2"
    for step in (1, 2):
        led.record(step, counters(), 0.010)
    led.save_state(ckpt)
    for step in (3, 4):
        led.record(step, counters(), 0.020)

    again = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    again.resume(ckpt)
    assert [r["step"] for r in again.rows()] == [1, 2]
    assert again.totals["cost_micro_usd"] == 20 and again.discarded["cost_micro_usd"] == 40
    assert again.spent()["cost_micro_usd"] == 60  # abandoned work still counts against budgets
    again.record(3, counters(), 0.010)
    assert [(r["step"], r["segment"]) for r in again.rows()] == [(1, 0), (2, 0), (3, 1)]
    assert again.rows()[-1]["cum_cost_micro_usd"] == 30 and again.rows()[-1]["spent_micro_usd"] == 70

    # Resuming from the same checkpoint a second time drops row 3 of segment 1 and keeps the earlier discards.
    third = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    third.resume(ckpt)
    assert [r["step"] for r in third.rows()] == [1, 2]
    assert third.discarded["cost_micro_usd"] == 40 + 10
    discarded = [json.loads(x)["step"] for x in (tmp_path / "ledger_discarded.jsonl").read_text().splitlines()]
    assert discarded == [3, 4, 3]
    assert third.segment == 2


def test_resume_at_last_step_keeps_everything(tmp_path: Path) -> None:
    led = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    for step in (1, 2):
        led.record(step, counters(), 0.010)
    led.save_state(tmp_path / "checkpoint-2")
    again = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    again.resume(tmp_path / "checkpoint-2")
    assert [r["step"] for r in again.rows()] == [1, 2]
    assert again.discarded["cost_micro_usd"] == 0 and again.totals["cost_micro_usd"] == 20
    with pytest.raises(FileNotFoundError):
        again.resume(tmp_path / "nowhere")


def test_counters_reset() -> None:
    c = counters()
    snap = c.snapshot()
    c.reset()
    assert c == StepCounters() and snap.rollouts == 8


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("NVIDIA H200", "nvidia-h200"),
        ("NVIDIA H100 80GB HBM3", "nvidia-h100"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "nvidia-h100"),
        ("NVIDIA A100-SXM4-80GB", "nvidia-a100"),  # was nvidia-a100-sxm4-80gb: no price, the run refused to start
        ("NVIDIA A100 80GB PCIe", "nvidia-a100"),
        ("NVIDIA L4", "nvidia-l4"),
        ("Tesla T4", "nvidia-t4"),
        ("NVIDIA GeForce RTX 4090", "nvidia-rtx-4090"),
        ("", "nvidia-gpu"),
    ],
)
def test_device_kind_from_cuda_name(name: str, kind: str) -> None:
    assert device_kind_from_name(name) == kind


def test_detect_device_cuda_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from training.grpo.run import detect_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert detect_device() == ("nvidia-h200", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detect_device() == ("cpu", 1)


def test_gpu_check_config_prices_the_detected_devices() -> None:
    """training/configs/gpu_check.yaml (bench/gpu_check.sh) has a price for an H200 as detected, and for CPU."""
    from training.grpo.config import REPO_ROOT, load_config

    cfg = load_config(REPO_ROOT / "training" / "configs" / "gpu_check.yaml")
    prices = cfg.ledger.prices()
    assert cfg.ledger.device_kind is None  # detected, not forced
    assert prices[device_kind_from_name("NVIDIA H200")] == Decimal("3.50")
    assert "cpu" in prices
    assert cfg.dynamic_sampling.enabled
    assert cfg.reward_names() == ["correctness", "kimi_length"]


def test_a_resume_killed_between_its_two_writes_counts_the_rolled_back_rows_once(tmp_path: Path) -> None:
    """Resume writes two files: the rolled-back rows appended to ``ledger_discarded.jsonl``, then ``ledger.jsonl``
    rewritten without them. A kill between the two left the rows in both: ``train runs`` billed them twice, and
    the next resume moved them to the discarded file a second time (40 micro-USD of rolled-back work counted 80,
    against the budget too)."""
    from training.registry import load_run

    led = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    ckpt = tmp_path / "checkpoint-2"
    for step in (1, 2):
        led.record(step, counters(), 0.010)
    led.save_state(ckpt)
    for step in (3, 4):
        led.record(step, counters(), 0.020)
    before = (tmp_path / "ledger.jsonl").read_text()

    first = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    first.resume(ckpt)
    # the process is killed after the first write: ledger.jsonl still holds rows 3 and 4
    (tmp_path / "ledger.jsonl").write_text(before)
    assert load_run(tmp_path).micro_usd == 60  # 20 on the training path + 40 rolled back, each once

    again = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    again.resume(ckpt)
    assert [r["step"] for r in again.rows()] == [1, 2]
    assert again.discarded["cost_micro_usd"] == 40 and again.spent()["cost_micro_usd"] == 60
    assert load_run(tmp_path).micro_usd == 60
    discarded = [json.loads(x)["step"] for x in (tmp_path / "ledger_discarded.jsonl").read_text().splitlines()]
    assert discarded == [3, 4]


def test_every_rank_resumes_to_the_same_spend(tmp_path: Path) -> None:
    """Every process resumes the ledger and takes the budget decisions on it; only rank 0 writes. The other ranks
    added the rows they found after the checkpoint to the checkpoint's own discarded totals, so they missed rows
    an earlier resume had already moved (resuming from an older checkpoint) and — reading after rank 0's rewrite —
    the rolled-back rows altogether: spent 100 and 20 micro-USD where rank 0 had 130."""
    led = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    for step, wall in ((1, 0.010), (2, 0.010)):
        led.record(step, counters(), wall)
    led.save_state(tmp_path / "checkpoint-2")
    for step in (3, 4):
        led.record(step, counters(), 0.020)
    led.save_state(tmp_path / "checkpoint-4")
    led.record(5, counters(), 0.030)  # killed after step 5: resumed from checkpoint-4, row 5 rolled back
    seg1 = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    seg1.resume(tmp_path / "checkpoint-4")
    seg1.record(5, counters(), 0.040)

    # now resumed from checkpoint-2 by two processes: rank 1 reads before rank 0 rewrites, rank 2 after
    rank1 = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"), writer=False)
    rank1.resume(tmp_path / "checkpoint-2")
    rank0 = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    rank0.resume(tmp_path / "checkpoint-2")
    rank2 = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"), writer=False)
    rank2.resume(tmp_path / "checkpoint-2")
    assert rank0.spent()["cost_micro_usd"] == 20 + (30 + 20 + 20 + 40)
    assert rank1.spent() == rank0.spent() and rank2.spent() == rank0.spent()


def test_a_resume_survives_half_a_row_left_by_a_kill(tmp_path: Path) -> None:
    """A process killed while appending a row leaves half a line at the end of ``ledger.jsonl`` (the registry
    already skips it). Resume refused the whole ledger (ValueError: invalid JSON), so the run could not go on."""
    led = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    for step in (1, 2):
        led.record(step, counters(), 0.010)
    led.save_state(tmp_path / "checkpoint-2")
    led.record(3, counters(), 0.020)
    with (tmp_path / "ledger.jsonl").open("a") as f:
        f.write('{"step": 4, "kind": "step", "seq": 4, "prompts": 2, "rol')  # cut: no cost in it to recover

    again = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    again.resume(tmp_path / "checkpoint-2")
    assert [r["step"] for r in again.rows()] == [1, 2]
    assert again.discarded["cost_micro_usd"] == 20  # row 3; the cut row holds no cost to count
    again.record(3, counters(), 0.010)
    assert [r["step"] for r in again.rows()] == [1, 2, 3]  # every line parses


def test_a_start_up_that_leaves_no_room_for_the_finish_stops_before_the_first_step(tmp_path: Path) -> None:
    """The projection needs a step row, so before the first step only a budget *reached* stopped the run: a
    start-up that left less than the finish's reserve trained a step anyway and the finish came after it (5000 of
    6000 micro-USD spent at start-up, then a 900 ms step and the 2000 ms finish: 7900, 32% over a hard budget;
    stopping at start-up ends at 7000, the finish the run must pay anyway). The finish reserve alone is known
    before any step: one more step costs at least nothing."""
    led = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"), Budgets(usd=Decimal("0.006")))
    led.record_overhead("startup", 0, {"startup": 5.0})  # $3.60/h = 1 micro-USD per device-ms: 5000 of 6000
    check = led.check()
    assert check.hard and check.stop_reason == (
        "budget usd: the next step is projected to exceed it ($0.005000 spent + $0.000000 per step + $0.002000 to "
        "finish > $0.006000)"
    )
    roomy = CostLedger(tmp_path / "r", "cpu", 1, Decimal("3.60"), Budgets(usd=Decimal("0.008")))
    roomy.record_overhead("startup", 0, {"startup": 5.0})  # 5000 + 2000 <= 8000: the first step runs
    assert roomy.check().stop_reason is None


def test_resume_auto_skips_a_checkpoint_whose_save_was_cut_short(tmp_path: Path) -> None:
    """The Trainer writes a checkpoint's weights, optimizer and trainer state (and rotates old checkpoints) before
    ThinkGate adds ``ledger_state.json``: a kill in between left ``checkpoint-4`` without it. ``--resume auto``
    took the newest directory and the resume failed on it (FileNotFoundError after the model load, a start-up
    billed nowhere) on every try; the last complete checkpoint is ``checkpoint-2``, and resuming it rolls back
    rows 3 and 4."""
    from training.grpo.run import resolve_checkpoint

    led = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    for step in (1, 2):
        led.record(step, counters(), 0.010)
    led.save_state(tmp_path / "checkpoint-2")
    for step in (3, 4):
        led.record(step, counters(), 0.020)
    (tmp_path / "checkpoint-4").mkdir()  # the Trainer's files only: killed before the ledger's state was saved
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("{}")

    ckpt = resolve_checkpoint(tmp_path, "auto")
    assert Path(ckpt).name == "checkpoint-2"
    again = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    again.resume(ckpt)
    assert again.totals["cost_micro_usd"] == 20 and again.discarded["cost_micro_usd"] == 40


def test_a_restart_from_step_0_keeps_the_earlier_attempts_spend_once(tmp_path: Path) -> None:
    """``--resume auto`` on a run that saved no checkpoint starts it again from step 0 over the same ledger: every
    row so far (a start-up a late config error ended, the interrupted first step of another attempt) is spent and
    stays so, in ``ledger_discarded.jsonl``; the new rows continue the sequence numbers in a new segment (a fresh
    ledger there started again at seq 1). A restart killed between its two writes counts nothing twice."""
    first = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))  # 1 micro-USD per device-ms
    first.record_overhead("startup", 0, {"startup": 0.300})
    first.record_overhead("interrupted", 0, {"sampling": 0.040}, counters())
    before = (tmp_path / "ledger.jsonl").read_text()

    again = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    again.restart()
    (tmp_path / "ledger.jsonl").write_text(before)  # killed after writing the discarded file, before ledger.jsonl
    again = CostLedger(tmp_path, "cpu", 1, Decimal("3.60"))
    again.restart()

    assert (tmp_path / "ledger.jsonl").read_text() == ""
    moved = [json.loads(x) for x in (tmp_path / "ledger_discarded.jsonl").read_text().splitlines()]
    assert [(r["seq"], r["discarded_at_resume_from_step"]) for r in moved] == [(1, 0), (2, 0)]
    assert again.totals["cost_micro_usd"] == 0 and again.spent()["cost_micro_usd"] == 340
    row = again.record_overhead("startup", 0, {"startup": 0.100})
    assert (row["seq"], row["segment"], row["spent_micro_usd"]) == (3, 1, 440)
