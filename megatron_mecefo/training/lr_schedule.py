"""Linear warmup then cosine decay to `min_lr` (pure function of the step)."""

from __future__ import annotations

import math

from megatron_mecefo.config.training import TrainingConfig


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """Learning rate for 0-based optimizer step `step`."""
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    span = max(1, decay_steps - cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / span
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
