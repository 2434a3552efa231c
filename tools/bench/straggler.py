"""A straggler's step time before, during and after the mitigation (issue 35, item 3;
`docs/anomalies.md`). Real processes under `mecefo-launch`.

    python tools/bench/straggler.py                  # CPU: 2 ranks, the small model
    python tools/bench/straggler.py --model tiny --steps 140 --slow-from 20 --tail 40

Four runs of the same job, one after another: failure-free; rank 1 slowed `--factor` x from
`--slow-from` with the straggler watch off (what a job without it pays); the same with the
watch on (paces compared every `--interval` steps over `--window`-step windows); and the same
with each rank on its own simulated node and a standby node, `straggler.evict_factor` at
`--evict-factor`: the slow node is handed to the standby (`--nproc` must be 2 for it). From
each run's metrics, the median step time of three phases: before the slowdown, slowed before the
first comparison could act, and the last `--tail` steps. Prints a table, with the floor that
uneven shares can reach (n / (n - 1 + 1/factor) x the failure-free time), and writes JSON.
On this 2-core machine run it with 2 ranks (one core each): with more ranks than cores the step
time measures the machine. The small model by default: the tiny one's step is mostly fixed cost
per micro-batch, which a smaller share does not shrink. A benchmark, not a test.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    bench_parser,
    ensure_demo,
    machine,
    run_demo_job,
    run_demo_nodes,
    write_json,
)


def parse_args(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--slow-from", type=int, default=10)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--interval", type=int, default=5, help="straggler.interval")
    p.add_argument("--window", type=int, default=5, help="straggler.window")
    p.add_argument("--tail", type=int, default=20, help="steps of the 'after' phase")
    p.add_argument(
        "--evict-factor", type=float, default=1.5, help="straggler.evict_factor, standby run"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override"
    )
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--out", default="bench_out/straggler.json")
    return p.parse_args(argv)


def _phases(metrics: list[dict], args) -> dict:
    t = {m["step"]: m["step_time_s"] for m in metrics}
    phase = {
        "before": range(5, args.slow_from),
        "slowed": range(args.slow_from + 1, args.slow_from + 5),
        "after": range(args.steps - args.tail, args.steps),
    }
    return {k: statistics.median(t[s] for s in steps) for k, steps in phase.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps - args.tail < args.slow_from + 20:
        sys.exit("error: --steps must leave --tail steps after the mitigation (slow-from + 20)")
    ensure_demo(args.demo_dir)
    slow = ["--inject", f"slow:1:{args.factor:g}:{args.slow_from}"]
    args.set = [
        f"model={args.model}",
        f"straggler.interval={args.interval}",
        f"straggler.window={args.window}",
        *args.set,
    ]
    runs = {
        "failure-free": args.set,
        "slowed, watch off": [*slow, *args.set, "straggler.enabled=false"],
        "slowed, watch on": [*slow, *args.set],
        "slowed, standby": [*slow, *args.set, f"straggler.evict_factor={args.evict_factor:g}"],
    }
    rows = {}
    with tempfile.TemporaryDirectory(prefix="mecefo-straggler-") as tmp:
        for name, extra in runs.items():
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            run_dir = Path(tmp) / name.replace(" ", "_").replace(",", "")
            if name.endswith("standby"):
                if args.nproc != 2:
                    continue
                res = run_demo_nodes(2, 1, args.steps, run_dir, args.demo_dir, extra)
            else:
                res = run_demo_job(
                    "failover", args.nproc, args.steps, run_dir, args.demo_dir, extra
                )
            rows[name] = {
                **_phases(res["metrics"], args),
                "rebalanced": [e for e in res["events"] if e["type"] == "rebalanced"],
                "evicted": [e for e in res["events"] if e["type"] in ("evicted", "node_replaced")],
            }
    base = rows["failure-free"]["before"]
    n, f = args.nproc, args.factor
    floor = n / (n - 1 + 1 / f)
    print(
        f"{args.nproc} ranks, model {args.model}, rank 1 {f:g}x slower from step "
        f"{args.slow_from}; median step ms"
    )
    print(f"{'run':<20}{'before':>9}{'slowed':>9}{'after':>9}{'after / failure-free':>22}")
    for name, r in rows.items():
        print(
            f"{name:<20}{1000 * r['before']:>9.1f}{1000 * r['slowed']:>9.1f}"
            f"{1000 * r['after']:>9.1f}{r['after'] / base:>21.2f}x"
        )
    print(f"floor with uneven shares: {floor:.2f}x; rebalanced events (watch on):")
    for e in rows["slowed, watch on"]["rebalanced"]:
        print(f"  step {e['step']}: {e.get('detail')}")
    for e in rows.get("slowed, standby", {}).get("evicted", []):
        print(f"  standby run, step {e['step']}: {e['type']}: {e.get('detail')}")
    write_json({"machine": machine(), "rows": rows, "floor": floor, "args": vars(args)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
