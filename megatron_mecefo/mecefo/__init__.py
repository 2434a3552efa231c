"""MeCeFO degraded-mode compute (attention-backward skip, FFN recompute, low-rank FFN weight grads,
masked averaging). The takeover planner lives in `megatron_mecefo.plan` (pure, below this package).

Public API: `install_degraded_mode(model, cfg) -> DegradedModeController`, `MecefoConfig`.
Importing this package does not import megatron.core.
"""

from megatron_mecefo.mecefo.config import MecefoConfig
from megatron_mecefo.mecefo.degraded import DegradedModeController, install_degraded_mode

__all__ = ["DegradedModeController", "MecefoConfig", "install_degraded_mode"]
