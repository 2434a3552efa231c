"""Node-loss benchmark: a whole simulated node dies and a standby node takes its ranks.

    python tools/bench/node_loss.py [--nnodes 2 --nproc 2 --standby 1 --steps 120 --kill-at 10]
        [--rounds 3] [--out bench_out/node_loss.json]

Each round runs `launch/local/run.sh` with NNODES working nodes and NSPARE standby nodes on this
machine (one `mecefo-launch` each), waits for step `--kill-at`, then SIGKILLs node 1's agent and
everything it started at once (a node losing power). From events.jsonl, metrics.jsonl and
summary.json: detection latency (failure -> detection of the node's ranks), node declared lost,
time to full strength (failure -> `node_replaced`), steps run with degraded micro-batches, and the
state bytes sent to the replacement ranks. With `--standby 0` the node stays lost: the baseline.
Anchor: TrainMover replaces a machine in about 20 s. Prints a table and writes JSON. A benchmark,
not a test; on a 2-core machine every process time-shares, so absolute times are pessimistic.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

from bench_common import (  # noqa: E402 - after the path fix
    bench_parser,
    cell,
    demo_job_args,
    median_of,
    read_jsonl,
    write_json,
)


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--nnodes", type=int, default=2, help="working nodes")
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("--standby", type=int, default=1, help="standby nodes (0: no spare)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-at", type=int, default=10, help="kill node 1 after this many steps")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=400)
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--out", default="bench_out/node_loss.json")
    args = p.parse_args()
    if args.nnodes < 2 or args.kill_at >= args.steps:
        p.error("need --nnodes >= 2 (node 1 is killed) and --kill-at < --steps")
    return args


def _node_agents(launcher: subprocess.Popen):
    import psutil

    agents = {}
    for proc in psutil.Process(launcher.pid).children():
        cmd = proc.cmdline()
        if "megatron_mecefo.failover.node.agent_cli" in cmd and "--node-rank" in cmd:
            node = int(cmd[cmd.index("--node-rank") + 1])
            agents[(node, "--standby" in cmd)] = proc
    return agents


def _kill_tree(proc) -> None:
    import psutil

    for p in [proc, *proc.children(recursive=True)]:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass


def run_round(args, run_dir: Path) -> dict:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "NNODES": str(args.nnodes),
        "NSPARE": str(args.standby),
        "NPROC": str(args.nproc),
        "PYTHONWARNINGS": "ignore",
    }
    cmd = ["bash", str(ROOT / "launch" / "local" / "run.sh")]
    cmd += demo_job_args(args.steps, run_dir, args.demo_dir, "failover.audit=true")
    log = run_dir.with_suffix(".log")
    start = time.monotonic()
    with open(log, "w") as fh:
        launcher = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        metrics = run_dir / "metrics.jsonl"
        killed_at = None
        try:
            while launcher.poll() is None and time.monotonic() - start < args.timeout_s:
                rows = metrics.read_text().splitlines() if metrics.exists() else []
                if killed_at is None and len(rows) >= args.kill_at:
                    _kill_tree(_node_agents(launcher)[(1, False)])
                    killed_at = time.time()
                time.sleep(0.05)
            rc = launcher.wait(timeout=max(1.0, args.timeout_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            rc = -9
    return summarize(run_dir, rc, killed_at, time.monotonic() - start, args)


def summarize(run_dir: Path, rc: int, killed_at: float | None, wall_s: float, args) -> dict:
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    lost_ranks = set(range(args.nproc, 2 * args.nproc))
    detections = [
        e["latency_ms"] for e in events if e["type"] == "detection" and set(e["ranks"]) & lost_ranks
    ]
    replaced = [e for e in events if e["type"] == "node_replaced"]
    rejoins = [e for e in events if e["type"] == "rejoin"]
    return {
        "exit_code": rc,
        "killed": killed_at is not None,
        "wall_s": wall_s,
        "detection_ms": max(detections) if detections else None,
        "node_lost": any(e["type"] == "node_lost" for e in events),
        "full_strength_s": replaced[0]["latency_ms"] / 1000 if replaced else None,
        "degraded_steps": sum(1 for m in metrics if m.get("degraded_microbatches")),
        "final_replicas": metrics[-1].get("replicas_alive") if metrics else None,
        "rejoin_bytes": sum(int(e.get("bytes", 0)) for e in rejoins),
        "steps_logged": len(metrics),
    }


def main() -> int:
    args = parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mecefo-node-loss-") as tmp:
        for i in range(args.rounds):
            row = run_round(args, Path(tmp) / f"round{i}")
            rows.append(row)
            print(f"round {i + 1}/{args.rounds}: {json.dumps(row)}", flush=True)
    world = args.nnodes * args.nproc
    print(
        f"\nnode loss: {args.nnodes} nodes x {args.nproc} ranks, {args.standby} standby; "
        f"node 1 SIGKILLed whole at step {args.kill_at}; median of {args.rounds} rounds"
    )
    print(f"{'metric':<34}{'value':>12}")
    for key, unit in (
        ("detection_ms", "ms"),
        ("full_strength_s", "s"),
        ("degraded_steps", "steps"),
        ("rejoin_bytes", "bytes"),
        ("final_replicas", f"of {world}"),
    ):
        value = median_of(r.get(key) for r in rows)
        shown = cell(value, ".1f" if isinstance(value, float) else "")
        print(f"{key + ' (' + unit + ')':<34}{shown:>12}")
    write_json({"args": vars(args), "rounds": rows}, args.out)
    ok = all(r["exit_code"] == 0 and r["killed"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
