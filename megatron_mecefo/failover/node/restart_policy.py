"""When the node agent restarts a rank, and when it stops the node instead.

A rank exiting with a deterministic error (bad config, data or layout, no state to load) or one
that says the job is over (coordinator lost, job aborted) is never restarted: the node stops with
its code, and a deterministic error ends the whole job (`DETERMINISTIC`: the agent raises the
job's abort flag, so no other node trains on without it). Any other death is a fault: restarted
after the base delay, with an optional backoff for a rank that keeps dying soon after it starts.
No torch import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from megatron_mecefo.errors import ExitCode

BACKOFF_ENV = "MECEFO_RESTART_BACKOFF"
BACKOFF_MAX_ENV = "MECEFO_RESTART_BACKOFF_MAX_S"
BACKOFF_RESET_ENV = "MECEFO_RESTART_BACKOFF_RESET_S"

DETERMINISTIC = frozenset(
    {
        ExitCode.CONFIG_ERROR,
        ExitCode.DATA_ERROR,
        ExitCode.DISTRIBUTED_ERROR,
        ExitCode.CHECKPOINT_ERROR,
    }
)
"""A mistake that a restart would only repeat: the job ends."""
FATAL = DETERMINISTIC | {ExitCode.COORDINATOR_LOST, ExitCode.JOB_ABORTED}
"""Exit codes that stop the node (with that code) instead of a restart."""
FINISHED = frozenset({ExitCode.OK, ExitCode.PREEMPTED})
"""Exit codes of a rank that is done: not restarted, not a failure."""


def restart_delay_s(
    base_s: float, quick_deaths: int, environ: Mapping[str, str] = os.environ
) -> float:
    """Delay before restarting a rank that died `quick_deaths` times in a row soon after starting
    (the first death: 0): `base_s * MECEFO_RESTART_BACKOFF ** quick_deaths`, at most
    MECEFO_RESTART_BACKOFF_MAX_S. Backoff 1 (the default) keeps the delay constant."""
    factor = float(environ.get(BACKOFF_ENV, 1.0))
    cap = float(environ.get(BACKOFF_MAX_ENV, 300.0))
    return min(max(cap, base_s), base_s * factor ** max(0, quick_deaths))


def is_quick_death(lived_s: float, environ: Mapping[str, str] = os.environ) -> bool:
    """A death within MECEFO_RESTART_BACKOFF_RESET_S of the start continues the backoff streak;
    a rank that lived longer starts over at the base delay."""
    return lived_s < float(environ.get(BACKOFF_RESET_ENV, 600.0))
