"""Cost ledger: what every optimizer step cost, in tokens, device time and money, with budgets that stop the run.

Rows in ``<run>/ledger.jsonl`` (appended and flushed as the run goes; ``ledger.parquet`` is rewritten at every
checkpoint and at the end), each with its ``phase`` split of the wall time — ``startup_ms`` (imports, model load,
engine start), ``sampling_ms`` (rollout generation), ``reward_ms``, ``update_ms`` (log-probs, backward, optimizer:
the rest of a step), ``eval_ms`` (held-out evaluations), ``io_ms`` (checkpoints, the saved model, card, plots):

- ``kind: startup`` — process start to the first optimizer step (incl. the evaluation before training);
- ``kind: step`` — one per optimizer step;
- ``kind: finish`` — after the last step: saving the model, the evaluation after training, plots.

So the whole process is billed, not only the training loop, and budgets count every phase. Money is integer
micro-USD, computed exactly with ``Decimal``: ``cost_micro_usd = round_half_even(device_ms *
price_usd_per_device_hour * 1e6 / 3.6e6)``, device_ms = wall_ms * device_count. Cumulative totals are sums of the
integer per-row values (no float drift).

Resume: the ledger's cumulative state is saved in every checkpoint (``ledger_state.json``, with the sequence number
of the last row written). Resuming keeps the rows written up to that checkpoint, moves the later rows of the
abandoned segment to ``ledger_discarded.jsonl`` and continues — each step appears once; the discarded rows' spend is
kept apart (``discarded_*``) and still counts against the budgets (that money was spent).
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from decimal import ROUND_FLOOR, ROUND_HALF_EVEN, Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

from router.jsonl import read_jsonl

logger = logging.getLogger(__name__)

PHASES = ("startup", "sampling", "reward", "update", "eval", "io")
LEDGER_FILE = "ledger.jsonl"
DISCARDED_FILE = "ledger_discarded.jsonl"
PARQUET_FILE = "ledger.parquet"
STATE_FILE = "ledger_state.json"
MICRO = Decimal(1_000_000)
MS_PER_HOUR = Decimal(3_600_000)
PROJECTION_WINDOW = 3  # step rows a budget projection looks back over (a step's cost varied 3x on a busy box)
# The finish phase (the stop's checkpoint, the saved model, the metric plots, card) is reserved from what this run
# measured of its parts: checkpoint saves (StepCounters.save_s) and one plot figure (rendered at start-up, where
# matplotlib's import is billed too: 0.26 s of a 0.63 s finish on a quiet box, and the finish ran 2.8 s against a
# 2.0 s guess under load). Until a save is measured, the finish is guessed as before: FINISH_FLOOR_MS per device,
# or 1/FINISH_STARTUP_SHARE of start-up when that is more (both slow down alike on a loaded box).
FINISH_FLOOR_MS = 2000
FINISH_STARTUP_SHARE = 8
# The measured parts are reserved at how much the same work varied in time over the last PROJECTION_WINDOW steps
# and saves (max / min: the spread, at most FINISH_SPREAD_CAP) — and the saves, which the finish cannot leave out,
# at FINISH_SAFETY times that (measured up to save_steps before the finish; the box may be busier by then). The
# plots are checked again figure by figure in the finish and left out when the budget left cannot cover them.
FINISH_SAFETY = Fraction(3, 2)
FINISH_SPREAD_CAP = 3
METRIC_FIGURES = 4  # figures training.grpo.plots.plot_metrics draws in the finish (reward, length, entropy, signal)
_RECENT_KEYS = ("cost_micro_usd", "device_ms", "sampled_tokens", "io_ms", "work_ms")


@dataclass
class StepCounters:
    """What the trainer accumulates during one optimizer step (reset by the ledger). Tokens are tokens."""

    prompts: int = 0
    rollouts: int = 0
    prompt_tokens: int = 0
    sampled_tokens: int = 0
    trained_tokens: int = 0
    dropped_rollouts: int = 0
    zero_signal_rollouts: int = 0
    generation_s: float = 0.0
    reward_s: float = 0.0
    eval_s: float = 0.0
    io_s: float = 0.0
    stored_bytes: int = 0  # rollout bytes written to the run directory (training/storage.py)
    save_s: float = 0.0  # the part of io_s spent writing checkpoints (the finish writes one, and the model)

    def reset(self) -> None:
        for k, v in asdict(StepCounters()).items():
            setattr(self, k, v)

    def snapshot(self) -> StepCounters:
        return StepCounters(**asdict(self))


@dataclass
class Budgets:
    """Hard limits (None = unlimited); all count discarded spend too."""

    usd: Decimal | None = None
    device_hours: float | None = None
    sampled_tokens: int | None = None


def micro_usd(device_ms: int, price_usd_per_device_hour: Decimal) -> int:
    """Integer micro-USD for ``device_ms`` device-milliseconds at a USD/device-hour price (round half even)."""
    value = Decimal(device_ms) * price_usd_per_device_hour * MICRO / MS_PER_HOUR
    return int(value.to_integral_value(rounding=ROUND_HALF_EVEN))


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux ``/proc/self/stat`` start time against the boot clock), so the
    start-up phase includes interpreter start and imports; None where that is not available."""
    try:
        import os

        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 (starttime), counting from 1, after "pid (comm)"
        hz = os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / hz)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def pro_rata(micro: int, part: int, whole: int) -> int:
    """``micro * part / whole`` in integer micro-USD (round half even); 0 when ``whole`` is 0.

    The USD spent on zero-signal groups is the step's cost attributed by rollouts: a group without signal (all
    solved or all failed) cost its share of the step and taught nothing.
    """
    if whole <= 0 or part <= 0:
        return 0
    value = Decimal(micro) * Decimal(min(part, whole)) / Decimal(whole)
    return int(value.to_integral_value(rounding=ROUND_HALF_EVEN))


_KIND_PHASE = {"startup": "startup", "step": "update", "finish": "io", "interrupted": "update"}


def phase_costs(row: dict[str, Any]) -> dict[str, int]:
    """A ledger row's own ``cost_micro_usd`` split over its phases (:data:`PHASES`) in proportion to their ms, by
    largest remainder (ties in :data:`PHASES` order): integer micro-USD that add up to the row's cost exactly, so
    per-phase sums over rows add up to the ledger's total. (Rounding each phase's summed device-ms instead was off
    by a micro-USD from the total, and one price for all rows was wrong for a resumed segment at another price.)"""
    cost = int(row["cost_micro_usd"])
    weights = {p: max(0, int(row.get(f"{p}_ms", 0))) for p in PHASES}
    whole = sum(weights.values())
    if whole == 0:  # no phase time (a 0 ms row costs 0): the cost, if any, goes to the row kind's own phase
        out = dict.fromkeys(PHASES, 0)
        out[_KIND_PHASE.get(str(row.get("kind", "step")), "update")] = cost
        return out
    out = {p: cost * w // whole for p, w in weights.items()}
    left = cost - sum(out.values())
    by_remainder = sorted(PHASES, key=lambda p: (-(cost * weights[p] % whole), PHASES.index(p)))
    for p in by_remainder[:left]:
        out[p] += 1
    return out


_BRAND_WORDS = {"nvidia", "tesla", "geforce", "quadro"}


def device_kind_from_name(name: str) -> str:
    """Price-table key (``nvidia-<model>``) of a CUDA device name as ``torch.cuda.get_device_name`` reports it.

    The model is the first word after the brand words, cut at its first ``-``: ``NVIDIA H200`` -> ``nvidia-h200``,
    ``NVIDIA H100 80GB HBM3`` (also as a MIG slice) -> ``nvidia-h100``, ``NVIDIA A100-SXM4-80GB`` ->
    ``nvidia-a100``, ``Tesla T4`` -> ``nvidia-t4``; ``RTX``/``GTX`` keep the next word
    (``NVIDIA GeForce RTX 4090`` -> ``nvidia-rtx-4090``). An empty name gives ``nvidia-gpu``.
    """
    words = [w for w in re.split(r"[\s_]+", name.lower()) if w and w not in _BRAND_WORDS]
    if not words:
        return "nvidia-gpu"
    model = words[0].split("-")[0] or "gpu"
    if model in ("rtx", "gtx") and len(words) > 1:
        model = f"{model}-{words[1].split('-')[0]}"
    return f"nvidia-{model}"


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))


def _ceil(value: Fraction) -> int:
    """``value`` rounded up to an integer (ms)."""
    return -(-value.numerator // value.denominator)


_TOTAL_KEYS = (
    "prompts",
    "rollouts",
    "prompt_tokens",
    "sampled_tokens",
    "trained_tokens",
    "dropped_rollouts",
    "zero_signal_rollouts",
    "zero_signal_micro_usd",
    "stored_bytes",
    "wall_ms",
    *(f"{p}_ms" for p in PHASES),
    "device_ms",
    "cost_micro_usd",
)


@dataclass
class BudgetCheck:
    warnings: list[str] = field(default_factory=list)
    stop_reason: str | None = None
    #: the stop is a budget's hard line (reached, or the next step projected past it), not its warning line
    hard: bool = False


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ledger file; half a line (a process killed while appending its last row) is passed over with a
    warning — that row is after the last checkpoint, and the part written holds no cost to count."""
    rows = list(read_jsonl(path, missing_ok=True, skip_invalid=True))
    if path.is_file():
        lines = sum(1 for line in path.read_text().splitlines() if line.strip())
        if lines > len(rows):
            logger.warning("%s: %d line(s) not a row (a write cut by a kill): left out", path, lines - len(rows))
    return rows


def _replace(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` to ``path`` as JSON lines through a temporary file and one rename: a reader, or a kill, sees
    the old file or the new one, never half of it."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


class CostLedger:
    """Per-step cost rows, cumulative totals, budget checks; see the module docstring."""

    def __init__(
        self,
        run_dir: str | Path,
        device_kind: str,
        device_count: int,
        price_usd_per_device_hour: Decimal,
        budgets: Budgets | None = None,
        tags: dict[str, str] | None = None,
        warn_fraction: float = 0.8,
        stop_on_projection: bool = True,
        writer: bool = True,
        quality_floor: float | None = None,
        past_warning: str = "continue",
    ) -> None:
        self.writer = writer  # False on non-main processes: same arithmetic and decisions, no files
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.device_kind = device_kind
        self.device_count = device_count
        self.price = Decimal(price_usd_per_device_hour)
        self.budgets = budgets or Budgets()
        self.tags = dict(tags or {})
        self.warn_fraction = warn_fraction
        self.stop_on_projection = stop_on_projection
        self.quality_floor = quality_floor
        self.past_warning = past_warning
        self.best_quality: float | None = None  # best held-out accuracy so far (set by the periodic check)
        self.totals: dict[str, int] = dict.fromkeys(_TOTAL_KEYS, 0)
        self.discarded: dict[str, int] = dict.fromkeys(_TOTAL_KEYS, 0)
        self.last_step = 0
        self.segment = 0
        self.seq = 0  # sequence number of the last row written (all kinds, all segments)
        self.last_row: dict[str, Any] | None = None  # the last *step* row (projections repeat a step)
        # the last PROJECTION_WINDOW step rows' projected keys and io_ms, and the costliest finish row this run
        # billed (a resumed run has seen one): the projection of :meth:`check`
        self.recent: list[dict[str, int]] = []
        self.finish_device_ms = 0
        # what the finish's parts took when this run did them before the finish (per device, wall ms): the last
        # PROJECTION_WINDOW checkpoint saves, and one plot figure rendered at start-up (0: none measured)
        self.saves: list[int] = []
        self.figure_ms = 0
        self.startup_ms = 0  # the longest start-up phase (wall ms) of this run's segments: how loaded the box is
        self.warned: set[str] = set()
        self.stop_reason: str | None = None
        self.hard_stop = False  # a budget's hard line stopped the run (BudgetCheck.hard): spend nothing more

    @property
    def path(self) -> Path:
        return self.run_dir / LEDGER_FILE

    # -- recording -----------------------------------------------------------------------------------------------
    def record(self, step: int, c: StepCounters, wall_s: float) -> dict[str, Any]:
        """Append the row of optimizer step ``step``; ``wall_s`` is the step's wall time in seconds (update = the
        part not spent sampling, scoring, evaluating or saving)."""
        if step <= self.last_step:
            raise ValueError(f"ledger: step {step} already recorded (last {self.last_step}); double counting")
        wall_ms = _ms(wall_s)
        phases = {
            "startup": 0,
            "sampling": _ms(c.generation_s),
            "reward": _ms(c.reward_s),
            "eval": _ms(c.eval_s),
            "io": _ms(c.io_s),
        }
        phases["update"] = max(0, wall_ms - sum(phases.values()))
        row = self._append("step", step, c, wall_ms, phases)
        self.last_step = step
        self.last_row = row
        # work_ms: the step's own work (sampling, reward, update), alike from step to step: how steady the box is
        work = {"work_ms": phases["sampling"] + phases["reward"] + phases["update"]}
        self.recent = [*self.recent, {**{k: row[k] for k in _RECENT_KEYS if k in row}, **work}][-PROJECTION_WINDOW:]
        if c.save_s > 0:
            self.saves = [*self.saves, _ms(c.save_s)][-PROJECTION_WINDOW:]
        return row

    def record_overhead(self, kind: str, step: int, phase_s: dict[str, float],
                        counters: StepCounters | None = None) -> dict[str, Any]:
        """Append a ``startup``, ``finish`` or ``interrupted`` row (the part of a step a Ctrl-C cut, with what it had
        sampled: ``counters``): ``phase_s`` maps phases (:data:`PHASES`) to seconds; the row's wall time is their
        sum. ``step`` is the optimizer step the run stood at."""
        unknown = set(phase_s) - set(PHASES)
        if unknown:
            raise ValueError(f"ledger: unknown phase(s) {sorted(unknown)}; known {PHASES}")
        phases = {p: _ms(phase_s.get(p, 0.0)) for p in PHASES}
        row = self._append(kind, step, counters or StepCounters(), sum(phases.values()), phases)
        if kind == "finish":
            self.finish_device_ms = max(self.finish_device_ms, row["device_ms"])
        if kind == "startup":
            self.startup_ms = max(self.startup_ms, row["startup_ms"])
        return row

    def _append(self, kind: str, step: int, c: StepCounters, wall_ms: int, phases: dict[str, int]) -> dict[str, Any]:
        device_ms = wall_ms * self.device_count
        self.seq += 1
        row: dict[str, Any] = {
            "step": step,
            "kind": kind,
            "seq": self.seq,
            "segment": self.segment,
            "ts": round(time.time(), 3),
            "prompts": c.prompts,
            "rollouts": c.rollouts,
            "prompt_tokens": c.prompt_tokens,
            "sampled_tokens": c.sampled_tokens,
            "trained_tokens": c.trained_tokens,
            "dropped_rollouts": c.dropped_rollouts,
            "zero_signal_rollouts": c.zero_signal_rollouts,
            "stored_bytes": c.stored_bytes,
            "wall_ms": wall_ms,
            **{f"{p}_ms": phases.get(p, 0) for p in PHASES},
            "device_kind": self.device_kind,
            "device_count": self.device_count,
            "device_ms": device_ms,
            "price_usd_per_device_hour": str(self.price),
            "cost_micro_usd": micro_usd(device_ms, self.price),
        }
        row["zero_signal_micro_usd"] = pro_rata(row["cost_micro_usd"], c.zero_signal_rollouts, c.rollouts)
        for k in _TOTAL_KEYS:
            self.totals[k] += row[k]
        row.update({f"cum_{k}": v for k, v in self.totals.items()})
        row["spent_micro_usd"] = self.totals["cost_micro_usd"] + self.discarded["cost_micro_usd"]
        row.update(self.tags)
        if self.writer:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    # -- budgets -------------------------------------------------------------------------------------------------
    def spent(self) -> dict[str, int]:
        """Totals including discarded (rolled-back) spend."""
        return {k: self.totals[k] + self.discarded[k] for k in _TOTAL_KEYS}

    def next_step(self, key: str) -> int:
        """The next step's projected ``key`` (``cost_micro_usd``, ``device_ms``, ``sampled_tokens``): the costliest
        of the last :data:`PROJECTION_WINDOW` steps — a step's cost varied 3x from one to the next on a busy box,
        so the last one alone under-projected."""
        return max((r[key] for r in self.recent), default=0)

    def finish_spread(self) -> Fraction:
        """How much the same work varied in time lately: the costliest over the cheapest of the last
        :data:`PROJECTION_WINDOW` steps' own work (sampling, reward, update; not their evaluations or saves) and of
        the last checkpoint saves, the larger; 1 when unmeasured, at most :data:`FINISH_SPREAD_CAP`. Exact (a
        fraction), so every rank reserves the same."""
        spread = Fraction(1)
        for values in ([r.get("work_ms", 0) for r in self.recent], self.saves):
            positive = [v for v in values if v > 0]
            if len(positive) > 1:
                spread = max(spread, Fraction(max(positive), min(positive)))
        return min(spread, Fraction(FINISH_SPREAD_CAP))

    def finish_reserve_device_ms(self) -> int:
        """Device-ms kept for the finish a stop is followed by (the stop's checkpoint, the saved model, the metric
        plots, card; no evaluation after a hard stop): the costliest of a finish row this run billed (exact, after
        a resume) and its parts as this run measured them, at :meth:`finish_spread` — two checkpoint saves (the
        costliest of the last :data:`PROJECTION_WINDOW`; the model is a checkpoint without the optimizer), which
        cannot be left out, at :data:`FINISH_SAFETY` times it, and :data:`METRIC_FIGURES` figures at the start-up
        figure's time (:attr:`figure_ms`). Until a save is measured the finish is guessed as before
        (:data:`FINISH_FLOOR_MS`, or 1/:data:`FINISH_STARTUP_SHARE` of start-up, or the figures when that is more;
        the plots, checked figure by figure in the finish, take what the saves leave). Wall ms per device, times
        the device count."""
        spread = self.finish_spread()
        figures = _ceil(spread * METRIC_FIGURES * self.figure_ms)
        if self.saves:
            parts = _ceil(FINISH_SAFETY * spread * 2 * max(self.saves)) + figures
        else:  # the guess covered the plots too (matplotlib's import included): the plots may take only what is left
            parts = max(FINISH_FLOOR_MS, self.startup_ms // FINISH_STARTUP_SHARE, figures)
        return max(self.finish_device_ms, parts * self.device_count)

    def finish_headroom_ms(self, elapsed_s: float) -> int | None:
        """Wall ms (per device) the finish may still take, ``elapsed_s`` seconds into it (not yet billed), before
        a hard budget in time or money (``usd``, ``device_hours``) is exceeded; negative when already over, None
        without such a budget (or at a price of 0)."""
        elapsed = _ms(elapsed_s) * self.device_count
        spent = self.spent()
        rooms: list[int] = []
        if self.budgets.usd is not None and self.price > 0:
            left = int(Decimal(self.budgets.usd) * MICRO) - spent["cost_micro_usd"] - micro_usd(elapsed, self.price)
            ms = (Decimal(left) * MS_PER_HOUR / (self.price * MICRO)).to_integral_value(rounding=ROUND_FLOOR)
            rooms.append(int(ms))
        if self.budgets.device_hours is not None:
            limit = int(Decimal(str(self.budgets.device_hours)) * MS_PER_HOUR)
            rooms.append(limit - spent["device_ms"] - elapsed)
        return min(rooms) // self.device_count if rooms else None

    def finish_fits(self, elapsed_s: float, part_ms: int) -> bool:
        """True when an optional part of the finish expected to take ``part_ms`` wall ms (per device), times
        :meth:`finish_spread`, still fits the hard budgets ``elapsed_s`` seconds into the finish
        (:meth:`finish_headroom_ms`): what may be left out is left out rather than spent past a budget."""
        room = self.finish_headroom_ms(elapsed_s)
        return room is None or _ceil(self.finish_spread() * part_ms) <= room

    def check(self) -> BudgetCheck:
        """Warn once per budget at ``warn_fraction``; stop when a budget is reached, or (``stop_on_projection``)
        when one more step (:meth:`next_step`) and then the finish (:meth:`finish_reserve_device_ms`; it samples
        no tokens) would exceed it — a hard budget's stop leaves room for the finish row billed after it."""
        out = BudgetCheck()
        spent = self.spent()
        reserve_ms = self.finish_reserve_device_ms()
        reserve = {"cost_micro_usd": micro_usd(reserve_ms, self.price), "device_ms": reserve_ms, "sampled_tokens": 0}
        limits: list[tuple[str, int | None, str, Any]] = [
            (
                "usd",
                None if self.budgets.usd is None else int(Decimal(self.budgets.usd) * MICRO),
                "cost_micro_usd",
                lambda v: f"${Decimal(v) / MICRO:.6f}",
            ),
            (
                "device_hours",
                None
                if self.budgets.device_hours is None
                else int(Decimal(str(self.budgets.device_hours)) * MS_PER_HOUR),
                "device_ms",
                lambda v: f"{v / 3.6e6:.6f} device-h",
            ),
            ("sampled_tokens", self.budgets.sampled_tokens, "sampled_tokens", lambda v: f"{v} tokens"),
        ]
        for name, limit, key, fmt in limits:
            if limit is None:
                continue
            used = spent[key]
            if used >= limit:
                out.hard = True
                out.stop_reason = out.stop_reason or f"budget {name} reached: {fmt(used)} of {fmt(limit)}"
            # before the first step there is no step to project (0), but the finish reserve is known: a start-up
            # that leaves less than it would otherwise train a step and then overspend by that step and the finish
            elif self.stop_on_projection and used + self.next_step(key) + reserve[key] > limit:
                out.hard = True
                finish = f" + {fmt(reserve[key])} to finish" if reserve[key] else ""
                out.stop_reason = out.stop_reason or (
                    f"budget {name}: the next step is projected to exceed it ({fmt(used)} spent + "
                    f"{fmt(self.next_step(key))} per step{finish} > {fmt(limit)})"
                )
            if used >= self.warn_fraction * limit and name not in self.warned:
                self.warned.add(name)
                share = f"{used / limit:.0%}" if limit else "all of it"  # a budget below one unit rounds to 0
                out.warnings.append(f"budget {name}: {fmt(used)} of {fmt(limit)} spent ({share})")
            at_warning = used >= self.warn_fraction * limit and not out.stop_reason
            if at_warning and (
                self.past_warning == "stop" or (self.past_warning == "continue_below_floor" and self.floor_met())
            ):
                out.stop_reason = f"budget {name}: warning line reached ({fmt(used)} of {fmt(limit)})"
        if out.stop_reason and self.quality_floor is not None and not self.floor_met():
            best = "none" if self.best_quality is None else f"{self.best_quality:.4g}"
            out.stop_reason = (
                f"stopped below quality floor (best held-out accuracy {best} < {self.quality_floor:g}): "
                + out.stop_reason
            )
        if out.stop_reason:
            self.stop_reason = out.stop_reason
            self.hard_stop = self.hard_stop or out.hard
        return out

    def floor_met(self) -> bool:
        """True when the best held-out accuracy reached ``quality_floor`` (or there is no floor)."""
        if self.quality_floor is None:
            return True
        return self.best_quality is not None and self.best_quality >= self.quality_floor

    # -- checkpoint / resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "last_step": self.last_step,
            "segment": self.segment,
            "seq": self.seq,
            "totals": self.totals,
            "discarded": self.discarded,
            "warned": sorted(self.warned),
            "last_row": self.last_row,
            "recent": self.recent,
            "saves": self.saves,
        }

    def save_state(self, checkpoint_dir: str | Path) -> None:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        # temp file + rename: a checkpoint has the whole state or none (--resume auto skips one without it)
        tmp = Path(checkpoint_dir) / f"{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(self.state_dict()))
        tmp.replace(Path(checkpoint_dir) / STATE_FILE)

    def resume(self, checkpoint_dir: str | Path) -> None:
        """Continue from a checkpoint: keep rows <= its step, move later rows to ``ledger_discarded.jsonl``.
        Raises ``FileNotFoundError`` when the checkpoint has no ledger state."""
        state_path = Path(checkpoint_dir) / STATE_FILE
        if not state_path.is_file():
            raise FileNotFoundError(f"no {STATE_FILE} in {checkpoint_dir}: cannot resume the ledger")
        self._continue(json.loads(state_path.read_text()))

    def restart(self) -> None:
        """Start the run again from step 0 over the ledger of earlier attempts that saved no checkpoint (a start-up
        a late configuration error, a crash or a Ctrl-C ended): as a resume from a checkpoint at step 0, every row
        written so far moves to ``ledger_discarded.jsonl`` — spent, so still counted in ``spent()`` and the budgets
        — and the rows that follow continue its sequence numbers in a new segment. Idempotent: a restart cut short
        and restarted again moves no row twice."""
        self._continue({"last_step": 0, "segment": 0, "seq": 0, "totals": {}, "discarded": {}})

    def _continue(self, st: dict[str, Any]) -> None:
        """Continue from a saved ledger state ``st`` (:meth:`state_dict`): see :meth:`resume`."""
        self.last_step = int(st["last_step"])
        self.totals = {k: int(st["totals"].get(k, 0)) for k in _TOTAL_KEYS}
        self.discarded = {k: int(st["discarded"].get(k, 0)) for k in _TOTAL_KEYS}
        self.warned = set(st.get("warned", []))
        self.last_row = st.get("last_row")
        last = self.last_row or {}
        default_recent = [{k: int(last.get(k, 0)) for k in _RECENT_KEYS}] if last else []
        self.recent = [{k: int(r.get(k, 0)) for k in _RECENT_KEYS} for r in st.get("recent", default_recent)]
        self.saves = [int(v) for v in st.get("saves", [])][-PROJECTION_WINDOW:]
        self.stop_reason = None
        self.hard_stop = False
        ckpt_seq = st.get("seq")  # None: a state written before rows had sequence numbers (keep by step)
        discarded_path = self.run_dir / DISCARDED_FILE
        # ledger.jsonl before the discarded file: rank 0 writes them in the other order (below), so a rank reading
        # while it resumes sees a moved row in one of the two, whatever the interleaving
        ledger_rows = _read_rows(self.path)
        abandoned = _read_rows(discarded_path)
        written = [*ledger_rows, *abandoned]
        self.segment = max([int(st.get("segment", 0))] + [int(r.get("segment", 0)) for r in written]) + 1
        self.finish_device_ms = max([0] + [int(r["device_ms"]) for r in written if r.get("kind") == "finish"])
        self.startup_ms = max([0] + [int(r.get("startup_ms", 0)) for r in written if r.get("kind") == "startup"])
        self.seq = max([int(ckpt_seq or 0)] + [int(r.get("seq", 0)) for r in written])
        keep, drop = [], []
        for row in ledger_rows:
            if ckpt_seq is not None and "seq" in row:
                kept = int(row["seq"]) <= int(ckpt_seq)
            else:
                kept = row["step"] <= self.last_step
            (keep if kept else drop).append(row)
        # A row is moved once: a resume killed between its two writes left its rows in both files, and a rank that
        # reads after rank 0's rewrite finds them in the discarded file only (rows carry unique sequence numbers).
        moved = {int(r["seq"]) for r in abandoned if "seq" in r}
        newly = [
            {**row, "discarded_at_resume_from_step": self.last_step}
            for row in drop
            if "seq" not in row or int(row["seq"]) not in moved
        ]
        abandoned += newly
        # Discarded spend = every row ever abandoned (the append-only file), whatever checkpoint we came back to,
        # computed alike on every rank (each takes the same budget decisions).
        if abandoned:
            self.discarded = {k: sum(int(row.get(k, 0)) for row in abandoned) for k in _TOTAL_KEYS}
        if not self.writer:
            return
        # each file replaced whole (a kill mid-write leaves the old one), the discarded rows first: a kill between
        # the two leaves the moved rows in both files, which the next resume and the registry count once
        if newly:
            _replace(discarded_path, abandoned)
        _replace(self.path, keep)

    # -- outputs -------------------------------------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.path, missing_ok=True))

    def write_parquet(self) -> Path | None:
        rows = self.rows()
        if not rows:
            return None
        import pyarrow as pa
        import pyarrow.parquet as pq

        out = self.run_dir / PARQUET_FILE
        pq.write_table(pa.Table.from_pylist(rows), out)
        return out

    def summary(self, accuracy_before: float | None = None, accuracy_after: float | None = None) -> dict[str, Any]:
        """Totals, spend incl. discarded, billed ms by phase, and cost per accuracy point (USD per +1 percentage
        point of held-out accuracy, evaluations included; None when accuracy did not improve or was not measured)."""
        spent = self.spent()
        usd = Decimal(self.totals["cost_micro_usd"]) / MICRO
        spent_usd = Decimal(spent["cost_micro_usd"]) / MICRO
        per_point: str | None = None
        gain_pp: float | None = None
        if accuracy_before is not None and accuracy_after is not None:
            gain_pp = round((accuracy_after - accuracy_before) * 100, 4)
            if gain_pp > 0:
                per_point = str((spent_usd / Decimal(str(gain_pp))).quantize(Decimal("0.000001")))
        return {
            "steps": self.last_step,
            "segments": self.segment + 1,
            "device_kind": self.device_kind,
            "device_count": self.device_count,
            "price_usd_per_device_hour": str(self.price),
            "totals": self.totals,
            "discarded": self.discarded,
            "usd": str(usd),
            "spent_usd": str(spent_usd),
            "device_hours": spent["device_ms"] / 3.6e6,
            "billed_ms_by_phase": {p: spent[f"{p}_ms"] for p in PHASES},
            "accuracy_before": accuracy_before,
            "accuracy_after": accuracy_after,
            "accuracy_gain_pp": gain_pp,
            "usd_per_accuracy_point": per_point,
            "stop_reason": self.stop_reason,
            "tags": self.tags,
        }
