"""`mecefo-inject`: send a real signal to one rank of a live failover run, from outside.

    mecefo-inject --coordinator HOST:PORT --rank 2 --signal KILL     (or STOP, CONT, TERM)

It looks the rank's pid up in its registration (the rank must run on this host), sends the
signal, and records the injection time so the coordinator reports the true failure time.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from megatron_mecefo.control import keys
from megatron_mecefo.control.records import read_registration


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mecefo-inject", description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", required=True, help="HOST:PORT (printed by mecefo-launch)")
    p.add_argument("--rank", type=int, required=True, help="global rank")
    p.add_argument("--signal", default="KILL", choices=["KILL", "STOP", "CONT", "TERM"])
    args = p.parse_args(argv)
    try:
        store = keys.connect(args.coordinator, 5.0)
    except Exception as exc:  # noqa: BLE001 - one clear line for an unreachable coordinator
        print(f"error: cannot reach the coordinator at {args.coordinator}: {exc}", file=sys.stderr)
        return 6
    reg = read_registration(store, args.rank)
    if reg is None:
        print(f"error: rank {args.rank} has not registered with this job", file=sys.stderr)
        return 2
    if reg.host != keys.this_host():
        print(
            f"error: rank {args.rank} runs on {reg.host}; run mecefo-inject there", file=sys.stderr
        )
        return 2
    if args.signal in ("KILL", "STOP"):
        kind = "kill" if args.signal == "KILL" else "hang"
        store.set(keys.injected(args.rank, reg.incarnation), f"{kind}:{time.time()}")
    try:
        os.kill(reg.pid, getattr(signal, f"SIG{args.signal}"))
    except ProcessLookupError:
        print(f"error: rank {args.rank} (pid {reg.pid}) is not running", file=sys.stderr)
        return 1
    print(
        f"sent SIG{args.signal} to rank {args.rank} (pid {reg.pid}, incarnation {reg.incarnation})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
