"""What a training run asks of the process it runs in: `RunControl`, the one interface between
the session (`megatron_mecefo/session.py`, which wires everything) and how the process takes part
in the job: `StaticRun` (a plain torchrun run) or failover's `FailoverManager`. The session never
branches on which. Pure interface: builds nothing, imports no checkpoint, snapshot or failover.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_mecefo.training.hooks import StepControl
from megatron_mecefo.training.membership import Membership
from megatron_mecefo.training.stop import StopFlag


class RunControl(StepControl):
    """How this process takes part in the job: set-up, every step (`StepControl`), the finish."""

    rank: int = 0
    """Global rank of this process."""
    first: bool = True
    """This process speaks for the job at start (its pre-checks: the occupied run directory)."""
    fresh: bool = True
    """A job start (not a restarted rank): it may resume from saved state."""
    resume: str | None = None
    """`checkpoint.resume` this process honours (None: the config's)."""
    membership: Membership
    """The DP membership the engine reduces and commits over (valid after `init_parallel`)."""

    def open(self, stop_flag: StopFlag) -> None:
        """Before anything is built (failover: register and start heartbeating)."""

    def init_parallel(self, cfg) -> Any:
        """Initialise process groups; returns the `ParallelContext`."""
        raise NotImplementedError

    @property
    def num_replicas(self) -> int:
        return self.membership.num_replicas

    def share_identity(self) -> Callable[[str], str]:
        """How every rank agrees on the state identity's proposal."""
        raise NotImplementedError

    def data_preparation(self) -> dict[str, Any]:
        """`build_engine`'s data arguments (who builds the data, how the others wait)."""
        return {}

    def shard_placement(self) -> dict[str, Any]:
        """How the distributed optimizer places its shards (`build_engine`): one copy each,
        placed at construction."""
        return {}

    def logger(self, component: str) -> Callable[[str], None]:
        """Where one component's messages go: `engine` (once for the job), `checkpoint`,
        `snapshot`, `recovery`."""
        raise NotImplementedError

    def saves_checkpoints(self) -> bool:
        """This replica writes the job's checkpoints now."""
        return True

    def start(self, engine, load_state: Callable[[], int | None]) -> int | None:
        """The first step to run, after loading or receiving state; None: the job finished
        without this process (it has nothing to do)."""
        return load_state() or 0

    @property
    def is_writer(self) -> bool:
        """Writes the metrics rows, the run directory and the summary now."""
        return self.rank == 0

    def layout(self, ctx) -> dict[str, Any]:
        """The job's layout, as `env.json` records it."""
        return {
            "world_size": ctx.world_size,
            "dp_size": self.num_replicas,
            "tp_size": ctx.tp_size,
            "pp_size": ctx.pp_size,
            "backend": ctx.backend,
        }

    def logs_metrics(self, ctx) -> bool:
        """This process may write the metrics (now, or when `metrics_writer` says so)."""
        return self.first

    metrics_writer: Callable[[], bool] | None = None
    """None: a process that `logs_metrics` writes from the start; else whether it writes now
    (the writer may change during the run)."""

    def claims_run_dir(self) -> bool:
        """This process creates the run directory (once per launch)."""
        return self.is_writer

    def run_dir_created(self, start_step: int) -> None:
        """Called by the process that created the run directory."""

    def joined(self, start_step: int) -> None:
        """Called on every process once its first step is known."""

    def job_summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The summary of the whole job (the writer's view of this process may be partial)."""
        return summary

    def stop(self) -> None:
        """After the loop, whatever happened in it."""

    def close(self, engine) -> None:
        """After a run that ended normally."""
