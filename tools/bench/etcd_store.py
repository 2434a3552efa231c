"""The etcd store against the tcp store: real jobs, the election, and etcd's load at scale.

    python tools/bench/etcd_store.py [--quick] [--out bench_out/etcd_store.json]

1. Real jobs on both stores, in one run (a 3-member etcd cluster on this machine):
   - a SIGKILL at step 10 (4 ranks): detection and regroup latency from events.jsonl;
   - a node lost (2 nodes of 2 ranks, node 1's agent and everything it started SIGKILLed at step
     8): the `node_lost` event's latency;
   - the failure-free step time (2 ranks), the two stores interleaved A/B/A/B, and the commit
     vote's median (its compare-and-set is the one store request on every step);
   - etcd's own request count (`grpc_server_started_total` from every member's /metrics) over
     the failure-free run: requests per second per node agent with its ranks.
2. The election: two candidates (`coordinator_cli --elect`), the leader SIGKILLed; the time until
   the other says it was elected, for the default TTL and a short one.
3. etcd at 1k, 4k and 16k ranks (8 per node): etcd's capacity for the agents' request mix
   (worker processes flat out, the product's calls), the coordinator's one read of every node
   report, and the offered rate against the capacity: every agent's tick (2 requests per 0.1 s
   and its lease) plus, per rank and step, the requests a step of the 2-rank job of 1. made (an
   upper bound: that count includes its agent and coordinator) at one step per --step-s.

Prints tables and writes JSON. A benchmark, not a test; every process it starts is stopped.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))
sys.path.insert(0, str(ROOT))

from bench_common import (  # noqa: E402
    bench_parser,
    demo_job_args,
    ensure_demo,
    free_port,
    read_jsonl,
    run_job,
    write_json,
)

from megatron_mecefo.control import keys  # noqa: E402
from megatron_mecefo.control.etcd_cluster import LocalEtcd  # noqa: E402
from megatron_mecefo.control.etcd_store import EtcdStore, address  # noqa: E402
from megatron_mecefo.failover.node.agent_cli import launch_command  # noqa: E402
from megatron_mecefo.failover.node.node_lease import LEASE_TTL_S  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def etcd_requests(cluster: LocalEtcd) -> int:
    total = 0
    for ep in cluster.endpoints:
        text = urllib.request.urlopen(f"http://{ep}/metrics", timeout=5).read().decode()
        total += sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines()
            if line.startswith("grpc_server_started_total{")
        )
    return total


def store_args(store: str, cluster: LocalEtcd, job: str) -> list[str]:
    if store == "tcp":
        return []
    return ["--store", "etcd", "--etcd-endpoints", ",".join(cluster.endpoints), "--job-id", job]


def agent_cmd(nproc: int, extra: list[str], train: list[str]) -> list[str]:
    return launch_command(train, nproc_per_node=nproc, flags=["--restart-delay-s", "0.5", *extra])


def first_event(events: list[dict], kind: str) -> dict | None:
    return next((e for e in events if e["type"] == kind), None)


def kill_run(store, cluster, tmp, steps, demo) -> dict:
    run_dir = tmp / f"kill_{store}"
    train = demo_job_args(steps, run_dir, demo, "--inject", "kill:2:10:4")
    res = run_job(
        agent_cmd(4, store_args(store, cluster, f"kill-{time.time_ns()}"), train),
        run_dir,
        timeout_s=600,
    )
    det, reg = first_event(res["events"], "detection"), first_event(res["events"], "regroup")
    return {"detection_ms": det and det["latency_ms"], "regroup_ms": reg and reg["latency_ms"]}


def node_loss_run(store, cluster, tmp, steps, demo) -> dict:
    import psutil

    run_dir = tmp / f"node_{store}"
    train = demo_job_args(steps, run_dir, demo)
    job, port = f"node-{time.time_ns()}", free_port()
    procs = []
    for node in range(2):
        if store == "tcp":
            where = (
                ["--coordinator-port", str(port)]
                if node == 0
                else ["--coordinator", f"127.0.0.1:{port}"]
            )
        else:
            where = store_args(store, cluster, job)
        cmd = agent_cmd(2, ["--nnodes", "2", "--node-rank", str(node), *where], train)
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
        time.sleep(1.0 if node == 0 else 0)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) > 8):
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            sys.exit("error: the node-loss job never reached step 8")
        time.sleep(0.05)
    victims = [procs[1], *psutil.Process(procs[1].pid).children(recursive=True)]
    for p in victims:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    procs[0].wait(600)
    events = read_jsonl(run_dir / "events.jsonl")
    lost, det = first_event(events, "node_lost"), first_event(events, "detection")
    silent = re.search(r"silent for ([0-9.]+) s", lost["detail"]) if lost else None
    return {
        "ranks_detected_ms": det and det["latency_ms"],
        "node_lost_ms": 1000 * float(silent.group(1)) if silent else None,
    }


def overhead_run(store, cluster, tmp, steps, demo, i) -> dict:
    """A failure-free job; on etcd, etcd's request counters sampled at steps 20 and steps - 10:
    the requests of one training step of the whole job (2 ranks, their agent, the coordinator)."""
    run_dir = tmp / f"oh_{store}_{i}"
    train = demo_job_args(steps, run_dir, demo)
    cmd = agent_cmd(2, store_args(store, cluster, f"oh-{time.time_ns()}"), train)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    samples = []
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if store == "etcd" and len(samples) < 2 and done >= (20, steps - 10)[len(samples)]:
            samples.append((done, time.monotonic(), etcd_requests(cluster)))
        time.sleep(0.02)
    if proc.returncode != 0:
        sys.exit(f"error: failure-free {store} job failed ({proc.returncode})")
    summary = json.loads((run_dir / "summary.json").read_text())
    out = {
        "step_s": statistics.median(
            m["step_time_s"] for m in read_jsonl(metrics) if m["step"] >= 20
        ),
        "vote_ms": summary["failover"]["vote_ms_median"],
    }
    if len(samples) == 2:
        (s0, t0, r0), (s1, t1, r1) = samples
        out["etcd_requests_per_step"] = (r1 - r0) / (s1 - s0)
        out["etcd_requests_per_s"] = (r1 - r0) / (t1 - t0)
    return out


def election_trials(cluster: LocalEtcd, ttl_s: int, trials: int, tmp: Path) -> list[float]:
    out = []
    for t in range(trials):
        addr = address(cluster.endpoints, f"elect-{ttl_s}-{t}-{time.time_ns()}")
        logs = [tmp / f"elect_{ttl_s}_{t}_{c}.log" for c in "ab"]
        cmd = [
            sys.executable,
            "-m",
            "megatron_mecefo.failover.authority.coordinator_cli",
            "--store",
            addr,
            "--world-size",
            "2",
            "--lease-ttl-s",
            str(ttl_s),
            "--elect",
        ]
        a = subprocess.Popen(
            [*cmd, "A"], stdout=open(logs[0], "w"), stderr=subprocess.STDOUT, env=ENV, cwd=ROOT
        )
        b = None
        try:
            wait_text(logs[0], "candidate A elected")
            b = subprocess.Popen(
                [*cmd, "B"], stdout=open(logs[1], "w"), stderr=subprocess.STDOUT, env=ENV, cwd=ROOT
            )
            wait_text(logs[1], "standing by")
            a.kill()
            killed = time.monotonic()
            wait_text(logs[1], "candidate B elected")
            out.append(time.monotonic() - killed)
        finally:
            for p in (a, b):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(10)
    return out


def wait_text(path: Path, text: str, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not (path.exists() and text in path.read_text()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{text!r} not in {path}")
        time.sleep(0.01)


# ---------------------------------------------------------------- etcd at scale
def _agent_worker(addr: str, nodes: list[int], seconds: float, out) -> None:
    """The agent's request mix, flat out: per tick one multi_get of 4 keys and one node report."""
    store = EtcdStore(addr, 10.0)
    report = json.dumps(
        {"seq": "1:1", "ranks": {str(r): [0, 1234, "R", 100, "0:5:fwd"] for r in range(8)}}
    )
    latencies, n, end = [], 0, time.monotonic() + seconds
    while time.monotonic() < end:
        node = nodes[n % len(nodes)]
        t0 = time.perf_counter()
        store.multi_get([keys.GEN, keys.FLAGS, keys.EVICT_SEQ, keys.node_owner(node)])
        store.set(keys.node_key(node), report)
        latencies.append((time.perf_counter() - t0) / 2)
        n += 1
    out.put((2 * n, latencies))


AGENT_RPS = 2 / 0.1 + 2 / (LEASE_TTL_S / 3)
"""A node agent's requests: one multi_get and one node report per 0.1 s tick, and its lease's
renewal (keepalive and put) every TTL/3 of 5 s."""


def scale(
    cluster: LocalEtcd,
    ranks: list[int],
    workers: int,
    seconds: float,
    per_rank_step: float,
    step_s: float,
) -> dict:
    """etcd's capacity for the agents' mix, and the offered rate at each size: every agent's
    ticks, plus `per_rank_step` requests per rank per step (measured on 2 ranks, so it carries
    their agent's and the coordinator's share too: an upper bound) at one step per `step_s`."""
    addr = address(cluster.endpoints, f"scale-{time.time_ns()}")
    store = EtcdStore(addr, 10.0)
    keys.control_keys(store)
    biggest = max(ranks) // 8
    report = json.dumps(
        {"seq": "1:1", "ranks": {str(r): [0, 1234, "R", 100, "0:5:fwd"] for r in range(8)}}
    )
    for node in range(biggest):
        store.set(keys.node_key(node), report)
        store.set(keys.node_owner(node), "1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_agent_worker, args=(addr, list(range(w, biggest, workers)), seconds, out)
        )
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
    total = sum(r[0] for r in results)
    lat = sorted(x for r in results for x in r[1])
    capacity = total / seconds
    rows = []
    for n in ranks:
        nodes = n // 8
        t0 = time.perf_counter()
        store.multi_get([keys.node_key(i) for i in range(nodes)])
        read_ms = 1000 * (time.perf_counter() - t0)
        agents, steps = nodes * AGENT_RPS, n * per_rank_step / step_s
        offered = agents + steps
        rows.append(
            {
                "ranks": n,
                "nodes": nodes,
                "agents_rps": agents,
                "steps_rps": steps,
                "offered_rps": offered,
                "utilization": offered / capacity,
                "coordinator_read_ms": read_ms,
            }
        )
    return {
        "capacity_rps": capacity,
        "latency_ms_p50": 1000 * lat[len(lat) // 2],
        "latency_ms_p99": 1000 * lat[int(0.99 * (len(lat) - 1))],
        "workers": workers,
        "step_s": step_s,
        "per_rank_step": per_rank_step,
        "rows": rows,
    }


def main() -> int:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--overhead-steps", type=int, default=120)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--step-s", type=float, default=2.0, help="step time of the projected jobs")
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--out", default="bench_out/etcd_store.json")
    args = p.parse_args()
    if args.quick:
        args.overhead_steps, args.repeats, args.trials = 60, 1, 2
    ensure_demo(args.demo_dir)
    tmp = Path(tempfile.mkdtemp(prefix="mecefo-bench-etcd-"))
    cluster = LocalEtcd(tmp / "etcd", log=lambda m: None)
    cluster.start()
    try:
        doc: dict = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "etcd": {}, "tcp": {}}
        for store in ("tcp", "etcd"):
            print(f"[bench] {store}: kill and node loss", flush=True)
            doc[store]["kill"] = kill_run(store, cluster, tmp, args.steps, args.demo_dir)
            doc[store]["node_loss"] = node_loss_run(store, cluster, tmp, args.steps, args.demo_dir)
        for store in ("tcp", "etcd"):
            doc[store]["overhead"] = []
        for i in range(args.repeats):
            for store in ("tcp", "etcd"):
                print(f"[bench] failure-free {i + 1}/{args.repeats}: {store}", flush=True)
                doc[store]["overhead"].append(
                    overhead_run(store, cluster, tmp, args.overhead_steps, args.demo_dir, i)
                )
        print("[bench] election", flush=True)
        doc["election_s"] = {ttl: election_trials(cluster, ttl, args.trials, tmp) for ttl in (5, 2)}
        per_step = statistics.median(
            r["etcd_requests_per_step"]
            for r in doc["etcd"]["overhead"]
            if "etcd_requests_per_step" in r
        )
        print("[bench] etcd at scale", flush=True)
        seconds = 4.0 if args.quick else 6.0
        ranks = [1024, 4096, 16384]
        doc["scale"] = scale(cluster, ranks, 3, seconds, per_step / 2, args.step_s)
        doc["scale"]["requests_per_step_2_ranks"] = per_step
    finally:
        cluster.stop()
    print()
    print(
        f"{'store':<6} {'kill detect ms':>14} {'regroup ms':>10} {'node det. ms':>12} "
        f"{'step ms':>8} {'vote ms':>8}"
    )
    for store in ("tcp", "etcd"):
        d = doc[store]
        step = statistics.median(r["step_s"] for r in d["overhead"])
        vote = statistics.median(r["vote_ms"] for r in d["overhead"])
        lost = d["node_loss"]["ranks_detected_ms"] or float("nan")
        print(
            f"{store:<6} {d['kill']['detection_ms']:>14.0f} {d['kill']['regroup_ms']:>10.0f} "
            f"{lost:>12.0f} {1000 * step:>8.1f} {vote:>8.2f}"
        )
    for ttl, xs in doc["election_s"].items():
        print(
            f"election after the leader's SIGKILL, TTL {ttl} s: "
            + ", ".join(f"{x:.2f} s" for x in xs)
        )
    s = doc["scale"]
    print(
        f"etcd capacity for the agents' mix: {s['capacity_rps']:.0f} requests/s "
        f"({s['workers']} client "
        f"processes; p50 {s['latency_ms_p50']:.2f} ms, p99 {s['latency_ms_p99']:.2f} ms); "
        f"{s['requests_per_step_2_ranks']:.1f} requests per step of a 2-rank job (measured); "
        f"projected at one step per {s['step_s']:.0f} s"
    )
    print(
        f"{'ranks':>6} {'nodes':>6} {'offered req/s':>13} {'of capacity':>11} {'coord read ms':>13}"
    )
    for r in s["rows"]:
        print(
            f"{r['ranks']:>6} {r['nodes']:>6} {r['offered_rps']:>13.0f} {r['utilization']:>10.0%} "
            f"{r['coordinator_read_ms']:>13.1f}"
        )
    return write_json(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
