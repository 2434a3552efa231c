"""Error hierarchy and process exit codes shared by the Python code and the launch scripts.

Every error a user can cause derives from `MecefoError` and carries a one-line, actionable message;
entry points turn it into a single `error: ...` line and the matching `ExitCode`, not a traceback.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes; `launch/README.md` lists the same table for the shell scripts."""

    OK = 0
    FAILURE = 1
    """Unexpected internal error (a bug): a traceback is printed."""
    CONFIG_ERROR = 2
    """Bad configuration or command line."""
    DATA_ERROR = 3
    """Missing or corrupt data, tokenizer/model mismatch."""
    DISTRIBUTED_ERROR = 4
    """A layout the job cannot run: world size not divisible by TP x PP, NCCL without CUDA, too
    few GPUs, an unhealthy GPU at the preflight. Deterministic: never restarted."""
    CHECKPOINT_ERROR = 5
    """No valid checkpoint or snapshot to resume from."""
    COORDINATOR_LOST = 6
    """The job's store (served by `mecefo-coordinator`, or an etcd cluster that lost its quorum)
    is gone or unreachable: every rank aborts (no hang). A coordinator process that dies is
    restarted in place, or another is elected (etcd), and does not cause this."""
    REJOIN = 7
    """This rank left the membership (fenced, its replica lost a TP peer, or no generation
    admitted it in time); the per-node agent restarts it and it rejoins from a live peer's state."""
    JOB_ABORTED = 8
    """The coordinator aborted the job: too few replicas left, or no survivor holds the state."""
    PREEMPTED = 9
    """A stop was requested (SIGUSR1 to `mecefo-launch` or to the trainers, e.g. Slurm's warning
    before the time limit): every rank stopped at the same step after a final checkpoint. Requeue
    the job to resume from it."""
    EVICTED = 11
    """This rank's step reproduced a numerical fault (NaN/Inf) that a healthy peer did not on the
    same inputs (`failover/trainer/rerun.py`): the rank is evicted, never restarted in place; the
    survivors take over its micro-batches (10 is the precheck's "already complete")."""


class MecefoError(Exception):
    """Base class of all errors the project raises on purpose."""

    exit_code: ExitCode = ExitCode.FAILURE


class ConfigError(MecefoError, ValueError):
    """A config file, key or value is invalid."""

    exit_code = ExitCode.CONFIG_ERROR


class DataError(MecefoError):
    """Input data is missing, corrupt or inconsistent with the model."""

    exit_code = ExitCode.DATA_ERROR


class DistributedSetupError(MecefoError):
    """The process layout cannot run the requested parallelism."""

    exit_code = ExitCode.DISTRIBUTED_ERROR


class QuorumTimeoutError(MecefoError):
    """No membership formed in time (a fault, not a mistake: the agent restarts the rank)."""

    exit_code = ExitCode.REJOIN


class FencedError(MecefoError):
    """This rank is no longer a member (declared dead, or its replica lost a rank)."""

    exit_code = ExitCode.REJOIN


class RollbackError(MecefoError):
    """The job rolls back to saved state: this rank exits to be restarted, and loads the newest
    snapshot or checkpoint (no newer than `keys.ROLLBACK_BOUND` when that is set)."""

    exit_code = ExitCode.REJOIN


class ShardsLostError(RollbackError):
    """Every copy of an optimizer shard was lost at once: a rollback to the newest saved state."""


class DivergedUpdateError(RollbackError):
    """Two replicas' states differ after an update and neither changed at rest: both redo the
    update from saved state, to tell which one computed it wrong (`failover/trainer/rerun.py`)."""


class JobAbortedError(MecefoError):
    """The coordinator aborted the job (quorum lost, no survivor)."""

    exit_code = ExitCode.JOB_ABORTED


class CheckpointError(MecefoError):
    """A checkpoint is missing, incomplete or fails validation."""

    exit_code = ExitCode.CHECKPOINT_ERROR


class SnapshotCorruptError(CheckpointError):
    """An in-memory snapshot failed its checksum."""


class CorruptStateError(MecefoError):
    """This replica's state differs from the majority's (silent data corruption): it leaves and
    rejoins with a healthy peer's state (`ExitCode.REJOIN`)."""

    exit_code = ExitCode.REJOIN


class EvictedError(MecefoError):
    """This rank is evicted for a persistent numerical fault (`ExitCode.EVICTED`)."""

    exit_code = ExitCode.EVICTED


class NumericalFaultError(MecefoError):
    """A step's loss or gradients stayed NaN/Inf on every attempt, with no peer to tell a data
    fault from a device fault (a run without failover)."""

    exit_code = ExitCode.DATA_ERROR
