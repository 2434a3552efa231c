"""AdamW on flat fp32 tensors: the arithmetic of `torch.optim.AdamW` (single-tensor path),
element for element, so that a shard updated here equals the same elements updated by megatron's
replicated optimizer on CPU bit for bit. Weight decay varies by optimizer group (runs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_mecefo.optim.layout import Run


@torch.no_grad()
def adamw_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    step: int,
    lr: Sequence[float],
    weight_decay: Sequence[float],
    runs: Sequence[Run],
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """One AdamW update in place. `step` counts from 1; `lr[g]` and `weight_decay[g]` are optimizer
    group g's, applied to each run of that group."""
    for run in runs:  # decoupled weight decay, then the moments and the step, as torch orders them
        decay = lr[run.group] * weight_decay[run.group]
        if decay:
            master[run.lo : run.hi].mul_(1 - decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    if len({lr[r.group] for r in runs}) <= 1:
        step_size = (lr[runs[0].group] if runs else 0.0) / bias_correction1
        master.addcdiv_(exp_avg, denom, value=-step_size)
        return
    for run in runs:
        step_size = lr[run.group] / bias_correction1
        master[run.lo : run.hi].addcdiv_(
            exp_avg[run.lo : run.hi], denom[run.lo : run.hi], value=-step_size
        )
