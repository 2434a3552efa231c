"""Step time, tokens/s (and MFU on GPU) of the real training step for one or more model configs.

    python tools/bench/step_time.py                       # CPU: tiny and small
    python tools/bench/step_time.py --models llama-350m --micro-batch-size 4 --seq-length 1024  #
    GPU
    python tools/bench/step_time.py --out bench_out/step_time.json

Single process (world 1), the full megatron stack (GPTModel, DDP, optimizer, schedule) on the
embedded demo corpus. Prints a table and writes JSON. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        help="model presets (default: tiny small on CPU, llama-350m on GPU)",
    )
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: 8 CPU, 4 GPU")
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=None, help="default: the preset's")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine more threads oversubscribe "
        "and run ~10x slower)",
    )
    p.add_argument("--out", default="bench_out/step_time.json")
    return p.parse_args()


def bench_model(name: str, args, ctx) -> dict:
    from bench_engine import build_bench_engine

    from megatron_mecefo.metrics.mfu import mfu, peak_flops

    mbs = args.micro_batch_size or (8 if ctx.on_cpu else 4)
    overrides = [f"model.seq_length={args.seq_length}"] if args.seq_length else []
    engine = build_bench_engine(
        ctx,
        name,
        demo_dir=args.demo_dir,
        micro_batch_size=mbs,
        num_microbatches=args.num_microbatches,
        max_steps=args.warmup + args.steps,
        overrides=overrides,
    )
    cfg = engine.cfg
    times = []
    for step in range(args.warmup + args.steps):
        if not ctx.on_cpu:
            import torch

            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = engine.train_step(step)
        if not ctx.on_cpu:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = result.global_tokens
    device = "cpu" if ctx.on_cpu else __import__("torch").cuda.get_device_name()
    util = mfu(
        tokens / step_s, cfg.model.flops_per_token(), 1, peak_flops(None if ctx.on_cpu else device)
    )
    return {
        "model": name,
        "params_m": cfg.model.num_parameters() / 1e6,
        "seq_length": cfg.model.seq_length,
        "micro_batch_size": mbs,
        "num_microbatches": args.num_microbatches,
        "tokens_per_step": tokens,
        "step_time_s": step_s,
        "step_time_stdev_s": statistics.pstdev(times),
        "tokens_per_s": tokens / step_s,
        "mfu": util,
        "device": device,
        "final_loss": result.loss,
    }


def main() -> int:
    args = parse_args()
    import torch

    from megatron_mecefo.mcore.config import ParallelConfig
    from megatron_mecefo.mcore.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(args.threads)
    ctx = init_parallel(ParallelConfig())
    models = args.models or (["tiny", "small"] if ctx.on_cpu else ["llama-350m"])
    rows = []
    for name in models:
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        rows.append(bench_model(name, args, ctx))
    destroy_parallel()
    header = (
        f"{'model':<12}{'params':>9}{'tokens/step':>13}{'step (s)':>11}{'tokens/s':>11}{'MFU':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        mfu_s = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(
            f"{r['model']:<12}{r['params_m']:>8.2f}M{r['tokens_per_step']:>13}"
            f"{r['step_time_s']:>11.4f}{r['tokens_per_s']:>11.0f}{mfu_s:>7}"
        )
    print(f"device: {rows[0]['device']}, threads: {torch.get_num_threads()}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "threads": torch.get_num_threads()}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
