"""Per-rank step time of the slowest survivor at micro-batch vs sample takeover granularity.

    python tools/bench/granularity.py                          # CPU: tiny and small, n = 4 8 32
    python tools/bench/granularity.py --models small --reps 7 --out bench_out/granularity.json

For each model (micro-batch size b, M micro-batches per replica, one dead replica out of n): the
slowest survivor's task list of `spread` at `microbatch` granularity (M + ceil(M / (n - 1))
micro-batches) and at `sample` granularity (whole micro-batches and at most two slices, M b +
ceil(M b / (n - 1)) samples), each timed as one real training step (`Engine.train_step` with that
task list as its plan: megatron schedule, DDP, AdamW) in a world-1 job, against a normal rank
(M micro-batches), scenarios interleaved round by round, fastest of `--reps` kept (as
`degraded.py` does). "pred" is the proportional model (slices cost their share of a micro-batch).
It also measures the fixed cost of a slice: one step with each of the M micro-batches cut into
single-sample slices, against the normal step: (t_cut - t_normal) / (M (b - 1)) per extra task,
the cost model's `slice_overhead_s` (an upper bound: a slice of k samples pays a (1 - k/b) share
of it). One process at a time; DP communication is not included (DESIGN.md section 4).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "bench"))

from bench_common import (  # noqa: E402 - after the path fix
    bench_parser,
    fastest_of_rounds,
    init_torch,
    timed_train_step,
    write_json,
)


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--models", nargs="*", default=None, help="presets (default: tiny small)")
    p.add_argument("--mbs", type=int, default=4, help="micro-batch size b (sequences)")
    p.add_argument("--microbatches", type=int, default=8, help="M, micro-batches per replica")
    p.add_argument("--replicas", type=int, nargs="+", default=[4, 8, 32], help="n")
    p.add_argument("--reps", type=int, default=5, help="timed rounds (fastest kept)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--demo-dir", default=".cache/demo_data", help="embedded demo corpus location")
    p.add_argument("--out", default="bench_out/granularity.json")
    return p.parse_args()


def slowest_tasks(n: int, m: int, b: int, granularity: str):
    """The slowest survivor's tasks under `spread` with replica 0 dead (proportional costs)."""
    from megatron_mecefo.plan import CostModel, make_step_plans
    from megatron_mecefo.plan.takeover import plan_step_times

    plans = make_step_plans(
        alive=list(range(1, n)),
        num_replicas=n,
        num_microbatches=m,
        policy="spread",
        cost=CostModel(),
        granularity=granularity,
        micro_batch_size=b,
    )
    times = plan_step_times(plans, CostModel())
    slowest = max(times, key=times.get)
    return plans[slowest].tasks, times[slowest] / m


def bench_model(name: str, args, ctx) -> dict:
    from bench_engine import build_bench_engine

    from megatron_mecefo.plan.step_plan import MicroBatchTask

    m, b = args.microbatches, args.mbs
    engine = build_bench_engine(
        ctx, name, demo_dir=args.demo_dir, micro_batch_size=b, num_microbatches=m, max_steps=10**5
    )
    n_max = max(args.replicas)
    own = [MicroBatchTask(1, i) for i in range(m)]
    cut = [MicroBatchTask(1, i, samples=(j, j + 1)) for i in range(m) for j in range(b)]
    scenarios = {"normal": (own, n_max, 1.0), "cut": (cut, n_max, 1.0)}
    for n in args.replicas:
        for granularity in ("microbatch", "sample"):
            tasks, pred = slowest_tasks(n, m, b, granularity)
            scenarios[f"{granularity} n={n}"] = (tasks, n, pred)

    def run(scenario, step: int) -> float:
        tasks, n, _ = scenario
        return timed_train_step(
            engine, tasks, step, num_replicas=n, microbatches_per_replica=m, micro_batch_size=b
        )

    best = fastest_of_rounds(run, scenarios, args.reps)  # interleaved, after a warm-up of each
    normal = best["normal"]
    extra_tasks = m * (b - 1)
    slice_overhead_s = max(0.0, (best["cut"] - normal) / extra_tasks)
    rows = []
    for label, (tasks, n, pred) in scenarios.items():
        if label in ("normal", "cut"):
            continue
        granularity = label.split()[0]
        slices = sum(t.is_slice for t in tasks)
        samples = sum(t.num_samples(b) for t in tasks)
        rows.append(
            {
                "granularity": granularity,
                "n": n,
                "tasks": len(tasks),
                "slices": slices,
                "samples": samples,
                "step_s": best[label],
                "ratio": best[label] / normal,
                "predicted_ratio": pred,
                "predicted_ratio_with_overhead": pred + slices * slice_overhead_s / normal,
            }
        )
    cfg = engine.cfg.model
    engine_info = f"{cfg.num_layers} layers, d={cfg.hidden_size}, s={cfg.seq_length}"
    return {
        "model": name,
        "shape": engine_info,
        "device": str(ctx.device),
        "mbs": b,
        "microbatches": m,
        "normal_step_s": normal,
        "cut_step_s": best["cut"],
        "slice_overhead_s": slice_overhead_s,
        "slice_overhead_fraction": slice_overhead_s / (normal / m),
        "rows": rows,
    }


def print_table(result: dict) -> None:
    print(
        f"\n{result['model']} ({result['shape']}, b={result['mbs']}, M={result['microbatches']}): "
        f"normal step {result['normal_step_s'] * 1e3:.1f} ms; slice overhead "
        f"{result['slice_overhead_s'] * 1e3:.2f} ms = {result['slice_overhead_fraction']:.1%} of a "
        "micro-batch"
    )
    print(f"{'n':>4} {'granularity':<11} {'tasks':>5} {'slices':>6} {'ratio':>6} {'pred':>6}")
    for r in result["rows"]:
        print(
            f"{r['n']:>4} {r['granularity']:<11} {r['tasks']:>5} {r['slices']:>6} "
            f"{r['ratio']:>6.3f} {r['predicted_ratio']:>6.3f}"
        )


def main() -> int:
    args = parse_args()
    ctx = init_torch(args.threads)
    models = args.models if args.models is not None else ["tiny", "small"]
    report = {"args": vars(args), "models": []}
    for name in models:
        result = bench_model(name, args, ctx)
        print_table(result)
        report["models"].append(result)
    return write_json(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
