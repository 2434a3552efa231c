"""Side by side with the peers: the same job (the demo GPTModel, data order, seed, global batch,
4 data-parallel replicas on this machine) and the same fault schedule on every system, in one run:
replica 1's trainer SIGKILLed at the start of each `--kills` step and back `--down-s` seconds
later, then at `--group-kill` replica 1's whole group (its launcher or agent with its trainer)
SIGKILLed at once and a new launch in its place `--down-s` later, as a scheduler brings a
replacement node. docs/peers.md says how each system is set up and what each column means.

    python tools/bench/peers.py                     # 400 steps, kills at 50,175,300, group 349
    python tools/bench/peers.py --quick             # 40 steps, a kill at step 8, group at 30
    python tools/bench/peers.py --systems torchrun,neighbour,torchft --steps 40 --kills 10,20

Systems: torchrun (plain, failure-free: the step-time baseline and the reference loss curve),
checkpoint-restart (torchrun --max-restarts, dist_checkpointing every K steps, K by Young/Daly;
the group kill takes the whole torchrun, relaunched as a requeue would), neighbour / hybrid /
spread-sample (mecefo-launch, one agent per replica as simulated nodes, in-memory snapshots every
step; the group kill takes node 1, a `--standby` agent replaces it), snapshot-restart (the same
with recovery.mode=restart), torchft (a torchrun per replica group; the group kill takes one
torchrun, a fresh one heals from its peers; `pip install -e '.[peers]'`).
Prints a table, writes JSON (`--out`) and a loss-vs-wall-clock figure (`--figure`).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

from bench_common import (  # noqa: E402
    bench_parser,
    demo_job_args,
    ensure_demo,
    free_port,
    machine,
    read_jsonl,
    torchrun_command,
    write_json,
)
from peers_group import (  # noqa: E402
    GROUP_MARKER,
    GroupKill,
    Job,
    PeersError,
    log_fired,
    marker_fired,
    run_trainer,
    step_fired,
    wait_run,
)
from peers_report import columns, plot, print_table, torchft_trace  # noqa: E402

REPLICAS = 4
"""Data-parallel replicas of the benchmark's job (`--replicas`; the test runs 2)."""
KILL_RANK = 1
"""The killed replica (and rank: one rank per replica), by one kill and by the group kill."""
MECEFO = {
    "neighbour": ["mecefo.takeover_policy=neighbor"],
    "hybrid": ["mecefo.takeover_policy=hybrid"],
    "spread-sample": ["mecefo.takeover_policy=spread", "mecefo.takeover_granularity=sample"],
    "snapshot-restart": ["recovery.mode=restart"],
}
SYSTEMS = ("torchrun", "checkpoint-restart", *MECEFO, "torchft")
TORCHFT_HINT = "torchft is not installed: pip install -e '.[peers]' (or torchft==0.2.0)"


def parse_args(argv=None):
    p = bench_parser(__doc__)
    # ~12 s of training between kills on the 2-core machine: every system's killed replica is
    # back before the next kill (torchft: 5 s heartbeat timeout + a restart of ~5-8 s)
    p.add_argument("--steps", type=int, default=400, help="steps of every run")
    p.add_argument("--kills", default="50,175,300", help="steps at which replica 1 is killed")
    p.add_argument(
        "--group-kill",
        default=None,
        help="step at which replica 1's whole group is killed (default: half-way from the last "
        "kill to the end; none: no group kill)",
    )
    p.add_argument("--down-s", type=float, default=2.0, help="seconds a killed replica stays down")
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma list, from: " + ", ".join(SYSTEMS)
    )
    p.add_argument(
        "--replicas", type=int, default=REPLICAS, help="data-parallel replicas (at least 2)"
    )
    p.add_argument("--quick", action="store_true", help="--steps 40 --kills 8 --group-kill 30")
    p.add_argument("--timeout-s", type=float, default=600.0, help="hard limit of each run")
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--work-dir", default=None, help="run directories (default: a new temp dir)")
    p.add_argument("--out", default="bench_out/peers.json")
    p.add_argument("--figure", default="bench_out/peers_loss.png")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.kills = 40, "8"
        args.group_kill = args.group_kill or "30"
    try:
        args.kill_steps = sorted({int(s) for s in args.kills.split(",") if s.strip()})
    except ValueError:
        p.error(f"--kills {args.kills!r}: expected STEP,STEP,... (plain numbers)")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad:
        p.error(f"--systems: unknown {', '.join(bad)}; choose from {', '.join(SYSTEMS)}")
    if args.steps < 4 or not args.kill_steps:
        p.error("need --steps >= 4 and at least one kill step")
    if not all(2 <= k < args.steps - 1 for k in args.kill_steps):
        p.error(f"--kills must be steps in 2..{args.steps - 2} (the job runs 0..{args.steps - 1})")
    args.group_kill = _group_step(p, args)
    if args.down_s < 0:
        p.error("--down-s must be >= 0")
    if args.replicas < 2 or args.replicas <= KILL_RANK:
        p.error(f"--replicas must be at least {max(2, KILL_RANK + 1)} (replica {KILL_RANK} dies)")
    return args


def _group_step(p, args) -> int | None:
    """--group-kill as a step (None: none), after the last kill and before the last step;
    by default half-way between them (none when they are adjacent)."""
    last, text = args.kill_steps[-1], args.group_kill
    if text is None:
        room = args.steps - 1 - last
        return last + room // 2 if room >= 2 else None
    if text.strip().lower() == "none":
        return None
    if not text.strip().isdigit() or not last < int(text) < args.steps - 1:
        p.error(
            f"--group-kill {text!r}: expected a step after the last kill ({last}) and before "
            f"the last step ({args.steps - 1}), or none"
        )
    return int(text)


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


# ------------------------------------------------------------------------------ traces
def with_kills(trace: dict, kills: list[tuple[int, float]], group: dict | None) -> dict:
    """`trace` with its kills: (step, epoch s) of each single kill that fired, then the group
    kill's (`GroupKill.record()` and whether the new launch trained before the end)."""
    steps = [s for s, _ in kills] + ([group["step"]] if group else [])
    times = [t for _, t in kills] + ([group["time"]] if group else [])
    return {**trace, "kill_steps": steps, "kill_times": times, "group_kill": group}


def trainer_trace(raw: dict, ctx: dict, *, restarts=None, live_heal: bool = False) -> dict:
    """The common trace of a run of our trainer: committed rows (step, time, loss, samples).
    `live_heal`: the rejoins' bytes are what healing moved (not a restart from saved state)."""
    per_micro = ctx["micro_batch_size"]
    # the samples the step trained on, as the trainer counted them (a takeover or a slice
    # included): its micro-batch count is its sample count over the micro-batch size
    rows = [
        {
            "step": r["step"],
            "time": r["seen"],
            "loss": r["loss"],
            "samples": r.get("global_microbatches", 0) * per_micro,
        }
        for r in raw["rows"]
    ]
    val = [r["val_loss"] for r in raw["rows"] if "val_loss" in r]
    fo = raw["summary"].get("failover") or {}
    rejoin_bytes = [e.get("bytes", 0) for e in raw["events"] if e.get("type") == "rejoin"]
    return {
        "start": raw["start"],
        "wall_s": raw["wall_s"],
        "rows": rows,
        "global_batch": ctx["global_batch"],
        "uncommitted_attempts": fo.get("steps_redone", 0),
        "redo_times": [t for _, t in _event_times(raw["events"], "step_redone")],
        "heal_bytes": sum(rejoin_bytes) if live_heal and rejoin_bytes else None,
        "val_loss": val[-1] if val else None,
        "restarts": restarts,
    }


def _event_times(events: list[dict], kind: str) -> list[tuple[dict, float]]:
    """(event, epoch s) of the events of type `kind` in events.jsonl: `time_s` is since the
    run's start, whose epoch time is bounded by the earliest (seen - time_s) over all events."""
    if not events:
        return []
    run_start = min(e["seen"] - e["time_s"] for e in events)
    return [(e, run_start + e["time_s"]) for e in events if e["type"] == kind]


def _injected_kills(events: list[dict], kill_steps: list[int]) -> list[tuple[int, float]]:
    """(scheduled step, epoch s) of the `--inject kill` failures in events.jsonl (not the group
    kill's stall). A failure event's step is the job's step when it failed, the kill's or the
    one before: its kill is the first scheduled at or after it."""
    out = []
    for e, t in _event_times(events, "failure"):
        later = [k for k in kill_steps if k >= e["step"]]
        if "injected kill" in e.get("detail", "") and later:
            out.append((later[0], t))
    return out


def _markers(kill_dir: Path) -> list[tuple[int, float]]:
    """(step, epoch s) of the kill markers (`s<STEP>` or `r<R>_s<STEP>`, holding the time)."""
    found = [(int(f.name.rsplit("s", 1)[1]), f.read_text()) for f in kill_dir.glob("*s*")]
    return sorted(((s, float(t)) for s, t in found if t), key=lambda st: st[1])


# --------------------------------------------------------------------------------- systems
def _train_args(args, run_dir: Path, *extra: str) -> list[str]:
    # evaluation once, after the last step (the final validation loss of every system)
    return demo_job_args(
        args.steps, run_dir, args.demo_dir, f"training.eval_interval={args.steps}", *extra
    )


def _one_process(name: str, cmd: list[str], env: dict):
    return lambda job: job.start(name, cmd, env)


def run_plain_torchrun(args, work: Path, ctx: dict) -> dict:
    """Plain torchrun, failure-free; one synchronous checkpoint after the last step measures
    the cost of a save (Young/Daly's C: training waits for it)."""
    run_dir = work / "torchrun" / "run"
    run_dir.parent.mkdir(parents=True)
    train = _train_args(args, run_dir, *_sync_ckpt(args.steps))
    cmd = torchrun_command(args.replicas, ["-m", "megatron_mecefo.train", *train])
    job = Job(run_dir.parent, args.timeout_s)
    launch = _one_process("torchrun", cmd, _env())
    raw = run_trainer(
        "torchrun", job, run_dir, args.steps, GroupKill(None, 0), launch=launch, main="torchrun"
    )
    ctx["checkpoint_s"] = (raw["summary"].get("checkpoint") or {}).get("mean_save_block_s")
    return with_kills(trainer_trace(raw, ctx), [], None)


def _sync_ckpt(interval: int) -> list[str]:
    # synchronous saves: an async one commits seconds later here (the write competes with
    # training for the 2 cores), so a kill before it lands restarts from an older step
    return [f"checkpoint.interval={interval}", "checkpoint.async_save=false"]


def failures(args) -> int:
    """The schedule's failures: its kills and the group kill."""
    return len(args.kill_steps) + (args.group_kill is not None)


def young_daly_interval(args, step_s: float, checkpoint_s: float) -> int:
    """K = sqrt(2 C MTBF) in steps, MTBF = the schedule's failure-free time / its failures."""
    mtbf_s = args.steps * step_s / failures(args)
    return max(1, round(math.sqrt(2 * checkpoint_s * mtbf_s) / step_s))


def run_checkpoint_restart(args, work: Path, ctx: dict) -> dict:
    """The job under one torchrun: a kill restarts it in place (--max-restarts); the group kill
    takes the torchrun and its workers, and the same command runs again `--down-s` later (a
    Slurm requeue); either way it resumes from the newest checkpoint."""
    name = "checkpoint-restart"
    run_dir = work / name / "run"
    kill_dir = run_dir.parent / "kills"
    kill_dir.mkdir(parents=True)
    marker = run_dir.parent / GROUP_MARKER
    k = ctx["checkpoint_interval"]
    extra = _sync_ckpt(k)
    cmd = torchrun_command(
        args.replicas,
        [str(ROOT / "tools" / "bench" / "peers_restart.py"), *_train_args(args, run_dir, *extra)],
        restarts=len(args.kill_steps) + 1,
    )
    env = {
        **_env(),
        "PEERS_KILLS": ",".join(map(str, args.kill_steps)),
        "PEERS_KILL_RANK": str(KILL_RANK),
        "PEERS_KILL_DIR": str(kill_dir),
        "PEERS_DOWN_S": str(args.down_s),
        "PEERS_GROUP_KILL": "" if args.group_kill is None else str(args.group_kill),
        "PEERS_GROUP_MARKER": str(marker),
    }

    def relaunch(job: Job):
        return job.start(f"{name}.relaunch", cmd, env, role=name)

    job = Job(run_dir.parent, args.timeout_s)
    # the whole job holds at the step: it cannot go past it while the rank is down
    group = GroupKill(args.group_kill, args.down_s, name, marker_fired(marker), relaunch=relaunch)
    launch = _one_process(name, cmd, env)
    raw = run_trainer(name, job, run_dir, args.steps, group, launch=launch, main=name)
    kills = _markers(kill_dir)
    trace = trainer_trace(raw, ctx, restarts=len(kills) + bool(group.relaunched))
    record = group.record()
    if record is not None:
        record["rejoined"] = bool(group.relaunched)  # the new launch is the whole job
    return {**with_kills(trace, kills, record), "checkpoint_interval": k}


def run_mecefo(name: str, args, work: Path, ctx: dict) -> dict:
    """Ours: one `mecefo-launch` agent per replica, simulated nodes of one rank (node 0 hosts
    the tcp store and the coordinator). A kill is `--inject kill:1:STEP` (node 1's agent
    restarts the rank); the group kill holds rank 1 at its step (`--inject stall`, seen in node
    1's log) and SIGKILLs node 1's whole tree (agent, fork server, trainer, snapshot process);
    `--down-s` later a `--standby` agent registers and takes node 1 once the coordinator
    declares it lost."""
    from megatron_mecefo.failover.node.agent_cli import launch_command

    run_dir = work / name / "run"
    run_dir.parent.mkdir(parents=True)
    g = args.group_kill
    inject = [f"kill:{KILL_RANK}:{k}" for k in args.kill_steps]
    inject += [] if g is None else [f"stall:{KILL_RANK}:{g}"]
    inject = [x for i in inject for x in ("--inject", i)]
    train = _train_args(args, run_dir, "snapshot.interval=1", *MECEFO[name], *inject)
    port = free_port()

    def agent(node: int, *flags: str) -> list[str]:
        where = ("--coordinator", f"127.0.0.1:{port}") if node else ("--coordinator-port", port)
        flags = ("--restart-delay-s", str(args.down_s), *map(str, where), *flags)
        return launch_command(
            train, nproc_per_node=1, nnodes=args.replicas, node_rank=node, flags=flags
        )

    def launch(job: Job) -> None:
        for node in range(args.replicas):
            job.start(f"node{node}", agent(node), _env())

    def relaunch(job: Job):
        if job.roles["node0"].poll() is not None:
            return None  # the job ended while the node was down: nothing to replace
        return job.start("standby", agent(args.replicas, "--standby"), _env())

    victim = f"node{KILL_RANK}"
    held = log_fired(run_dir.parent / f"{victim}.log", f"stall at step {g}")
    group = GroupKill(
        g, args.down_s, victim, held, step_fired(run_dir / "metrics.jsonl", g), relaunch
    )
    job = Job(run_dir.parent, args.timeout_s)
    try:
        raw = run_trainer(name, job, run_dir, args.steps, group, launch=launch, main="node0")
    finally:
        _remove_lost_snapshot(group.cmdlines)
    kills = _injected_kills(raw["events"], args.kill_steps)
    trace = trainer_trace(
        raw, ctx, restarts=len(kills) + bool(group.relaunched), live_heal=name != "snapshot-restart"
    )
    record = group.record()
    if record is not None:
        record["rejoined"] = any(e["type"] == "node_replaced" for e in raw["events"])
    return with_kills(trace, kills, record)


def _remove_lost_snapshot(cmdlines: list[list[str]]) -> None:
    """The killed node's shared-memory snapshot folder (its snapshot process's `--dir`): a lost
    node takes its memory along, but simulated nodes share this machine's /dev/shm, where it
    would stay (5-8 MB a run) unless a standby took the node and removed it at the end."""
    for cmd in cmdlines:
        if "megatron_mecefo.snapshot.smp" in cmd and "--dir" in cmd:
            folder = Path(cmd[cmd.index("--dir") + 1])
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                folder.parent.rmdir()  # the run's folder, once no node's is left in it


def run_torchft(args, work: Path, ctx: dict) -> dict:
    """4 replica groups, each `torchrun --nproc-per-node 1 --max-restarts N`, and torchft's
    lighthouse in this process (min_replicas 1, quorum tick 100 ms, join timeout 10 s: the
    values of torchft's README). The group kill takes replica 1's torchrun and its worker;
    `--down-s` later a fresh torchrun for replica 1 heals from its peers."""
    from torchft._torchft import LighthouseServer

    out = work / "torchft"
    out.mkdir(parents=True)
    g = args.group_kill
    worker = [
        str(ROOT / "tools" / "bench" / "peers_torchft.py"),
        *("--steps", str(args.steps), "--out-dir", str(out), "--demo-dir", args.demo_dir),
        *("--replicas", str(args.replicas), "--kill-replica", str(KILL_RANK)),
        *("--kills", ",".join(map(str, args.kill_steps)), "--down-s", str(args.down_s)),
        *("--group-kill", str(-1 if g is None else g)),
    ]

    def group_cmd(r: int, *extra: str) -> list[str]:
        return [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"),
            *("--nproc-per-node", "1", "--max-restarts", str(len(args.kill_steps) + 1)),
            *("--master-port", str(free_port()), *worker, "--replica", str(r), *extra),
        ]

    base = {}

    def relaunch(job: Job):
        # its incarnations so far: the first, then one per kill that fired
        base["n"] = 1 + len(list((out / "kills").glob(f"r{KILL_RANK}_s*")))
        cmd = group_cmd(KILL_RANK, "--incarnation-base", str(base["n"]))
        return job.start(f"replica{KILL_RANK}.relaunch", cmd, env, role=f"replica{KILL_RANK}")

    job = Job(out, args.timeout_s)
    held, passed = marker_fired(out / GROUP_MARKER), step_fired(out / "rows_replica0.jsonl", g)
    group = GroupKill(g, args.down_s, f"replica{KILL_RANK}", held, passed, relaunch)
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=10000, quorum_tick_ms=100
    )
    env = {**_env(), "TORCHFT_LIGHTHOUSE": lighthouse.address()}
    start = time.time()
    try:
        prep = job.start("prepare", [sys.executable, *worker, "--prepare-only"], _env())
        _wait(job, GroupKill(None, 0), [prep], "torchft data preparation")
        for r in range(args.replicas):
            job.start(f"replica{r}", group_cmd(r), env)
        rows0 = out / "rows_replica0.jsonl"
        end = _wait(job, group, None, "torchft", progress=rows0, steps=args.steps)
    finally:
        job.close()
        lighthouse.shutdown()
    wall = end - start
    record = group.record()
    if record is not None:
        rows = read_jsonl(out / f"rows_replica{KILL_RANK}.jsonl")
        record["rejoined"] = any(
            r.get("incarnation") == base.get("n") and r.get("committed") for r in rows
        )
    trace = torchft_trace(out, args.replicas, start, wall)
    if group.relaunched:  # counted even if it never trained (its rows count the others)
        trace["restarts"] = max(trace["restarts"], base["n"])
    kills = _markers(out / "kills")
    return {**with_kills(trace, kills, record), "global_batch": ctx["global_batch"]}


def _wait(job: Job, group: GroupKill, procs, what: str, progress=None, steps: int = 0) -> float:
    """Until `procs` (None: every role's current process) have exited; each must exit 0 but
    the one the group kill killed. Returns when all but the group kill's new launch had exited
    (the end of the job: a new launch that never joined takes seconds to see the job done)."""
    last_print = [time.time()]

    def current():
        return list(job.roles.values()) if procs is None else procs

    def show() -> None:
        if progress is not None and time.time() - last_print[0] > 5 and progress.exists():
            done = sum(1 for r in read_jsonl(progress) if r.get("committed"))
            print(f"[peers]   {what}: replica 0 committed {done}/{steps} steps", flush=True)
            last_print[0] = time.time()

    def finished() -> bool:
        return all(p.poll() is not None for p in current() if p is not group.new_launch)

    end = wait_run(job, group, finished, what, show)
    for p in current():
        try:
            p.wait(timeout=max(1.0, job.left_s()))
        except subprocess.TimeoutExpired:
            raise PeersError(f"{what}: still running at the time limit") from None
    bad = [p for p in current() if p.returncode != 0 and p is not group.killed]
    if bad:
        raise PeersError(f"{what} exited {bad[0].returncode} (logs in {job.log_dir})")
    return end


# ------------------------------------------------------------------------------------ main
def batch_sizes(replicas: int) -> dict:
    """The demo job's micro-batch size and the global batch of `replicas` replicas."""
    import yaml

    tc = yaml.safe_load((ROOT / "configs" / "run" / "demo_cpu.yaml").read_text())["training"]
    mbs = tc["micro_batch_size"]
    return {"micro_batch_size": mbs, "global_batch": mbs * tc["num_microbatches"] * replicas}


def run_system(name: str, args, work: Path, ctx: dict) -> dict:
    if name == "torchrun":
        return run_plain_torchrun(args, work, ctx)
    if name == "checkpoint-restart":
        return run_checkpoint_restart(args, work, ctx)
    if name == "torchft":
        return run_torchft(args, work, ctx)
    return run_mecefo(name, args, work, ctx)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    systems = list(args.systems)
    if "torchft" in systems:
        os.environ.setdefault("RUST_LOG", "warn")  # before the import: its lighthouse logs
        try:  # every quorum at info level
            import torchft  # noqa: F401
        except ImportError:
            print(f"[peers] skipping torchft: {TORCHFT_HINT}", flush=True)
            systems.remove("torchft")
    if "checkpoint-restart" in systems and "torchrun" not in systems:
        systems.insert(0, "torchrun")  # its step time and checkpoint cost set K
    systems.sort(key=SYSTEMS.index)
    ensure_demo(args.demo_dir)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mecefo-bench-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx: dict = batch_sizes(args.replicas)
    traces: dict[str, dict] = {}
    group = "none" if args.group_kill is None else f"at step {args.group_kill}"
    print(
        f"[peers] {len(systems)} systems, {args.steps} steps, {args.replicas} replicas, kill "
        f"replica {KILL_RANK} at steps {args.kill_steps}, its whole group {group}, down "
        f"{args.down_s} s; run dirs in {work}",
        flush=True,
    )
    try:
        for name in systems:
            if name == "checkpoint-restart":
                step_s = columns({"torchrun": traces["torchrun"]}, None)["torchrun"]["step_s"]
                cost = ctx.get("checkpoint_s") or step_s
                ctx["checkpoint_interval"] = young_daly_interval(args, step_s, cost)
                print(
                    f"[peers] Young/Daly: checkpoint {cost:.3f} s, step {step_s:.3f} s, MTBF "
                    f"{args.steps * step_s / failures(args):.1f} s -> every "
                    f"{ctx['checkpoint_interval']} steps",
                    flush=True,
                )
            print(f"[peers] {name} ...", flush=True)
            t0 = time.time()
            traces[name] = run_system(name, args, work, ctx)
            print(f"[peers] {name}: done in {time.time() - t0:.1f} s", flush=True)
            group = traces[name].get("group_kill")
            if group and not group["held"]:
                print(
                    f"[peers] note: {name}: replica {KILL_RANK} was still down at step "
                    f"{group['step']}, so its group was killed as the job went past it (the "
                    "group figures are marked *); leave more steps after the last kill",
                    flush=True,
                )
    except PeersError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    table = columns(traces, "torchrun" if "torchrun" in traces else None)
    print()
    print_table(table)
    plot(traces, args.figure)
    print(f"wrote {args.figure}")
    doc = {
        "machine": machine(),
        "command": " ".join(sys.argv),
        "schedule": {
            "steps": args.steps,
            "replicas": args.replicas,
            "kill_replica": KILL_RANK,
            "kill_steps": args.kill_steps,
            "group_kill_step": args.group_kill,
            "down_s": args.down_s,
        },
        "checkpoint": {k: ctx.get(k) for k in ("checkpoint_s", "checkpoint_interval")},
        "columns": table,
        "traces": traces,
    }
    return write_json(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
