"""Supervised fine-tuning on verified teacher traces (TRL ``SFTTrainer``) with GRPO's ledger and run directory."""
