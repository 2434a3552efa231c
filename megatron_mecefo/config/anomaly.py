"""Settings of the in-job numerical checks (`training/anomaly.py`, `failover/trainer/rerun.py`):
pure dataclasses, below both, so that `config.run` composes them without an upward import."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(kw_only=True)
class AnomalyConfig:
    """NaN/Inf and spikes in a step's loss or gradients, and replicas whose states differ:
    caught before the update, rerun, classified (`docs/anomalies.md`)."""

    enabled: bool = True
    """Check each step attempt's local loss and local gradients (before they are reduced) for
    NaN/Inf; a rank that finds one votes the step down, so no NaN reaches the parameters or the
    optimizer state. Costs one pass over the gradient buffers per step."""
    loss_spike_factor: float = 3.0
    """A rank whose mean micro-batch loss exceeds this many times its median over the last
    `spike_window` committed steps votes the step down (0 = off). On three failure-free runs of
    1000 steps (`tools/bench/spike_threshold.py`, `docs/anomalies.md`) the largest ratio was
    1.10: a 2.7x margin. Real corpora shift more than the demo's; raise it before lowering it."""
    grad_spike_factor: float = 10.0
    """The same for the norm of a rank's local gradients, before they are reduced (0 = off).
    The largest failure-free ratio measured was 1.85 (right after the warm-up, while the
    learning rate still rises): a 5.4x margin, wide because gradient-norm spikes without a fault
    are common in LLM training."""
    spike_window: int = 100
    """Committed steps in the running median of each spike statistic."""
    spike_warmup: int = 20
    """Steps the window must hold before spikes are checked (the first steps' statistics move
    fast)."""
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
        for name in ("loss_spike_factor", "grad_spike_factor"):
            value = getattr(self, name)
            if value != 0 and not value > 1:
                raise ValueError(f"anomaly.{name} must be 0 (off) or > 1, got {value}")
        if self.spike_warmup < 1 or self.spike_window < self.spike_warmup:
            raise ValueError("anomaly.spike_warmup must be >= 1 and <= anomaly.spike_window")
