"""How far a failure-free run's spike statistics stray from their running median: the evidence
behind `anomaly.loss_spike_factor` and `anomaly.grad_spike_factor` (issue 35,
`docs/anomalies.md`).

    python tools/bench/spike_threshold.py                       # CPU: 3 runs of 1000 steps
    python tools/bench/spike_threshold.py --runs tiny:8:2:1234 --steps 300
    python tools/bench/spike_threshold.py --trace tests/data/failure_free_spikes.json


Each run (`MODEL:MICRO_BATCH_SIZE:MICROBATCHES:SEED`) trains the demo job's configuration in one
process (world 1, the real `Engine.train_step`, the demo's learning-rate schedule) with the
checks on, so one rank's statistics are exactly what a data-parallel rank with that many
micro-batches sees. After each step it records the step's mean loss and local gradient norm
over the median of the previous `anomaly.spike_window` steps, as `AnomalyGuard` judges them.
Prints, per run, the largest ratio of each and where it happened, the 99.9th percentile, and
the margin of the default factor over the largest; writes JSON. `--trace` also writes each run's
per-step statistics (the loss and gradient norm each step was judged on), which
`tests/unit/training/test_false_alarms.py` replays through `AnomalyGuard`: the issue's "1,000
failure-free steps, zero false alarms" as a suite test that costs no training.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import bench_parser, ensure_demo, machine, percentile, write_json  # noqa: E402


def parse_args(argv=None):
    p = bench_parser(__doc__)
    p.add_argument(
        "--runs",
        nargs="+",
        default=["tiny:8:2:1234", "tiny:4:2:7", "tiny:8:1:99"],
        help="MODEL:MICRO_BATCH_SIZE:MICROBATCHES:SEED each (default: three demo-like runs)",
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--out", default="bench_out/spike_threshold.json")
    p.add_argument("--trace", default=None, help="also write each step's statistics here (JSON)")
    return p.parse_args(argv)


def measure(spec: str, args, ctx) -> dict:
    from bench_engine import build_bench_engine

    model, mbs, m, seed = spec.split(":")
    engine = build_bench_engine(
        ctx,
        model,
        demo_dir=args.demo_dir,
        micro_batch_size=int(mbs),
        num_microbatches=int(m),
        max_steps=args.steps,
        overrides=[f"training.seed={seed}"],
    )
    guard = engine.anomaly
    series, trace = [], {"loss": [], "grad_norm": []}
    for step in range(args.steps):
        before = (guard.loss.median(), guard.grad_norm.median())
        result = engine.train_step(step)
        if not result.committed or guard.reason is not None:  # a false alarm: report it
            series.append({"step": step, "alarm": guard.reason})
            continue
        for name, window in (("loss", guard.loss), ("grad_norm", guard.grad_norm)):
            trace[name].append(float(f"{window.values[-1]:.7g}"))  # judged on, then accepted
        row = {"step": step}
        for name, window, med in (
            ("loss", guard.loss, before[0]),
            ("grad", guard.grad_norm, before[1]),
        ):
            if med:
                row[name] = window.values[-1] / med
        series.append(row)
        if step % 200 == 0:
            print(f"[bench] {spec}: step {step}", file=sys.stderr, flush=True)
    alarms = [r for r in series if "alarm" in r]
    out = {"run": spec, "steps": args.steps, "alarms": alarms, "trace": trace}
    for name in ("loss", "grad"):
        rows = [r for r in series if name in r]
        top = max(rows, key=lambda r: r[name])
        out[name] = {
            "checked": len(rows),
            "peak": top[name],
            "peak_step": top["step"],
            "p999": percentile([r[name] for r in rows], 99.9),
        }
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from megatron_mecefo.config.anomaly import AnomalyConfig
    from megatron_mecefo.mcore.config import ParallelConfig
    from megatron_mecefo.mcore.parallel import destroy_parallel, init_parallel

    ensure_demo(args.demo_dir)
    torch.set_num_threads(1)
    ctx = init_parallel(ParallelConfig())
    results = [measure(spec, args, ctx) for spec in args.runs]
    destroy_parallel()
    d = AnomalyConfig()
    factors = {"loss": d.loss_spike_factor, "grad": d.grad_spike_factor}
    print(
        f"window {d.spike_window} steps, warm-up {d.spike_warmup}; ratio = value / running median"
    )
    print(
        f"{'run':<16}{'stat':<6}{'checked':>8}{'largest':>9}{'at step':>9}{'p99.9':>8}"
        f"{'default':>9}{'margin':>8}{'alarms':>8}"
    )
    for r in results:
        for name in ("loss", "grad"):
            s = r[name]
            print(
                f"{r['run']:<16}{name:<6}{s['checked']:>8}{s['peak']:>9.3f}{s['peak_step']:>9}"
                f"{s['p999']:>8.3f}{factors[name]:>9g}{factors[name] / s['peak']:>7.1f}x"
                f"{len(r['alarms']):>8}"
            )
    traces = [{"run": r["run"], **r.pop("trace")} for r in results]
    if args.trace:
        doc = {
            "what": "per-step loss and local gradient norm of failure-free runs, as judged",
            "command": "python tools/bench/spike_threshold.py --trace " + args.trace,
            "machine": machine(),
            "runs": traces,
        }
        write_json(doc, args.trace, indent=None)
    write_json(
        {
            "machine": machine(),
            "defaults": factors,
            "window": d.spike_window,
            "warmup": d.spike_warmup,
            "runs": results,
            "args": vars(args),
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
