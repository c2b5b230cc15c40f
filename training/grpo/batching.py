"""Select rows from several scored TRL generation batches and merge them into one (dynamic sampling).

A TRL scored batch (``GRPOTrainer._generate_and_score_completions`` output, text-only) is a dict of tensors with
one row per rollout: prompts left-padded, completions and per-token tensors right-padded, ``advantages`` (B,),
and the scalar ``num_items_in_batch`` (loss-mask tokens). Rounds differ in padded width, so rows are re-padded to
the widest part. ``advantages`` and ``num_items_in_batch`` are recomputed by the caller / here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

_LEFT = {"prompt_ids", "prompt_mask"}
_RIGHT_VALUE = {
    "completion_ids": None,  # pad token id
    "completion_mask": 0,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 0.0,
    "tool_mask": 1,
}
_ROW = {"advantages"}
_SCALAR = {"num_items_in_batch"}


def _pad_to(t: torch.Tensor, width: int, value: float | int, left: bool) -> torch.Tensor:
    extra = width - t.size(1)
    if extra <= 0:
        return t
    return F.pad(t, (extra, 0) if left else (0, extra), value=value)


def merge_rows(parts: Sequence[tuple[dict[str, Any], Sequence[int]]], pad_token_id: int) -> dict[str, Any]:
    """Concatenate ``batch[rows]`` over ``parts`` (in order). Raises ``NotImplementedError`` for keys other than
    the text-only GRPO keys (multimodal batches are not supported by dynamic sampling)."""
    if not parts:
        raise ValueError("nothing to merge")
    keys = set(parts[0][0])
    for batch, _ in parts:
        if set(batch) != keys:
            raise ValueError(f"scored batches differ in keys: {sorted(keys ^ set(batch))}")
    unknown = keys - _LEFT - set(_RIGHT_VALUE) - _ROW - _SCALAR
    if unknown:
        raise NotImplementedError(f"dynamic sampling supports text-only batches; unexpected keys {sorted(unknown)}")
    out: dict[str, Any] = {}
    for key in sorted(keys - _SCALAR):
        pieces = []
        for batch, rows in parts:
            idx = torch.as_tensor(list(rows), dtype=torch.long, device=batch[key].device)
            pieces.append(batch[key].index_select(0, idx))
        if key in _ROW:
            out[key] = torch.cat(pieces, dim=0)
            continue
        width = max(p.size(1) for p in pieces)
        left = key in _LEFT
        value = (0 if key == "prompt_mask" else pad_token_id) if left else _RIGHT_VALUE[key]
        if value is None:
            value = pad_token_id
        out[key] = torch.cat([_pad_to(p, width, value, left) for p in pieces], dim=0)
    mask = out["completion_mask"]
    if "tool_mask" in out:
        mask = mask * out["tool_mask"]
    out["num_items_in_batch"] = mask.sum()
    return out
