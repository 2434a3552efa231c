"""A real run's layout as the simulator sees it: how many GPUs one failover replica is (TP x PP),
how much state one rank holds, and so how long a standby node takes to bring a lost node's ranks
back (the replacement time), from a run config and a stated network bandwidth.

The state a replacement rank receives from a live peer is its shard of the model and optimizer
(`training/state.py`): with the replicated optimizer 14 bytes per parameter (bf16 weights, fp32
master weights and two fp32 Adam moments), or 2 + 12 / DP with the distributed optimizer.
No torch import.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_mecefo.errors import ConfigError

BYTES_PER_PARAM = 14
"""Bytes of transferred state per parameter, replicated optimizer (bf16 2 + fp32 master 4 + Adam
moments 4 + 4)."""
DEFAULT_STATE_GBPS = 200.0
"""Assumed network bandwidth per GPU for the state transfer, Gb/s: one 200 Gb/s InfiniBand HDR /
400 Gb/s NDR port per GPU pair is common on H100 nodes. A stated assumption, not a measurement."""


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """One replica of a run: its TP x PP ranks and the state each holds."""

    name: str
    parameters: int
    tp: int
    pp: int
    micro_batch_size: int = 1
    num_microbatches: int = 1
    """Micro-batches per replica per step, when no global batch size is fixed."""
    global_batch_size: int | None = None

    @property
    def gpus(self) -> int:
        """GPUs of one replica (a failover group)."""
        return self.tp * self.pp

    def microbatches(self, num_gpus: int) -> int:
        """M: micro-batches per replica per step of a job of `num_gpus` GPUs."""
        if self.global_batch_size is None:
            return self.num_microbatches
        return max(1, self.global_batch_size // (self.micro_batch_size * (num_gpus // self.gpus)))

    def state_bytes_per_rank(self, bytes_per_param: float = BYTES_PER_PARAM) -> float:
        return self.parameters * bytes_per_param / self.gpus

    def replacement_s(self, base_s: float, gbps: float = DEFAULT_STATE_GBPS) -> float:
        """`base_s` (detection, assignment, warm start: measured on the tiny model, whose state
        transfer is negligible) plus this rank's state over `gbps`."""
        if gbps <= 0:
            raise ConfigError(f"the state bandwidth must be > 0 Gb/s, got {gbps}")
        return base_s + self.state_bytes_per_rank() * 8 / (gbps * 1e9)

    def describe(self, base_s: float, gbps: float) -> str:
        state_gb = self.state_bytes_per_rank() / 1e9
        return (
            f"{self.name}: a replica is {self.gpus} GPUs (TP {self.tp} x PP {self.pp}); "
            f"{state_gb:.1f} GB of state per rank; replacement {base_s:g} s + "
            f"{state_gb:.1f} GB at {gbps:g} Gb/s = {self.replacement_s(base_s, gbps):.1f} s"
        )


def from_run_config(path: str | Path) -> ReplicaLayout:
    """The layout of a `configs/run/*.yaml` (its model preset and parallel sizes)."""
    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig

    cfg = load_config(RunConfig, path)
    p, t = cfg.parallel, cfg.training
    return ReplicaLayout(
        name=cfg.model.name,
        parameters=cfg.model.num_parameters(),
        tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size,
        micro_batch_size=t.micro_batch_size,
        num_microbatches=t.num_microbatches,
        global_batch_size=t.global_batch_size,
    )
