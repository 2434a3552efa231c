"""Matplotlib PNG plots: TTT/T_0 vs redundancy, vs scale, and availability over time.

Functions take computed results (or compute them with the planner) and write one PNG each; they use
the non-interactive Agg backend and never show windows.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from megatron_mecefo.sim.failures import FailureProcess  # noqa: E402
from megatron_mecefo.sim.planner import PlanConfig, best_per_family, candidates, sweep  # noqa: E402
from megatron_mecefo.sim.simulator import JobConfig, SimResult  # noqa: E402
from megatron_mecefo.sim.strategies import StrategyConfig  # noqa: E402


def _save(fig, out: str | os.PathLike) -> str:
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return str(out)


def plot_ttt_vs_redundancy(
    job: JobConfig,
    process: FailureProcess,
    out: str | os.PathLike,
    *,
    seeds: int = 1,
    max_redundancy: int = 12,
) -> dict:
    """Simulated and closed-form TTT/T_0 of replication and SPARe for r = 2..max_redundancy."""
    rs = list(range(2, min(max_redundancy, job.num_groups) + 1))
    data: dict = {"r": rs}
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, color in (("replication", "tab:red"), ("spare", "tab:blue")):
        configs = [StrategyConfig(name=name, redundancy=r) for r in rs]
        rows = sweep(job, process, PlanConfig(seeds=seeds), configs)
        by_r = {row.config.redundancy: row for row in rows}
        sim = [by_r[r].ratio for r in rs]
        closed = [by_r[r].closed_form_ratio for r in rs]
        ax.plot(rs, sim, "o-", color=color, label=f"{name} (simulated)")
        ax.plot(rs, closed, "--", color=color, alpha=0.6, label=f"{name} (closed form)")
        data[name] = {"simulated": sim, "closed_form": closed}
    ax.set_xlabel("redundancy r")
    ax.set_ylabel("TTT / T_0")
    ax.set_title(f"{job.num_gpus:,} GPUs, N = {job.num_groups}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    data["path"] = _save(fig, out)
    return data


def plot_ttt_vs_scale(
    gpus: list[int],
    gpus_per_group: int,
    process: FailureProcess,
    out: str | os.PathLike,
    *,
    base_job: JobConfig | None = None,
    seeds: int = 1,
    max_redundancy: int = 10,
) -> dict:
    """Best simulated TTT/T_0 of each strategy family as the number of GPUs grows."""
    base = base_job or JobConfig()
    families: dict[str, list[float]] = {}
    for n_gpus in gpus:
        job = JobConfig(
            num_gpus=n_gpus,
            gpus_per_group=gpus_per_group,
            num_steps=base.num_steps,
            step_time_s=base.step_time_s,
            checkpoint_save_s=base.checkpoint_save_s,
            restart_s=base.restart_s,
            horizon_factor=base.horizon_factor,
        )
        plan = PlanConfig(seeds=seeds, max_redundancy=max_redundancy)
        best = best_per_family(sweep(job, process, plan, candidates(job, plan)))
        for name, row in best.items():
            families.setdefault(name, []).append(row.ratio)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ratios in sorted(families.items()):
        ax.plot(gpus, ratios, "o-", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("best TTT / T_0")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return {"gpus": gpus, "families": families, "path": _save(fig, out)}


def availability_curve(result: SimResult, points: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """(time_s, cumulative fraction of wall time spent computing) sampled on a uniform grid."""
    t = result.timeline["time_s"]
    up = result.timeline["up"]
    # up[i] is the state from t[i] to t[i+1]
    dt = np.diff(t)
    uptime = np.concatenate([[0.0], np.cumsum(dt * up[:-1])])
    grid = np.linspace(t[-1] / points, t[-1], points) if t[-1] > 0 else np.array([0.0])
    return grid, np.interp(grid, t, uptime) / np.maximum(grid, 1e-9)


def plot_availability(results: list[SimResult], out: str | os.PathLike) -> dict:
    """Cumulative availability (uptime / wall time) over time, one line per strategy."""
    fig, ax = plt.subplots(figsize=(6, 4))
    data = {}
    for res in results:
        grid, avail = availability_curve(res)
        ax.plot(grid / 3600.0, avail, label=res.label)
        data[res.label] = {"time_h": (grid / 3600.0).tolist(), "availability": avail.tolist()}
    ax.set_xlabel("wall time (h)")
    ax.set_ylabel("availability (cumulative)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    data["path"] = _save(fig, out)
    return data
