"""What the silent-fault checks cost a normal step (issue 35, `docs/anomalies.md`).

    python tools/bench/anomaly_cost.py                   # CPU: tiny and small
    python tools/bench/anomaly_cost.py --models llama-350m --micro-batch-size 4    # GPU

For each model preset, in one process (world 1, the real `Engine.train_step`), interleaved
round by round and the fastest of `--reps` kept: the step with the NaN/Inf checks on and off,
and the state fingerprint of the commit vote alone (`training.anomaly.state_fingerprint`: every
parameter and optimizer-state tensor read once). Then the fingerprint's throughput on one
`--mb` MB tensor, to scale it to a real state size. Prints a table and writes JSON.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import bench_parser, ensure_demo, fastest_of_rounds, machine, write_json  # noqa: E402


def parse_args(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--models", nargs="+", default=None, help="default: tiny small on CPU")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--reps", type=int, default=8, help="timed rounds (the fastest is kept)")
    p.add_argument("--mb", type=int, default=256, help="size of the throughput tensor (MB)")
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--out", default="bench_out/anomaly_cost.json")
    return p.parse_args(argv)


def bench_model(name: str, args, ctx) -> dict:
    from bench_engine import build_bench_engine

    from megatron_mecefo.training.anomaly import state_fingerprint

    engine = build_bench_engine(
        ctx,
        name,
        demo_dir=args.demo_dir,
        micro_batch_size=args.micro_batch_size,
        num_microbatches=args.num_microbatches,
        max_steps=4 * args.reps + 8,
    )
    steps = iter(range(10**6))

    def run(scenario: str, _step: int) -> float:
        if scenario == "fingerprint":
            t0 = time.perf_counter()
            state_fingerprint(engine)
            return time.perf_counter() - t0
        engine.anomaly.enabled = scenario == "checks on"
        t0 = time.perf_counter()
        engine.train_step(next(steps))
        return time.perf_counter() - t0

    best = fastest_of_rounds(
        run, {k: k for k in ("checks on", "checks off", "fingerprint")}, args.reps
    )
    state_mb = sum(p.numel() * p.element_size() for p in engine.ddp.module.parameters()) / 2**20
    return {
        "model": name,
        "params_m": engine.cfg.model.num_parameters() / 1e6,
        "params_mb": state_mb,
        "step_on_s": best["checks on"],
        "step_off_s": best["checks off"],
        "check_overhead": best["checks on"] / best["checks off"] - 1,
        "fingerprint_s": best["fingerprint"],
        "fingerprint_vs_step": best["fingerprint"] / best["checks off"],
    }


def throughput(mb: int) -> float:
    """GB/s of `fingerprint` over one fp32 tensor of `mb` MB (fastest of 5)."""
    import torch

    from megatron_mecefo.training.anomaly import fingerprint

    t = torch.randn(mb * 2**20 // 4)
    best = min(_timed(fingerprint, [t]) for _ in range(5))
    return mb / 1024 / best


def _timed(fn, arg) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from megatron_mecefo.mcore.config import ParallelConfig
    from megatron_mecefo.mcore.parallel import destroy_parallel, init_parallel

    ensure_demo(args.demo_dir)
    torch.set_num_threads(1)
    ctx = init_parallel(ParallelConfig())
    rows = []
    for name in args.models or ["tiny", "small"]:
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        rows.append(bench_model(name, args, ctx))
    destroy_parallel()
    gbs = throughput(args.mb)
    print(
        f"{'model':<8}{'params':>9}{'step, checks on':>17}{'off':>9}{'overhead':>10}"
        f"{'fingerprint':>13}{'vs step':>9}"
    )
    for r in rows:
        print(
            f"{r['model']:<8}{r['params_m']:>8.2f}M{1000 * r['step_on_s']:>14.1f} ms"
            f"{1000 * r['step_off_s']:>6.1f} ms{100 * r['check_overhead']:>9.1f}%"
            f"{1000 * r['fingerprint_s']:>10.2f} ms{100 * r['fingerprint_vs_step']:>8.1f}%"
        )
    print(f"fingerprint throughput: {gbs:.2f} GB/s on one {args.mb} MB fp32 tensor (1 thread)")
    write_json(
        {"machine": machine(), "rows": rows, "fingerprint_gb_per_s": gbs, "args": vars(args)},
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
