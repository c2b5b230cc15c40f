"""The cost ledger of a tiny-model SFT run (``thinkgate train tiny``, ``thinkgate train dial-sft``).

Billed like ``train grpo`` and ``train sft``: :class:`~training.grpo.ledger.CostLedger` rows in the run directory
(``ledger.jsonl``, ``ledger.parquet``), ``summary.json`` and ``heartbeat.json``, so ``train runs`` lists the run.
The device is one CPU at GRPO's default ``ledger.price_usd_per_device_hour`` for ``cpu``.

Rows: ``startup`` from process start to the first optimizer step; one ``step`` row per optimizer step
(``prompts`` = examples in the batch, ``trained_tokens`` = tokens under the loss); for a run of several stages
(``train tiny``: from scratch, continued, over-thinking), a ``startup`` row at each later stage's start billing
the time between the stages (saving one stage's model, loading it for the next) as ``io``, and step numbers that
continue across stages (a ledger counts each optimizer step once); a ``finish`` row for saving the model. A Ctrl-C
or an error inside ``with billing:`` is billed as ``train grpo`` and ``train sft`` bill it: a ``startup`` row from
process start when no row holds it yet, else an ``interrupted`` row for the time since the last row (the step in
flight, the save, the evaluation after training), then it propagates.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from training.tiny.data import Example

logger = logging.getLogger(__name__)


class SFTBilling:
    """One SFT run's bill. Pass :meth:`on_step` as :func:`training.tiny.train.train`'s ``on_step`` hook (of every
    stage, in order), then call :meth:`finish` once; run all of it inside ``with billing:`` so that a Ctrl-C or an
    error is billed (:meth:`bill_unfinished`).

    Raises :class:`~training.grpo.config.ConfigError` when ``run_dir`` already holds a run (a ``ledger.jsonl``):
    two runs must not share one bill."""

    def __init__(self, run_dir: Path, tags: dict[str, str]) -> None:
        from training.grpo.config import ConfigError, LedgerConfig
        from training.grpo.ledger import CostLedger, seconds_since_process_start
        from training.grpo.run import git_commit

        if (run_dir / "ledger.jsonl").exists():
            raise ConfigError(f"{run_dir} already holds a run (ledger.jsonl): choose a new --output-dir")
        since = seconds_since_process_start()
        self._t = time.perf_counter() - (since if since is not None else 0.0)
        price = LedgerConfig().prices()["cpu"]
        self.ledger = CostLedger(run_dir, "cpu", 1, price, tags={**tags, "git_commit": git_commit()})
        self._offset = 0  # optimizer steps of the stages before this one
        self._last = 0  # the run's last step number billed
        self.finished = False  # the finish row is written: it holds the time since the last step

    def __enter__(self) -> SFTBilling:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None and not self.finished:  # the exception propagates (nothing is suppressed)
            self.bill_unfinished("interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed")
        if exc_type is not None and not issubclass(exc_type, KeyboardInterrupt):
            from training.registry import mark_failed

            # else listed `running`, then `abandoned`, the error nowhere
            mark_failed(self.ledger.run_dir, f"{exc_type.__name__}: {exc}")

    def bill_unfinished(self, cause: str = "interrupted") -> dict[str, Any] | None:
        """Bill the time since the last row, which no row holds (``cause`` names the interrupt or error in the
        log): as the ``startup`` row when the first stage had not started (process start to now), else as an
        ``interrupted`` row at the last step billed (its ``update`` phase: the step in flight, or the save or the
        evaluation after the last step). Returns the row, None when billing failed (logged; never raises, so the
        interrupt or error reaches the user). A Ctrl-C marks the run ``interrupted`` for ``train runs``."""
        from training.registry import mark_interrupted, write_heartbeat

        try:
            now = time.perf_counter()
            wall, self._t = now - self._t, now
            if not self.ledger.seq:
                row = self.ledger.record_overhead("startup", 0, {"startup": wall})
            else:
                row = self.ledger.record_overhead("interrupted", self._last, {"update": wall})
            self.ledger.write_parquet()
            write_heartbeat(self.ledger.run_dir, self._last)
            if cause == "interrupted":
                mark_interrupted(self.ledger.run_dir)
            logger.warning("%s: %.1f s since the last row billed (%s micro-USD)", cause, wall, row["cost_micro_usd"])
            return row
        except Exception:
            logger.exception("%s: could not bill it", cause)
            return None

    def on_step(self, step: int, batch: list[Example]) -> None:
        """:func:`training.tiny.train.train`'s hook: ``step`` 0 opens a stage (the run's first closes the start-up
        row; a later one bills the time since the previous stage's last step as ``io``), later steps their own
        row under the run's step number (the stage's step plus the steps of the stages before)."""
        from training.grpo.ledger import StepCounters
        from training.registry import write_heartbeat

        now = time.perf_counter()
        wall, self._t = now - self._t, now
        if step == 0:
            self._offset = self._last
            phase = "startup" if not self.ledger.seq else "io"
            self.ledger.record_overhead("startup", self._last, {phase: wall})
        else:
            self._last = self._offset + step
            trained = sum(1 for e in batch for label in e.labels if label != -100)
            self.ledger.record(self._last, StepCounters(prompts=len(batch), trained_tokens=trained), wall)
        write_heartbeat(self.ledger.run_dir, self._last)

    def finish(self, eval_s: float = 0.0) -> dict[str, Any]:
        """Bill the time since the last step as the ``finish`` row: ``eval_s`` seconds of it as ``eval`` (an
        offline check after training), the rest as ``io`` (saving the model, the card); write the Parquet copy,
        ``summary.json`` (``global_step`` = the run's optimizer steps) and the last heartbeat. Returns the
        summary (``spent_usd``, ``totals`` in integer micro-USD and ms)."""
        from training.registry import write_heartbeat

        since = time.perf_counter() - self._t
        eval_s = min(max(0.0, eval_s), since)
        self.ledger.record_overhead("finish", self._last, {"io": since - eval_s, "eval": eval_s})
        self.finished = True
        self.ledger.write_parquet()
        summary = {**self.ledger.summary(), "global_step": self._last}
        (self.ledger.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        write_heartbeat(self.ledger.run_dir, self._last)
        return summary
