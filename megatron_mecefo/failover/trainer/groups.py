"""Process groups of a failover generation: how they are built, and how a superseded one goes.

Each membership generation gets a new group built directly on a `PrefixStore` (no default group,
no dead rank). A superseded group must not linger:
- NCCL: a collective blocked on a dead peer leaves its kernel on the GPU stream, and every later
  kernel queues behind it; each communicator also holds GPU memory and network resources. So a
  superseded NCCL group is *aborted* (`ncclCommAbort` under the hood, as torchft does when it
  reconfigures) and then dropped, which destroys it. An abort that itself hangs is bounded; the
  group is then kept (never destroyed while it may still run) and the caller is told.
- gloo: its destructor waits for the group's running work, so a superseded gloo group is dropped
  from a daemon thread (`release_in_background`). Its work cannot hang longer than its timeout,
  which the failover collectives bound (`collectives.CollectiveBound`). A group kept alive
  instead would keep its transport thread: with unread data from a dead peer at the head of a
  socket, gloo's event loop spins on it at a full core until that work times out
  (pytorch/gloo#246), and each failure adds one.
The NCCL watchdog policy is set explicitly (`NCCL_POLICY`): on an error or timeout the watchdog
aborts the communicator and the collective fails (the step is redone on the next generation); it
never tears the surviving process down, which torch's default does.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from datetime import timedelta
from typing import Any

NCCL_POLICY: dict[str, str] = {
    # 2 = CleanUpOnly: on an error/timeout seen by the watchdog, abort the communicator and fail
    # the work; do not kill the process (torch's default, 3, kills it: a survivor must live).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # we poll Work.is_completed() and abandon work when the membership changes: never block
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    # the watchdog's own monitor kills a process whose watchdog is stuck (e.g. in an abort that
    # hangs) after this long: a hung survivor is worse than a dead one, its agent restarts it
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600",
}
"""Environment defaults for NCCL process groups (a value the site or user already set wins).
`launch/slurm/pretrain.sbatch` exports the same block; the test suite checks they agree."""

NONBLOCKING_ENV = "MECEFO_NCCL_NONBLOCKING"
"""`0` builds NCCL groups in blocking mode (torch's default); `1` (default) non-blocking, as
torchft does, so that an abort can also interrupt a communicator set-up stuck on a dead peer."""


def apply_nccl_policy(environ: MutableMapping[str, str], timeout_s: float) -> dict[str, str]:
    """Set `NCCL_POLICY` (plus the non-blocking timeout = the collective timeout) in `environ`
    where not already set; returns what it set. Torch reads these when a group is constructed."""
    wanted = {**NCCL_POLICY, "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(int(max(1, timeout_s)))}
    applied = {}
    for key, value in wanted.items():
        if key not in environ:
            environ[key] = applied[key] = value
    return applied


def new_group(backend: str, store, rank: int, size: int, timeout: timedelta):
    """A process group built directly on `store` (no default group, no dead rank involved)."""
    if backend == "nccl":  # explicit watchdog policy, non-blocking communicators
        return new_nccl_group(store, rank, size, timeout)
    import torch.distributed as dist

    return dist.ProcessGroupGloo(store, rank, size, timeout)


def new_nccl_group(store, rank: int, size: int, timeout: timedelta, device=None):
    """A `ProcessGroupNCCL` on `store` for one generation, under the explicit watchdog policy.

    Non-blocking communicators (unless MECEFO_NCCL_NONBLOCKING=0) and, where torch has it, an
    eager connect on this rank's device: a peer that died meanwhile fails the build (which the
    manager bounds and retries on the next generation) instead of the first step's collective.
    """
    import torch
    import torch.distributed as dist

    apply_nccl_policy(os.environ, timeout.total_seconds())
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    config = getattr(opts, "config", None)
    if config is not None and os.environ.get(NONBLOCKING_ENV, "1") != "0":
        config.blocking = False
    group = dist.ProcessGroupNCCL(store, rank, size, opts)
    connect = getattr(group, "eager_connect_single_device", None)
    if connect is not None:
        connect(device if device is not None else torch.device("cuda", torch.cuda.current_device()))
    return group


def retire_group(
    group: Any,
    backend: str,
    graveyard: list[Any],
    *,
    timeout_s: float = 30.0,
    log: Callable[[str], None] = print,
) -> bool:
    """Dispose of a superseded generation's group. NCCL: abort it (bounded by `timeout_s`) and
    drop it; an NCCL abort that did not return in time: keep it in `graveyard`; gloo: drop it
    from a daemon thread (`release_in_background`; the caller must hold no other reference).

    Returns True when the group is gone (aborted and released, or there was none).
    """
    if group is None:
        return True
    if backend != "nccl":
        release_in_background(group)
        return True
    abort = _abort_method(group)
    if abort is None:
        log("[failover] this torch's NCCL group has no abort(); keeping the superseded group")
        graveyard.append(group)
        return False
    errors: list[BaseException] = []

    def run() -> None:
        try:
            abort()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run, name="mecefo-nccl-abort", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log(
            f"[failover] aborting a superseded NCCL group did not finish in {timeout_s:.0f} s; "
            "keeping it (the NCCL watchdog's monitor ends this process if it stays stuck)"
        )
        graveyard.append(group)
        return False
    if errors:  # an abort that raised has still torn the communicator down or never had one
        log(f"[failover] abort of a superseded NCCL group raised: {errors[0]}")
    return True  # no reference kept: the group (and its communicators) is destroyed


def release_in_background(group: Any, *, settle_s: float = 5.0) -> threading.Thread:
    """Drop a superseded gloo group from a daemon thread, so that its destructor (which waits for
    hung work up to the group timeout) never blocks the trainer. The thread first waits (at most
    `settle_s`) until it holds the last Python reference, so the destructor runs there."""
    box = [group]
    del group

    def run() -> None:
        deadline = time.monotonic() + settle_s
        while sys.getrefcount(box[0]) > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        box.clear()

    thread = threading.Thread(target=run, name="mecefo-gloo-release", daemon=True)
    thread.start()
    return thread


def _abort_method(group: Any) -> Callable[[], Any] | None:
    for name in ("abort", "_abort"):
        method = getattr(group, name, None)
        if callable(method):
            return method
    return None
