"""Optimisation and schedule settings of a run (pure dataclass; here, below `training/`, so that
`config.run` composes it without an upward import)."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(kw_only=True)
class TrainingConfig:
    """Batch shape, optimiser (AdamW), LR schedule (warmup + cosine), evaluation cadence."""

    seed: int = 1234
    """Seed for weights, dropout and data order; identical on every rank."""
    max_steps: int = 200
    """Optimizer steps to run."""
    micro_batch_size: int = 4
    """Sequences per micro-batch."""
    num_microbatches: int = 2
    """Micro-batches per DP replica per step (gradient accumulation); global batch =
    micro_batch_size x num_microbatches x DP size. Derived from `global_batch_size` when that is
    set (the value given here is then replaced at start-up)."""
    global_batch_size: int | None = None
    """Sequences per optimizer step, fixed whatever the node count: num_microbatches becomes
    global_batch_size / (micro_batch_size x DP size) at start-up, which must divide evenly
    (`megatron_mecefo/config/batch.py`). None: the global batch follows the DP size."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup from 0 to `lr`."""
    lr_decay_steps: int | None = None
    """Steps of warmup + cosine decay; None = max_steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto = bf16 on GPU, fp32 on CPU."""
    eval_interval: int = 50
    """Evaluate validation loss every this many steps (and at the end); 0 disables."""
    eval_microbatches: int = 8
    """Validation micro-batches per evaluation (a fixed set, identical for any DP size)."""
    use_distributed_optimizer: bool = False
    """Shard fp32 master weights and AdamW moments over the DP replicas (ZeRO-1, as megatron's
    DistributedOptimizer; our own, `megatron_mecefo/optim/`, so shards survive failover).
    Under failover each shard is kept on `failover.shard_copies` replicas."""

    def __post_init__(self) -> None:
        positive = ("max_steps", "micro_batch_size", "num_microbatches", "eval_microbatches")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size is not None and (
            self.global_batch_size < 1 or self.global_batch_size % self.micro_batch_size
        ):
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a positive multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(
                f"need 0 <= min_lr <= lr and lr > 0 (lr={self.lr}, min_lr={self.min_lr})"
            )
        if self.warmup_steps < 0 or self.eval_interval < 0 or self.clip_grad < 0:
            raise ValueError("warmup_steps, eval_interval and clip_grad must be >= 0")
        if self.lr_decay_steps is not None and self.lr_decay_steps < max(1, self.warmup_steps):
            raise ValueError("lr_decay_steps must be >= warmup_steps")
