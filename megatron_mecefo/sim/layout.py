"""A real run's layout as the simulator sees it: how many GPUs one failover replica is (TP x PP),
how much state one rank holds, and so how long a standby node takes to bring a lost node's ranks
back (the replacement time), from a run config and a stated network bandwidth.

The state a replacement rank receives from a live peer is its shard of the model and optimizer
(`training/state.py`): with the replicated optimizer 14 bytes per parameter (bf16 weights, fp32
master weights and two fp32 Adam moments), or 2 + 12 / DP with the distributed optimizer.
`GpuMemory` is the resident state of one GPU of the largest pipeline stage (docs/memory.md).
No torch import.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_mecefo.errors import ConfigError

if TYPE_CHECKING:
    from megatron_mecefo.config.run import RunConfig
    from megatron_mecefo.mcore.config import ModelConfig, ParallelConfig

BYTES_PER_PARAM = 14
"""Bytes of transferred state per parameter, replicated optimizer (bf16 2 + fp32 master 4 + Adam
moments 4 + 4)."""
WEIGHT_BYTES = 2
"""bf16 model weights, per parameter."""
GRAD_BYTES = 4
"""fp32 gradient buffer per parameter (megatron DDP, `grad_reduce_in_fp32=True`): full size on
every rank, with or without the distributed optimizer."""
OPTIMIZER_BYTES = 12
"""fp32 master weights + Adam exp_avg + exp_avg_sq, per parameter: on every rank (replicated) or
split over DP (sharded)."""
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


def stage_layers(num_layers: int, parallel: ParallelConfig) -> list[int]:
    """Transformer layers of each pipeline stage, as megatron splits them (an even split, or the
    configured first and last stages and an even split of the rest; `RunConfig` checks it)."""
    pp = parallel.pipeline_model_parallel_size
    first = parallel.num_layers_in_first_pipeline_stage
    last = parallel.num_layers_in_last_pipeline_stage
    middle = num_layers - (first or 0) - (last or 0)
    even = pp - (first is not None) - (last is not None)
    out = [middle // even] * even
    if first is not None:
        out.insert(0, first)
    if last is not None:
        out.append(last)
    return out


def stage_parameters_per_gpu(model: ModelConfig, parallel: ParallelConfig) -> list[int]:
    """Parameters one GPU of each pipeline stage holds. The first stage holds the input
    embedding, the last the final norm and the output layer (untied); every matrix (vocab-parallel
    embedding and output layer, QKV, attention output, SwiGLU fc1 and fc2) is split over TP, the
    RMSNorm weights are whole on every TP rank. Over TP x stages: `model.num_parameters()`."""
    d, f, tp = model.hidden_size, model.ffn_hidden_size, parallel.tensor_model_parallel_size
    groups = model.num_query_groups or model.num_attention_heads
    kv = d // model.num_attention_heads * groups  # width of K (and of V)
    layer_matrices = d * (d + 2 * kv) + d * d + 3 * f * d  # QKV, proj, fc1 (2f x d), fc2
    layer_norms = 2 * d  # before attention, before the MLP
    embedding = model.vocab_size * d
    layers = stage_layers(model.num_layers, parallel)
    out = []
    for i, n in enumerate(layers):
        matrices, norms = n * layer_matrices, n * layer_norms
        if i == 0:
            matrices += embedding
        if i == len(layers) - 1:
            matrices, norms = matrices + embedding, norms + d  # output layer, final norm
        out.append(math.ceil(matrices / tp) + norms)
    return out


@dataclasses.dataclass(frozen=True)
class GpuMemory:
    """Resident training state of one GPU of a run's largest pipeline stage, in bytes:
    bf16 weights, fp32 gradient buffer and Adam state (fp32 master + 2 moments), the optimizer
    replicated on every DP rank or sharded over DP with each shard held by `copies` replicas.
    Activations, communication buffers, the CUDA context and fragmentation are not counted."""

    name: str
    parameters_per_gpu: int
    """Of the largest stage (`stage_parameters_per_gpu`)."""
    tp: int
    pp: int
    dp: int

    @property
    def weights(self) -> float:
        return self.parameters_per_gpu * WEIGHT_BYTES

    @property
    def grads(self) -> float:
        return self.parameters_per_gpu * GRAD_BYTES

    @property
    def optimizer_replicated(self) -> float:
        return self.parameters_per_gpu * OPTIMIZER_BYTES

    def optimizer_sharded(self, copies: int = 1) -> float:
        """Each of DP shards held by `copies` replicas: 12 x copies / DP bytes a parameter."""
        if not 1 <= copies <= self.dp:
            raise ConfigError(f"shard copies must be in [1, DP = {self.dp}], got {copies}")
        return self.parameters_per_gpu * OPTIMIZER_BYTES * copies / self.dp

    def total(self, optimizer: float) -> float:
        """Weights + grads + the given optimizer bytes."""
        return self.weights + self.grads + optimizer


def memory_per_gpu(cfg: RunConfig, world_size: int) -> GpuMemory:
    """The `GpuMemory` of a loaded run config on `world_size` GPUs (DP = world / (TP x PP))."""
    p = cfg.parallel
    per_replica = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if world_size < per_replica or world_size % per_replica:
        raise ConfigError(
            f"world size {world_size} is not a positive multiple of TP x PP = {per_replica}"
        )
    return GpuMemory(
        name=cfg.model.name,
        parameters_per_gpu=max(stage_parameters_per_gpu(cfg.model, p)),
        tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size,
        dp=world_size // per_replica,
    )
