"""Discrete-event simulation of one training job under one failure trace, strategy by strategy.

Time advances from event to event (failure, rejoin, checkpoint save, finish), never step by step:
progress accrues at 1 / (step_time_s * multiplier) steps per second. A fatal failure costs the
restart time and rolls progress back to the last saved checkpoint; failures during a restart are
absorbed by it (replacement hardware comes up with the job). This module owns time, not policy:
what is fatal and how slow a step is comes from `strategies.py`.

Spare nodes (`JobConfig.spare_nodes` K > 0): a masked failure takes a standby node from the pool,
and the dead group is back at full strength `replace_s` after the failure; the failed node is
repaired (`repair_s` of the trace) and joins the pool. With the pool empty the group stays dead
until a repaired node arrives (then `replace_s` more). A restart restores the pool to K. K = 0:
a dead group rejoins when its own node is repaired, as before.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.sim import spare
from megatron_mecefo.sim.failures import FailureProcess, FailureTrace, generate_trace
from megatron_mecefo.sim.strategies import (
    MEASURED_REPLACE_S,
    Strategy,
    StrategyConfig,
    build_strategy,
)


@dataclass(kw_only=True)
class JobConfig:
    """The training job being simulated (defaults: the SPARe paper's 600k-GPU setup, N = 600)."""

    num_gpus: int = 600_000
    """GPUs in the job."""
    gpus_per_group: int = 1000
    """GPUs per DP group (one TP x PP model replica); a failed GPU takes its group down."""
    num_steps: int = 10_000
    """Training steps to complete."""
    step_time_s: float = 64.0
    """Failure-free time of one step without redundancy (one SPARe stack layer)."""
    checkpoint_save_s: float = 60.0
    """T_s: blocking time of one disk checkpoint save."""
    restart_s: float = 3600.0
    """T_r: time from a fatal failure until training resumes (relaunch + load)."""
    horizon_factor: float = 40.0
    """Failure traces cover horizon_factor * T_0; runs slower than that are reported unfinished."""
    spare_nodes: int = 0
    """K: standby nodes that replace a failed group's node without a restart (0: none; a dead
    group then waits for its own repair)."""
    replace_s: float = MEASURED_REPLACE_S
    """Spare nodes: failure -> the group at full strength again on a standby node."""

    def __post_init__(self) -> None:
        for name in ("num_gpus", "gpus_per_group", "num_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_gpus % self.gpus_per_group:
            raise ConfigError(
                f"gpus_per_group={self.gpus_per_group} must divide num_gpus={self.num_gpus}"
            )
        if not self.step_time_s > 0:
            raise ConfigError(f"step_time_s must be > 0, got {self.step_time_s}")
        if self.checkpoint_save_s <= 0 or self.restart_s < 0:
            raise ConfigError("checkpoint_save_s must be > 0 and restart_s >= 0")
        if self.horizon_factor < 1:
            raise ConfigError(f"horizon_factor must be >= 1, got {self.horizon_factor}")
        if self.spare_nodes < 0:
            raise ConfigError(f"spare_nodes must be >= 0, got {self.spare_nodes}")
        if not (math.isfinite(self.replace_s) and self.replace_s >= 0):
            raise ConfigError(f"replace_s must be finite and >= 0, got {self.replace_s}")

    @property
    def num_groups(self) -> int:
        """N: number of DP groups."""
        return self.num_gpus // self.gpus_per_group

    @property
    def t0_s(self) -> float:
        """T_0: failure-free time to train without redundancy."""
        return self.num_steps * self.step_time_s


def trace_for_job(process: FailureProcess, job: JobConfig, seed: int) -> FailureTrace:
    """A failure trace covering `job`'s horizon (`horizon_factor * T_0`) on its GPUs and groups."""
    return generate_trace(
        process,
        num_gpus=job.num_gpus,
        gpus_per_group=job.gpus_per_group,
        horizon_s=job.t0_s * job.horizon_factor,
        seed=seed,
    )


@dataclass(kw_only=True)
class SimResult:
    """Outcome of one strategy on one trace."""

    label: str
    """Strategy display name."""
    finished: bool
    """False when the run did not finish within the trace horizon."""
    ttt_s: float
    """Wall time to train (inf when unfinished)."""
    t0_s: float
    """Failure-free time without redundancy."""
    restarts: int
    """Job restarts (fatal failures)."""
    masked_failures: int
    """Failures survived without a restart."""
    checkpoint_period_s: float
    """Disk checkpoint period used (inf: none)."""
    mean_multiplier: float
    """Time-weighted mean step-time multiplier while computing (S_bar for SPARe)."""
    uptime_fraction: float
    """Fraction of wall time spent computing (not restarting, saving or failing over)."""
    replacements: int = 0
    """Dead groups brought back by a spare node."""
    degraded_s: float = 0.0
    """Wall time spent computing with at least one group dead."""
    timeline: dict = field(default_factory=dict, repr=False)
    """{'time_s', 'progress_steps', 'up'} arrays sampled at events, for plots."""

    @property
    def ratio(self) -> float:
        """TTT / T_0."""
        return self.ttt_s / self.t0_s

    def summary(self) -> dict:
        """JSON-able summary (no timeline)."""
        return {
            "strategy": self.label,
            "finished": self.finished,
            "ttt_h": self.ttt_s / 3600.0,
            "ttt_over_t0": self.ratio,
            "restarts": self.restarts,
            "masked_failures": self.masked_failures,
            "checkpoint_period_s": self.checkpoint_period_s,
            "mean_step_multiplier": self.mean_multiplier,
            "uptime_fraction": self.uptime_fraction,
            "replacements": self.replacements,
            "degraded_h": self.degraded_s / 3600.0,
        }


def checkpoint_period(job: JobConfig, strategy: Strategy, system_mtbf_s: float | None) -> float:
    """The configured T_c, else T_c* for this strategy's expected time between fatal failures."""
    if not strategy.uses_disk_checkpoints:
        return math.inf
    if strategy.config.checkpoint_interval_s is not None:
        if strategy.config.checkpoint_interval_s <= job.checkpoint_save_s:
            raise ConfigError(
                f"checkpoint_interval_s={strategy.config.checkpoint_interval_s} must exceed "
                f"checkpoint_save_s={job.checkpoint_save_s}"
            )
        return strategy.config.checkpoint_interval_s
    if system_mtbf_s is None or not math.isfinite(system_mtbf_s):
        return math.inf
    mtbf = strategy.mtbf_factor() * system_mtbf_s
    return spare.optimal_checkpoint_period(job.checkpoint_save_s, mtbf, strategy.restart_s)


class _Run:
    """Mutable state of one simulation; methods are the event handlers."""

    def __init__(self, job: JobConfig, strategy: Strategy, trace: FailureTrace, period_s: float):
        self.job, self.strategy, self.trace, self.period_s = job, strategy, trace, period_s
        self.t = 0.0
        self.progress = 0.0
        self.saved = 0.0
        self.next_save = period_s - job.checkpoint_save_s
        self.i = 0
        self.rejoins: list[tuple[float, int]] = []
        self.restarts = self.masked = 0
        self.compute_s = self.weighted_s = self.degraded_s = 0.0
        self.pool = job.spare_nodes  # free standby nodes
        self.returns: list[float] = []  # heap: times failed nodes come back repaired
        self.waiting: list[int] = []  # dead groups waiting for a spare, oldest first
        self.replacements = 0
        self.log_t, self.log_p, self.log_up = [0.0], [0.0], [1]

    def log(self, up: int) -> None:
        self.log_t.append(self.t)
        self.log_p.append(self.progress)
        self.log_up.append(up)

    def advance(self, t_next: float) -> None:
        """Compute from self.t to t_next at the current step multiplier."""
        mult = self.strategy.multiplier()
        dt = t_next - self.t
        self.progress += dt / (self.job.step_time_s * mult)
        self.compute_s += dt
        self.weighted_s += dt * mult
        if self.strategy.num_dead:
            self.degraded_s += dt
        self.t = t_next

    def fail(self, t_fail: float, group: int, repair_s: float) -> None:
        """Handle a failure at t_fail (>= self.t)."""
        if self.strategy.dead[group]:
            return
        self.t = t_fail
        if self.strategy.fail(group):
            self.restart()
            return
        self.masked += 1
        self.log(0)
        self.t += self.strategy.failover_s
        if self.job.spare_nodes:
            self.replace(t_fail, group, repair_s)
        elif math.isfinite(repair_s):
            heapq.heappush(self.rejoins, (t_fail + repair_s, group))
        self.log(1)

    def replace(self, t_fail: float, group: int, repair_s: float) -> None:
        """Spare nodes: the failed node goes to repair; a free standby takes its place."""
        if math.isfinite(repair_s):
            heapq.heappush(self.returns, t_fail + repair_s)
        if self.pool:
            self.pool -= 1
            self.replacements += 1
            heapq.heappush(self.rejoins, (t_fail + self.job.replace_s, group))
        else:
            self.waiting.append(group)

    def node_returns(self, t_return: float) -> None:
        """A repaired node joins the pool, or replaces the longest-waiting dead group."""
        if self.waiting:
            self.replacements += 1
            heapq.heappush(self.rejoins, (t_return + self.job.replace_s, self.waiting.pop(0)))
        else:
            self.pool += 1

    def restart(self) -> None:
        self.log(0)
        self.restarts += 1
        self.t += self.strategy.restart_s
        if not self.strategy.uses_disk_checkpoints:  # every-step snapshot: only the step in flight
            self.saved = math.floor(self.progress)
        self.progress = self.saved
        self.strategy.reset()
        self.rejoins.clear()
        self.pool, self.waiting = self.job.spare_nodes, []  # the relaunch restores the pool
        self.returns.clear()
        times = self.trace.times_s
        while self.i < times.size and times[self.i] < self.t:
            self.i += 1  # failures during the restart are absorbed by it
        self.next_save = self.t + self.period_s - self.job.checkpoint_save_s
        self.log(1)

    def save(self) -> None:
        """Blocking checkpoint save; a fatal failure during it loses the save."""
        self.log(0)
        end = self.t + self.job.checkpoint_save_s
        tr = self.trace
        restarts = self.restarts
        while self.i < tr.times_s.size and tr.times_s[self.i] < end:
            i = self.i
            self.i += 1
            self.fail(max(self.t, tr.times_s[i]), int(tr.groups[i]), float(tr.repair_s[i]))
            if self.restarts > restarts:
                return
        self.t = end
        self.saved = self.progress
        self.next_save = self.t + self.period_s - self.job.checkpoint_save_s
        self.log(1)


def simulate(
    job: JobConfig,
    config: StrategyConfig,
    trace: FailureTrace,
    *,
    system_mtbf_s: float | None = None,
) -> SimResult:
    """Run `config` on `trace`. `system_mtbf_s` (m) picks T_c* when no period is configured."""
    strategy = build_strategy(config, job.num_groups, job.restart_s)
    period = checkpoint_period(job, strategy, system_mtbf_s)
    run = _Run(job, strategy, trace, period)
    times, groups, repairs = trace.times_s, trace.groups, trace.repair_s
    if groups.size and (groups.max() >= job.num_groups or groups.min() < 0):
        raise ConfigError(f"trace names a group outside 0..{job.num_groups - 1}")
    finished = False
    while True:
        rate_time = job.step_time_s * strategy.multiplier()
        t_finish = run.t + (job.num_steps - run.progress) * rate_time
        t_fail = max(run.t, times[run.i]) if run.i < times.size else math.inf
        t_rejoin = run.rejoins[0][0] if run.rejoins else math.inf
        t_return = run.returns[0] if run.returns else math.inf
        t_next = min(t_finish, t_fail, t_rejoin, t_return, run.next_save)
        if t_next > trace.horizon_s:
            break
        run.advance(max(t_next, run.t))
        if t_next == t_finish:
            finished = True
            break
        if t_next == t_fail:
            i = run.i
            run.i += 1
            run.fail(t_fail, int(groups[i]), float(repairs[i]))
        elif t_next == t_rejoin:
            _, group = heapq.heappop(run.rejoins)
            strategy.rejoin(group)
        elif t_next == t_return:
            run.node_returns(heapq.heappop(run.returns))
        else:
            run.save()
    run.log(1)
    return _result(run, config, finished)


def _result(run: _Run, config: StrategyConfig, finished: bool) -> SimResult:
    ttt = run.t if finished else math.inf
    return SimResult(
        label=config.label,
        finished=finished,
        ttt_s=ttt,
        t0_s=run.job.t0_s,
        restarts=run.restarts,
        masked_failures=run.masked,
        checkpoint_period_s=run.period_s,
        mean_multiplier=run.weighted_s / run.compute_s if run.compute_s else 1.0,
        uptime_fraction=run.compute_s / run.t if run.t else 1.0,
        replacements=run.replacements,
        degraded_s=run.degraded_s,
        timeline={
            "time_s": np.array(run.log_t),
            "progress_steps": np.array(run.log_p),
            "up": np.array(run.log_up),
        },
    )


def simulate_all(
    job: JobConfig,
    configs: list[StrategyConfig],
    trace: FailureTrace,
    *,
    system_mtbf_s: float | None = None,
) -> list[SimResult]:
    """The strategies side by side on the same trace."""
    return [simulate(job, c, trace, system_mtbf_s=system_mtbf_s) for c in configs]
