"""MeCeFO degraded-mode compute (attention-backward skip, FFN recompute, low-rank FFN weight grads,
masked averaging). The takeover planner lives in `megatron_mecefo.plan` (pure, below this package).

Public API: `install_degraded_mode(model, cfg) -> DegradedModeController`, `MecefoConfig`.
Importing this package does not import megatron.core, nor torch: the compute loads on first use,
so a config can be read without it (the node agent does).
"""

from __future__ import annotations

import importlib

from megatron_mecefo.mecefo.config import MecefoConfig

__all__ = ["DegradedModeController", "MecefoConfig", "install_degraded_mode"]


def __getattr__(name: str):
    if name in ("DegradedModeController", "install_degraded_mode"):
        return getattr(importlib.import_module("megatron_mecefo.mecefo.degraded"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
