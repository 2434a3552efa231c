"""Preparing the data when no rank is special (under failover): a file lock among the builders.

A stalled or restarted rank 0 must not leave the others waiting, so every replica's TP rank 0 is
a builder: builders take turns under a file lock beside the data (the first builds, the others
find the cache; a dead builder's lock goes with its process), then mark the data ready in the
store (`keys.DATA_READY`). The other TP ranks wait for that mark. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_mecefo.control import keys
from megatron_mecefo.data.pipeline import build_dir
from megatron_mecefo.errors import QuorumTimeoutError


def shared_preparation(
    data_cfg, store, *, builder: bool, rank: int, timeout_s: float, log: Callable[[str], None]
) -> dict[str, Any]:
    """`build_engine`'s data arguments (`data_rank`, `data_barrier`, `data_guard`) for a builder
    (`builder`: TP rank 0 of its replica) or a waiter."""
    if builder:
        guard = functools.partial(_build_lock, data_cfg, store, rank, timeout_s, log)
        return {"data_rank": 0, "data_barrier": lambda: None, "data_guard": guard}
    barrier = functools.partial(_wait_data_ready, store, timeout_s)
    return {"data_rank": 1, "data_barrier": barrier, "data_guard": None}


@contextlib.contextmanager
def _build_lock(data_cfg, store, rank: int, timeout_s: float, log: Callable[[str], None]):
    folder = Path(build_dir(data_cfg)).absolute()
    folder.parent.mkdir(parents=True, exist_ok=True)
    # beside the folder, not in it: the demo corpus refuses a folder holding anything else
    with open(folder.parent / f".{folder.name}.mecefo-build.lock", "a+") as fh:
        deadline = time.monotonic() + timeout_s
        next_note = time.monotonic() + 30
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise QuorumTimeoutError(
                        f"another rank held the data-preparation lock in {folder} for "
                        f"{timeout_s:.0f} s (failover.start_timeout_s)"
                    ) from None
                if time.monotonic() > next_note:
                    log(f"rank {rank}: waiting for another rank to prepare the data")
                    next_note += 30
                time.sleep(0.1)
        try:
            yield
            store.set(keys.DATA_READY, "1")
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _wait_data_ready(store, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.check([keys.DATA_READY]):
        if time.monotonic() > deadline:
            raise QuorumTimeoutError(
                f"no replica prepared the data within {timeout_s:.0f} s (failover.start_timeout_s)"
            )
        time.sleep(0.05)
