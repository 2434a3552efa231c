"""Settings of the in-job numerical checks (`training/anomaly.py`, `failover/trainer/rerun.py`):
pure dataclasses, below both, so that `config.run` composes them without an upward import."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(kw_only=True)
class AnomalyConfig:
    """NaN/Inf in a step's loss or gradients: caught before the update, rerun, classified."""

    enabled: bool = True
    """Check each step attempt's local loss and local gradients (before they are reduced) for
    NaN/Inf; a rank that finds one votes the step down, so no NaN reaches the parameters or the
    optimizer state. Costs one pass over the gradient buffers per step."""
    check_timeout_s: float = 120.0
    """Under failover: how long members wait for the healthy peer's recomputation of a suspect's
    micro-batches (the classification of a fault that reproduced on a rerun)."""
    fingerprint_interval: int = 1
    """Under failover: every this many steps each replica adds a fingerprint of its parameters and
    optimizer state to the commit vote (0 = never). Replicas must be bitwise equal: one that
    differs from the majority is rejoined from a healthy peer, evicted if it happens twice
    (`docs/anomalies.md`). Costs one read of the state per fingerprinted step."""
    max_attempts: int = 3
    """Without failover (no peer to compare with): attempts of one step whose loss or gradients
    stay NaN/Inf before the run stops with DATA_ERROR."""

    def __post_init__(self) -> None:
        if self.check_timeout_s <= 0 or self.max_attempts < 2 or self.fingerprint_interval < 0:
            raise ValueError(
                "anomaly.check_timeout_s must be > 0, max_attempts >= 2, fingerprint_interval >= 0"
            )
