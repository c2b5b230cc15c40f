"""Dynamic sampling: keep only groups with reward variance, refill by over-sampling, skip predicted-useless prompts.

- DAPO dynamic sampling (arXiv 2503.14476, sec. 3.2): a group whose G rewards are all equal has zero advantage and
  teaches nothing; drop it and roll out more prompts until the batch holds ``target`` informative groups.
- GRESO-like pre-rollout skipping (arXiv 2506.02177): a prompt whose last ``skip_after`` groups were all
  zero-variance is predicted to stay so and is skipped before rollout — all-solved prompts with probability
  ``skip_probability``, all-failed ("hard") prompts with probability ``1 - hard_keep_share`` so a share of hard
  prompts is still tried and the model can grow on them.
- Bounded: at most ``max_rounds`` rollout rounds per batch. A batch that found some informative groups is padded
  with zero-variance groups (zero advantage, no policy gradient); a batch that found none raises
  :class:`NoLearningSignalError` with a diagnosis (all solved / all failed) — never an endless refill loop.

Pure Python (no torch): the trainer supplies a ``rollout`` callable; tests use fakes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from router.errors import ThinkGateError
from training.grpo.config import DynamicSamplingConfig

Prediction = Literal["solved", "failed", "flat"]


class NoLearningSignalError(ThinkGateError, RuntimeError):
    """No prompt yields reward variance any more (data all solved or all failed); training should stop."""


@dataclass
class PromptRecord:
    """Per-prompt history. Counts are rollouts (completions)."""

    rollouts: int = 0
    solved: int = 0
    groups: int = 0
    zero_var_streak: int = 0
    last_pass_rate: float | None = None


class PassRateHistory:
    """Pass rate and zero-variance streak per prompt id."""

    def __init__(self, skip_after: int = 2) -> None:
        self.skip_after = skip_after
        self.records: dict[str, PromptRecord] = {}

    def observe(self, pid: Hashable, n_rollouts: int, n_solved: int, has_signal: bool) -> None:
        rec = self.records.setdefault(str(pid), PromptRecord())
        rec.rollouts += n_rollouts
        rec.solved += n_solved
        rec.groups += 1
        rec.zero_var_streak = 0 if has_signal else rec.zero_var_streak + 1
        rec.last_pass_rate = n_solved / n_rollouts if n_rollouts else None

    def pass_rate(self, pid: Hashable) -> float | None:
        """Cumulative solved / rollouts, or None when never rolled out."""
        rec = self.records.get(str(pid))
        return rec.solved / rec.rollouts if rec and rec.rollouts else None

    def prediction(self, pid: Hashable) -> Prediction | None:
        """``solved``/``failed``/``flat`` when the last ``skip_after`` groups were zero-variance, else None."""
        rec = self.records.get(str(pid))
        if rec is None or rec.zero_var_streak < self.skip_after:
            return None
        if rec.last_pass_rate == 1.0:
            return "solved"
        if rec.last_pass_rate == 0.0:
            return "failed"
        return "flat"

    def state_dict(self) -> dict[str, Any]:
        return {"skip_after": self.skip_after, "records": {k: asdict(v) for k, v in self.records.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skip_after = int(state["skip_after"])
        self.records = {k: PromptRecord(**v) for k, v in state["records"].items()}


@dataclass
class Candidate:
    """A prompt that may be rolled out; ``payload`` is opaque (the dataset row)."""

    pid: Hashable
    payload: Any = None


@dataclass
class ScoredGroup:
    """The outcome of rolling out one prompt G times. ``payload`` is opaque (where the rollout tensors are)."""

    pid: Hashable
    has_signal: bool
    n_rollouts: int
    n_solved: int
    payload: Any = None


@dataclass
class FillResult:
    """``groups``: exactly ``target`` groups, informative first, then zero-variance padding."""

    groups: list[ScoredGroup]
    rounds: int = 0
    rolled_groups: int = 0
    signal_groups: int = 0
    skipped: int = 0
    dropped: int = 0
    padded: int = 0
    extra_signal_dropped: int = 0
    round_sizes: list[int] = field(default_factory=list)


class DynamicSampler:
    """Pre-rollout skipping, refill pool and the bounded fill loop (see module docstring)."""

    def __init__(self, cfg: DynamicSamplingConfig, pool: Sequence[Candidate]) -> None:
        if not pool:
            raise ValueError("dynamic sampling needs a non-empty prompt pool")
        self.cfg = cfg
        self.pool = list(pool)
        self.history = PassRateHistory(cfg.skip_after)
        self.rng = random.Random(cfg.seed)
        self._order: list[int] = []
        self._cursor = 0

    # -- skipping ------------------------------------------------------------------------------------------------
    def should_skip(self, pid: Hashable) -> bool:
        if not self.cfg.skip_predicted:
            return False
        pred = self.history.prediction(pid)
        if pred is None:
            return False
        if pred == "failed":
            return self.rng.random() >= self.cfg.hard_keep_share
        return self.rng.random() < self.cfg.skip_probability

    def _check_not_exhausted(self) -> None:
        if not self.cfg.skip_predicted:
            return
        preds = [self.history.prediction(c.pid) for c in self.pool]
        if all(p is not None for p in preds):
            solved, failed = preds.count("solved"), preds.count("failed")
            raise NoLearningSignalError(
                f"dynamic sampling: all {len(preds)} training prompts are predicted zero-variance "
                f"({solved} always solved, {failed} never solved, {len(preds) - solved - failed} flat) after "
                f"{self.cfg.skip_after} consecutive zero-variance groups each. " + _advice(solved, failed)
            )

    # -- refill pool -------------------------------------------------------------------------------------------
    def _next_index(self) -> int:
        if self._cursor >= len(self._order):
            self._order = list(range(len(self.pool)))
            self.rng.shuffle(self._order)
            self._cursor = 0
        i = self._order[self._cursor]
        self._cursor += 1
        return i

    def draw(self, n: int, exclude: set[Hashable] | None = None) -> tuple[list[Candidate], int]:
        """``(candidates, n_skipped)``: the next ``n`` prompts of the shuffled pool, not in ``exclude``, passing
        :meth:`should_skip`. Scans at most two passes over the pool; if too few pass, skipped prompts fill the rest
        (so it always returns ``n`` when the pool allows). Raises :class:`NoLearningSignalError` when every pool
        prompt is predicted zero-variance."""
        self._check_not_exhausted()
        exclude = set(exclude or ())
        chosen: list[Candidate] = []
        passed_over: list[Candidate] = []
        skipped = 0
        for _ in range(2 * len(self.pool)):
            if len(chosen) >= n:
                break
            c = self.pool[self._next_index()]
            if c.pid in exclude:
                continue
            exclude.add(c.pid)
            if self.should_skip(c.pid):
                skipped += 1
                passed_over.append(c)
                continue
            chosen.append(c)
        while len(chosen) < n and passed_over:
            chosen.append(passed_over.pop(0))
            skipped -= 1
        return chosen, skipped

    # -- the loop ----------------------------------------------------------------------------------------------
    def fill(
        self,
        target: int,
        initial: Sequence[Candidate],
        rollout: Callable[[list[Candidate]], list[ScoredGroup]],
    ) -> FillResult:
        """Roll out ``initial`` (minus predicted-skip prompts, topped up from the pool), then refill from the pool for
        at most ``max_rounds - 1`` more rounds until ``target`` groups have signal; pad with zero-variance groups."""
        if target < 1:
            raise ValueError("target must be >= 1")
        res = FillResult(groups=[])
        queue = [c for c in initial if not self.should_skip(c.pid)]
        res.skipped = len(initial) - len(queue)
        in_batch: set[Hashable] = {c.pid for c in initial}
        if len(queue) < target:
            top_up, s = self.draw(target - len(queue), exclude=in_batch)
            queue += top_up
            res.skipped += s
            in_batch |= {c.pid for c in top_up}
        kept: list[ScoredGroup] = []
        spare: list[ScoredGroup] = []
        for rnd in range(self.cfg.max_rounds):
            need = target - len(kept)
            if need <= 0:
                break
            if rnd > 0:
                queue, s = self.draw(math.ceil(need * self.cfg.oversample), exclude=in_batch)
                res.skipped += s
                in_batch |= {c.pid for c in queue}
                if not queue:
                    break
            scored = rollout(queue)
            res.rounds += 1
            res.round_sizes.append(len(queue))
            for sg in scored:
                self.history.observe(sg.pid, sg.n_rollouts, sg.n_solved, sg.has_signal)
                (kept if sg.has_signal else spare).append(sg)
            queue = []
        res.rolled_groups = len(kept) + len(spare)
        res.signal_groups = len(kept)
        if not kept:
            rollouts = sum(s.n_rollouts for s in spare)
            solved = sum(s.n_solved for s in spare)
            rate = solved / rollouts if rollouts else float("nan")
            n_solved = sum(1 for s in spare if s.n_rollouts and s.n_solved == s.n_rollouts)
            n_failed = sum(1 for s in spare if s.n_solved == 0)
            raise NoLearningSignalError(
                f"dynamic sampling: no informative group (see advantages.signal) in {res.rounds} rollout rounds "
                f"({len(spare)} groups, {rollouts} rollouts, pass rate {rate:.2f}). " + _advice(n_solved, n_failed)
            )
        if len(kept) > target:
            res.extra_signal_dropped = len(kept) - target
            kept = kept[:target]
        res.padded = target - len(kept)
        res.dropped = len(spare) - res.padded
        res.groups = kept + spare[: res.padded]
        if len(res.groups) < target:  # cannot happen: round 0 rolls out >= target groups when the pool allows
            raise NoLearningSignalError(f"dynamic sampling: only {len(res.groups)} groups for a batch of {target}")
        return res

    # -- checkpointing -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": self.history.state_dict(),
            "rng": _rng_state_to_json(self.rng.getstate()),
            "order": self._order,
            "cursor": self._cursor,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.load_state_dict(state["history"])
        self.rng.setstate(_rng_state_from_json(state["rng"]))
        self._order = list(state["order"])
        self._cursor = int(state["cursor"])


def _advice(n_solved: int, n_failed: int) -> str:
    if n_solved and not n_failed:
        return "The data looks all solved: use harder problems (task.difficulties) or stop here."
    if n_failed and not n_solved:
        return "The data looks all failed: use easier problems or more SFT before RL."
    return "Rewards are constant within every group: check the reward functions and their weights."


def _rng_state_to_json(state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_state_from_json(state: list[Any]) -> tuple[Any, ...]:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
