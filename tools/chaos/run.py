"""Chaos soak: random fault schedules from a seed, run against real `mecefo-launch` jobs, each
checked against the failover invariants.

    python tools/chaos/run.py --seed 1 --schedules 12                 # 2 nodes x 2 ranks, all kinds
    python tools/chaos/run.py --seed 1 --schedules 3 --kinds kill,stop,exception,smp_kill
    python tools/chaos/run.py --seed 1 --only 4 ...                   # reproduce schedule 4 alone
    python tools/chaos/run.py --seed 1 --schedules 12 --list          # print the schedules only
    python tools/chaos/run.py --seed 1 --schedules 8 --store etcd     # on a 3-member etcd
    python tools/chaos/run.py --seed 1 --schedules 4 --pp 2           # replicas of 2 stages
    python tools/chaos/run.py --seed 1 --schedules 4 --dist-opt       # sharded optimizer

Each schedule (`tools/chaos/schedule.py`: kinds, awkward moments, acceptable exits)
runs the tiny demo model on `--nodes` simulated nodes (one `mecefo-launch` agent each; node 0
starts the coordinator, or with `--store etcd` the tool starts 3 etcd members per job and the
agents elect one) with `failover.audit=true`, in the layout `--tp`/`--pp`/`--dist-opt` ask
for (a replica is TP x PP consecutive ranks and fails over whole). Faults are timed by job
progress (the step from the coordinator store's job/step key and metrics.jsonl; "start" = the
first generation has formed, before step 0). Every job carries a unique tag in its environment
(and run-dir path); after it ends the tool checks (`tools/chaos/checks.py`): each step logged
once, each (step, replica, micro-batch) committed once (after a recovery or a rollback: once
from the step the job went back to), final digests equal per (stage, TP rank) position and,
with the distributed optimizer, each shard's holders equal, summary.json agreeing with events
and metrics, exit codes acceptable for the schedule, no tagged process and no shared memory
left. Every wait is bounded: a job past its time limit, or without a new step for --stall-s,
is killed (every tagged process) and fails with "hang".

Prints a line per schedule and a table; writes OUT/chaos.json (after every schedule). Exit 0 only
if every schedule ended acceptably.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.chaos import checks  # noqa: E402
from tools.chaos.job import JOB_ENV, Job, Probe, _kill, _killpg  # noqa: E402
from tools.chaos.schedule import (  # noqa: E402
    FAIL_STOP,
    KIND_HELP,
    KINDS,
    PASSING_TODAY,
    SILENT,
    STORES,
    Fault,
    Schedule,
    generate,
)

RETRY_S = 20.0
"""How long a fault waits for its target (a rank being restarted, a snapshot process) to exist."""
LEFTOVER_GRACE_S = 25.0
"""After the agents exit: how long the job's processes may take to go (agent: 10 s for its
children, 10 s for the coordinator)."""


def parse_args(argv=None) -> argparse.Namespace:
    kinds = "\n".join(f"  {k:17s}{KIND_HELP[k]}" for k in KINDS)
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"fault kinds (passing today: {', '.join(PASSING_TODAY)}):\n{kinds}",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedules", type=int, default=10, help="schedules 0..N-1")
    p.add_argument("--only", default="", help="comma list of schedule indices to run (repro)")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (agents)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument(
        "--kinds",
        default=",".join(FAIL_STOP),
        help=f"comma list of {', '.join(KINDS)} (default: all but {', '.join(SILENT)})",
    )
    p.add_argument(
        "--store",
        choices=STORES,
        default="tcp",
        help="control-plane store (etcd: the tool starts a 3-member etcd cluster per job)",
    )
    p.add_argument("--tp", type=int, default=1, help="parallel.tensor_model_parallel_size")
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="parallel.pipeline_model_parallel_size (a replica is TP x PP ranks; the tiny "
        "model's 2 layers allow 1 or 2)",
    )
    p.add_argument(
        "--dist-opt",
        action="store_true",
        help="training.use_distributed_optimizer=true (each shard on 2 replicas; losing both "
        "at once rolls back to the newest snapshot, or aborts without one)",
    )
    p.add_argument("--out", default="", help="output folder (default runs/chaos-seed<S>)")
    p.add_argument("--demo-dir", default=str(ROOT / ".cache" / "demo_data"))
    p.add_argument(
        "--warm-spares",
        type=int,
        default=None,
        help="per agent (mecefo-launch --warm-spares); default: the launcher's own (as many as "
        "a replica has ranks on the node)",
    )
    p.add_argument("--job-timeout-s", type=float, default=0, help="0: 180 + 3/step + 45/fault")
    p.add_argument("--stall-s", type=float, default=180, help="hang if no new step this long")
    p.add_argument("--list", action="store_true", help="print the schedules, run nothing")
    args = p.parse_args(argv)
    args.kinds = tuple(k for k in args.kinds.split(",") if k)
    args.indices = (
        [int(i) for i in args.only.split(",") if i] if args.only else list(range(args.schedules))
    )
    args.out = Path(args.out or ROOT / "runs" / f"chaos-seed{args.seed}").resolve()
    args.layout = dict(tp=args.tp, pp=args.pp, dist_opt=args.dist_opt)
    return args


# ---------------------------------------------------------------------------- faults


class Faults:
    """Fires the tool-side faults of a schedule when their moment comes; keeps a ledger."""

    def __init__(self, job: Job, probe: Probe):
        self.job, self.probe = job, probe
        self.pending = [f for f in job.s.faults if not f.by_trainer]
        self.first_try: dict[int, float] = {}
        self.timers: list[tuple[float, str, object]] = []  # (when, "cont"|"unhog", target)
        self.stopped: set[int] = set()
        self.hogs: list[subprocess.Popen] = []
        self.ledger: list[dict] = []
        self.job_started = time.monotonic()

    def tick(self, step: int) -> None:
        now = time.monotonic()
        for when, what, target in [t for t in self.timers if t[0] <= now]:
            self.timers.remove((when, what, target))
            if what == "cont":
                self._cont(target)
            elif what == "etcd_start":
                self._etcd_start(target)
            else:
                self._unhog()
        for fault in list(self.pending):
            ready = self.probe.generation() >= 1 if fault.at == "start" else step >= fault.step
            if not ready:
                continue
            done, detail = self._fire(fault)
            if done or now - self.first_try.setdefault(id(fault), now) > RETRY_S:
                self.pending.remove(fault)
                self.ledger.append(
                    {"fault": fault.describe(), "fired": done, "step": step, "detail": detail,
                     "t_s": round(now - self.job_started, 1)}
                )  # fmt: skip

    def _fire(self, f: Fault) -> tuple[bool, str]:
        kind = f.kind
        if kind in ("kill", "stop"):
            pid = self.probe.rank_pid(f.rank)
            if pid is None:
                return False, f"rank {f.rank} not running"
            if kind == "kill":
                return _kill(pid, signal.SIGKILL), f"SIGKILL pid {pid}"
            if not _kill(pid, signal.SIGSTOP):
                return False, f"pid {pid} gone"
            self.stopped.add(pid)
            self.timers.append((time.monotonic() + f.hold_s, "cont", pid))
            return True, f"SIGSTOP pid {pid} for {f.hold_s:.1f} s"
        if kind == "agent_kill":
            self.job.killed_agents.add(f.node)
            return _kill(self.job.agents[f.node].pid, signal.SIGKILL), f"SIGKILL agent {f.node}"
        if kind == "node_loss":
            return self._lose_node(f.node)
        if kind == "head_node_loss":
            if self.job.etcd is None:
                return self._lose_node(0)
            elected = self.probe.coordinator()
            if elected is None:
                return False, "no elected coordinator"
            done, detail = self._lose_node(elected[0])
            return done, f"node {elected[0]} coordinates: {detail}"
        if kind == "etcd_kill":
            return self._etcd_kill(f.hold_s)
        if kind == "coordinator_kill" and self.job.etcd is not None:
            elected = self.probe.coordinator()
            if elected is None:
                return False, "no elected coordinator"
            node, proc = elected
            return _kill(proc.pid, signal.SIGKILL), f"SIGKILL node {node}'s candidate {proc.pid}"
        if kind in ("smp_kill", "coordinator_kill"):
            role = "smp" if kind == "smp_kill" else "coordinator"
            hits = [
                p for p in self.job.processes(role)
                if role != "smp" or f" --node {f.node} " in p.cmdline + " "
            ]  # fmt: skip
            if not hits:
                return False, f"no {role} process"
            return all(_kill(p.pid, signal.SIGKILL) for p in hits), f"SIGKILL {role} " + ",".join(
                str(p.pid) for p in hits
            )
        if kind == "cpu_hog":
            return self._hog(f.hold_s)
        return False, f"not a tool-side fault: {kind}"

    def _lose_node(self, node: int) -> tuple[bool, str]:
        """The agent, then every process under it (ranks, spares, snapshot process and, on
        node 0, the coordinator: a head-node loss), each with the process group it leads (a
        rank and what it forked), back to back."""
        agent = self.job.agents[node]
        procs = self.job.processes()
        under, frontier = [], {agent.pid}
        while frontier:
            level = [p for p in procs if p.ppid in frontier]
            under += level
            frontier = {p.pid for p in level}
        self.job.killed_agents.add(node)
        _killpg(agent.pid)
        for p in under:
            _killpg(p.pid)
            _kill(p.pid, signal.SIGKILL)
        return True, f"SIGKILL agent {node} and {len(under)} process(es) " + ",".join(
            str(p.pid) for p in under
        )

    def _etcd_kill(self, hold_s: float) -> tuple[bool, str]:
        """SIGKILL the etcd leader, restarted hold_s later; members still down are restarted
        first, so one etcd_kill never costs the quorum. Fired once another member leads."""
        etcd = self.job.etcd
        if etcd is None:
            return False, "the job does not run on etcd"
        for when, what, target in [t for t in self.timers if t[1] == "etcd_start"]:
            self.timers.remove((when, what, target))
            self._etcd_start(target)
        try:
            etcd.wait_healthy(15.0)
            leader = etcd.leader(5.0)
        except (TimeoutError, RuntimeError) as exc:
            return False, f"etcd not healthy: {exc}"
        etcd.kill(leader)
        self.timers.append((time.monotonic() + hold_s, "etcd_start", leader))
        try:  # landed only once the others elected a leader of their own
            successor = etcd.leader(10.0)
        except TimeoutError:
            return False, f"SIGKILL etcd leader m{leader}: no new leader within 10 s"
        if successor == leader:
            return False, f"SIGKILL etcd leader m{leader}: it still leads"
        return True, f"SIGKILL etcd leader m{leader} for {hold_s:.1f} s; m{successor} leads"

    def _etcd_start(self, member: int) -> None:
        """Restart a killed member; bounded wait until it serves again (a member that does
        not is left to the next etcd_kill's health check)."""
        try:
            self.job.etcd.restart_member(member, 15.0)
        except TimeoutError:
            pass

    def _hog(self, hold_s: float) -> tuple[bool, str]:
        env = {k: v for k, v in JOB_ENV.items() if k != checks.TAG_ENV}
        env["MECEFO_CHAOS_HOG"] = self.job.tag
        for _ in range(os.cpu_count() or 1):
            self.hogs.append(
                subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"], env=env, start_new_session=True
                )
            )
        self.timers.append((time.monotonic() + hold_s, "unhog", None))
        return True, f"{len(self.hogs)} busy loops for {hold_s:.1f} s"

    def _cont(self, pid: int) -> None:
        self.stopped.discard(pid)
        if pid in {p.pid for p in self.job.processes()}:  # not evicted and replaced meanwhile
            _kill(pid, signal.SIGCONT)

    def _unhog(self) -> None:
        for h in self.hogs:
            _killpg(h.pid)
            h.wait(timeout=5)
        self.hogs.clear()

    def cleanup(self) -> None:
        for pid in list(self.stopped):
            self._cont(pid)
        self._unhog()
        for f in self.pending:
            self.ledger.append({"fault": f.describe(), "fired": False, "detail": "never reached"})


# ---------------------------------------------------------------------------- one schedule


def run_schedule(s: Schedule, args: argparse.Namespace) -> dict:
    job = Job(s, args.out, args)
    probe = Probe(job)
    faults = Faults(job, probe)
    limit = args.job_timeout_s or 180 + 3 * s.max_steps + 45 * len(s.faults)
    faults.job_started = time.monotonic()
    try:
        return _run(job, probe, faults, limit, args)
    finally:
        job.stop_etcd()  # after the checks: the job's keys live there


def _run(job: Job, probe: Probe, faults: Faults, limit: float, args) -> dict:
    start, hang = faults.job_started, None
    try:
        job.start()
        while not job.ended():
            step = probe.step()
            faults.tick(step)
            now = time.monotonic()
            if now - start > limit:
                hang = f"hang: the job ran past its {limit:.0f} s limit (at step {step})"
            elif now - probe.step_changed > args.stall_s:
                hang = f"hang: no new step for {args.stall_s:.0f} s (at step {step})"
            if hang:
                break
            time.sleep(0.05)
    finally:
        faults.cleanup()
        if hang or sys.exc_info()[0] is not None:
            job.kill_all()
    result = judge(job, probe, faults, hang)
    result["wall_s"] = round(time.monotonic() - start, 1)
    return result


def judge(job: Job, probe: Probe, faults: Faults, hang: str | None) -> dict:
    s, run_dir = job.s, job.run_dir
    codes = job.exit_codes()
    violations = [hang] if hang else []
    leftovers = _wait_gone(job, LEFTOVER_GRACE_S)
    violations += checks.check_leftovers(leftovers)
    checks.kill_processes(leftovers)
    events, _ = checks.read_jsonl(run_dir / "events.jsonl")
    notes = _notes(job, faults, events)
    acceptable = s.acceptable_exits()
    if not hang:
        violations += checks.check_exits(codes, acceptable)
        violations += checks.check_abort_reason(run_dir, codes)
        finished = bool(codes) and all(c == 0 for c in codes.values())
        violations += _run_dir_checks(job, events, finished, notes)
        if finished:
            violations += checks.check_summary(run_dir)
        violations += _shm_checks(job, finished)
    _remove_shm(job)
    code_set = sorted({c for c in codes.values() if c is not None})
    why = "; ".join(acceptable[c] for c in code_set if c in acceptable and c != 0)
    why = "" if violations else why
    if violations:
        outcome = "FAIL"
    elif why:
        outcome = f"ok (exit {','.join(map(str, code_set))})"
    else:
        outcome = "ok"
    return {
        "index": s.index, "outcome": outcome, "why": why, "violations": violations,
        "notes": notes, "exit_codes": codes,
        "agents_killed": sorted(job.killed_agents), "fired": faults.ledger,
        "last_step": probe.step_seen - 1, "events": dict(Counter(e.get("type") for e in events)),
        "failures": [f"r{e.get('ranks')} @{e.get('step')}: {e.get('detail')}"
                     for e in events if e.get("type") == "failure"],
        "dir": str(job.folder), "tag": job.tag,
        "schedule": s.to_dict(),
    }  # fmt: skip


def _run_dir_checks(job: Job, events: list[dict], finished: bool, notes: list[str]) -> list[str]:
    s, run_dir = job.s, job.run_dir
    layout = _layout(run_dir)
    if layout is None:
        return [f"{run_dir}/config.yaml is missing or unreadable (the job never started)"]
    replica_size, micro = layout
    if replica_size != s.replica_size:
        return [f"config.yaml has TP x PP = {replica_size}, the schedule {s.replica_size}"]
    rolled_back = checks.went_back(events)
    out = checks.check_metrics(run_dir, s.max_steps, complete=finished)
    out += checks.check_audit(
        run_dir,
        s.max_steps,
        s.num_replicas,
        micro,
        rolled_back=rolled_back,
        complete=finished,
        gaps=notes,
    )
    if finished:
        # a failure event lists every rank of the lost replica (the failover unit)
        failed = {r for e in events if e.get("type") == "failure" for r in e.get("ranks") or []}
        failed = {r for rep in {s.replica_of(r) for r in failed} for r in s.replica_ranks(rep)}
        orphaned = {r for n in job.killed_agents for r in s.ranks_of(n)}
        required = set(range(s.world)) - failed - orphaned
        out += checks.check_digests(
            run_dir,
            s.max_steps,
            replica_size=s.replica_size,
            required=required,
            num_shards=s.num_replicas if s.dist_opt else 0,
        )
    return out


def _shm_checks(job: Job, finished: bool) -> list[str]:
    """After a finished job no surviving node keeps a snapshot folder (a lost node's stays, as
    its memory would on a real node until reboot; the tool removes it)."""
    root = _shm_root(job)
    if root is None or not finished:
        return []
    out = []
    for node in set(range(job.s.nodes)) - job.killed_agents:
        out += checks.check_shm(root / f"node{node:04d}")
    if not job.killed_agents:
        out += checks.check_shm(root)
    return out


def _shm_root(job: Job) -> Path | None:
    if not job.s.snapshot_interval:
        return None
    from megatron_mecefo.config.snapshot import SnapshotConfig
    from megatron_mecefo.snapshot.paths import run_snapshot_root

    return run_snapshot_root(SnapshotConfig(), str(job.run_dir))


def _remove_shm(job: Job) -> None:
    root = _shm_root(job)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


def _notes(job: Job, faults: Faults, events: list[dict]) -> list[str]:
    """What is worth knowing but not a violation: faults that did not fire, failures no fault
    explains (false deaths), a rank-fault without a failure event."""
    notes = [f"{e['fault']} not fired: {e['detail']}" for e in faults.ledger if not e["fired"]]
    notes += [
        f"{e['fault']} fired late, at step {e['step']}: {e['detail']}"
        for e in faults.ledger
        if e["fired"] and e["step"] > _planned(e["fault"]) + 5
    ]
    failed = Counter(r for e in events if e.get("type") == "failure" for r in e.get("ranks") or [])
    hit = {f.rank for f in job.s.faults if f.rank is not None}
    hit |= {r for f in job.s.faults if f.node is not None for r in job.s.ranks_of(f.node)}
    hit |= {r for n in job.killed_agents for r in job.s.ranks_of(n)}  # head_node_loss
    for e in events:
        if e.get("type") == "failure" and not set(e.get("ranks") or []) & hit:
            notes.append(f"failure of rank(s) {e.get('ranks')} no fault hit: {e.get('detail')}")
    logs = "".join(p.read_text(errors="replace") for p in job.folder.glob("node*.log"))
    fired = {e["fault"] for e in faults.ledger if e["fired"]}
    classified = {(e.get("kind"), e.get("step")) for e in events if e.get("type") == "classified"}
    for f in job.s.faults:
        if f.by_trainer:
            if f.kind == "nan_data":  # bad data fires on whichever rank computes it: no line
                if ("data", f.step) not in classified:
                    notes.append(f"{f.describe()}: no data classification at step {f.step}")
                continue
            if f"[inject] rank {f.rank}: {f.inject_arg().split(':')[0]}" not in logs:
                notes.append(f"{f.describe()} (trainer-side) never fired")
                continue
            fired.add(f.describe())
        # a flipped bit takes its replica out (it rejoins healed), a persistent NaN for good; a
        # transient NaN does not
        dies = f.kind in ("kill", "exception", "bitflip", "nan_persistent") or (
            f.kind == "stop" and f.hold_s > 3.0
        )
        if dies and f.describe() in fired and not failed.get(f.rank):
            notes.append(f"{f.describe()}: fired, but no failure event for rank {f.rank}")
    return notes


def _planned(described: str) -> int:
    """The planned step of a described fault ("kill r2@17" -> 17; "@start" -> 0)."""
    when = described.split("@", 1)[1].split()[0]
    return int(when) if when.isdigit() else 0


def _layout(run_dir: Path) -> tuple[int, int] | None:
    """(replica size TP x PP, micro-batches per replica) of the job's resolved config."""
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        par = cfg["parallel"]
        return (
            int(par["tensor_model_parallel_size"]) * int(par["pipeline_model_parallel_size"]),
            int(cfg["training"]["num_microbatches"]),
        )
    except (OSError, KeyError, TypeError, ValueError):
        return None


def _wait_gone(job: Job, bound_s: float) -> list[checks.Proc]:
    deadline = time.monotonic() + bound_s
    while True:
        left = job.processes()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


# ---------------------------------------------------------------------------- CLI


def _line(i: int, n: int, s: Schedule, r: dict) -> str:
    why = f": {r['why']}" if r["why"] else ""
    head = f"[chaos {i}/{n}] #{s.index} {s.describe()} -> {r['outcome']}{why} ({r['wall_s']:.0f} s)"
    if r["violations"]:
        head += "".join(f"\n    ! {v}" for v in r["violations"])
        head += f"\n    repro: {s.repro()}\n    logs: {r['dir']}"
    return head


def table(results: list[dict]) -> str:
    rows = [("#", "faults", "outcome", "violations", "wall s")]
    for r in results:
        v = r["violations"]
        first = f"{len(v)}: {v[0][:70]}" if v else "0"
        rows.append((str(r["index"]), r["schedule"]["describe"], r["outcome"], first,
                     f"{r['wall_s']:.0f}"))  # fmt: skip
    widths = [max(len(row[c]) for row in rows) for c in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        plans = [
            generate(args.seed, i, nodes=args.nodes, nproc=args.nproc, max_steps=args.max_steps,
                     kinds=args.kinds, store=args.store, **args.layout)
            for i in args.indices
        ]  # fmt: skip
        _check_config(plans[0] if plans else None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for s in plans:
            print(f"#{s.index}: {s.describe()}  acceptable exits {sorted(s.acceptable_exits())}")
        return 0
    _prepare_data(args.demo_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # the finally blocks kill the running job
    results: list[dict] = []
    try:
        for i, s in enumerate(plans, 1):
            results.append(run_schedule(s, args))
            print(_line(i, len(plans), s, results[-1]), flush=True)
            _write(args, results)
    except KeyboardInterrupt as exc:  # the running job was killed on the way out
        print(f"interrupted ({exc or 'SIGINT'}) after {len(results)} schedule(s)", flush=True)
        print(table(results))
        return 130
    print(table(results))
    bad = [r for r in results if r["violations"]]
    print(f"{len(results) - len(bad)}/{len(results)} schedules ended acceptably; "
          f"results: {args.out / 'chaos.json'}")  # fmt: skip
    return 1 if bad else 0


def _check_config(s: Schedule | None) -> None:
    """The jobs' config loads (e.g. the model's layers split over --pp stages): one error line
    now, not a failed job per schedule. Raises ValueError."""
    if s is None:
        return
    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig
    from tools.chaos.job import CONFIG, layout_overrides

    try:
        load_config(RunConfig, CONFIG, overrides=layout_overrides(s))
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"the jobs' config ({CONFIG.name} + the layout) is invalid: {exc}"
        ) from None


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _prepare_data(demo_dir: str) -> None:
    from megatron_mecefo.data.config import DataConfig
    from megatron_mecefo.data.demo import ensure_demo_corpus

    cfg = DataConfig()
    ensure_demo_corpus(
        demo_dir,
        num_documents=cfg.demo_num_documents,
        seed=cfg.demo_seed,
        vocab_size=cfg.demo_vocab_size,
    )


def _write(args: argparse.Namespace, results: list[dict]) -> None:
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path = args.out / "chaos.json"
    path.write_text(json.dumps({"args": meta, "results": results}, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
