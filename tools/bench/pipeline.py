"""Step time of a covering pipeline (PP 2), normal against covering, per policy.

    python tools/bench/pipeline.py                                  # small, n = 4, M = 8
    python tools/bench/pipeline.py --models tiny small --reps 5 --out bench_out/pipeline.json

A replica here is a 2-stage pipeline (two processes over gloo, megatron's 1F1B schedule). For one
dead replica of n, the step of the busiest survivor under each takeover policy (`neighbor`: 2M
micro-batches, MeCeFO's degraded mode; `spread`: M + ceil(M / (n - 1)) exact; `hybrid`: what the
planner gives it) is timed as a real training step (`Engine.train_step` with that plan on both
stages: schedule, p2p activations, DDP, AdamW) against a normal replica's M micro-batches,
scenarios interleaved round by round, fastest of `--reps` kept (as `degraded.py` does). The two
stages share the machine's cores, so read ratios, not times. "1F1B model" is the time the
simulator charges: (W + P - 1) / (M + P - 1) for W micro-batches of work on P stages, with a
degraded micro-batch worth `--degraded-cost` of an exact one (the per-rank ratio degraded.py
measures). DP communication is not included (one replica runs).
Prints a table and writes JSON.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "tools" / "bench", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_common import (  # noqa: E402
    bench_parser,
    fastest_of_rounds,
    free_port,
    machine,
    write_json,
)

STAGES = 2


def parse_args(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--models", nargs="*", default=["small"], help="presets (default: small)")
    p.add_argument("--mbs", type=int, default=4, help="micro-batch size b (sequences)")
    p.add_argument("--microbatches", type=int, default=8, help="M, micro-batches per replica")
    p.add_argument("--replicas", type=int, default=4, help="n, replicas of the job (one dead)")
    p.add_argument("--reps", type=int, default=5, help="timed rounds (fastest kept)")
    p.add_argument("--degraded-cost", type=float, default=0.685, help="a degraded micro-batch "
                   "over an exact one (MEASURED_NEIGHBOR_STEP_RATIO / 2)")  # fmt: skip
    p.add_argument("--demo-dir", default=".cache/demo_data", help="embedded demo corpus location")
    p.add_argument("--out", default="bench_out/pipeline.json")
    return p.parse_args(argv)


def plans(n: int, m: int, cfg) -> dict:
    """Replica 1's plan (it covers dead replica 0 under `neighbor`; the busiest otherwise) for
    each scenario."""
    from megatron_mecefo.plan import failure_free_plan
    from megatron_mecefo.plan.from_config import plans_for_members

    out = {"normal": failure_free_plan(1, n, m)}
    for policy in ("neighbor", "spread", "hybrid"):
        cfg.mecefo.takeover_policy = policy
        every = plans_for_members(cfg, tuple(range(1, n)), n)
        out[policy] = max(every.values(), key=lambda p: (len(p.tasks), p.num_degraded))
    return out


def model_ratio(plan, m: int, degraded_cost: float) -> float:
    work = len(plan.tasks) - plan.num_degraded + plan.num_degraded * degraded_cost
    return (work + STAGES - 1) / (m + STAGES - 1)


def measure(rank: int, args, model: str) -> dict:
    """One stage's part for `model`; rank 0's rows are the table."""
    import time

    import torch

    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig
    from megatron_mecefo.training.engine import build_engine

    torch.set_num_threads(1)  # one model per pair of processes: megatron's groups are set once
    rows = []
    cfg = load_config(
        RunConfig,
        ROOT / "configs" / "run" / "demo_cpu.yaml",
        [
            f"model={model}",
            f"data.demo_dir={args.demo_dir}",
            f"training.micro_batch_size={args.mbs}",
            f"training.num_microbatches={args.microbatches}",
            f"training.max_steps={4 * args.reps + 8}",
            "training.eval_interval=0",
            f"parallel.pipeline_model_parallel_size={STAGES}",
            "mecefo.hybrid_target_ratio=1.15",
        ],
    )
    engine = build_engine(cfg)
    scenarios = plans(args.replicas, args.microbatches, cfg)

    def run(plan, step):
        start = time.perf_counter()
        engine.train_step(step, plan)
        return time.perf_counter() - start

    best = fastest_of_rounds(run, scenarios, args.reps)
    for label, plan in scenarios.items():
        rows.append(
            {
                "model": model,
                "scenario": label,
                "microbatches": len(plan.tasks),
                "degraded": plan.num_degraded,
                "step_s": best[label],
                "ratio": best[label] / best["normal"],
                "model_ratio": model_ratio(plan, args.microbatches, args.degraded_cost),
            }
        )
    engine.close()
    return {"rank": rank, "rows": rows}


def _spawned(rank: int, args, model: str, port: int, queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(STAGES), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
    )  # fmt: skip
    queue.put(measure(rank, args, model))


def run_pipeline(args, model: str, limit_s: float = 3600.0) -> list[dict]:
    """Rank 0's rows of one model, from a fresh pair of processes; every wait is bounded and a
    stage that dies is an error, not a hang."""
    import multiprocessing as mp
    import queue as queue_mod
    import time

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_spawned, args=(r, args, model, port, queue)) for r in range(STAGES)
    ]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + limit_s
    try:
        while len(results) < STAGES:
            try:
                results.append(queue.get(timeout=1.0))
            except queue_mod.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise SystemExit(f"error: a pipeline stage of {model} failed: {dead}") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return next(r for r in results if r["rank"] == 0)["rows"]


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = [row for model in args.models for row in run_pipeline(args, model)]
    print(f"{'model':<8}{'scenario':<10}{'tasks':>6}{'degr':>6}{'step ms':>9}{'ratio':>8}"
          f"{'1F1B model':>12}")  # fmt: skip
    for r in rows:
        print(
            f"{r['model']:<8}{r['scenario']:<10}{r['microbatches']:>6}{r['degraded']:>6}"
            f"{1000 * r['step_s']:>9.1f}{r['ratio']:>8.3f}{r['model_ratio']:>12.3f}"
        )
    write_json({"args": vars(args), "machine": machine(), "stages": STAGES, "rows": rows},
               args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
