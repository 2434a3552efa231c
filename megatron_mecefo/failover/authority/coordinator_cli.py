"""The membership coordinator's process: its flags (shared with `mecefo-coordinator`, which
starts and restarts it, and with `mecefo-launch --coordinator-arg`) and its main loop.

    python -m megatron_mecefo.failover.authority.coordinator_cli --store HOST:PORT --world-size W

Not meant to be run by hand: `store_host.py` runs it as a child, with the store as a client.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from megatron_mecefo.control import keys
from megatron_mecefo.errors import ExitCode
from megatron_mecefo.failover.authority.coordinator import Coordinator
from megatron_mecefo.failover.liveness.detector import DetectorConfig

_FLAGS = (
    ("heartbeat_timeout_s", "MECEFO_HEARTBEAT_TIMEOUT_S"),
    ("heartbeat_hard_timeout_s", "MECEFO_HEARTBEAT_HARD_TIMEOUT_S"),
    ("agent_timeout_s", "MECEFO_AGENT_TIMEOUT_S"),
    ("hang_timeout_floor_s", "MECEFO_HANG_TIMEOUT_FLOOR_S"),
    ("hang_timeout_factor", "MECEFO_HANG_TIMEOUT_FACTOR"),
    ("grace_s", "MECEFO_GRACE_S"),
    ("start_timeout_s", "MECEFO_START_TIMEOUT_S"),
)


def add_detector_flags(p: argparse.ArgumentParser) -> None:
    """The DetectorConfig flags, each defaulting to its MECEFO_* environment variable."""
    d = DetectorConfig()
    for name, env in _FLAGS:
        flag = "--" + name.replace("_", "-")
        p.add_argument(
            flag, type=float, default=float(os.environ.get(env, getattr(d, name))), help=f"${env}"
        )
    p.add_argument(
        "--min-replicas", type=int, default=int(os.environ.get("MECEFO_MIN_REPLICAS", 1))
    )


def detector_config(args: argparse.Namespace) -> DetectorConfig:
    """Raises ValueError on a bad value."""
    fields = {name: getattr(args, name) for name, _ in _FLAGS}
    return DetectorConfig(**fields, min_replicas=args.min_replicas)


def detector_argv(args: argparse.Namespace) -> list[str]:
    """The flags that give the same DetectorConfig (handed to a restarted coordinator)."""
    out = [f"--{name.replace('_', '-')}={getattr(args, name)!r}" for name, _ in _FLAGS]
    return [*out, f"--min-replicas={args.min_replicas}"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m megatron_mecefo.failover.authority.coordinator_cli",
        description="The membership coordinator of one job, a client of its store (started and "
        "restarted by mecefo-coordinator; not meant to be run by hand).",
    )
    p.add_argument("--store", required=True, help="HOST:PORT of the job's store")
    p.add_argument("--world-size", type=int, required=True, help="trainer processes in the job")
    add_detector_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = detector_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    store = keys.connect(args.store, 30.0)
    stop = {"flag": False}

    def _stop(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    coord = Coordinator(store, args.world_size, cfg, log=lambda m: print(m, flush=True))
    coord.restore()
    parent = os.getppid()
    try:  # never outlive the store's host
        coord.run(lambda: stop["flag"] or os.getppid() != parent)
    except Exception as exc:
        if not _host_gone(parent):
            raise  # a bug: the traceback, and the store host restarts this process
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"[coordinator] the store host is gone ({first}); stopping", file=sys.stderr)
        return int(ExitCode.COORDINATOR_LOST)
    finally:
        coord.close()
    return 0


def _host_gone(parent: int, wait_s: float = 1.0) -> bool:
    """Whether the store host (this process's parent) died: its socket closes before the kernel
    reparents its children, so a store error may come first; wait a moment for the second."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


if __name__ == "__main__":
    sys.exit(main())
