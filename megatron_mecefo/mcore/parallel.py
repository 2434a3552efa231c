"""torch.distributed + megatron parallel_state set-up, returned as an explicit `ParallelContext`.

Works under torchrun (RANK/WORLD_SIZE/MASTER_ADDR env) and as a plain single process (an in-memory
store). On CPU it applies the compatibility layer. Nothing here is kept in module globals except
what megatron's own `parallel_state` keeps.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from megatron_mecefo.errors import DistributedSetupError
from megatron_mecefo.mcore import cpu_compat
from megatron_mecefo.mcore.config import ParallelConfig, check_layout


@dataclasses.dataclass
class ParallelContext:
    """This process's place in the job: the static TP x PP layout of its replica. Who trains
    alongside it (the DP membership) is `training.membership.Membership`, which can change during
    a run."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    backend: str
    device: torch.device
    tp_group: dist.ProcessGroup
    on_cpu: bool
    pp_rank: int = 0
    pp_size: int = 1
    pp_group: dist.ProcessGroup | None = None
    """This replica's pipeline group (all its stages at this TP rank); None without PP."""
    pp_last_rank: int = 0
    """Global rank of the last stage in `pp_group` (where the loss is computed)."""

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one replica (TP x PP)."""
        return self.tp_size * self.pp_size

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def barrier(self) -> None:
        dist.barrier()


def resolve_backend(cfg: ParallelConfig) -> str:
    """`parallel.backend` with auto resolved: nccl with CUDA, gloo without.

    Raises:
        DistributedSetupError: nccl asked for on a machine without CUDA.
    """
    on_cpu = not torch.cuda.is_available()
    backend = cfg.backend if cfg.backend != "auto" else ("gloo" if on_cpu else "nccl")
    if backend == "nccl" and on_cpu:
        raise DistributedSetupError("backend 'nccl' needs CUDA; use parallel.backend=gloo on CPU")
    return backend


def init_parallel(cfg: ParallelConfig) -> ParallelContext:
    """Initialise the default process group (if needed) and megatron's model-parallel groups."""
    from megatron.core import parallel_state as ps

    on_cpu = not torch.cuda.is_available()
    backend = resolve_backend(cfg)
    if on_cpu:
        device = torch.device("cpu")
    else:  # NCCL binds communicators to the current device: set it before the group exists
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        _init_default_group(backend, cfg.timeout_s)
    world = dist.get_world_size()
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    check_layout(world, tp, pp)
    if on_cpu:
        cpu_compat.apply()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            distributed_timeout_minutes=max(1, int(cfg.timeout_s // 60)),
        )
    return ParallelContext(
        rank=dist.get_rank(),
        world_size=world,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=tp,
        backend=backend,
        device=device,
        tp_group=ps.get_tensor_model_parallel_group(),
        on_cpu=on_cpu,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=pp,
        pp_group=ps.get_pipeline_model_parallel_group() if pp > 1 else None,
        pp_last_rank=ps.get_pipeline_model_parallel_last_rank() if pp > 1 else 0,
    )


def data_parallel_layout() -> tuple[int, int, dist.ProcessGroup]:
    """(DP rank, DP size, DP group) of megatron's static layout (the no-failover membership)."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_data_parallel_rank(),
        ps.get_data_parallel_world_size(),
        ps.get_data_parallel_group(),
    )


def _init_default_group(backend: str, timeout_s: float, environ=os.environ) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    store = restart_safe_store(environ)
    if store is not None:
        dist.init_process_group(
            backend,
            store=store,
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    elif "RANK" in environ and "WORLD_SIZE" in environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # a plain `python -m ...` run: one process, no rendezvous needed
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )


def restart_safe_store(environ=os.environ):
    """Under `torchrun --max-restarts` (its agent hosts the store): the agent's store under a
    prefix per restart attempt, else None (the env:// rendezvous as usual). torch 2.13's env://
    rendezvous on the agent's store reuses the first attempt's keys, so a restarted attempt's
    gloo ranks read their predecessors' dead addresses ("Connection refused")."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in environ:
        return None
    agent = dist.TCPStore(
        environ["MASTER_ADDR"],
        int(environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=300),
    )
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"/mecefo/attempt_{attempt}", agent)


def seed_everything(seed: int) -> None:
    """Same seed on every rank: megatron DDP does not broadcast initial weights."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default group (safe to call twice)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def rng_states() -> dict:
    """Every RNG a training step draws from: torch CPU, CUDA (on GPU) and megatron's tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = {
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    """Inverse of `rng_states`."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(states["torch"])
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in states["tracker"].items()})
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
