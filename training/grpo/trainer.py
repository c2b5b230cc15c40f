"""``ThinkGateGRPOTrainer``: TRL's ``GRPOTrainer`` extended through its hooks, not forked.

Overridden hooks, each calling ``super()``:
- ``_generate``: times generation and counts prompts, rollouts, prompt and sampled tokens for the cost ledger.
- ``_calculate_rewards``: times reward computation and keeps the gathered (B, K) reward matrix.
- ``_generate_and_score_completions``: replaces TRL's advantages by :func:`advantages.compute_advantages` (same
  formulas for sum_then_normalize / decoupled, plus per-group signal metrics) and, with dynamic sampling, drives
  the bounded drop-and-refill loop of :class:`sampling.DynamicSampler` (several TRL rollout rounds merged).
- ``compute_loss``: counts trained (loss-mask) tokens.
- ``_save_checkpoint``: also saves the sampler/monitor/ledger state (``thinkgate_state.json``, ``ledger_state.json``).

Metrics added to TRL's logs: ``signal/effective_ratio`` (informative groups / groups rolled out, per group, in both
aggregation modes; informative = accuracy varies by default, ``advantages.signal``), ``signal/batch_effective_ratio``
(in the trained batch), ``signal/reward_variance_ratio`` (groups whose total-reward advantages vary),
``signal/<reward>/zero_std_frac``,
``advantages/collapsed_pair_frac``, ``dynamic_sampling/{rounds,skipped_prompts,dropped_groups,padded_groups}``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from training.grpo.advantages import AdvantageResult, collapsed_pair_fraction, compute_advantages
from training.grpo.batching import merge_rows
from training.grpo.config import AdvantageConfig
from training.grpo.ledger import StepCounters
from training.grpo.length_penalties import _GroupReward
from training.grpo.sampling import Candidate, DynamicSampler, ScoredGroup

logger = logging.getLogger(__name__)

STATE_FILE = "thinkgate_state.json"
_COLLAPSE_MAX_ROWS = 2048


def problem_key(row: dict[str, Any]) -> str:
    """Stable id of a dataset row: its ``problem_id`` column, else its prompt rendered as JSON."""
    pid = row.get("problem_id")
    return str(pid) if pid is not None else json.dumps(row.get("prompt"), sort_keys=True, default=str)


class ThinkGateGRPOTrainer(GRPOTrainer):
    """GRPO with ThinkGate's advantages, dynamic sampling, cost counters and extra checkpoint state."""

    def __init__(
        self,
        *args: Any,
        advantage_config: AdvantageConfig | None = None,
        counters: StepCounters | None = None,
        dynamic_sampler: DynamicSampler | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.advantage_config = advantage_config or AdvantageConfig()
        self.counters = counters if counters is not None else StepCounters()
        self.dynamic_sampler = dynamic_sampler
        self.state_savers: list[Callable[[Path], None]] = []
        self._last_rewards: torch.Tensor | None = None
        # dynamic sampling: the (B, K) rewards and problem ids of the merged batch, row-aligned with it (inspection)
        self.last_batch_rewards: torch.Tensor | None = None
        self.last_batch_problem_ids: list[str] = []
        n_proc = self.accelerator.num_processes
        if dynamic_sampler is not None and n_proc > 1:
            raise ValueError("dynamic sampling is implemented for a single process (num_processes=1)")
        local = self.args.per_device_train_batch_size * self.args.steps_per_generation
        if n_proc > 1 and local % self.num_generations and any(isinstance(f, _GroupReward) for f in self.reward_funcs):
            raise ValueError(
                "group-relative rewards (kimi_length, alp_length) need whole groups per process: make "
                f"per_device_train_batch_size * steps_per_generation ({local}) a multiple of num_generations "
                f"({self.num_generations})"
            )

    # -- counting ----------------------------------------------------------------------------------------------
    def _generate(self, prompts: list) -> Any:
        t0 = time.perf_counter()
        out = super()._generate(prompts)
        dt = time.perf_counter() - t0
        if self.model.training:
            prompt_ids, completion_ids = out[0], out[1]
            c = self.counters
            c.generation_s += dt
            c.rollouts += len(completion_ids)
            c.prompts += len(completion_ids) // self.num_generations
            c.prompt_tokens += sum(len(p) for p in prompt_ids)
            c.sampled_tokens += sum(len(x) for x in completion_ids)
        else:
            self.counters.eval_s += dt
        return out

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        dt = time.perf_counter() - t0
        if self.model.training:
            self.counters.reward_s += dt
        else:
            self.counters.eval_s += dt
        self._last_rewards = rewards
        return rewards

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        if model.training:
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:
                mask = mask * inputs["tool_mask"]
            self.counters.trained_tokens += int(mask.sum().item())
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    # -- advantages ------------------------------------------------------------------------------------------
    def _advantages(self, rewards: torch.Tensor, g: int) -> AdvantageResult:
        a = self.advantage_config
        return compute_advantages(rewards, self.reward_weights, g, a.aggregation, a.scale, a.epsilon)

    def _solved_per_group(self, rewards: torch.Tensor, g: int) -> list[int]:
        """Rollouts per group counted as solved: ``pass_reward >= pass_threshold`` (weighted total when the
        pass reward is not configured)."""
        a = self.advantage_config
        if a.pass_reward in self.reward_func_names:
            col = rewards[:, self.reward_func_names.index(a.pass_reward)]
        else:
            col = (torch.nan_to_num(rewards) * self.reward_weights.to(rewards).unsqueeze(0)).sum(dim=1)
        return (torch.nan_to_num(col, nan=float("-inf")) >= a.pass_threshold).view(-1, g).sum(dim=1).tolist()

    def _group_signal(self, rewards: torch.Tensor, res: AdvantageResult, g: int) -> torch.Tensor:
        """(n_groups,) bool: the group is informative under ``advantages.signal`` — ``accuracy``: some but not all
        rollouts solved (DAPO's filter); ``reward``: its total-reward advantages are not all equal."""
        if self.advantage_config.signal == "accuracy":
            solved = torch.tensor(self._solved_per_group(rewards, g))
            return (solved > 0) & (solved < g)
        return res.group_has_signal.cpu()

    def _log_signal(self, mode: str, res: AdvantageResult, rewards: torch.Tensor, rolled_ratio: float, g: int) -> None:
        m = self._metrics[mode]
        m["signal/effective_ratio"].append(rolled_ratio)
        m["signal/batch_effective_ratio"].append(self._group_signal(rewards, res, g).float().mean().item())
        m["signal/reward_variance_ratio"].append(res.group_has_signal.float().mean().item())
        for k, name in enumerate(self.reward_func_names):
            m[f"signal/{name}/zero_std_frac"].append(res.component_zero_std[:, k].float().mean().item())
        if rewards.size(0) <= _COLLAPSE_MAX_ROWS:
            m["advantages/collapsed_pair_frac"].append(collapsed_pair_fraction(rewards, res.advantages))

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        mode = "train" if self.model.training else "eval"
        g = self.num_generations if mode == "train" else self.num_generations_eval
        if mode == "train" and self.dynamic_sampler is not None:
            return self._dynamic_generate_and_score(inputs, g)
        out = super()._generate_and_score_completions(inputs)
        rewards = self._last_rewards
        assert rewards is not None
        res = self._advantages(rewards, g)
        start = self.accelerator.process_index * len(inputs)
        out["advantages"] = res.advantages[start : start + len(inputs)].to(out["advantages"])
        sig = self._group_signal(rewards, res, g)
        if mode == "train":  # this process's rollouts in groups without signal (the ledger sums processes)
            row_sig = sig.repeat_interleave(g)[start : start + len(inputs)]
            self.counters.zero_signal_rollouts += int((~row_sig).sum())
        self._log_signal(mode, res, rewards, sig.float().mean().item(), g)
        return out

    def _dynamic_generate_and_score(self, inputs: list[dict[str, Any]], g: int) -> dict[str, Any]:
        sampler = self.dynamic_sampler
        assert sampler is not None
        if len(inputs) % g:
            raise ValueError(f"generation batch of {len(inputs)} rows is not a multiple of num_generations={g}")
        target = len(inputs) // g
        initial = [Candidate(problem_key(inputs[i * g]), inputs[i * g]) for i in range(target)]
        rounds: list[tuple[dict[str, Any], torch.Tensor]] = []

        def rollout(cands: list[Candidate]) -> list[ScoredGroup]:
            rows = [c.payload for c in cands for _ in range(g)]
            out = super(ThinkGateGRPOTrainer, self)._generate_and_score_completions(rows)
            rewards = self._last_rewards
            assert rewards is not None
            res = self._advantages(rewards, g)
            solved = self._solved_per_group(rewards, g)
            sig = self._group_signal(rewards, res, g)
            # counted per round, so an aborted step (NoLearningSignalError) still reports what it paid for
            self.counters.zero_signal_rollouts += int((~sig).sum()) * g
            r_idx = len(rounds)
            rounds.append((out, rewards))
            return [
                ScoredGroup(c.pid, bool(sig[j]), g, int(solved[j]), payload=(r_idx, j)) for j, c in enumerate(cands)
            ]

        fill = sampler.fill(target, initial, rollout)
        parts, reward_rows = [], []
        for sg in fill.groups:
            r_idx, j = sg.payload
            rows = list(range(j * g, (j + 1) * g))
            parts.append((rounds[r_idx][0], rows))
            reward_rows.append(rounds[r_idx][1][j * g : (j + 1) * g])
        merged = merge_rows(parts, self._tokenizer.pad_token_id)
        rewards = torch.cat(reward_rows, dim=0)
        res = self._advantages(rewards, g)
        merged["advantages"] = res.advantages.to(merged["completion_mask"].device)
        self.last_batch_rewards = rewards
        self.last_batch_problem_ids = [str(sg.pid) for sg in fill.groups for _ in range(g)]
        self.counters.dropped_rollouts += (fill.dropped + fill.extra_signal_dropped) * g
        self._log_signal("train", res, rewards, fill.signal_groups / max(1, fill.rolled_groups), g)
        m = self._metrics["train"]
        m["dynamic_sampling/rounds"].append(float(fill.rounds))
        m["dynamic_sampling/skipped_prompts"].append(float(fill.skipped))
        m["dynamic_sampling/dropped_groups"].append(float(fill.dropped + fill.extra_signal_dropped))
        m["dynamic_sampling/padded_groups"].append(float(fill.padded))
        return merged

    # -- checkpoint state ----------------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        t0 = time.perf_counter()
        try:
            self._save_checkpoint_inner(model, trial)
        finally:
            took = time.perf_counter() - t0
            self.counters.io_s += took
            self.counters.save_s += took  # the ledger reserves the finish's checkpoint and model saves from it

    def _save_checkpoint_inner(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if not self.args.should_save:
            return
        ckpt = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        state: dict[str, Any] = {"global_step": self.state.global_step}
        if self.dynamic_sampler is not None:
            state["dynamic_sampler"] = self.dynamic_sampler.state_dict()
        (ckpt / STATE_FILE).write_text(json.dumps(state))
        for save in self.state_savers:
            save(ckpt)

    def load_thinkgate_state(self, checkpoint: str | Path) -> None:
        """Restore the sampler state saved by :meth:`_save_checkpoint` (call before ``train(resume_...)``)."""
        path = Path(checkpoint) / STATE_FILE
        if not path.is_file():
            logger.warning("no %s in %s: dynamic-sampling history starts empty", STATE_FILE, checkpoint)
            return
        state = json.loads(path.read_text())
        if self.dynamic_sampler is not None and "dynamic_sampler" in state:
            self.dynamic_sampler.load_state_dict(state["dynamic_sampler"])
