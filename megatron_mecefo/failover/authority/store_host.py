"""`mecefo-coordinator`: the job's control plane on the head node.

It serves the job's `TCPStore` (torch's C++ server, in this process) and runs the membership
authority (`coordinator_cli.py`) as a child process that it restarts when it dies.
The coordinator keeps all of its state in the store, so a restarted one rebuilds membership from it
while the trainers go on with the current generation (they only ever talk to the store). This
process runs no decision logic of its own: losing it is losing the store (a head-node loss), after
which every trainer exits COORDINATOR_LOST instead of hanging.

    mecefo-coordinator --world-size W [--port P] [--port-file F] [detector flags ...]
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megatron_mecefo.control import keys
from megatron_mecefo.control.proc import die_with_parent, exit_now
from megatron_mecefo.control.records import post_event
from megatron_mecefo.failover.authority.coordinator_cli import (
    add_detector_flags,
    detector_argv,
    detector_config,
)
from megatron_mecefo.failover.authority.event_log import EventLog

RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)
"""Delay before the n-th consecutive restart of a coordinator that died young (< 30 s old)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="mecefo-coordinator",
        description="Serve the failover store and keep the membership coordinator running "
        "(one per job, head node).",
    )
    p.add_argument("--world-size", type=int, required=True, help="trainer processes in the job")
    p.add_argument("--host", default="0.0.0.0", help="listen address")
    p.add_argument("--port", type=int, default=0, help="listen port (0: a free one)")
    p.add_argument("--port-file", help="write the chosen port here once listening")
    add_detector_flags(p)
    return p.parse_args(argv)


def _coordinator_cmd(args: argparse.Namespace, port: int) -> list[str]:
    """The child's command: the same detector settings, the store as a client."""
    return [
        sys.executable,
        "-m",
        "megatron_mecefo.failover.authority.coordinator_cli",
        "--store",
        f"127.0.0.1:{port}",
        "--world-size",
        str(args.world_size),
        *detector_argv(args),
    ]


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    args = parse_args(argv)
    try:
        detector_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    store = dist.TCPStore(
        args.host,
        args.port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
        use_libuv=True,
    )
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(store.port))
        tmp.replace(args.port_file)
    print(f"[coordinator] serving on port {store.port} for {args.world_size} ranks", flush=True)
    stop: dict[str, Any] = {"flag": False, "deadline": None}
    grace_s = float(os.environ.get("MECEFO_TERM_GRACE_S") or 0)

    def _stop(signum, frame):
        if signum == signal.SIGTERM and grace_s > 0:
            # Slurm's SIGTERM reaches every process of the job (twice: the step, and srun
            # forwarding it): keep the store up while the ranks save their final checkpoint,
            # until the agents have left or the grace time is over
            if stop["deadline"] is None:
                stop["deadline"] = time.monotonic() + grace_s
            return
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    cmd = _coordinator_cmd(args, store.port)
    child, started, restarts = _start(cmd), time.monotonic(), 0
    agents_seen, parent = False, os.getppid()
    code = 0
    try:
        while not stop["flag"] and os.getppid() == parent:  # never outlive the launcher
            if stop["deadline"] is not None and time.monotonic() > stop["deadline"]:
                break
            rc = child.poll()
            finished = store.check([keys.DONE]) or store.check([keys.ABORT])
            if rc is not None:
                # with a SIGTERM grace time (Slurm), a clean exit of the child is not the end: it
                # may be Slurm's SIGTERM reaching it (restarted unless the job is done), and the
                # store stays up until the agents have left, for the ranks' final checkpoint
                if (rc == 0 and grace_s <= 0) or finished:
                    code = 8 if store.check([keys.ABORT]) else 0
                    if rc == 0 and grace_s <= 0:
                        break
                else:
                    restarts = restarts + 1 if time.monotonic() - started < 30 else 1
                    how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
                    print(
                        f"[coordinator] the membership coordinator died ({how}); restarting it "
                        f"(restart {restarts}); the trainers keep the current generation",
                        flush=True,
                    )
                    post_event(
                        store,
                        "coordinator_restart",
                        step=job_step(store),
                        dp_rank=None,
                        detail=f"died ({how})",
                    )
                    time.sleep(RESTART_BACKOFF_S[min(restarts, len(RESTART_BACKOFF_S)) - 1])
                    child, started = _start(cmd), time.monotonic()
            active = keys.get_int(store, keys.AGENTS_ACTIVE, 0)
            agents_seen = agents_seen or active > 0
            if agents_seen and active <= 0:
                break  # every agent is gone: nothing left to coordinate
            time.sleep(0.1)
    finally:
        _stop_child(child)
        # a coordinator killed before it drained (or still starting when the job ended) leaves
        # posted events unwritten: write them now (each line's `seq` prevents a duplicate)
        EventLog(store, log=lambda m: print(m, flush=True)).close()
    if store.check([keys.ABORT]):
        code = 8
    return code


def job_step(store) -> int:
    """The step the job is at: the coordinator's view (JOB_STEP), or past the last committed step
    when that is newer (no coordinator ran meanwhile)."""
    committed = keys.get_int(store, keys.COMMITTED, -1)
    return max(keys.get_int(store, keys.JOB_STEP, 0), committed + 1)


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, preexec_fn=die_with_parent)


def _stop_child(child: subprocess.Popen) -> None:
    """Stop the coordinator (SIGTERM: it drains its last events), then kill it if it lingers."""
    if child.poll() is None:
        child.terminate()
    try:
        child.wait(10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def cli() -> None:
    """The `mecefo-coordinator` command: `main`, then `proc.exit_now`."""
    exit_now(main())


if __name__ == "__main__":
    cli()
