"""Run a function in N real processes wired as a torch.distributed job on localhost.

Free port per job (never a fixed one), a hard timeout that kills every child, and each rank's return
value (or its traceback) handed back to the test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, env, args, queue):
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        import torch

        torch.set_num_threads(1)
        # plain pickle: torch's multiprocessing reducer would pass tensors through shared-memory
        # handles that die with this process before the parent reads them
        queue.put((rank, True, pickle.dumps(fn(rank, *args))))
    except BaseException:  # report everything, including SystemExit, to the parent
        queue.put((rank, False, traceback.format_exc()))


_PRELOAD = ["tests.helpers.preloaded"]


def _context():
    """multiprocessing's forkserver, its server preloaded with torch and megatron-core
    (`preloaded.py`, which refuses to load where a fork would be unsafe): each rank is a fork of
    it, a fresh interpreter's state without the 4-8 s of imports (`test_fork_server.py` shows a
    forked trainer equals a fresh one bit for bit; the golden losses of `test_training.py` too)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Call `fn(rank, *args)` in `world_size` forked processes; return results ordered by rank.

    Raises AssertionError with the failing rank's traceback, or on timeout (children are killed).
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    base_env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    procs = [
        ctx.Process(
            target=_worker, args=(fn, r, world_size, port, base_env, args, queue), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        import queue as queue_mod

        for _ in range(world_size):
            try:
                rank, ok, value = queue.get(timeout=timeout_s)
            except queue_mod.Empty:
                raise AssertionError(f"distributed job timed out after {timeout_s} s") from None
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
