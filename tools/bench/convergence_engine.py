"""The convergence benchmark's runs: the engine of one config, the failure scenarios it trains
through, the plans it follows, and the calibration of their step time.

Imported by `convergence.py`, which puts `tools/bench` and the repository on `sys.path`."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from bench_common import (
    fastest_of_rounds,
    save_json,
)

# name -> (description, [(start fraction, end fraction, dead replicas)]) for n = 4 replicas
SCENARIOS = {
    "moderate": ("1 of 4 dead for 25% of steps", [(0.25, 0.50, (1,))]),
    "harsh": (
        "1-2 of 4 dead for 75% of steps",
        [(0.10, 0.30, (1,)), (0.30, 0.60, (1, 3)), (0.60, 0.85, (3,))],
    ),
}
TECHNIQUES = ("skip_attention_backward", "recompute_ffn", "lowrank_ffn_grad")


# ---------------------------------------------------------------------------------- engine
def build(args, ctx, overrides: list[str]):
    from bench_engine import build_bench_engine

    extra = [
        f"training.lr={args.lr}",
        f"training.min_lr={args.lr / 10}",
        f"training.lr_decay_steps={args.steps}",
        "training.warmup_steps=20",
        f"training.eval_microbatches={args.eval_microbatches}",
    ]
    if args.num_layers:
        extra.append(f"model.num_layers={args.num_layers}")
    if args.seed is not None:
        extra.append(f"training.seed={args.seed}")
    return build_bench_engine(
        ctx,
        args.model,
        demo_dir=args.demo_dir,
        micro_batch_size=args.mbs,
        num_microbatches=args.microbatches,
        max_steps=args.steps * args.replicas,  # the sampler serves n replicas from one process
        overrides=[*args.data_overrides, *extra, *overrides],
    )


def union_plan(plans: dict):
    """All survivors' tasks as one plan with the group's scaling (same SUM-reduced gradient)."""
    from megatron_mecefo.plan import RankStepPlan

    first = next(iter(plans.values()))
    return RankStepPlan(
        tasks=tuple(t for r in sorted(plans) for t in plans[r].tasks),
        num_replicas=first.num_replicas,
        microbatches_per_replica=first.microbatches_per_replica,
        masked_scale=first.masked_scale,
        micro_batch_size=next(
            (p.micro_batch_size for p in plans.values() if p.micro_batch_size), None
        ),
    )


def dead_at(scenario: str | None, step: int, steps: int) -> tuple[int, ...]:
    if scenario is None:
        return ()
    for start, end, dead in SCENARIOS[scenario][1]:
        if start * steps <= step < end * steps:
            return dead
    return ()


CONFIGS = {
    # name -> (policy, mecefo overrides); hybrid plans with --objective, --target-ratio, --budget
    "neighbor": ("neighbor", []),
    "spread": ("spread", []),
    "hybrid": ("hybrid", []),
    "hybrid_sample": ("hybrid", ["mecefo.takeover_granularity=sample"]),
    "hybrid_auto": ("hybrid", ["mecefo.hybrid_techniques=auto"]),
    "hybrid_sample_auto": (
        "hybrid",
        ["mecefo.takeover_granularity=sample", "mecefo.hybrid_techniques=auto"],
    ),
    "no_skip": ("neighbor", ["mecefo.skip_attention_backward=false"]),
    "no_recompute": ("neighbor", ["mecefo.recompute_ffn=false"]),
    "no_lowrank": ("neighbor", ["mecefo.lowrank_ffn_grad=false"]),
    "weight_svd": ("neighbor", ["mecefo.lowrank_basis=weight_svd"]),
}


def train(args, ctx, scenario, policy, overrides, cost, accuracy=None) -> dict:
    """One emulated n-replica run; returns the curve, final val loss and the slowest plans."""
    from megatron_mecefo.plan import make_step_plans
    from megatron_mecefo.plan.takeover import plan_step_times

    engine = build(args, ctx, overrides)
    mec = engine.cfg.mecefo
    n, m = args.replicas, args.microbatches
    curve, degraded_steps, slowest, degraded_mbe = [], 0, None, 0.0
    failure_times = []  # predicted slowest-rank time of each step with a dead replica
    start = time.perf_counter()
    for step in range(args.steps):
        dead = dead_at(scenario, step, args.steps)
        alive = [r for r in range(n) if r not in dead]
        plans = make_step_plans(
            alive=alive,
            num_replicas=n,
            num_microbatches=m,
            policy=policy,
            cost=cost,
            target_ratio=args.target_ratio,
            choose_techniques=mec.hybrid_techniques == "auto",
            allowed_techniques=mec.techniques,
            granularity=mec.takeover_granularity,
            micro_batch_size=args.mbs,
            objective=args.objective,
            accuracy_budget=args.budget,
            accuracy=accuracy,
        )
        if dead:
            times = plan_step_times(plans, cost)
            worst = max(times, key=times.get)
            failure_times.append(times[worst])
            if slowest is None or times[worst] > slowest[1]:
                slowest = (plans[worst], times[worst])
            degraded_steps += any(p.num_degraded for p in plans.values())
            degraded_mbe += sum(
                p.task_fraction(t) for p in plans.values() for t in p.tasks if t.degraded
            )
        result = engine.train_step(step, union_plan(plans))
        curve.append(result.loss)
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(
                f"    step {step + 1}/{args.steps} loss {result.loss:.4f} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    val = engine.evaluate()
    return {
        "engine": engine,
        "loss_curve": curve,
        "val_loss": val,
        "slowest_plan": slowest[0] if slowest else None,
        "slowest_predicted_s": slowest[1] if slowest else None,
        "mean_failure_step_s": sum(failure_times) / len(failure_times) if failure_times else None,
        "techniques": mec.techniques.key,
        "steps_with_degraded": degraded_steps,
        # mean share of the global batch that ran degraded, per step of the run
        "degraded_fraction": degraded_mbe / (args.steps * n * m),
    }


def time_plan(engine, plan, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        best = min(best, engine.train_step(10**6, plan).step_time_s)
    return best


def calibrate(args, ctx):
    """Cost model from separate calibration steps (not the runs it is used for): exact, degraded
    with the configured techniques, and degraded with each subset of them (`hybrid_auto`)."""
    from megatron_mecefo.plan import CostModel, MicroBatchTask, RankStepPlan, candidate_techniques

    engine = build(args, ctx, [])
    m = args.microbatches
    installed = engine.cfg.mecefo.techniques

    def plan(flags, techniques=None):
        tasks = tuple(
            MicroBatchTask(i // m, i % m, f, techniques if f else None) for i, f in enumerate(flags)
        )
        return RankStepPlan(tasks=tasks, num_replicas=2, microbatches_per_replica=m)

    cases = {
        "exact": plan([False] * m),
        "double": plan([False] * (2 * m)),
        "mixed": plan([False] * m + [True] * m),
    }
    for t in candidate_techniques(installed):
        cases[t.key] = plan([False] * m + [True] * m, t)
    best = fastest_of_rounds(  # interleaved, min of each
        lambda p, step: time_plan(engine, p, 1), cases, args.calib_reps, warmup=False
    )
    exact_mb = max(1e-9, (best["double"] - best["exact"]) / m)

    def degraded_mb(key):
        return max(1e-9, (best[key] - best["exact"]) / m)

    overhead = max(best["exact"] - m * exact_mb, -0.5 * exact_mb)
    return CostModel.from_measured(
        exact_microbatch_s=exact_mb,
        degraded_microbatch_s=degraded_mb("mixed"),
        step_overhead_s=overhead,
        technique_microbatch_s={t.key: degraded_mb(t.key) for t in candidate_techniques(installed)},
    )


def load_or_calibrate(args, ctx):
    from megatron_mecefo.plan import CostModel

    path = Path(args.cost_model) if args.cost_model else None
    shape = {k: getattr(args, k) for k in ("model", "num_layers", "microbatches", "mbs")}
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        if saved.get("shape") != shape:
            raise SystemExit(
                f"error: {path} was calibrated for {saved.get('shape')}, this run is {shape}"
            )
        print(f"cost model from {path}", flush=True)
        return CostModel.from_measured(**saved["cost_model"])
    cost = calibrate(args, ctx)
    if path is not None:
        save_json({"cost_model": vars(cost), "shape": shape}, path)
    return cost
