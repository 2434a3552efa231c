"""Control-plane benchmark: the job's store and membership coordinator under the load of a
16,384-GPU job, driven by synthetic clients on one machine.

    python tools/bench/control_plane.py [--ranks 1024 4096 16384] [--modes a b]
        [--client-rps 20000] [--out bench_out/control_plane.json]
    python tools/bench/control_plane.py --real-nproc 8 16 32    # real jobs, one kill each

The store is torch's libuv `TCPStore`, served in its own process exactly as `mecefo-coordinator`
(`store_host.py`) serves it, with the same 0.1 s polling loop beside it. The coordinator is the real
`Coordinator` class in its own process, running its own loop (`Coordinator.run`: tick, sleep 50 ms)
in a subclass that times every tick and counts its store requests (the real `mecefo-coordinator`
would start its own coordinator child, which exposes neither). Every record the bench writes (node
reports, generation records, registrations) is built with the product's record types
(`control/records.py`).

Clients are worker processes, each driving many logical ranks and node agents over one store
connection, request for request as the product's. Mode a is the per-rank protocol (a trainer
without an agent channel): each rank's heartbeat (every 0.2 s: add hb/<r>, set progress/<r> when
it changed, get GEN, check ABORT, check STOP; on a new GEN its main thread reads gen/<g>), beside
the same node agents as in b. Mode b is the product's protocol under `mecefo-launch`
(heartbeats aggregated per node, `control/local_beat.py`): one writer per node of 8 ranks. The
agent's node report carries each rank's heartbeat counter and progress; every 0.1 s the agent
reads [GEN, job/flags, evict/seq, node_owner/<i>] in one multi_get, hands GEN/ABORT/STOP to its
trainers through a node-local file (that local hop is not measured here; tests/dist cover it),
and reads its ranks' eviction keys only when evict/seq moved; on a new GEN it reads gen/<g> once
for the node and puts it in the folder, where its ranks read it. Registrations, death reports
and standbys are announced in append-only logs. The coordinator is
the product's `Coordinator` in both modes: it reads every node report with one multi_get, only new
log entries, and the per-rank keys only of ranks no node report carries (all of them in mode a).

A 2-core machine cannot generate the request rate of 16k ranks (a Python client does about 20k
synchronous requests/s), so only `live` nodes (as many as --client-rps allows, victims included)
run the protocol on its schedule; the other nodes' keys are kept fresh by one multi_set per worker
every 0.1 s, so the coordinator reads and judges all N ranks. The store's CPU per protocol request
is measured (workers flat out, before the coordinator starts) and the load of all N ranks is
projected from it: what is measured and what is projected is labelled in the table and the JSON.
Prints tables and writes JSON. A benchmark, not a test; every wait is bounded and every process
it starts is stopped before it returns.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "tools" / "bench", ROOT):  # bench_common; the package (tests load by path)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_common import (  # noqa: E402 - after the path fix (no torch import)
    bench_parser,
    demo_job_args,
    machine,
    mem_available_gb,
    percentile,
    read_jsonl,
    write_json,
)
from control_plane_clients import (  # noqa: E402
    _coordinator_main,
    _cpu_s,
    _Inbox,
    _server_main,
    _thread_cpu_s,
    _worker_main,
)
from control_plane_model import (  # noqa: E402
    DEAD_LOG,
    FLAGS,
    MODES,
    REG_LOG,
    STANDBY_LOG,
    WAIT_GEN_S,
    WAIT_SEEN_S,
    Layout,
    _registration,
    assign_nodes,
    generation_record,
    live_nodes,
    offered_rps,
    report_template,
    server_cores,
    tick_summary,
)
from control_plane_report import (  # noqa: E402
    LEGEND,
    format_real,
    format_tables,
)

from megatron_mecefo.control import keys  # noqa: E402
from megatron_mecefo.control.keys import node_key  # noqa: E402
from megatron_mecefo.failover.liveness.detector import DetectorConfig  # noqa: E402

# ------------------------------------------------------------------------------ one configuration


def _populate(store, mode: str, layout: Layout, run_dir: str, tp: int) -> None:
    """What the job's start-up leaves in the store: every rank registered and beating once, every
    node's agent reporting, GEN = 0 (the bench sets it so that mode b's multi_get finds it; the
    coordinator treats 0 as no generation)."""
    items: dict[str, str] = {
        keys.AGENT_IDS: str(layout.nodes),
        keys.AGENTS_ACTIVE: str(layout.nodes),
        keys.REG_SEQ: str(layout.ranks),
        keys.GEN: "0",
        keys.RECOVERY: json.dumps({"mode": "failover", "recoverable": True, "wait_all_s": 60.0}),
        keys.RUN_DIR: f"{run_dir}|{time.time()}",
    }
    for r in range(layout.ranks):
        items[keys.registration(r)] = _registration(r, 0, tp, layout, r // layout.ranks_per_node)
        items[keys.heartbeat(r)] = "1"
        items[keys.progress(r)] = "0:-1:idle"
    for n in range(layout.nodes):
        items[keys.node_owner(n)] = str(n + 1)
        template = report_template(mode, list(layout.node_ranks(n)), {})
        items[node_key(n)] = template % {"seq": f"{n + 1}:0", "hb": 0, "progress": "-1:idle"}
    # the job flags, eviction counter and append-only logs, as a running job has them
    items.update({FLAGS: "", keys.EVICT_SEQ: "0", DEAD_LOG: "", STANDBY_LOG: ""})
    items[REG_LOG] = "".join(f"{r}," for r in range(layout.ranks))
    names = list(items)
    for i in range(0, len(names), 8192):
        chunk = names[i : i + 8192]
        store.multi_set(chunk, [items[k] for k in chunk])


class _Run:
    """One (mode, N) configuration: start, calibrate, steady load, a silent failure, an exit, a
    rejoin of both; every wait bounded, every process stopped in `close`."""

    def __init__(self, mode: str, n_ranks: int, args, ctx):
        self.mode, self.protocol, self.args, self.ctx = mode, mode[0], args, ctx
        self.layout = Layout(n_ranks, args.ranks_per_node)
        self.live = live_nodes(
            self.protocol, self.layout, step_s=args.step_s, client_rps=args.client_rps
        )
        self.plan = assign_nodes(self.layout, self.live, args.workers)
        self.out = ctx.Queue()
        self.inbox = _Inbox(self.out)
        self.stop_server, self.stop_coord = ctx.Event(), ctx.Event()
        self.counters = ctx.Array("d", 3 * args.workers + 2, lock=False)
        self.cmds = [ctx.Queue() for _ in range(args.workers)]
        self.procs: list = []
        self.run_dir = tempfile.mkdtemp(prefix="mecefo-control-plane-")
        self.res: dict = {"mode": mode, "ranks": n_ranks, "nodes": self.layout.nodes}

    def _spawn(self, target, *args) -> None:
        proc = self.ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)

    def start(self) -> None:
        self._spawn(_server_main, self.out, self.stop_server)
        msg = self.inbox.take("server", 120)
        if msg is None:
            raise TimeoutError("the store did not start within 120 s")
        self.address, self.server_pid = f"127.0.0.1:{msg[1]}", msg[2]
        store = keys.connect(self.address, 60.0)
        t = time.perf_counter()
        _populate(store, self.protocol, self.layout, self.run_dir, self.args.ranks_per_node)
        record = generation_record(self.layout)
        store.set(keys.gen_record(0), record)
        self.res.update(populate_s=time.perf_counter() - t, record_bytes=len(record))
        t0 = time.monotonic()
        for w, part in enumerate(self.plan):
            spec = {"mode": self.protocol, "ranks": self.layout.ranks, "address": self.address}
            spec.update(ranks_per_node=self.layout.ranks_per_node, tp=self.layout.ranks_per_node)
            spec.update(t0=t0, step_s=self.args.step_s, **part)
            self._spawn(_worker_main, spec, w, self.counters, self.cmds[w], self.out)
        self.inbox.take_all("ready", self.args.workers, 180)
        self.res["live_nodes"] = self.live
        self.res["live_ranks"] = self.live * self.layout.ranks_per_node

    def calibrate(self) -> None:
        """Server CPU per request: the workers flat out on their live nodes' protocol requests,
        then on gen/<g> reads of an N-rank record (before the coordinator starts)."""
        calib = {}
        for what, seconds in (("protocol", self.args.calibrate_s), ("record", 0.5)):
            c0 = _cpu_s(self.server_pid)
            for q in self.cmds:
                q.put(("calibrate", what, seconds))
            replies = self.inbox.take_all("calibrated", self.args.workers, seconds + 60)
            cpu = _cpu_s(self.server_pid) - c0
            requests = sum(m[3] for m in replies)
            elapsed = max(m[4] for m in replies)
            calib[what] = {
                "requests": requests,
                "requests_per_s": requests / elapsed,
                "server_cpu_fraction": cpu / elapsed,
                "server_us_per_request": 1e6 * cpu / requests if requests else None,
            }
        self.res["calibration"] = calib

    def begin(self) -> None:
        for q in self.cmds:
            q.put(("start",))
        spec = {"mode": self.mode, "ranks": self.layout.ranks, "address": self.address}
        spec["heartbeat_timeout_s"] = self.args.heartbeat_timeout_s
        self._spawn(_coordinator_main, spec, self.counters, self.stop_coord, self.out)
        msg = self.inbox.take("restored", 300)
        if msg is None:
            raise TimeoutError("the coordinator did not restore within 300 s")
        self.res.update(coordinator_restore_s=msg[1], coordinator_restore_requests=msg[2])
        if self.inbox.until(lambda: self.inbox.gens.get(1), 120) is None:
            raise TimeoutError("no first generation within 120 s")
        self.res["start_propagation"] = self._propagation(1)

    def _propagation(self, gen: int) -> dict:
        """Time from the publication of `gen` until every live client (mode a: rank; mode b:
        agent) of every worker has read GEN and then the generation record."""
        workers = self.args.workers
        got = self.inbox.until(
            lambda: (
                self.inbox.seen.get(gen) if len(self.inbox.seen.get(gen, {})) == workers else None
            ),
            WAIT_SEEN_S,
        )
        if got is None:
            return {
                "gen_s": None,
                "record_s": None,
                "note": f"not everywhere in {WAIT_SEEN_S:.0f} s",
            }
        t_pub = self.inbox.gens[gen]["t"]
        return {
            "gen_s": max(v[0] for v in got.values()) - t_pub,
            "record_s": max(v[1] for v in got.values()) - t_pub,
        }

    def steady(self) -> None:
        time.sleep(self.args.warmup_s)
        a = (time.monotonic(), _cpu_s(self.server_pid), _thread_cpu_s(self.server_pid))
        ca = list(self.counters)
        time.sleep(self.args.steady_s)
        b = (time.monotonic(), _cpu_s(self.server_pid), _thread_cpu_s(self.server_pid))
        cb = list(self.counters)
        dt = b[0] - a[0]
        d = [y - x for x, y in zip(ca, cb)]
        live = sum(d[3 * w] for w in range(self.args.workers))
        bulk = sum(d[3 * w + 1] for w in range(self.args.workers))
        threads = [b[2][t] - a[2].get(t, 0.0) for t in b[2]]
        self.window = (a[0], b[0])
        self.res["steady"] = {
            "window_s": dt,
            "live_requests_per_s": live / dt,
            "bulk_multi_sets_per_s": bulk / dt,
            "coordinator_requests_per_s": d[-1] / dt,
            "coordinator_ticks": d[-2],
            "served_requests_per_s": (live + bulk + d[-1]) / dt,
            "server_cpu_fraction": (b[1] - a[1]) / dt,
            "server_busiest_thread_fraction": max(threads, default=0.0) / dt,
            "client_errors": sum(d[3 * w + 2] for w in range(self.args.workers)),
        }

    def _worker_of(self, node: int) -> int:
        return next(w for w, p in enumerate(self.plan) if node in p["live"])

    def fail(self, kind: str, node: int) -> dict:
        """Stop a rank of `node` (silence: its heartbeat and its agent's report; exit: the rank
        dies and its agent reports it) and time the generation that removes its replica."""
        rank = self.layout.node_ranks(node)[1]
        self.cmds[self._worker_of(node)].put((kind, node, rank))
        msg = self.inbox.take("failed", 30, lambda m: m[2] == node)
        if msg is None:
            return {"node": node, "detection_s": None, "note": "worker did not confirm"}
        t_fail = msg[4]
        bound = self.args.heartbeat_timeout_s + DetectorConfig().agent_timeout_s + WAIT_GEN_S

        def removed():
            for g, rec in sorted(self.inbox.gens.items()):
                if rec["t"] > t_fail and node not in rec["members"]:
                    return g
            return None

        gen = self.inbox.until(removed, bound)
        if gen is None:
            return {
                "node": node,
                "rank": rank,
                "detection_s": None,
                "note": f"none in {bound:.0f} s",
            }
        t_pub = self.inbox.gens[gen]["t"]
        return {
            "node": node,
            "rank": rank,
            "generation": gen,
            "detection_s": t_pub - t_fail,
            "propagation": self._propagation(gen),
        }

    def rejoin(self, nodes: list[int]) -> dict:
        for node in nodes:
            self.cmds[self._worker_of(node)].put(("rejoin", node))
        msgs = [self.inbox.take("rejoined", 30, lambda m, n=n: m[1] == n) for n in nodes]
        if any(m is None for m in msgs):
            return {"rejoin_s": None, "note": "worker did not confirm"}
        t_back = max(m[2] for m in msgs)

        def joined():
            for g, rec in sorted(self.inbox.gens.items()):
                if rec["t"] > t_back and all(n in rec["members"] for n in nodes):
                    return g
            return None

        gen = self.inbox.until(joined, WAIT_GEN_S)
        if gen is None:
            return {"rejoin_s": None, "note": f"no generation with them in {WAIT_GEN_S:.0f} s"}
        return {
            "generation": gen,
            "rejoin_s": self.inbox.gens[gen]["t"] - t_back,
            "propagation": self._propagation(gen),
        }

    def finish(self, victims: set[int]) -> None:
        t0, t1 = self.window
        for q in self.cmds:
            q.put(("stop", t0, t1))
        stats = [m[2] for m in self.inbox.take_all("stats", self.args.workers, 60)]
        beats = [p for s in stats for p in s["beat_periods"]]
        agents = [p for s in stats for p in s["agent_periods"]]
        self.res["client_periods_s"] = {
            "beat": {"p50": percentile(beats, 50), "p99": percentile(beats, 99), "n": len(beats)},
            "agent": {
                "p50": percentile(agents, 50),
                "p99": percentile(agents, 99),
                "n": len(agents),
            },
        }
        self.stop_coord.set()
        msg = self.inbox.take("coordinator", 60)
        if msg is not None:
            ticks = msg[1]["ticks"]
            steady = [t for t in ticks if t0 <= t[0] <= t1]
            self.res["coordinator"] = {
                "steady": tick_summary(steady),
                "all": tick_summary(ticks),
                "requests_by_op": msg[1]["by_op"],
                "notes": msg[1]["notes"][:20],
            }
        everyone = set(range(self.layout.nodes))
        wrongly = set()
        for rec in self.inbox.gens.values():
            wrongly |= everyone - rec["members"] - victims
        self.res["false_removals"] = sorted(wrongly)
        self.res["detection_events_ms"] = _detection_events(Path(self.run_dir))

    def close(self) -> None:
        self.stop_coord.set()
        self.stop_server.set()
        for q in self.cmds:
            q.put(("stop", 0.0, 0.0))
        for proc in self.procs:
            proc.join(timeout=5)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.res["leftover_processes"] = sum(p.is_alive() for p in self.procs)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        for q in [self.out, *self.cmds]:
            q.cancel_join_thread()
            q.close()


def _detection_events(run_dir: Path) -> list[float]:
    events = read_jsonl(run_dir / "events.jsonl")
    return [  # the failed ranks' own (their TP peers are removed with them, latency 0)
        e["latency_ms"]
        for e in events
        if e.get("type") == "detection" and "TP peer" not in e.get("detail", "")
    ]


def run_config(mode: str, n_ranks: int, args, ctx) -> dict:
    """One configuration, start to finish; its processes are stopped whatever happens."""
    run = _Run(mode, n_ranks, args, ctx)
    load0 = os.getloadavg()[0]
    t = time.monotonic()
    try:
        _phases(run, args)
    except TimeoutError as exc:
        run.res["error"] = str(exc)
    finally:
        run.close()
    run.res.update(wall_s=time.monotonic() - t, loadavg_1m=[load0, os.getloadavg()[0]])
    _project(run.res, args)
    return run.res


def _phases(run: _Run, args) -> None:
    run.start()
    run.calibrate()
    run.begin()
    run.steady()
    ticks = run.res["steady"]["coordinator_ticks"]
    if ticks < 2:  # a tick takes longer than half the window: no failure can be timed
        run.res["skipped_failures"] = (
            f"the coordinator completed {ticks:.0f} ticks in {args.steady_s:.0f} s"
        )
        run.finish(set())
        return
    silent = run.plan[0]["live"][0]
    exited = run.plan[-1]["live"][-1]
    run.res["silent"] = run.fail("silence", silent)
    run.res["exit"] = run.fail("exit", exited)
    run.res["rejoin"] = run.rejoin([silent, exited])
    run.finish({silent, exited})


def _project(res: dict, args) -> None:
    """The full-N load from the protocol and the measured server cost per request."""
    layout = Layout(res["ranks"], args.ranks_per_node)
    protocol = res["mode"][0]
    offered = offered_rps(protocol, layout, step_s=args.step_s)
    calib = res.get("calibration", {})
    us = calib.get("protocol", {}).get("server_us_per_request")
    us_record = calib.get("record", {}).get("server_us_per_request")
    readers = layout.ranks if protocol == "a" else layout.nodes  # b: the agent, for its node
    res["projected"] = {
        "offered_requests_per_s": offered,
        "server_cores_needed": server_cores(offered["total"], us),
        "record_storm_s": None if us_record is None else readers * us_record / 1e6,
        "record_readers": readers,
    }


# ------------------------------------------------------------------------------------ real jobs
def run_real(nproc: int, args) -> dict:
    """`launch/local/run.sh` with NPROC ranks of the tiny demo model and one SIGKILL (the last
    rank at step --real-kill-step, back after 3 steps): detection and regroup from events.jsonl."""
    avail_gb = mem_available_gb()
    need_gb = 0.4 * (nproc + 2) + 1.0  # ~360 MB a rank, a warm spare, the agent and coordinator
    res = {"nproc": nproc, "mem_available_gb": avail_gb, "loadavg_1m": os.getloadavg()[0]}
    if avail_gb < need_gb:
        return {**res, "skipped": f"needs ~{need_gb:.0f} GB, {avail_gb:.1f} GB available"}
    victim, kill_at = nproc - 1, args.real_kill_step
    run_dir = Path(tempfile.mkdtemp(prefix=f"mecefo-real-{nproc}-")) / "run"
    cmd = ["bash", str(ROOT / "launch/local/run.sh")]
    cmd += demo_job_args(kill_at + 8, run_dir, args.demo_dir, f"--inject=kill:{victim}:{kill_at}:3")
    env = {**os.environ, "NPROC": str(nproc), "PYTHON": sys.executable, "PYTHONWARNINGS": "ignore"}
    log = run_dir.parent / "job.log"
    t0, first_step = time.monotonic(), None
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while proc.poll() is None and time.monotonic() - t0 < args.real_timeout_s:
                if first_step is None and (run_dir / "metrics.jsonl").exists():
                    first_step = time.monotonic() - t0
                time.sleep(0.5)
            rc = proc.poll()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the job's whole session, on time-out
                proc.wait(30)
    res.update(exit_code=rc, wall_s=time.monotonic() - t0, first_step_s=first_step)
    if rc is None:
        res["note"] = f"did not finish within {args.real_timeout_s:.0f} s (killed)"
    res.update(_real_latencies(run_dir, victim))
    res["log_tail"] = log.read_text(errors="replace").splitlines()[-5:]
    shutil.rmtree(run_dir.parent, ignore_errors=True)
    return res


def _real_latencies(run_dir: Path, victim: int) -> dict:
    events = read_jsonl(run_dir / "events.jsonl")
    det = [
        e["latency_ms"] for e in events if e["type"] == "detection" and victim in e.get("ranks", [])
    ]
    reg = [e["latency_ms"] for e in events if e["type"] == "regroup" and "latency_ms" in e]
    rejoin = [e for e in events if e["type"] == "rejoin"]
    return {
        "detection_ms": det[0] if det else None,
        "regroup_ms": reg[0] if reg else None,
        "rejoined": bool(rejoin),
        "events": len(events),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "--ranks-per-node", type=int, default=8, help="also the TP size (node = replica)"
    )
    p.add_argument("--workers", type=int, default=3, help="client processes")
    p.add_argument(
        "--client-rps",
        type=float,
        default=20000.0,
        help="protocol requests/s the workers offer (sets the live nodes)",
    )
    p.add_argument("--step-s", type=float, default=2.0, help="synthetic training step time")
    p.add_argument(
        "--heartbeat-timeout-s", type=float, default=3.0, help="coordinator soft timeout"
    )
    p.add_argument("--calibrate-s", type=float, default=1.5)
    p.add_argument("--warmup-s", type=float, default=1.5)
    p.add_argument("--steady-s", type=float, default=5.0)
    p.add_argument(
        "--real-nproc",
        type=int,
        nargs="*",
        default=None,
        help="run real jobs of these sizes instead of the synthetic load",
    )
    p.add_argument("--real-kill-step", type=int, default=4)
    p.add_argument("--real-timeout-s", type=float, default=420.0)
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--out", default=None, help="default bench_out/control_plane[_real].json")
    args = p.parse_args(argv)
    if any(n % args.ranks_per_node or n < 4 * args.ranks_per_node for n in args.ranks):
        p.error("--ranks must be multiples of --ranks-per-node, at least 4 nodes")
    return args


def main(argv=None) -> int:
    import multiprocessing as mp

    args = parse_args(argv)
    real = args.real_nproc is not None
    out = Path(args.out or f"bench_out/control_plane{'_real' if real else ''}.json")
    doc = {"machine": machine(), "args": vars(args)}
    if real:
        rows = []
        for n in args.real_nproc or [8, 16, 32]:
            rows.append(run_real(n, args))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "log_tail"}), flush=True)
        doc["real"] = rows
        print("\n" + format_real(rows))
    else:
        ctx = mp.get_context("spawn")
        rows = []
        for n in args.ranks:
            for mode in args.modes:
                rows.append(run_config(mode, n, args, ctx))
                print(
                    f"mode {mode}, {n} ranks: {rows[-1].get('error', 'done')} "
                    f"in {rows[-1]['wall_s']:.0f} s",
                    flush=True,
                )
        doc["synthetic"] = rows
        print("\n" + format_tables(rows) + "\n\n" + LEGEND)
    return write_json(doc, out, indent=1, blank_line=False)


if __name__ == "__main__":
    sys.exit(main())
