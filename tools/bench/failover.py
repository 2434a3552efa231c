"""Failover benchmark: detection, regroup and rejoin latencies, work lost per failure, and the
failure-free overhead of the failover manager. Real processes, real signals.

    python tools/bench/failover.py                     # CPU: tiny model, 4 ranks over gloo
    python tools/bench/failover.py --quick --out bench_out/failover.json
    python tools/bench/failover.py --store both     # the same runs on tcp and on etcd, in one run

1. Failure runs (`mecefo-launch`, 4 ranks): SIGKILL, SIGSTOP (hang) and an exception, each at step
   10, back after 5 steps. From events.jsonl and summary.json: detection and regroup latency (from
   the failure), rejoin time and state bytes/MB/s, steps redone, samples lost.
2. Overhead: the same failure-free job (2 ranks) under `mecefo-launch` (heartbeats, abortable
   reductions on staging copies, commit vote) and under plain torchrun (megatron's DP group),
   interleaved A/B/A/B; median step time after warm-up. On a 2-core machine the processes
   time-share, so compare the two in one run and read the ratio, not the absolute times.

`--store etcd|both`: the failover runs also (or only) on `mecefo-launch --store etcd`, which
starts a local 3-member etcd cluster per run (`etcd` on PATH: `scripts/install_etcd.sh`); their
rows say "(etcd)". Prints a table and writes JSON. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

from bench_common import (  # noqa: E402
    bench_parser,
    cell,
    ensure_demo,
    run_demo_job,
    write_json,
)

SCENARIOS = {"kill": "kill:2:10:5", "hang": "hang:1:10:5", "exception": "exception:3:10:5"}


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--steps", type=int, default=40, help="steps of each failure run")
    p.add_argument("--overhead-steps", type=int, default=200, help="steps of each overhead run")
    p.add_argument("--repeats", type=int, default=2, help="A/B pairs of overhead runs")
    p.add_argument("--quick", action="store_true", help="fewer steps, one A/B pair")
    p.add_argument("--skip-failures", action="store_true", help="only the overhead runs")
    p.add_argument(
        "--store",
        choices=("tcp", "etcd", "both"),
        default="tcp",
        help="the failover runs' control-plane store (both: tcp and etcd side by side)",
    )
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--out", default="bench_out/failover.json")
    return p.parse_args()


def failure_row(kind: str, res: dict) -> dict:
    ev = res["events"]
    first = {
        t: next((e for e in ev if e["type"] == t), None)
        for t in ("failure", "detection", "regroup", "rejoin")
    }
    fo = res["summary"]["failover"]
    rejoin = first["rejoin"]
    detail = rejoin["detail"] if rejoin else ""
    return {
        "kind": kind,
        "detection_ms": first["detection"]["latency_ms"] if first["detection"] else None,
        "regroup_ms": first["regroup"]["latency_ms"] if first["regroup"] else None,
        "rejoin_ms": rejoin["latency_ms"] if rejoin else None,
        "rejoin_state_mb": rejoin["bytes"] / 1e6 if rejoin else None,
        "rejoin_transfer_ms": rejoin["transfer_ms"] if rejoin else None,
        "rejoin_detail": detail,
        "steps_redone": fo["steps_redone"],
        "samples_lost": fo["samples_lost"],
        "steps_completed": res["summary"]["steps"],
    }


def _store(launcher: str) -> str:
    return " (etcd)" if launcher.endswith("etcd") else ""


def _name(launcher: str) -> str:
    return "etcd" if launcher.endswith("etcd") else "tcp"


def median_step_s(res: dict, skip: int = 20) -> float:
    return statistics.median(m["step_time_s"] for m in res["metrics"] if m["step"] >= skip)


def main() -> int:
    args = parse_args()
    if args.quick:
        args.steps, args.overhead_steps, args.repeats = 30, 80, 1
    sys.path.insert(0, str(ROOT))
    ensure_demo(args.demo_dir)
    tmp = Path(tempfile.mkdtemp(prefix="mecefo-bench-failover-"))
    stores = {"tcp": ["failover"], "etcd": ["failover-etcd"]}.get(
        args.store, ["failover", "failover-etcd"]
    )
    rows = []
    for kind, spec in {} if args.skip_failures else SCENARIOS.items():
        for launcher in stores:
            label = kind + _store(launcher)
            print(f"[bench] failure run: {label} ({spec}), {args.steps} steps, 4 ranks", flush=True)
            run_dir = tmp / label.replace(" (etcd)", "-etcd")
            res = run_demo_job(launcher, 4, args.steps, run_dir, args.demo_dir, ["--inject", spec])
            rows.append({**failure_row(kind, res), "kind": label, "store": _name(launcher)})
    overhead: dict[str, list[float]] = {launcher: [] for launcher in [*stores, "torchrun"]}
    votes: dict[str, list[float]] = {launcher: [] for launcher in stores}
    for i in range(args.repeats):
        for launcher in overhead:
            print(f"[bench] overhead run {i + 1}/{args.repeats}: {launcher}", flush=True)
            res = run_demo_job(
                launcher, 2, args.overhead_steps, tmp / f"oh_{launcher}_{i}", args.demo_dir
            )
            overhead[launcher].append(median_step_s(res))
            if launcher in votes:
                votes[launcher].append(res["summary"]["failover"]["vote_ms_median"])
    first = stores[0]
    vote_ms = votes[first]
    fo_s = statistics.median(overhead[first])
    tr_s = statistics.median(overhead["torchrun"])
    print()
    print(
        f"{'failure':<16} {'detect ms':>9} {'regroup ms':>10} {'rejoin ms':>9} "
        f"{'state MB':>8} {'xfer ms':>7} {'redone':>6} {'lost':>4}"
    )
    for r in rows:

        def f(v, fmt):
            return cell(v, fmt, missing="-")

        print(
            f"{r['kind']:<16} {f(r['detection_ms'], '9.0f')} {f(r['regroup_ms'], '10.0f')} "
            f"{f(r['rejoin_ms'], '9.0f')} {f(r['rejoin_state_mb'], '8.2f')} "
            f"{f(r['rejoin_transfer_ms'], '7.0f')} {r['steps_redone']:>6} "
            f"{r['samples_lost']:>4}"
        )
    print()
    for launcher in stores:
        step_s, vote = statistics.median(overhead[launcher]), statistics.median(votes[launcher])
        print(
            f"failure-free step time, 2 ranks, median of {args.repeats} runs x "
            f"{args.overhead_steps - 20} steps: mecefo-launch{_store(launcher)} "
            f"{1000 * step_s:.2f} ms, torchrun {1000 * tr_s:.2f} ms, difference "
            f"{100 * (step_s / tr_s - 1):+.1f}% (run-to-run noise here is +-6%); commit vote "
            f"(including waiting for the slower rank) median {vote:.2f} ms = "
            f"{100 * vote / 1000 / step_s:.2f}% of a step"
        )
    by_store = {
        _name(launcher): {
            "step_s": overhead[launcher],
            "overhead_fraction": statistics.median(overhead[launcher]) / tr_s - 1,
            "vote_ms_per_step": votes[launcher],
        }
        for launcher in stores
    }
    out = {
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "failures": rows,
        "overhead": {  # the first store's (tcp unless --store etcd); by_store: each
            "failover_step_s": overhead[first],
            "torchrun_step_s": overhead["torchrun"],
            "overhead_fraction": fo_s / tr_s - 1,
            "vote_ms_per_step": vote_ms,
            "by_store": by_store,
        },
        "sim_inputs": {
            "failover_s": statistics.mean(
                [
                    r["regroup_ms"] / 1000
                    for r in rows
                    if r["regroup_ms"] is not None and r["store"] == _name(first)
                ]
                or [0.0]
            ),
        },
    }
    return write_json(out, args.out, blank_line=False)


if __name__ == "__main__":
    sys.exit(main())
