"""Failure-scenario files (`configs/failures/*.yaml`), shared by the trainer's injector and the
simulator.

A scenario has (a) deterministic injections for real runs, keyed by (step, dp_rank), and (b) an
optional stochastic failure process for the simulator. This module is the schema and the conversion
of injections into a simulator trace; it never injects anything itself.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from megatron_mecefo.config.loader import load_config
from megatron_mecefo.errors import ConfigError
from megatron_mecefo.sim.failures import FailureProcess, FailureTrace

INJECTION_KINDS = ("kill", "hang", "crash", "slow", "network")


@dataclass(kw_only=True)
class Injection:
    """One deterministic failure of one DP rank at a step boundary."""

    step: int
    """Training step at which the failure happens (before the step's forward)."""
    dp_rank: int
    """Data-parallel rank (all its TP/PP ranks) that fails."""
    kind: Literal["kill", "hang", "crash", "slow", "network"] = "kill"
    """kill: SIGKILL the rank's processes; hang: stop progress and heartbeats; crash: the trainer
    raises (snapshot process survives); slow: straggler; network: drop the rank's connections."""
    downtime_steps: int | None = None
    """Steps until the rank comes back and rejoins. Give this or rejoin_step, or neither (never)."""
    rejoin_step: int | None = None
    """Absolute step at which the rank rejoins (alternative to downtime_steps)."""

    def __post_init__(self) -> None:
        if self.step < 0 or self.dp_rank < 0:
            raise ConfigError(
                f"injection step and dp_rank must be >= 0, got {self.step}, {self.dp_rank}"
            )
        if self.downtime_steps is not None and self.rejoin_step is not None:
            raise ConfigError(
                "give either downtime_steps or rejoin_step for an injection, not both"
            )
        if self.downtime_steps is not None and self.downtime_steps < 1:
            raise ConfigError(f"downtime_steps must be >= 1, got {self.downtime_steps}")
        if self.rejoin_step is not None and self.rejoin_step <= self.step:
            raise ConfigError(
                f"rejoin_step={self.rejoin_step} must come after the failure step={self.step}"
            )

    @property
    def rejoin_at(self) -> int | None:
        """Step at which the rank rejoins, or None if it never does."""
        if self.downtime_steps is not None:
            return self.step + self.downtime_steps
        return self.rejoin_step


@dataclass(kw_only=True)
class FailureScenario:
    """A failure scenario: deterministic injections and/or a stochastic failure process."""

    name: str = ""
    """Short identifier, used in reports."""
    description: str = ""
    """What the scenario models, for humans."""
    seed: int = 0
    """Seed of the stochastic process (simulator) and of any randomised injection."""
    injections: list[Injection] = field(default_factory=list)
    """Deterministic failures for real runs (and replayable by the simulator)."""
    process: FailureProcess | None = None
    """Stochastic failure process for the simulator; null: only the injections."""

    def __post_init__(self) -> None:
        seen = set()
        for inj in self.injections:
            key = (inj.step, inj.dp_rank)
            if key in seen:
                raise ConfigError(f"two injections for dp_rank {inj.dp_rank} at step {inj.step}")
            seen.add(key)


def load_scenario(path: str | os.PathLike, overrides: list[str] | None = None) -> FailureScenario:
    """Load and validate a scenario YAML file (unknown keys are errors)."""
    return load_config(FailureScenario, path, overrides)


def injections_to_trace(
    scenario: FailureScenario, *, step_time_s: float, num_groups: int, horizon_s: float = math.inf
) -> FailureTrace:
    """Turn the deterministic injections into a trace (failure at step * step_time_s)."""
    injections = sorted(scenario.injections, key=lambda inj: (inj.step, inj.dp_rank))
    for inj in injections:
        if inj.dp_rank >= num_groups:
            raise ConfigError(
                f"injection dp_rank {inj.dp_rank} does not exist with {num_groups} DP groups"
            )
    repair = [
        math.inf if inj.rejoin_at is None else (inj.rejoin_at - inj.step) * step_time_s
        for inj in injections
    ]
    return FailureTrace(
        times_s=np.array([inj.step * step_time_s for inj in injections], dtype=float),
        groups=np.array([inj.dp_rank for inj in injections], dtype=np.int64),
        repair_s=np.array(repair, dtype=float),
        horizon_s=horizon_s,
    )
