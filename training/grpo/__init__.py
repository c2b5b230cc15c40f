"""GRPO post-training with length control on TRL's GRPOTrainer (`thinkgate train grpo`).

Modules: ``config`` (run dataclasses), ``rewards`` / ``length_penalties`` (TRL reward functions), ``advantages``
(multi-reward aggregation, signal metrics), ``sampling`` (dynamic sampling), ``monitors`` (callbacks), ``ledger``
(cost ledger), ``trainer`` (GRPOTrainer subclass), ``run`` (one run end to end), ``cli``. Nothing heavy is imported
here.
"""
