"""Merging rows of TRL scored batches of different padded widths (dynamic-sampling refills)."""

from __future__ import annotations

import pytest
import torch

from training.grpo.batching import merge_rows

PAD = 0


def batch(prompts: list[list[int]], completions: list[list[int]]) -> dict:
    pw = max(len(p) for p in prompts)
    cw = max(len(c) for c in completions)
    return {
        "prompt_ids": torch.tensor([[PAD] * (pw - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (pw - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [PAD] * (cw - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (cw - len(c)) for c in completions]),
        "old_per_token_logps": torch.tensor([[-0.5] * len(c) + [0.0] * (cw - len(c)) for c in completions]),
        "advantages": torch.arange(len(prompts), dtype=torch.float32),
        "num_items_in_batch": torch.tensor(sum(len(c) for c in completions)),
    }


def test_merge_pads_prompts_left_and_completions_right() -> None:
    a = batch([[7, 8], [9]], [[1, 2, 3], [4]])
    b = batch([[5, 6, 7, 8]], [[2]])
    out = merge_rows([(a, [1]), (b, [0]), (a, [0])], PAD)
    assert out["prompt_ids"].tolist() == [[0, 0, 0, 9], [5, 6, 7, 8], [0, 0, 7, 8]]
    assert out["prompt_mask"].tolist() == [[0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 1, 1]]
    assert out["completion_ids"].tolist() == [[4, 0, 0], [2, 0, 0], [1, 2, 3]]
    assert out["completion_mask"].tolist() == [[1, 0, 0], [1, 0, 0], [1, 1, 1]]
    assert out["old_per_token_logps"][2].tolist() == [-0.5, -0.5, -0.5]
    assert out["advantages"].tolist() == [1.0, 0.0, 0.0]
    assert out["num_items_in_batch"].item() == 1 + 1 + 3  # recomputed from the merged loss mask


def test_merge_refuses_multimodal_and_mismatched_keys() -> None:
    a = batch([[1]], [[2]])
    with pytest.raises(NotImplementedError, match="text-only"):
        merge_rows([({**a, "pixel_values": torch.zeros(1, 3)}, [0])], PAD)
    with pytest.raises(ValueError, match="differ"):
        merge_rows([(a, [0]), ({k: v for k, v in a.items() if k != "old_per_token_logps"}, [0])], PAD)
