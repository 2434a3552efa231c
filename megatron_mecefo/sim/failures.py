"""Failure processes and failure traces (vectorised; no per-GPU Python objects).

`FailureProcess` is the stochastic part of a failure-scenario file (`scenario.py`). Defaults come
from the Llama 3 405B run: 419 unexpected interruptions in 54 days on 16,384 GPUs, about 50.7k GPU-
hours between failures per GPU. A trace is a time-sorted list of (time_s, group, repair_s) events
that every strategy in `simulator.py` replays, so strategies are compared on the same failures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from megatron_mecefo.errors import ConfigError

LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54.0
LLAMA3_INTERRUPTIONS = 419
LLAMA3_GPU_MTBF_H = LLAMA3_GPUS * LLAMA3_DAYS * 24.0 / LLAMA3_INTERRUPTIONS
"""About 50,674 GPU-hours between unexpected interruptions, per GPU."""
LLAMA3_CAUSES = {"faulty_gpu": 148, "hbm3": 72, "software": 54, "network": 35}
"""Top root causes of the 419 interruptions (counts), for reference in reports."""


@dataclass(kw_only=True)
class FailureProcess:
    """Stochastic failure process of a cluster (the `process:` block of a scenario file)."""

    distribution: Literal["exponential", "weibull"] = "exponential"
    """Time-between-failures law. Weibull with shape < 1 gives bursty, early-heavy failures."""
    level: Literal["gpu", "system"] = "gpu"
    """"gpu": every GPU runs its own renewal process from age 0 at t=0 (fresh cluster).
    "system": one renewal process for the whole cluster (inter-arrival law with mean system MTBF),
    each failure hitting a uniformly random GPU."""
    gpu_mtbf_h: float | None = None
    """Mean time between failures of one GPU, hours. Default (both MTBFs unset): Llama 3 405B
    value."""
    system_mtbf_s: float | None = None
    """Mean time between failures of the whole cluster, seconds (= GPU MTBF / number of GPUs)."""
    weibull_shape: float = 0.78
    """Weibull shape k (only used with distribution: weibull)."""
    repair_time_s: float | None = None
    """Time until a failed GPU is back (repaired or swapped for a hot spare) and its group may
    rejoin without a restart. null: it comes back only with the next job restart."""

    def __post_init__(self) -> None:
        if self.gpu_mtbf_h is not None and self.system_mtbf_s is not None:
            raise ConfigError(
                "set only one of gpu_mtbf_h and system_mtbf_s (they are the same quantity "
                "at different scales: system_mtbf_s = gpu_mtbf_h * 3600 / num_gpus)"
            )
        for name in ("gpu_mtbf_h", "system_mtbf_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value} (an MTBF is a positive time)")
        if not self.weibull_shape > 0:
            raise ConfigError(f"weibull_shape must be > 0, got {self.weibull_shape}")
        if self.repair_time_s is not None and self.repair_time_s < 0:
            raise ConfigError(f"repair_time_s must be >= 0 or null, got {self.repair_time_s}")

    def gpu_mtbf_s(self, num_gpus: int) -> float:
        """Per-GPU MTBF in seconds for a cluster of `num_gpus`."""
        if self.system_mtbf_s is not None:
            return self.system_mtbf_s * num_gpus
        return (self.gpu_mtbf_h if self.gpu_mtbf_h is not None else LLAMA3_GPU_MTBF_H) * 3600.0

    def cluster_mtbf_s(self, num_gpus: int) -> float:
        """System MTBF m in seconds (long-run mean time between failures of the cluster)."""
        return self.gpu_mtbf_s(num_gpus) / num_gpus


@dataclass(kw_only=True)
class FailureTrace:
    """Group-level failure events, sorted by time."""

    times_s: np.ndarray
    """Failure times, seconds from job start (float64, ascending)."""
    groups: np.ndarray
    """Failed DP group of each event (int64)."""
    repair_s: np.ndarray
    """Seconds after each failure until the group may rejoin (inf: only at the next restart)."""
    horizon_s: float
    """Events are complete up to this time; a run still going past it is reported unfinished."""

    def __post_init__(self) -> None:
        if not (self.times_s.shape == self.groups.shape == self.repair_s.shape):
            raise ValueError("times_s, groups and repair_s must have the same length")
        if self.times_s.size and np.any(np.diff(self.times_s) < 0):
            raise ValueError("failure times must be sorted ascending")


def _lifetimes(process: FailureProcess, mean_s: float, size: int, rng) -> np.ndarray:
    """Draw `size` times-between-failures with mean `mean_s`."""
    if process.distribution == "exponential":
        return rng.exponential(mean_s, size)
    k = process.weibull_shape
    return (mean_s / math.gamma(1.0 + 1.0 / k)) * rng.weibull(k, size)


def gpu_failures(
    process: FailureProcess, num_gpus: int, horizon_s: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(times_s, gpu ids) of all failures before `horizon_s`, sorted by time.

    "gpu" level: per-GPU renewal processes, generated round by round for the GPUs still under the
    horizon (most GPUs never fail, so a handful of vectorised rounds suffice).
    """
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    if process.level == "system":
        mean = process.cluster_mtbf_s(num_gpus)
        expected = int(horizon_s / mean * 1.2 + 10 * math.sqrt(horizon_s / mean + 1) + 16)
        times = np.cumsum(_lifetimes(process, mean, expected, rng))
        while times[-1] < horizon_s:
            more = times[-1] + np.cumsum(_lifetimes(process, mean, expected, rng))
            times = np.concatenate([times, more])
        times = times[times < horizon_s]
        return times, rng.integers(0, num_gpus, times.size)
    mean = process.gpu_mtbf_s(num_gpus)
    delay = process.repair_time_s or 0.0
    current = _lifetimes(process, mean, num_gpus, rng)
    ids = np.flatnonzero(current < horizon_s)
    current = current[ids]
    all_t, all_id = [current], [ids]
    while ids.size:
        current = current + delay + _lifetimes(process, mean, ids.size, rng)
        keep = current < horizon_s
        ids, current = ids[keep], current[keep]
        all_t.append(current)
        all_id.append(ids)
    times = np.concatenate(all_t)
    gpus = np.concatenate(all_id)
    order = np.argsort(times, kind="stable")
    return times[order], gpus[order]


def generate_trace(
    process: FailureProcess,
    *,
    num_gpus: int,
    gpus_per_group: int,
    horizon_s: float,
    seed: int,
) -> FailureTrace:
    """Group-level trace for a cluster of `num_gpus` split into DP groups of `gpus_per_group`."""
    if gpus_per_group < 1 or num_gpus % gpus_per_group:
        raise ConfigError(
            f"gpus_per_group={gpus_per_group} must divide num_gpus={num_gpus} "
            "(every DP group has the same size)"
        )
    rng = np.random.default_rng(seed)
    times, gpus = gpu_failures(process, num_gpus, horizon_s, rng)
    repair = math.inf if process.repair_time_s is None else process.repair_time_s
    return FailureTrace(
        times_s=times,
        groups=(gpus // gpus_per_group).astype(np.int64),
        repair_s=np.full(times.size, repair),
        horizon_s=horizon_s,
    )


def no_failures(horizon_s: float = math.inf) -> FailureTrace:
    """An empty trace (failures switched off)."""
    empty = np.zeros(0)
    return FailureTrace(
        times_s=empty, groups=empty.astype(np.int64), repair_s=empty, horizon_s=horizon_s
    )
