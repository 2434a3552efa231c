"""MeCeFO degraded-mode compute (attention-backward skip, FFN recompute, low-rank FFN weight grads,
masked averaging) and the takeover planner.

Public API: `install_degraded_mode(model, cfg) -> DegradedModeController`, `MecefoConfig`,
`make_step_plans`, `neighbor_of`, `CostModel`. Importing this package does not import megatron.core.
"""

from megatron_mecefo.mecefo.config import MecefoConfig
from megatron_mecefo.mecefo.cost import CostModel, microbatch_flops
from megatron_mecefo.mecefo.degraded import DegradedModeController, install_degraded_mode
from megatron_mecefo.mecefo.plan import make_step_plans, neighbor_of, plan_step_times

__all__ = [
    "CostModel",
    "DegradedModeController",
    "MecefoConfig",
    "install_degraded_mode",
    "make_step_plans",
    "microbatch_flops",
    "neighbor_of",
    "plan_step_times",
]
