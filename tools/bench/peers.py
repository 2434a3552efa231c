"""Side by side with the peers: the same job (the demo GPTModel, data order, seed, global batch,
4 data-parallel replicas on this machine) and the same fault schedule (SIGKILL replica 1's
trainer at the start of each `--kills` step, back `--down-s` seconds later) on every system, in
one run. docs/peers.md says how each system is set up and what each column means.

    python tools/bench/peers.py                         # 400 steps, kills at 50,175,300
    python tools/bench/peers.py --quick                 # 20 steps, one kill at step 8
    python tools/bench/peers.py --systems torchrun,neighbour,torchft --steps 40 --kills 10,20

Systems: torchrun (plain, failure-free: the step-time baseline and the reference loss curve),
checkpoint-restart (torchrun --max-restarts, dist_checkpointing every K steps, K by Young/Daly),
neighbour / hybrid / spread-sample (mecefo-launch, in-memory snapshots every step),
snapshot-restart (mecefo-launch, recovery.mode=restart), torchft (`pip install -e '.[peers]'`).
Prints a table, writes JSON (`--out`) and a loss-vs-wall-clock figure (`--figure`).
"""

from __future__ import annotations

import json
import math
import os
import signal
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
from peers_report import columns, plot, print_table, torchft_trace  # noqa: E402

REPLICAS = 4
"""Data-parallel replicas of the benchmark's job (`--replicas`; the test runs 2)."""
KILL_RANK = 1
"""The killed replica (and rank: one rank per replica)."""
MECEFO = {
    "neighbour": ["mecefo.takeover_policy=neighbor"],
    "hybrid": ["mecefo.takeover_policy=hybrid"],
    "spread-sample": ["mecefo.takeover_policy=spread", "mecefo.takeover_granularity=sample"],
    "snapshot-restart": ["recovery.mode=restart"],
}
SYSTEMS = ("torchrun", "checkpoint-restart", *MECEFO, "torchft")
POLL_S = 0.05
"""How often a run's metrics.jsonl / events.jsonl are read; a row's time is when it was seen."""
TORCHFT_HINT = "torchft is not installed: pip install -e '.[peers]' (or torchft==0.2.0)"


class PeersError(Exception):
    """A run failed or timed out (one line)."""


def parse_args(argv=None):
    p = bench_parser(__doc__)
    # ~12 s of training between kills on the 2-core machine: every system's killed replica is
    # back before the next kill (torchft: 5 s heartbeat timeout + a restart of ~5-8 s)
    p.add_argument("--steps", type=int, default=400, help="steps of every run")
    p.add_argument("--kills", default="50,175,300", help="steps at which replica 1 is killed")
    p.add_argument("--down-s", type=float, default=2.0, help="seconds a killed replica stays down")
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma list, from: " + ", ".join(SYSTEMS)
    )
    p.add_argument(
        "--replicas", type=int, default=REPLICAS, help="data-parallel replicas (at least 2)"
    )
    p.add_argument("--quick", action="store_true", help="--steps 20 --kills 8")
    p.add_argument("--timeout-s", type=float, default=600.0, help="hard limit of each run")
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--work-dir", default=None, help="run directories (default: a new temp dir)")
    p.add_argument("--out", default="bench_out/peers.json")
    p.add_argument("--figure", default="bench_out/peers_loss.png")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.kills = 20, "8"
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
    if args.down_s < 0:
        p.error("--down-s must be >= 0")
    if args.replicas < 2 or args.replicas <= KILL_RANK:
        p.error(f"--replicas must be at least {max(2, KILL_RANK + 1)} (replica {KILL_RANK} dies)")
    return args


# ------------------------------------------------------------------------------ processes
class Job:
    """Subprocesses, each in its own process group, killed (the whole group) on close."""

    def __init__(self, log_dir: Path, timeout_s: float):
        self.procs: list[subprocess.Popen] = []
        self.log_dir = log_dir
        self.deadline = time.monotonic() + timeout_s

    def start(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.procs.append(proc)
        return proc

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def close(self) -> None:
        """Kill every process still running and all their descendants (torchrun starts its
        workers in sessions of their own, so its process group does not hold them)."""
        import psutil

        for proc in self.procs:
            if proc.poll() is not None:
                continue
            try:
                tree = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                tree = []
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for child in tree:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
        for proc in self.procs:
            proc.wait()


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _tail(
    path: Path, pos: tuple[int, int], now: float, out: list[dict], known: set[str]
) -> tuple[int, int]:
    """Append the new complete lines of `path` to `out`, each stamped `seen` = now (`known`: the
    rows of `out` as read, kept beside it so that a poll does not rebuild it). `pos`:
    (inode, offset). A file replaced (a new inode: a run started over) or shrunk (in-job recovery
    keeps the rows before its state, rewriting the file in place) is read again from its start.
    A row already seen as it is is never added twice: it is kept history, not a step run again
    (a step run again has its own timings). Always checked, since a poll may catch a rewrite
    half done."""
    try:
        with open(path) as fh:
            st = os.fstat(fh.fileno())
            rewritten = st.st_ino != pos[0] or st.st_size < pos[1]
            offset = 0 if rewritten else pos[1]
            fh.seek(offset)
            chunk = fh.read()
    except FileNotFoundError:
        return pos
    lines = chunk.split("\n")
    for line in lines[:-1]:
        if line.strip():
            row = json.loads(line)
            text = json.dumps(row)
            if text not in known:
                known.add(text)
                out.append({**row, "seen": now})
    return st.st_ino, offset + len(chunk) - len(lines[-1])


def _log_tail(job: Job, name: str) -> str:
    text = (job.log_dir / f"{name}.log").read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-3:])[-400:]


def run_trainer(name: str, cmd: list[str], run_dir: Path, args, env: dict) -> dict:
    """One run of our trainer (any launcher): metrics and events tailed as they appear."""
    job = Job(run_dir.parent, args.timeout_s)
    rows: list[dict] = []
    events: list[dict] = []
    offsets = [(0, 0), (0, 0)]
    known: tuple[set[str], set[str]] = (set(), set())
    start = time.time()
    last_print = 0.0
    try:
        proc = job.start(name, cmd, env)
        while True:
            done = proc.poll() is not None
            now = time.time()
            offsets[0] = _tail(run_dir / "metrics.jsonl", offsets[0], now, rows, known[0])
            offsets[1] = _tail(run_dir / "events.jsonl", offsets[1], now, events, known[1])
            if done:
                break
            if job.expired():
                raise PeersError(f"{name}: no result within {args.timeout_s:.0f} s")
            if rows and now - last_print > 5:
                print(f"[peers]   {name}: step {rows[-1]['step'] + 1}/{args.steps}", flush=True)
                last_print = now
            time.sleep(POLL_S)
        if proc.returncode != 0:
            raise PeersError(f"{name} exited {proc.returncode}: {_log_tail(job, name)}")
    finally:
        job.close()
    wall = time.time() - start
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"start": start, "wall_s": wall, "rows": rows, "events": events, "summary": summary}


def trainer_trace(
    raw: dict, ctx: dict, kill_times: list[float], *, restarts=None, live_heal: bool = False
) -> dict:
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
        "kill_times": kill_times,
        "uncommitted_attempts": fo.get("steps_redone", 0),
        "heal_bytes": sum(rejoin_bytes) if live_heal and rejoin_bytes else None,
        "val_loss": val[-1] if val else None,
        "restarts": restarts,
    }


def _event_kill_times(events: list[dict]) -> list[float]:
    """Epoch times of the failures in events.jsonl: `time_s` is since the run's start, whose
    epoch time is bounded by the earliest (seen - time_s) over all events."""
    if not events:
        return []
    run_start = min(e["seen"] - e["time_s"] for e in events)
    return [run_start + e["time_s"] for e in events if e.get("type") == "failure"]


def _marker_times(kill_dir: Path) -> list[float]:
    return sorted(float(f.read_text()) for f in kill_dir.glob("*s*") if f.read_text())


# --------------------------------------------------------------------------------- systems
def _train_args(args, run_dir: Path, *extra: str) -> list[str]:
    # evaluation once, after the last step (the final validation loss of every system)
    return demo_job_args(
        args.steps, run_dir, args.demo_dir, f"training.eval_interval={args.steps}", *extra
    )


def runtorchrun_command(args, work: Path, ctx: dict) -> dict:
    """Plain torchrun, failure-free; one synchronous checkpoint after the last step measures
    the cost of a save (Young/Daly's C: training waits for it)."""
    run_dir = work / "torchrun" / "run"
    run_dir.parent.mkdir(parents=True)
    cmd = torchrun_command(
        args.replicas,
        [
            "-m",
            "megatron_mecefo.train",
            *_train_args(args, run_dir, *_sync_ckpt(args.steps)),
        ],
    )
    raw = run_trainer("torchrun", cmd, run_dir, args, _env())
    ctx["checkpoint_s"] = (raw["summary"].get("checkpoint") or {}).get("mean_save_block_s")
    return trainer_trace(raw, ctx, [])


def _sync_ckpt(interval: int) -> list[str]:
    # synchronous saves: an async one commits seconds later here (the write competes with
    # training for the 2 cores), so a kill before it lands restarts from an older step
    return [f"checkpoint.interval={interval}", "checkpoint.async_save=false"]


def young_daly_interval(args, step_s: float, checkpoint_s: float) -> int:
    """K = sqrt(2 C MTBF) in steps, MTBF = the schedule's failure-free time / its kills."""
    mtbf_s = args.steps * step_s / len(args.kill_steps)
    return max(1, round(math.sqrt(2 * checkpoint_s * mtbf_s) / step_s))


def run_checkpoint_restart(args, work: Path, ctx: dict) -> dict:
    run_dir = work / "checkpoint-restart" / "run"
    kill_dir = run_dir.parent / "kills"
    kill_dir.mkdir(parents=True)
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
    }
    raw = run_trainer("checkpoint-restart", cmd, run_dir, args, env)
    kills = _marker_times(kill_dir)
    trace = trainer_trace(raw, ctx, kills, restarts=len(kills))
    trace["checkpoint_interval"] = k
    return trace


def run_mecefo(name: str, args, work: Path, ctx: dict) -> dict:
    from megatron_mecefo.failover.node.agent_cli import launch_command

    run_dir = work / name / "run"
    run_dir.parent.mkdir(parents=True)
    inject = [x for k in args.kill_steps for x in ("--inject", f"kill:{KILL_RANK}:{k}")]
    train = _train_args(args, run_dir, "snapshot.interval=1", *MECEFO[name], *inject)
    cmd = launch_command(
        train, nproc_per_node=args.replicas, flags=["--restart-delay-s", str(args.down_s)]
    )
    raw = run_trainer(name, cmd, run_dir, args, _env())
    kills = _event_kill_times(raw["events"])
    live_heal = name != "snapshot-restart"
    return trainer_trace(raw, ctx, kills, restarts=len(kills), live_heal=live_heal)


def run_torchft(args, work: Path, ctx: dict) -> dict:
    """4 replica groups, each `torchrun --nproc-per-node 1 --max-restarts N`, and torchft's
    lighthouse in this process (min_replicas 1, quorum tick 100 ms, join timeout 10 s: the
    values of torchft's README)."""
    from torchft._torchft import LighthouseServer

    out = work / "torchft"
    out.mkdir(parents=True)
    worker = [
        str(ROOT / "tools" / "bench" / "peers_torchft.py"),
        "--steps",
        str(args.steps),
        "--out-dir",
        str(out),
        "--demo-dir",
        args.demo_dir,
        "--replicas",
        str(args.replicas),
    ]
    job = Job(out, args.timeout_s)
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=10000, quorum_tick_ms=100
    )
    start = time.time()
    try:
        prep = job.start("prepare", [sys.executable, *worker, "--prepare-only"], _env())
        _wait(job, [prep], "torchft data preparation")
        env = {**_env(), "TORCHFT_LIGHTHOUSE": lighthouse.address()}
        kills = ",".join(map(str, args.kill_steps))
        procs = []
        for r in range(args.replicas):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "1",
                "--nproc-per-node",
                "1",
                "--max-restarts",
                str(len(args.kill_steps) + 1),
                "--master-port",
                str(free_port()),
                *worker,
                "--replica",
                str(r),
                "--kills",
                kills,
                "--kill-replica",
                str(KILL_RANK),
                "--down-s",
                str(args.down_s),
            ]
            procs.append(job.start(f"replica{r}", cmd, env))
        _wait(job, procs, "torchft", progress=out / "rows_replica0.jsonl", steps=args.steps)
    finally:
        job.close()
        lighthouse.shutdown()
    wall = time.time() - start
    trace = torchft_trace(out, args.replicas, start, wall, _marker_times(out / "kills"))
    return {**trace, "global_batch": ctx["global_batch"]}


def _wait(job: Job, procs, what: str, progress: Path | None = None, steps: int = 0) -> None:
    last_print = time.time()
    while any(p.poll() is None for p in procs):
        if job.expired():
            raise PeersError(f"{what}: no result within the time limit")
        if progress is not None and time.time() - last_print > 5 and progress.exists():
            done = sum(1 for r in read_jsonl(progress) if r.get("committed"))
            print(f"[peers]   {what}: replica 0 committed {done}/{steps} steps", flush=True)
            last_print = time.time()
        time.sleep(POLL_S)
    bad = [p for p in procs if p.returncode != 0]
    if bad:
        raise PeersError(f"{what} exited {bad[0].returncode} (logs in {job.log_dir})")


# ------------------------------------------------------------------------------------ main
def batch_sizes(replicas: int) -> dict:
    """The demo job's micro-batch size and the global batch of `replicas` replicas."""
    import yaml

    tc = yaml.safe_load((ROOT / "configs" / "run" / "demo_cpu.yaml").read_text())["training"]
    mbs = tc["micro_batch_size"]
    return {"micro_batch_size": mbs, "global_batch": mbs * tc["num_microbatches"] * replicas}


def run_system(name: str, args, work: Path, ctx: dict) -> dict:
    if name == "torchrun":
        return runtorchrun_command(args, work, ctx)
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
    print(
        f"[peers] {len(systems)} systems, {args.steps} steps, {args.replicas} replicas, kill "
        f"replica {KILL_RANK} at steps {args.kill_steps}, down {args.down_s} s; run dirs in {work}",
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
                    f"{args.steps * step_s / len(args.kill_steps):.1f} s -> every "
                    f"{ctx['checkpoint_interval']} steps",
                    flush=True,
                )
            print(f"[peers] {name} ...", flush=True)
            t0 = time.time()
            traces[name] = {**run_system(name, args, work, ctx), "kill_steps": []}
            if name != "torchrun":
                traces[name]["kill_steps"] = args.kill_steps
            print(f"[peers] {name}: done in {time.time() - t0:.1f} s", flush=True)
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
            "down_s": args.down_s,
        },
        "checkpoint": {k: ctx.get(k) for k in ("checkpoint_s", "checkpoint_interval")},
        "columns": table,
        "traces": traces,
    }
    return write_json(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
