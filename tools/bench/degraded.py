"""Per-rank step time and peak activation memory of MeCeFO takeover modes, one process at a time.

    python tools/bench/degraded.py                                   # CPU: tiny and small
    python tools/bench/degraded.py --models small --microbatches 8 --reps 7
    python tools/bench/degraded.py --svd-shapes llama-350m llama-1b  # exact vs randomized SVD cost
    python tools/bench/degraded.py --models llama-350m --num-layers 8 --mbs 4   # GPU (unverified)
    python tools/bench/degraded.py --models small --skip-layers off first:1 last:1 all

With `--skip-layers` it runs only the skip-layer sweep instead: for each
`mecefo.skip_attention_layers` setting (`off` = `mecefo.skip_attention_backward=false`), a step of
M exact and a step of M degraded micro-batches on an engine built with it, settings interleaved
round by round (the time axis of an accuracy/time curve; default JSON
bench_out/degraded_skip_layers.json).

For each model: a normal rank (M exact micro-batches), naive Neighbor-Do-Both (2M exact), MeCeFO
neighbour (2M degraded), and the slowest rank of `spread` and `hybrid` for n = 4, 8, 32 (one dead
replica; hybrid planned with a cost model calibrated on held-out task lists on a separate engine,
or read from an earlier run with --calibration, so every "pred" is out of sample; the JSON
records the prediction error of each row and whether the fallback cost model was used). Each
scenario is one real training step (`Engine.train_step` with the scenario's task list as its
plan: megatron schedule, DDP `main_grad` accumulation, megatron AdamW) on a world-1 job over the
demo corpus; DP communication is not included (per-rank compute, as DESIGN.md section 4
prescribes on CPU). Peak activation memory: CPU = bytes autograd saves for one micro-batch
(saved-tensor hooks), GPU = torch.cuda.max_memory_allocated above the weights. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))  # bench_common, bench_engine, degraded_*
sys.path.insert(0, str(ROOT))

from bench_common import bench_parser, init_torch, write_json  # noqa: E402 - after the path fix

# one module per benchmark (their shared rank: degraded_rank.py)
from degraded_grad_error import grad_error  # noqa: E402
from degraded_skip_layers import bench_skip_layers, print_skip_layers_table  # noqa: E402
from degraded_svd import bench_svd  # noqa: E402
from degraded_takeover import bench_model, print_table  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--models", nargs="*", default=None, help="presets (default: tiny small on CPU)")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--mbs", type=int, default=4, help="micro-batch size (sequences)")
    p.add_argument("--microbatches", type=int, default=8, help="M, micro-batches per replica")
    p.add_argument(
        "--replicas", type=int, nargs="+", default=[4, 8, 32], help="n for spread/hybrid"
    )
    p.add_argument("--target-ratio", type=float, default=1.15, help="hybrid's step-time bound")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per scenario (min)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--svd-shapes", nargs="*", default=[], help="presets whose FFN SVD cost to time")
    p.add_argument(
        "--grad-error-steps",
        type=int,
        default=0,
        help="also report the degraded gradient error after this many exact steps",
    )
    p.add_argument("--demo-dir", default=".cache/demo_data", help="embedded demo corpus location")
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="run-config overrides for every engine, e.g. mecefo.recompute_ffn=true (so that the "
        "recompute technique can be calibrated)",
    )
    p.add_argument(
        "--calibration",
        default=None,
        help="degraded.json of an earlier run whose cost model the planner uses (default: "
        "calibrate here on held-out task lists)",
    )
    p.add_argument(
        "--techniques",
        nargs="*",
        default=["skip", "lowrank"],
        help="technique sets (DegradedTechniques keys) to calibrate besides the configured one: "
        "the candidates of the hybrid_auto rows (mecefo.hybrid_techniques=auto); sets that are "
        "not subsets of the configured switches are skipped",
    )
    p.add_argument(
        "--skip-layers",
        nargs="+",
        default=None,
        metavar="SETTING",
        help="run only the skip-layer sweep over these mecefo.skip_attention_layers settings "
        "(all, first:K, last:K, every:K, 0,2,5; off = skip_attention_backward=false)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="JSON output (default bench_out/degraded.json; with --skip-layers "
        "bench_out/degraded_skip_layers.json)",
    )
    args = p.parse_args()
    if args.out is None:
        args.out = f"bench_out/degraded{'_skip_layers' if args.skip_layers else ''}.json"
    return args


def main() -> int:
    args = parse_args()
    ctx = init_torch(args.threads)
    device = ctx.device
    models = (
        args.models
        if args.models is not None
        else (["tiny", "small"] if ctx.on_cpu else ["llama-350m"])
    )
    if args.skip_layers:
        report = {"skip_layers": []}
        for name in models:
            result = bench_skip_layers(name, args, ctx)
            print_skip_layers_table(result)
            report["skip_layers"].append(result)
        return write_json(report, args.out)
    report = {"models": [], "svd": [], "grad_error": []}
    for name in models:
        result = bench_model(name, args, ctx)
        print_table(result)
        report["models"].append(result)
        if args.grad_error_steps:
            report["grad_error"] += grad_error(name, args, device, args.grad_error_steps)
    for name in args.svd_shapes:
        report["svd"] += bench_svd(name, device)
    return write_json(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
