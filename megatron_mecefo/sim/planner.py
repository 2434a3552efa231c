"""Planner: sweep strategies and redundancy on shared failure traces, recommend the fastest.

Every candidate runs on the same traces (one per seed), with its optimal checkpoint period T_c*,
and is ranked by mean simulated time-to-train. Closed forms from `spare.py` are reported next to
the simulated ratios as a sanity check. Pure computation: printing belongs to `cli.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.sim import spare
from megatron_mecefo.sim.failures import FailureProcess
from megatron_mecefo.sim.simulator import JobConfig, SimResult, simulate, trace_for_job
from megatron_mecefo.sim.strategies import (
    MEASURED_NEIGHBOR_STEP_RATIO,
    MEASURED_SNAPSHOT_RESTART_S,
    STRATEGY_NAMES,
    StrategyConfig,
)


@dataclass(kw_only=True)
class PlanConfig:
    """What the planner sweeps."""

    strategies: list[str] = field(default_factory=lambda: list(STRATEGY_NAMES))
    """Strategy families to consider."""
    max_redundancy: int = 12
    """Largest r tried for replication and SPARe."""
    seeds: int = 2
    """Failure traces per candidate (results are averaged)."""
    seed: int = 0
    """First trace seed."""
    mecefo_policies: list[str] = field(default_factory=lambda: ["neighbor", "spread", "hybrid"])
    """MeCeFO takeover policies to try."""
    neighbor_step_ratio: float = MEASURED_NEIGHBOR_STEP_RATIO
    """MeCeFO degraded neighbour step time ratio (measured by the trainer benchmark)."""
    snapshot_restart_s: float = MEASURED_SNAPSHOT_RESTART_S
    """Restart cost from the in-memory snapshot (measured by tools/bench/recovery.py)."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategies if s not in STRATEGY_NAMES]
        if unknown:
            raise ConfigError(
                f"unknown strategy {unknown[0]!r} (allowed: {', '.join(STRATEGY_NAMES)})"
            )
        if self.max_redundancy < 2:
            raise ConfigError(f"max_redundancy must be >= 2, got {self.max_redundancy}")
        if self.seeds < 1:
            raise ConfigError(f"seeds must be >= 1, got {self.seeds}")


@dataclass(kw_only=True)
class PlanRow:
    """One candidate's averaged outcome."""

    config: StrategyConfig
    """The candidate."""
    ratio: float
    """Mean TTT / T_0 over seeds (inf if any run did not finish)."""
    uptime: float
    """Mean fraction of wall time computing."""
    restarts: float
    """Mean restarts per run."""
    checkpoint_period_s: float
    """T_c used."""
    closed_form_ratio: float | None
    """J(r) from the closed forms (replication / SPARe / ckpt), for comparison."""

    def summary(self, t0_s: float) -> dict:
        """JSON-able row."""
        return {
            "strategy": self.config.label,
            "redundancy": self.config.redundancy,
            "ttt_over_t0": self.ratio,
            "ttt_h": self.ratio * t0_s / 3600.0,
            "uptime_fraction": self.uptime,
            "restarts": self.restarts,
            "checkpoint_period_s": self.checkpoint_period_s,
            "closed_form_ttt_over_t0": self.closed_form_ratio,
        }


def candidates(job: JobConfig, plan: PlanConfig) -> list[StrategyConfig]:
    """All strategy configurations the planner tries."""
    out: list[StrategyConfig] = []
    r_max = min(plan.max_redundancy, job.num_groups)
    for name in plan.strategies:
        if name == "ckpt":
            out.append(StrategyConfig(name="ckpt"))
        elif name == "snapshot":
            out.append(StrategyConfig(name="snapshot", snapshot_restart_s=plan.snapshot_restart_s))
        elif name in ("replication", "spare"):
            out.extend(StrategyConfig(name=name, redundancy=r) for r in range(2, r_max + 1))
        else:
            out.extend(
                StrategyConfig(
                    name="mecefo", takeover_policy=p, neighbor_step_ratio=plan.neighbor_step_ratio
                )
                for p in plan.mecefo_policies
            )
    return out


def closed_form(job: JobConfig, config: StrategyConfig, system_mtbf_s: float) -> float | None:
    """Closed-form TTT / T_0 where one exists."""
    args = (system_mtbf_s, job.restart_s, job.checkpoint_save_s)
    if config.name == "ckpt":
        return spare.time_to_train_ratio(job.num_groups, 1, *args)
    if config.name in ("spare", "replication"):
        return spare.time_to_train_ratio(
            job.num_groups, config.redundancy, *args, scheme=config.name
        )
    return None


def sweep(
    job: JobConfig, process: FailureProcess, plan: PlanConfig, configs: list[StrategyConfig]
) -> list[PlanRow]:
    """Simulate each config on `plan.seeds` shared traces; rows sorted fastest first."""
    m = process.cluster_mtbf_s(job.num_gpus)
    traces = [trace_for_job(process, job, plan.seed + i) for i in range(plan.seeds)]
    rows = []
    for cfg in configs:
        runs: list[SimResult] = [simulate(job, cfg, tr, system_mtbf_s=m) for tr in traces]
        rows.append(
            PlanRow(
                config=cfg,
                ratio=float(np.mean([r.ratio for r in runs])),
                uptime=float(np.mean([r.uptime_fraction for r in runs])),
                restarts=float(np.mean([r.restarts for r in runs])),
                checkpoint_period_s=runs[0].checkpoint_period_s,
                closed_form_ratio=closed_form(job, cfg, m),
            )
        )
    return sorted(rows, key=lambda row: (row.ratio, row.config.label))


def best_per_family(rows: list[PlanRow]) -> dict[str, PlanRow]:
    """Fastest row of each strategy family (rows must be sorted)."""
    out: dict[str, PlanRow] = {}
    for row in rows:
        out.setdefault(row.config.name, row)
    return out


def plan(job: JobConfig, process: FailureProcess, plan_cfg: PlanConfig) -> list[PlanRow]:
    """Full planner sweep; the first row is the recommendation."""
    rows = sweep(job, process, plan_cfg, candidates(job, plan_cfg))
    if not rows or not math.isfinite(rows[0].ratio):
        raise ConfigError(
            "no strategy finishes within the trace horizon: raise job.horizon_factor or check "
            "the failure rate"
        )
    return rows
