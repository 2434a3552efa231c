"""A graceful stop on request: SIGUSR1 (Slurm's `--signal` before the time limit, or by hand),
and SIGTERM when MECEFO_TERM_GRACE_S is set (Slurm's scancel, time limit or preemption).

The signal only sets a flag; the ranks agree on the step to stop after (every rank must save the
same final checkpoint), the loop ends there, and the process exits `PREEMPTED`. Without failover
the agreement is a one-element all-reduce of the flag after each step; under failover it rides on
the commit vote (`failover/trainer/commit.py`), so it costs nothing extra.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from megatron_mecefo.training.hooks import TrainHook

STOP_SIGNAL = signal.SIGUSR1
TERM_GRACE_ENV = "MECEFO_TERM_GRACE_S"
"""Seconds between SIGTERM and SIGKILL (Slurm's KillWait / preemption GraceTime). When set > 0,
SIGTERM is a graceful stop too (final checkpoint, exit PREEMPTED), as in Megatron's
--exit-signal-handler; unset, SIGTERM keeps its default (the process ends at once)."""


class StopFlag:
    """Set by SIGUSR1 (installed from the main thread) or by `request()`."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def install(self) -> StopFlag:
        signal.signal(STOP_SIGNAL, lambda signum, frame: self.request("SIGUSR1"))
        if float(os.environ.get(TERM_GRACE_ENV) or 0) > 0:  # Slurm's SIGTERM, then KILL later
            signal.signal(signal.SIGTERM, lambda signum, frame: self.request("SIGTERM"))
        return self

    def request(self, reason: str) -> None:
        self.reason = self.reason or reason
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()


class StopRequest(TrainHook):
    """Plain (torchrun) runs: all ranks stop after the first step at which any rank saw the flag."""

    def __init__(self, flag: StopFlag, world_size: int):
        self.flag = flag
        self.world_size = world_size

    def should_stop(self, engine: Any, result: Any) -> bool:
        if self.world_size == 1:
            return self.flag.is_set
        import torch
        import torch.distributed as dist

        seen = torch.tensor([1.0 if self.flag.is_set else 0.0], device=engine.ctx.device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)  # every rank calls this once per step
        return bool(seen.item() > 0)
