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
from megatron_mecefo.failover.authority import election
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
    p.add_argument("--store", required=True, help="HOST:PORT or etcd://... of the job's store")
    p.add_argument("--world-size", type=int, required=True, help="trainer processes in the job")
    p.add_argument(
        "--elect",
        metavar="CANDIDATE",
        help="etcd store: campaign as this candidate and coordinate only while elected "
        "(`election.py`); each node agent runs one",
    )
    p.add_argument(
        "--lease-ttl-s",
        type=int,
        default=int(os.environ.get("MECEFO_LEASE_TTL_S", election.DEFAULT_TTL_S)),
        help="--elect: the leader's lease; a dead leader is replaced within it "
        "($MECEFO_LEASE_TTL_S)",
    )
    add_detector_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = detector_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # elected: a short bound, so a candidate that lost etcd stands down within seconds
    store = keys.connect(args.store, 5.0 if args.elect else 30.0)
    stop = {"flag": False}

    def _stop(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if args.elect:
        return run_elected(args, cfg, store, lambda: stop["flag"])
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


def run_elected(args: argparse.Namespace, cfg: DetectorConfig, store, stopped) -> int:
    """A candidate (`--elect`): campaign, then coordinate while the lease holds. Exit 0 when the
    job is over or on SIGTERM; REJOIN when it stood down (lease lost, fenced, etcd unreachable):
    its agent then starts a new candidate."""
    from megatron_mecefo.control.records import Fenced

    def log(msg: str) -> None:
        print(msg, flush=True)

    def job_over() -> bool:
        flags = store.get(keys.FLAGS) if store.check([keys.FLAGS]) else b""
        return keys.flag_raised(flags, keys.DONE) or keys.flag_raised(flags, keys.ABORT)

    try:
        leadership = election.campaign(
            store,
            args.store,
            args.elect,
            ttl_s=args.lease_ttl_s,
            should_stop=lambda: stopped() or job_over(),
            log=log,
        )
    except Exception as exc:  # noqa: BLE001 - etcd unreachable: the agent retries
        log(f"[coordinator] candidate {args.elect}: cannot campaign ({_first(exc)})")
        return int(ExitCode.REJOIN)
    if leadership is None:
        return 0
    t0 = time.monotonic()
    coord = Coordinator(store, args.world_size, cfg, log=log)
    try:
        coord.restore()
        log(
            f"[coordinator] candidate {args.elect} elected (lease TTL {args.lease_ttl_s} s, "
            f"epoch {coord.epoch}, restored in {1000 * (time.monotonic() - t0):.0f} ms)"
        )
        why = coord.run(lambda: stopped() or leadership.expired())
    except Fenced as exc:
        log(f"[coordinator] candidate {args.elect} fenced ({exc}); standing down")
        return int(ExitCode.REJOIN)
    except Exception as exc:  # noqa: BLE001 - etcd unreachable (quorum lost): stand down
        log(f"[coordinator] candidate {args.elect}: etcd failed ({_first(exc)}); standing down")
        return int(ExitCode.REJOIN)
    finally:
        coord.close()
    if leadership.expired():
        reason = leadership.lost_reason or f"not renewed for {args.lease_ttl_s} s (paused?)"
        log(f"[coordinator] candidate {args.elect} lost the leadership ({reason}); standing down")
        return int(ExitCode.REJOIN)
    leadership.resign(store)
    return 0 if why in ("agents gone", "stopped") else int(ExitCode.REJOIN)


def _first(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


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
