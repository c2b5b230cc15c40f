"""Where the shipped tiny models live: ``models/`` at the top of the source checkout (not package data: the
product wheel carries no models, and training runs from a checkout). ``MODELS_DIR / "thinkgate-tiny"`` is the
SFT over-thinker, ``-short`` its GRPO length-penalised sibling, ``-dial`` the budget-following one."""

from __future__ import annotations

from pathlib import Path

#: the checkout's ``models/`` folder (one Hugging Face model directory per shipped model)
MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
#: the shipped SFT model (policy and tokenizer of the tiny runs; the tokenizer all three share)
TINY_MODEL_DIR = MODELS_DIR / "thinkgate-tiny"
