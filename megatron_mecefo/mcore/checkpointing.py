"""megatron-core `dist_checkpointing` for the whole training state: model and optimizer as sharded
tensors (resharding across TP on load), the RNG states as one sharded object per TP rank, and the
next step. Synchronous or asynchronous (background writer processes) save.

Collective over torch.distributed's default group: every rank of that group calls these together
(under failover that group is one replica's TP ranks, so one replica saves for the job).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_mecefo.control import proc
from megatron_mecefo.mcore.parallel import rng_states, set_rng_states


def is_sharded(optimizer: Any) -> bool:
    """The distributed optimizer (`optim/sharded.py`), whose shards are saved as files."""
    return hasattr(optimizer, "held")


def stage_and_tp_rank() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()


def _sharded_state(engine: Any, next_step: int, *, is_loading: bool, with_rng: bool) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model_sd = engine.ddp.module.sharded_state_dict()
    state = {"model": model_sd, "next_step": next_step}
    if not is_sharded(engine.optimizer):  # sharded: per-shard files (`optim/shard_files.py`)
        state["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    if with_rng:  # one RNG state per (PP stage, TP rank); without PP the earlier (TP,) shape
        tp, pp = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
        )
        pp_rank, tp_rank = stage_and_tp_rank()
        shape, offset = ((tp,), (tp_rank,)) if pp == 1 else ((pp, tp), (pp_rank, tp_rank))
        state["rng"] = ShardedObject(
            "rng_state",
            rng_states(),
            shape,
            offset,
            replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
        )
    return state


def save(engine: Any, folder: str, next_step: int, *, async_save: bool):
    """Write the state into `folder` (must exist). Returns an AsyncRequest when `async_save`."""
    from megatron.core import dist_checkpointing

    start_writer_queue_ignoring_stop_signals()  # before megatron spawns it with the defaults
    state = _sharded_state(engine, next_step, is_loading=False, with_rng=True)
    return dist_checkpointing.save(state, folder, async_sharded_save=async_save)


def load(engine: Any, folder: str, *, with_rng: bool = True) -> int:
    """Load `folder` into the engine (model, optimizer, RNG); returns the next step to run.

    `with_rng=False` keeps this process's RNG (a checkpoint written with another TP size has no
    RNG shard for this rank's layout).
    """
    from megatron.core import dist_checkpointing

    state = _sharded_state(engine, 0, is_loading=True, with_rng=with_rng)
    loaded = dist_checkpointing.load(state, folder)
    engine.ddp.module.load_state_dict(loaded["model"])
    if is_sharded(engine.optimizer):
        engine.optimizer.load_checkpoint(folder, *stage_and_tp_rank())
    else:
        engine.optimizer.load_state_dict(loaded["optimizer"])
    if with_rng:
        set_rng_states(loaded["rng"])
    engine.controller.clear_caches()
    return int(loaded["next_step"])


class AsyncSaves:
    """The queue of in-flight async saves; `poll` finalizes the finished ones (all ranks of the
    default group call it at the same points: it agrees on completion with a collective)."""

    def __init__(self) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self._queue = AsyncCallsQueue()

    def schedule(self, request, on_done: Callable[[], None]) -> None:
        request.add_finalize_fn(on_done)
        self._queue.schedule_async_request(request)

    def poll(self, *, blocking: bool = False) -> int:
        """Finalize completed saves (or wait for all with `blocking`); returns how many finished."""
        return len(self._queue.maybe_finalize_async_calls(blocking=blocking))

    @property
    def pending(self) -> int:
        return self._queue.get_num_unfinalized_calls()

    def close(self) -> None:
        self._queue.close()


def default_group_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def start_writer_queue_ignoring_stop_signals() -> None:
    """Start megatron's checkpoint-result queue (once per process) with SIGUSR1 and SIGTERM
    ignored.

    megatron's writer collects results through a Manager process that it *spawns* on first use
    (`filesystem_async._get_write_results_queue`). A spawned process starts with the default
    actions, and Slurm delivers a stop signal to every process of the step: SIGUSR1 (the stop
    before the time limit) or SIGTERM (scancel, preemption) would kill that Manager, and the
    final checkpoint of the graceful stop would fail ("Connection refused"). A disposition of
    SIG_IGN survives exec, so a Manager started here outlives both. It dies with the rank
    (PDEATHSIG): a rank SIGKILLed alone, as a failover test or a benchmark kills it, left its
    Manager, and through it multiprocessing's resource tracker, running for good.
    """
    import signal
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    use_short_socket_dir()
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:  # what megatron's `_get_write_results_queue` makes, behind `PickledQueue`
        manager = SyncManager(ctx=torch.multiprocessing.get_context("spawn"))
        manager.start(initializer=proc.die_with, initargs=(os.getpid(),))
        filesystem_async._results_queue = PickledQueue(manager.Queue())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class PickledQueue:
    """A queue whose items cross it as pickled bytes: the `put` and `get_nowait` that megatron's
    async writer calls on its result queue.

    That queue lives in a Manager process, which holds real objects: the writer's results
    (`torch.distributed.checkpoint` `WriteResult`s) made it import torch at the first save, 1.1 s
    of CPU in every process that saves asynchronously. As bytes, they never leave the
    interpreters that pickle and unpickle them, both of which have torch already."""

    def __init__(self, inner):
        self.inner = inner

    def put(self, item, *args, **kwargs) -> None:
        self.inner.put(pickle.dumps(item), *args, **kwargs)

    def get_nowait(self):
        return pickle.loads(self.inner.get_nowait())


SOCKET_DIR_MAX = 60
"""Longest temporary directory for multiprocessing's sockets: it adds `/pymp-XXXXXXXX/listener-
XXXXXXXX` (~40 bytes) and AF_UNIX paths end at 107 bytes."""


def use_short_socket_dir(environ=os.environ) -> str:
    """Point the temporary directory at /tmp, here and for the processes started from here
    (megatron's result-queue Manager is spawned: it reads $TMPDIR), when it is too long for a
    socket path (a long TMPDIR failed every async save: "AF_UNIX path too long"); returns the
    directory in use."""
    import tempfile

    current = tempfile.gettempdir()
    if len(current) > SOCKET_DIR_MAX and os.access("/tmp", os.W_OK):
        tempfile.tempdir = environ["TMPDIR"] = "/tmp"
        return "/tmp"
    return current
