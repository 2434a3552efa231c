"""Benchmark the simulator: one 10,000-step 600k-GPU run and a full planner sweep (not a test).

Usage: python tools/bench/sim_speed.py [--out bench_out/sim_speed.json] [--repeats 3]
Prints a table and writes JSON with the timings and the machine's CPU count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from megatron_mecefo.sim.failures import FailureProcess
from megatron_mecefo.sim.planner import PlanConfig, plan
from megatron_mecefo.sim.simulator import JobConfig, simulate, trace_for_job
from megatron_mecefo.sim.strategies import StrategyConfig


def time_one_sim(job: JobConfig, proc: FailureProcess, seed: int) -> dict:
    """Trace generation + one SPARe r=8 simulation, timed separately."""
    t0 = time.perf_counter()
    trace = trace_for_job(proc, job, seed)
    t1 = time.perf_counter()
    res = simulate(job, StrategyConfig(name="spare", redundancy=8), trace, system_mtbf_s=300.0)
    t2 = time.perf_counter()
    return {
        "trace_s": t1 - t0,
        "simulate_s": t2 - t1,
        "total_s": t2 - t0,
        "failures": int(trace.times_s.size),
        "ttt_over_t0": res.ratio,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out/sim_speed.json", help="JSON output path")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the single simulation")
    args = ap.parse_args()
    job = JobConfig(num_gpus=600_000, gpus_per_group=1000, num_steps=10_000)
    proc = FailureProcess(distribution="weibull", weibull_shape=0.78, system_mtbf_s=300.0)
    sims = [time_one_sim(job, proc, seed) for seed in range(args.repeats)]
    t = time.perf_counter()
    rows = plan(job, proc, PlanConfig())
    sweep_s = time.perf_counter() - t
    out = {
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "one_sim": sims,
        "one_sim_best_s": min(s["total_s"] for s in sims),
        "planner_sweep_s": sweep_s,
        "planner_candidates": len(rows),
        "planner_seeds": PlanConfig().seeds,
        "recommendation": rows[0].config.label,
    }
    print(f"{'benchmark':<44}{'seconds':>10}")
    for i, s in enumerate(sims):
        print(
            f"{f'one 10k-step sim, 600k GPUs (seed {i})':<44}{s['total_s']:>10.2f}"
            f"   ({s['failures']} failures, trace {s['trace_s']:.2f} s)"
        )
    print(f"{f'planner sweep ({len(rows)} candidates x 2 seeds)':<44}{sweep_s:>10.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
