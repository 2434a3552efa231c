"""The exit code of a trainer that hit an unexpected error under failover.

A lost coordinator is a clean COORDINATOR_LOST exit; an error because this replica left the
membership (a TP peer died, so its collectives broke) is a one-line REJOIN exit; anything else
prints its traceback, is reported dead to the coordinator at once (not by heartbeat silence) and
exits FAILURE. The agent restarts REJOIN and FAILURE.

An etcd store that no member serves (its quorum lost) is a COORDINATOR_LOST exit at once, with the
step boundary this rank stopped at (`training/boundary.py`): an update is applied only after the
commit vote, which needs the store.
"""

from __future__ import annotations

import sys
import time
import traceback

from megatron_mecefo.control import etcd_store, keys
from megatron_mecefo.control.records import read_generation, read_registration
from megatron_mecefo.errors import ExitCode
from megatron_mecefo.failover.trainer.collectives import brief_error
from megatron_mecefo.training import boundary

COMM_WORDS = ("gloo", "NCCL", "Connection", "Timed out")
"""An error text with one of these is a collective's: wait a little for the coordinator's view."""


def wait_for_removal(store, rank: int, timeout_s: float) -> str | None:
    """Wait up to `timeout_s` for a generation without `rank`'s replica; its reason, or None.
    Raises if the coordinator is unreachable."""
    replica = rank // read_registration(store, rank).replica_size
    deadline = time.monotonic() + timeout_s
    while True:
        gen = keys.get_int(store, keys.GEN)
        if gen > 0 and replica not in read_generation(store, gen).members:
            return f"generation {gen}: replica {replica} removed"
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def crash_code(exc: Exception, rank: int, address: str, incarnation: int) -> int:
    """Report and classify `exc` (see the module docstring); returns the exit code."""
    text = str(exc)
    first = brief_error(exc)  # no C++ frames, no gloo banner
    if etcd_store.UNAVAILABLE_TEXT in text:
        print(f"error: rank {rank}: {first}; {boundary.describe()}", file=sys.stderr, flush=True)
        return int(ExitCode.COORDINATOR_LOST)
    comm_error = any(w in text for w in COMM_WORDS)
    try:
        store = keys.connect(address, 2.0)
        removed = wait_for_removal(store, rank, timeout_s=5.0 if comm_error else 0.0)
        if removed is None:  # a genuine error here: tell the coordinator now, not by heartbeat
            keys.report_dead(store, rank, incarnation)
    except Exception:  # noqa: BLE001 - unreachable, whatever the error type
        print(f"error: rank {rank}: coordinator unreachable ({first})", file=sys.stderr, flush=True)
        return int(ExitCode.COORDINATOR_LOST)
    if removed is not None:
        print(f"rank {rank}: left the membership ({removed}) after: {first}", flush=True)
        return int(ExitCode.REJOIN)
    traceback.print_exception(exc)
    return int(ExitCode.FAILURE)
