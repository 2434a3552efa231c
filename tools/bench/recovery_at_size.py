"""Recovery at a real state size: every trainer killed, then back from memory, parity or disk.

    python tools/bench/recovery_at_size.py                     # ~1 GB of state per rank
    python tools/bench/recovery_at_size.py --quick             # small model, a smoke run
    python tools/bench/recovery_at_size.py --hidden 2048 --layers 2 --out bench_out/r.json

The real job (`mecefo-launch`, configs/run/demo_cpu.yaml) as two simulated nodes of one rank
each (so a node's memory can be lost while its peer's parity survives), with a wide, shallow
model, the default warm spares, a synchronous checkpoint every `--ckpt-interval` steps, and both
trainers SIGKILLed back to back (a direct kill) once the checkpoint of `--kill-step` steps is
committed, so snapshot and checkpoint hold the same step. Three cases, one job each:

  memory  snapshots every step: both ranks load their node's shared-memory slot;
  parity  the same, then node 1's snapshot process SIGKILLed and its shared memory deleted: the
          restarted snapshot process rebuilds node 1's blob from node 0's XOR parity;
  disk    no snapshots: both ranks load the last dist_checkpointing checkpoint.

Each recovery is split from the job's own events.jsonl (`time_s`, one clock) and metrics.jsonl:

  detection   failure.time_s -> detection.time_s (the coordinator has declared the loss)
  start       detection.time_s -> the earliest recovery's time_s - latency_ms (a process is
              up; includes the agent's restart delay)
  build       the slowest recovery's latency_ms - load_ms: the engine built (model, DDP,
              optimizer: the same work for every source) and the group joined
  state       its load_ms: finding, reading, verifying and installing the state
  first step  last recovery.time_s -> regroup "recover" time_s, plus the first resumed step's
              step_time_s from metrics.jsonl
  redo        steps between the loaded state and the failure step, times the median step time
  lost        total + redo - the median failure-free step: what the failure cost (the first
              resumed step would have run anyway)

A benchmark, not a test: on a loaded 2-core box read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.bench.bench_common import (  # noqa: E402
    DEMO_CONFIG,
    bench_parser,
    ensure_demo,
    free_port,
    machine,
    mem_available_gb,
    read_jsonl,
    write_json,
)

CASES = ("memory", "parity", "disk")
GIB = 2**30
STATE_BYTES_PER_PARAM = 12
"""What a snapshot or checkpoint holds per fp32 parameter: the weight and Adam's two moments."""
LIVE_BYTES_PER_PARAM = 16
"""What a trainer holds per parameter: weight, gradient and the two moments."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--hidden", type=int, default=2304, help="model.hidden_size (ffn = 4x)")
    p.add_argument("--layers", type=int, default=1, help="model.num_layers")
    p.add_argument("--seq", type=int, default=32, help="model.seq_length")
    p.add_argument(
        "--kill-step", type=int, default=4, help="kill once this step's checkpoint is committed"
    )
    p.add_argument("--ckpt-interval", type=int, default=2, help="checkpoint.interval")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--timeout", type=float, default=600, help="seconds per job (hard)")
    p.add_argument("--quick", action="store_true", help="hidden 256, 1 layer: a smoke run")
    p.add_argument("--keep", action="store_true", help="keep the run directories and logs")
    p.add_argument("--out", default=str(ROOT / "bench_out" / "recovery_at_size.json"))
    p.error = lambda msg: p.exit(2, f"recovery_at_size: {msg}\n")  # one line, not the usage
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers = 256, 1
    heads = 16 if args.hidden % 16 == 0 else 0
    if args.hidden < 64 or not heads or args.layers < 1 or args.seq < 8:
        p.exit(2, "recovery_at_size: --hidden must be a multiple of 16 >= 64, --layers >= 1\n")
    if args.ckpt_interval < 1 or args.kill_step < 2 or args.kill_step % args.ckpt_interval:
        p.exit(2, "recovery_at_size: --kill-step must be a multiple of --ckpt-interval\n")
    return args


def num_params(hidden: int, layers: int, vocab: int = 512) -> int:
    """Parameters of the LLaMA-style model (see ModelConfig.num_parameters)."""
    from megatron_mecefo.mcore.config import ModelConfig

    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=4 * hidden,
        num_attention_heads=16,
        vocab_size=vocab,
    ).num_parameters()


def memory_estimate(params: int, cases, ranks: int = 2) -> dict:
    """Peak host memory of the heaviest case, GiB. Per rank: the live trainer (16 B/param), two
    shared-memory slots, the checkpoint writer's staging copy, and in the parity case the
    snapshot process's blob, parity and rebuild buffers (XOR over 2 nodes is a full copy, two
    steps kept: 6.3 GB anonymous RSS measured at 1.05 GB of state, so 6 states); plus ~0.5 GiB
    per trainer and warm spare."""
    state = STATE_BYTES_PER_PARAM * params
    per_rank = LIVE_BYTES_PER_PARAM * params + 2 * state + state
    if "parity" in cases:
        per_rank += 6 * state
    return {
        "state_bytes_per_rank": state,
        "per_rank_gib": per_rank / GIB,
        "total_gib": (ranks * per_rank + ranks * 2 * 0.5 * GIB) / GIB,
    }


def model_overrides(args) -> list[str]:
    return [
        f"model.hidden_size={args.hidden}",
        f"model.ffn_hidden_size={4 * args.hidden}",
        f"model.num_layers={args.layers}",
        "model.num_attention_heads=16",
        f"model.seq_length={args.seq}",
        "training.micro_batch_size=1",
        "training.num_microbatches=1",
        "training.warmup_steps=1",
    ]


def case_overrides(case: str, args) -> list[str]:
    common = [f"checkpoint.interval={args.ckpt_interval}", "checkpoint.async_save=false"]
    if case == "disk":
        return [*common, "snapshot.interval=0"]
    # the memory case needs no parity (it would double the snapshot process's memory)
    return [
        *common,
        "snapshot.interval=1",
        f"snapshot.parity={'xor' if case == 'parity' else 'none'}",
    ]


# ---------------------------------------------------------------------------------- one job
def run_case(case: str, args, work: Path, demo: Path, say) -> dict:
    """Two agents (nodes 0 and 1, one rank each); returns the row of this case."""
    from megatron_mecefo.failover.node.agent_cli import launch_command

    run_dir = work / case
    shm_root = Path("/dev/shm" if Path("/dev/shm").is_dir() else work) / (
        f"mecefo-bench-{uuid.uuid4().hex[:8]}"
    )
    delay = 1.5 if case == "parity" else 0.5
    trainer = [
        "--config",
        str(DEMO_CONFIG),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(args.kill_step + 2 + 4 * (case == "parity")),  # parity: room to wait for it
        f"data.demo_dir={demo}",
        "training.eval_interval=0",
        "logging.print_interval=0",
        *model_overrides(args),
        *case_overrides(case, args),
    ]
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "MECEFO_SHM_DIR": str(shm_root),
    }
    port = free_port()
    procs, logs = [], []
    t0 = time.monotonic()
    try:
        for node in range(2):
            where = (
                ["--coordinator-port", str(port)]
                if node == 0
                else ["--coordinator", f"127.0.0.1:{port}"]
            )
            cmd = launch_command(
                trainer,
                nproc_per_node=1,
                nnodes=2,
                node_rank=node,
                flags=["--restart-delay-s", str(delay), *where],
            )
            logs.append(work / f"{case}.node{node}.log")
            with open(logs[-1], "w") as fh:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=ROOT,
                        start_new_session=True,
                    )
                )
            if node == 0:
                time.sleep(1.0)  # the coordinator first
        parity_of = shm_root if case == "parity" else None
        kill_trainers(run_dir, args.kill_step, t0 + args.timeout, parity_of)
        lost = None
        if case == "parity":
            lost = lose_node_1_memory(logs, shm_root, t0 + args.timeout)
        slot_bytes = 0
        while any(proc.poll() is None for proc in procs):
            if time.monotonic() - t0 > args.timeout:
                raise subprocess.TimeoutExpired("mecefo-launch", args.timeout)
            slot_bytes = max([slot_bytes, *_slot_sizes(shm_root)])
            time.sleep(0.2)
        codes = [proc.returncode for proc in procs]
    except subprocess.TimeoutExpired:
        codes, slot_bytes = ["timeout"], 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc)
        shutil.rmtree(shm_root, ignore_errors=True)
    wall = time.monotonic() - t0
    output = "\n".join(log.read_text() for log in logs if log.exists())
    row = breakdown(read_jsonl(run_dir / "events.jsonl"), read_jsonl(run_dir / "metrics.jsonl"))
    row.update(
        exit=codes,
        wall_s=wall,
        restart_delay_s=delay,
        state_bytes_per_rank=state_bytes(run_dir),
        slot_bytes=slot_bytes or None,
        sources=sorted({_source(ln) for ln in output.splitlines() if "recovered the state" in ln}),
        rebuilt_from_parity="rebuilt this node's snapshot" in output,
    )
    if lost is not None:
        row["node1_memory_lost_s"] = lost
    ok = codes == [0, 0] and row.get("total_s") is not None
    row["ok"] = ok
    if not ok:
        row["log_tail"] = output[-3000:]
    say(
        f"  {case}: exit {codes}, total {row.get('total_s')}, sources {row['sources']}, "
        f"wall {wall:.0f} s"
    )
    return row


def kill_trainers(run_dir: Path, step: int, deadline: float, parity_of: Path | None) -> None:
    """SIGKILL both trainers back to back once the checkpoint of `step` is committed (so the
    snapshot and the checkpoint hold the same step; `--inject` fires per rank at its own step
    start and on a loaded box the second rank died after the first had already rejoined).
    `parity_of`: also wait until both nodes hold parity of a step >= `step` (parity is encoded
    after the snapshot and lags it at this size; killed earlier, nothing can be rebuilt)."""
    marker = run_dir / "checkpoints" / f"step_{step:08d}" / "commit.json"
    while not marker.exists() or (parity_of and not _parity_covers(parity_of, step)):
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("checkpoint", 0)
        time.sleep(0.02)
    pids = _pids_with("megatron_mecefo.train", f"--run-dir {run_dir} ")
    if len(pids) != 2:
        raise RuntimeError(f"expected 2 trainers of {run_dir}, found {len(pids)}")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def _parity_covers(shm_root: Path, step: int) -> bool:
    """Whether every node folder holds a parity file of a step >= `step`."""
    nodes = list(shm_root.glob("mecefo-*/node*"))
    return len(nodes) == 2 and all(
        any(int(f.name[4:16]) >= step for f in n.glob("parity/step*.parity")) for n in nodes
    )


def lose_node_1_memory(logs: list[Path], shm_root: Path, deadline: float) -> float:
    """Once both trainers have died: SIGKILL node 1's snapshot process and delete its folder.
    Returns the seconds from the second death line to the deletion."""
    while time.monotonic() < deadline:
        if all(p.exists() and "(incarnation 0) died" in p.read_text() for p in logs):
            break
        time.sleep(0.02)
    else:
        raise subprocess.TimeoutExpired("parity", 0)
    t_seen = time.monotonic()
    node1 = next(shm_root.glob("mecefo-*"), shm_root) / "node0001"
    for pid in _pids_with("snapshot.smp", f"--dir {node1} "):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(node1, ignore_errors=True)
    return time.monotonic() - t_seen


def _pids_with(module: str, text: str) -> list[int]:
    """Processes running `module` whose command line contains `text` (this job's own run or
    snapshot folder, so no other job's process matches)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if module in cmd and text in cmd:
            pids.append(int(proc.name))
    return pids


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _source(line: str) -> str:
    text = line.split(" from ", 1)[1] if " from " in line else line
    return text.split(" (")[0].split(" in ")[0].strip()


def _slot_sizes(shm_root: Path) -> list[int]:
    """Sizes of the shared-memory slot files now (one rank's snapshot each)."""
    sizes = []
    for f in shm_root.glob("*/node*/rank*.slot*"):
        try:
            sizes.append(f.stat().st_size)
        except OSError:
            pass
    return sizes


def state_bytes(run_dir: Path) -> int | None:
    """Bytes of one rank's saved state: the newest checkpoint folder's files (both ranks are
    data-parallel replicas of the whole model and optimizer; the checkpoint holds one copy)."""
    ckpts = sorted(
        (p for p in run_dir.rglob("*") if p.is_dir() and p.name.startswith("step")),
        key=lambda p: p.stat().st_mtime,
    )
    if not ckpts:
        return None
    return sum(f.stat().st_size for f in ckpts[-1].rglob("*") if f.is_file())


# ----------------------------------------------------------------------------- the breakdown
def breakdown(events: list[dict], metrics: list[dict]) -> dict:
    """Detection / start / load / first step of the first failure, from the job's events."""
    fail = next((e for e in events if e["type"] == "failure"), None)
    if fail is None:
        return {}
    after = [e for e in events if e["seq"] > fail["seq"]]
    det = [e for e in after if e["type"] == "detection"]
    rec = [e for e in after if e["type"] == "recovery"]
    reg = [e for e in after if e["type"] == "regroup" and "recover" in (e.get("detail") or "")]
    if not reg and rec:  # the first regroup after the last load
        last = max(e["seq"] for e in rec)
        reg = [e for e in after if e["type"] == "regroup" and e["seq"] > last]
    if not det or not rec or not reg:
        return {"failure_step": fail["step"], "events": [e["type"] for e in after]}
    t_fail = fail["time_s"]
    t_det = max(e["time_s"] for e in det if e["time_s"] <= rec[0]["time_s"]) if det else t_fail
    load_start = min(e["time_s"] - e["latency_ms"] / 1e3 for e in rec)
    load_end = max(e["time_s"] for e in rec)
    t_reg = reg[0]["time_s"]
    resumed = min(e["step"] for e in rec)
    gen = max(e.get("generation", 0) for e in rec)
    times = [m["step_time_s"] for m in metrics if m.get("generation", 0) < gen]
    later = [m for m in metrics if m.get("generation", 0) >= gen]
    first = later[0]["step_time_s"] if later else None
    median = statistics.median(times) if times else first
    slowest = max(rec, key=lambda e: e["latency_ms"])
    state_s = slowest["load_ms"] / 1e3 if "load_ms" in slowest else None
    row = {
        "failure_step": fail["step"],
        "resumed_step": resumed,
        "steps_redone": fail["step"] - resumed,
        "median_step_s": median,
        "detection_s": t_det - t_fail,
        "start_s": load_start - t_det,
        "load_s": slowest["latency_ms"] / 1e3,
        "build_s": None if state_s is None else slowest["latency_ms"] / 1e3 - state_s,
        "state_s": state_s,
        "first_step_s": (t_reg - load_end) + (first or 0.0),
        "redo_s": max(0, fail["step"] - resumed - 1) * (median or 0.0),
        "load_details": sorted({e.get("detail", "") for e in rec}),
    }
    row["total_s"] = row["detection_s"] + row["start_s"] + row["load_s"] + row["first_step_s"]
    row["total_with_redo_s"] = row["total_s"] + row["redo_s"]
    # what the failure cost: the first step would have run anyway
    row["lost_s"] = row["total_with_redo_s"] - (median or 0.0)
    return row


def print_table(rows: dict, state: int | None) -> None:
    size = f"{state / 1e9:.2f} GB" if state else "?"
    print(f"\n== recovery of 2 ranks, {size} of state per rank: every trainer SIGKILLed")
    cols = ("detection_s", "start_s", "build_s", "state_s", "first_step_s", "total_s", "lost_s")
    print(f"{'source':<8}" + "".join(f"{c[:-2]:>12}" for c in cols) + f"{'redone':>8}  ok")
    for case, r in rows.items():
        cells = "".join(
            f"{r[c]:12.2f}" if isinstance(r.get(c), float | int) else f"{'-':>12}" for c in cols
        )
        print(f"{case:<8}{cells}{str(r.get('steps_redone', '-')):>8}  {r.get('ok')}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = num_params(args.hidden, args.layers)
    est = memory_estimate(params, args.cases)
    avail = mem_available_gb()
    print(
        f"model: hidden {args.hidden}, ffn {4 * args.hidden}, {args.layers} layer(s), "
        f"{params / 1e6:.1f}M params; state {est['state_bytes_per_rank'] / 1e9:.2f} GB per rank; "
        f"peak memory estimate {est['total_gib']:.1f} GiB of {avail:.1f} GiB available",
        flush=True,
    )
    if est["total_gib"] > 0.85 * avail:
        print(
            f"recovery_at_size: needs ~{est['total_gib']:.1f} GiB, {avail:.1f} GiB available: "
            "refusing (use a smaller --hidden)",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up on SIGTERM
    work = Path(tempfile.mkdtemp(prefix="mecefo-rsize-"))
    say = lambda m: print(m, flush=True)  # noqa: E731
    load = []
    out = {
        "machine": machine(),
        "model": {"hidden": args.hidden, "layers": args.layers, "seq": args.seq, "params": params},
        "memory_estimate": est,
        "cases": {},
    }
    try:
        ensure_demo(work / "demo")
        for case in args.cases:
            say(f"[{case}] 2 nodes x 1 rank, both killed after step {args.kill_step}'s checkpoint")
            load.append(os.getloadavg()[0])
            out["cases"][case] = run_case(case, args, work, work / "demo", say)
            load.append(os.getloadavg()[0])
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    rows = out["cases"]
    sizes = [r["state_bytes_per_rank"] for r in rows.values() if r.get("state_bytes_per_rank")]
    out["state_bytes_per_rank"] = max(sizes) if sizes else None
    out["load_average_1m"] = {"min": min(load), "max": max(load)}
    mem, disk = rows.get("memory", {}), rows.get("disk", {})
    if mem.get("total_s") and disk.get("total_s"):
        out["disk_over_memory"] = disk["total_s"] / mem["total_s"]
        out["disk_over_memory_with_redo"] = disk["total_with_redo_s"] / mem["total_with_redo_s"]
        out["disk_over_memory_lost"] = disk["lost_s"] / mem["lost_s"]
        if mem.get("state_s") and disk.get("state_s"):
            out["disk_over_memory_state"] = disk["state_s"] / mem["state_s"]
    print_table(rows, out["state_bytes_per_rank"])
    if "disk_over_memory" in out:
        print(
            f"disk / memory end to end: {out['disk_over_memory']:.2f}x "
            f"({out['disk_over_memory_with_redo']:.2f}x counting redone steps); goal >= 3x"
        )
        print(
            f"disk / memory, time lost (the first step not counted): "
            f"{out['disk_over_memory_lost']:.2f}x; the state load alone: "
            + (f"{out['disk_over_memory_state']:.2f}x" if "disk_over_memory_state" in out else "?")
        )
    print(f"load average (1 min) during the runs: {min(load):.1f} .. {max(load):.1f}")
    write_json(out, args.out, blank_line=False)
    return 0 if all(r.get("ok") for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
