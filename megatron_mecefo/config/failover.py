"""Trainer-side failover settings (pure dataclass; here, below `failover/`, so that `config.run`
composes it without an upward import). Coordinator-side detection knobs are flags of
`mecefo-coordinator` (and `mecefo-launch`), since the coordinator never reads a run config."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(kw_only=True)
class FailoverConfig:
    """How a trainer takes part in failover when launched by `mecefo-launch`.

    Failover is active only when the process finds a coordinator (`MECEFO_COORDINATOR`, set by
    `mecefo-launch`); under plain torchrun these settings are ignored and a rank death ends the job.
    """

    heartbeat_interval_s: float = 0.2
    """Seconds between heartbeats (a thread independent of the training step)."""
    coordinator_timeout_s: float = 5.0
    """A trainer that cannot reach the coordinator for this long exits with COORDINATOR_LOST."""
    failure_wait_s: float = 3.0
    """After a collective fails, how long to wait for the coordinator to publish a new membership
    before redoing the step on the same membership (a transient error)."""
    start_timeout_s: float = 1800.0
    """Bound on waiting for rank 0 to prepare the data and for the first generation to form."""
    regroup_timeout_s: float = 120.0
    """Give up (DISTRIBUTED_ERROR) if no usable membership forms within this time, a (re)joining
    replica's state transfer included."""
    collective_timeout_floor_s: float = 10.0
    """With gloo, each DP collective of a generation's group times out after max(this, factor x
    the slowest committed step): the coordinator's hang rule (its --hang-timeout-floor-s; keep
    the two equal). A reduction abandoned when a member died then ends within this bound, and
    with it gloo's busy transport thread (`failover/trainer/collectives.py`)."""
    collective_timeout_factor: float = 5.0
    """See `collective_timeout_floor_s` (the coordinator's --hang-timeout-factor)."""
    audit: bool = False
    """Write every committed (step, source replica, micro-batch) each rank ran to
    `run_dir/audit/tasks_rank<R>.jsonl` and, at the end, a SHA-256 of each rank's model and
    optimizer state to `run_dir/audit/state_rank<R>.json` (checks of the no-loss and
    bitwise-identical-replicas guarantees; cheap, off by default)."""

    shard_copies: int = 2
    """With `training.use_distributed_optimizer`: live replicas that hold each optimizer shard,
    on different nodes where possible. 2 keeps an exact copy through any single replica or node
    loss at 2 x 12 / DP bytes per parameter; 1 is plain ZeRO-1 (a lost shard ends the job)."""

    def __post_init__(self) -> None:
        if self.shard_copies < 1:
            raise ValueError(f"failover.shard_copies must be >= 1, got {self.shard_copies}")
        for name in (
            "heartbeat_interval_s",
            "coordinator_timeout_s",
            "failure_wait_s",
            "start_timeout_s",
            "regroup_timeout_s",
            "collective_timeout_floor_s",
            "collective_timeout_factor",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"failover.{name} must be > 0, got {getattr(self, name)}")
        if self.coordinator_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("failover.coordinator_timeout_s must exceed heartbeat_interval_s")
