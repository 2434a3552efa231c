"""The failover part of tools/bench/sharded_optimizer.py: the launched demo jobs (also its
step-time runs', `run_job`) and what their run folders say about shard moves.

Two runs of the tiny model with `training.use_distributed_optimizer=true`, `spread` takeover and
the shard audit on: (a) `mecefo-launch` with 4 ranks, rank 2 SIGKILLed at step 5 and back 3 steps
later; (b) 2 nodes x 2 ranks through `launch/local/run.sh` with node 1's agent and its children
SIGKILLed at once. From events.jsonl each `shard_adopt` next to the regroup and rejoins of its
generation; from `audit/shards_rank*.jsonl` whether every shard always had a holder and its
holders agreed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from bench_common import cell, demo_job_args, median_of, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
SHARDED = ("training.use_distributed_optimizer=true",)
FAILOVER_OVERRIDES = (*SHARDED, "mecefo.takeover_policy=spread", "failover.audit=true")


def run_job(cmd: list[str], run_dir: Path, timeout_s: float) -> dict:
    """Run one demo job to its end; its exit code, output tail, metrics, events and summary."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = -9, f"timed out after {timeout_s} s\n{str(exc.stdout or '')[-2000:]}"
    return job_result(rc, tail, start, run_dir)


def job_result(rc: int, tail: str, start: float, run_dir: Path) -> dict:
    """A finished job (started at `time.monotonic()` = `start`): its exit code, output tail,
    wall time, and the metrics, events and summary in its run folder."""
    summary = run_dir / "summary.json"
    return {
        "exit_code": rc,
        "tail": tail,
        "wall_s": time.monotonic() - start,
        "metrics": read_jsonl(run_dir / "metrics.jsonl"),
        "events": read_jsonl(run_dir / "events.jsonl"),
        "summary": json.loads(summary.read_text()) if summary.exists() else None,
    }


def audit_check(run_dir: Path) -> dict:
    """From `audit/shards_rank*.jsonl`: steps audited, whether every shard (of the shards seen)
    had a holder after every audited step, the most holders of one shard, whether holders
    always agreed bit for bit, and whether after the last step every shard's own replica held
    it again (shards handed back)."""
    rows: dict[tuple[int, int, int], list[tuple[int, str]]] = defaultdict(list)
    steps: set[int] = set()
    for path in sorted((run_dir / "audit").glob("shards_rank*.jsonl")):
        for row in read_jsonl(path):
            steps.add(row["next_step"])
            for shard, digest in row["shards"].items():
                rows[(row["next_step"], row["position"], int(shard))].append(
                    (row["replica"], digest)
                )
    if not steps:
        return {"audited_steps": 0}
    shards = sorted({(k[1], k[2]) for k in rows})
    return {
        "audited_steps": len(steps),
        "always_held": all((s, *ps) in rows for s in steps for ps in shards),
        "max_holders": max(len({r for r, _ in v}) for v in rows.values()),
        "holders_agree": all(len({d for _, d in v}) == 1 for v in rows.values()),
        "own_held_at_end": all(
            s in {r for r, _ in rows.get((max(steps), pos, s), [])} for pos, s in shards
        ),
    }


def shard_moves(events: list[dict]) -> list[dict]:
    """Each `shard_adopt` event with the regroup of its generation (after a failure its
    `latency_ms` runs from the failure to the generation formed, state and shards in place) and
    that generation's rejoins (`latency_ms`, state bytes sent to the rejoining ranks)."""
    regroups = {e.get("generation"): e for e in events if e["type"] == "regroup"}
    out = []
    for e in events:
        if e["type"] != "shard_adopt":
            continue
        gen = e.get("generation")
        rg = regroups.get(gen, {})
        rejoins = [r for r in events if r["type"] == "rejoin" and r.get("generation") == gen]
        out.append(
            {
                "generation": gen,
                "step": e["step"],
                "bytes": e.get("bytes"),
                "transfer_ms": e.get("transfer_ms"),
                "regroup_ms": rg.get("latency_ms"),
                "regroup_detail": rg.get("detail", ""),
                "rejoin_ms": median_of(r.get("latency_ms") for r in rejoins),
                "rejoin_state_bytes": sum(int(r.get("bytes", 0)) for r in rejoins) or None,
            }
        )
    return out


def failover_row(scenario: str, res: dict, run_dir: Path) -> dict:
    ev = res["events"]
    detections = [e["latency_ms"] for e in ev if e["type"] == "detection" and "latency_ms" in e]
    summary = res["summary"] or {}
    return {
        "scenario": scenario,
        "exit_code": res["exit_code"],
        "ok": res["exit_code"] == 0,
        "wall_s": res["wall_s"],
        "steps_logged": len(res["metrics"]),
        "detection_ms": max(detections) if detections else None,
        "moves": shard_moves(ev),
        "regroups_without_shard_adopt": sorted(
            e.get("generation")
            for e in ev
            if e["type"] == "regroup"
            and not any(
                a["type"] == "shard_adopt" and a.get("generation") == e.get("generation")
                for a in ev
            )
        ),
        "event_types": sorted({e["type"] for e in ev}),
        "steps_redone": (summary.get("failover") or {}).get("steps_redone"),
        "final_replicas": res["metrics"][-1].get("replicas_alive") if res["metrics"] else None,
        "audit": audit_check(run_dir),
        "tail": None if res["exit_code"] == 0 else res["tail"][-1500:],
        "events": ev,
    }


def run_kill(args, tmp: Path) -> dict:
    run_dir = tmp / "kill"
    from megatron_mecefo.failover.node.agent_cli import launch_command

    train = demo_job_args(
        args.failover_steps, run_dir, args.demo_dir, *FAILOVER_OVERRIDES, "--inject", "kill:2:5:3"
    )
    cmd = launch_command(train, nproc_per_node=4, flags=["--restart-delay-s", "0.5"])
    print(f"[bench] failover: kill:2:5:3, 4 ranks, {args.failover_steps} steps", flush=True)
    return failover_row("kill rank 2", run_job(cmd, run_dir, args.timeout_s), run_dir)


def run_node_loss(args, tmp: Path) -> dict:
    """2 nodes x 2 ranks (+ standbys) through launch/local/run.sh; node 1's agent and its
    children SIGKILLed at once after `--kill-at` steps (as tools/bench/node_loss.py does)."""
    from node_loss import _kill_tree, _node_agents

    run_dir = tmp / "node_loss"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "NNODES": "2",
        "NSPARE": str(args.standby),
        "NPROC": "2",
        "PYTHONWARNINGS": "ignore",
    }
    cmd = ["bash", str(ROOT / "launch" / "local" / "run.sh")]
    cmd += demo_job_args(args.failover_steps, run_dir, args.demo_dir, *FAILOVER_OVERRIDES)
    print(
        f"[bench] failover: node 1 of 2 (2 ranks each, {args.standby} standby) lost after "
        f"{args.kill_at} steps, {args.failover_steps} steps",
        flush=True,
    )
    log = tmp / "node_loss.log"
    start = time.monotonic()
    killed = False
    with open(log, "w") as fh:
        launcher = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        metrics = run_dir / "metrics.jsonl"
        try:
            while launcher.poll() is None and time.monotonic() - start < args.timeout_s:
                rows = metrics.read_text().splitlines() if metrics.exists() else []
                if not killed and len(rows) >= args.kill_at:
                    _kill_tree(_node_agents(launcher)[(1, False)])
                    killed = True
                time.sleep(0.05)
            rc = launcher.wait(timeout=max(1.0, args.timeout_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(30)
            rc = -9
    res = job_result(rc if killed else -1, log.read_text()[-3000:], start, run_dir)
    row = failover_row("lose node 1", res, run_dir)
    row["killed"] = killed
    return row


def print_failover(rows: list[dict]) -> None:
    print("\nshard moves under failover (tiny, 4 ranks, 2 copies per shard)")
    print(
        f"{'scenario':<13}{'ok':>4}{'detect ms':>10}{'gen':>5}{'step':>6}{'MB moved':>10}"
        f"{'xfer ms':>9}{'regroup ms':>12}{'rejoin ms':>11}  audit"
    )
    for r in rows:
        a = r["audit"]
        audit = (
            f"held {a.get('always_held')}, <= {a.get('max_holders')} holders, "
            f"agree {a.get('holders_agree')}, handed back {a.get('own_held_at_end')}"
            if a.get("audited_steps")
            else "no audit rows"
        )
        moves = r["moves"] or [{}]
        for i, m in enumerate(moves):
            lead = (
                f"{r['scenario']:<13}{'yes' if r['ok'] else 'NO':>4}"
                f"{cell(r['detection_ms'], '.0f', missing='-'):>10}"
                if i == 0
                else " " * 27  # under scenario, ok, detect ms
            )
            print(
                f"{lead}{cell(m.get('generation'), '', missing='-'):>5}"
                f"{cell(m.get('step'), '', missing='-'):>6}"
                f"{cell(m.get('bytes'), '.3f', scale=1e-6, missing='-'):>10}"
                f"{cell(m.get('transfer_ms'), '.0f', missing='-'):>9}"
                f"{cell(m.get('regroup_ms'), '.0f', missing='-'):>12}"
                f"{cell(m.get('rejoin_ms'), '.0f', missing='-'):>11}  {audit if i == 0 else ''}"
            )
        if r["regroups_without_shard_adopt"]:
            print(f"  no shard_adopt event at generation(s) {r['regroups_without_shard_adopt']}")
        if not r["ok"]:
            print(f"  failed (exit {r['exit_code']}): {(r['tail'] or '').strip()[-400:]}")
