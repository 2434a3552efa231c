"""The top-level run config: one YAML file under configs/run/ (+ CLI overrides) -> `RunConfig`."""

from __future__ import annotations

import dataclasses

from megatron_mecefo.config.anomaly import AnomalyConfig
from megatron_mecefo.config.checkpoint import CheckpointConfig
from megatron_mecefo.config.failover import FailoverConfig
from megatron_mecefo.config.snapshot import RecoveryConfig, SnapshotConfig
from megatron_mecefo.config.straggler import StragglerConfig
from megatron_mecefo.config.training import TrainingConfig
from megatron_mecefo.data.config import DataConfig
from megatron_mecefo.mcore.config import ModelConfig, ParallelConfig
from megatron_mecefo.mecefo.config import MecefoConfig
from megatron_mecefo.metrics.config import LoggingConfig


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """Everything one training run needs. `model` may name a preset in configs/model/."""

    run_dir: str = "runs/demo"
    """Output directory: config.yaml, env.json, metrics.jsonl, events.jsonl, summary.json."""
    overwrite: bool = False
    """Allow writing into a run_dir that already holds a run (its metrics are replaced)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Model shape (or a preset name such as 'tiny', 'llama-350m')."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Dataset and tokenizer; the embedded demo corpus by default."""
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    """Batch, optimiser and schedule."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """TP/PP layout and backend."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Metric sinks."""
    mecefo: MecefoConfig = dataclasses.field(default_factory=MecefoConfig)
    """MeCeFO degraded-mode switches and takeover policy."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Disk checkpoints (megatron dist_checkpointing) and resume."""
    failover: FailoverConfig = dataclasses.field(default_factory=FailoverConfig)
    """Heartbeats, timeouts and auditing of the failover manager (active under mecefo-launch)."""
    snapshot: SnapshotConfig = dataclasses.field(default_factory=SnapshotConfig)
    """In-memory snapshots (shared memory per node, erasure-coded across nodes)."""
    recovery: RecoveryConfig = dataclasses.field(default_factory=RecoveryConfig)
    """Failover (keep training) or checkpoint-restart, and the recovery order."""
    anomaly: AnomalyConfig = dataclasses.field(default_factory=AnomalyConfig)
    """NaN/Inf and spikes in a step: voted down, rerun and classified inside the job
    (`docs/anomalies.md`)."""
    straggler: StragglerConfig = dataclasses.field(default_factory=StragglerConfig)
    """Replicas persistently slower than their peers get smaller shares (`docs/anomalies.md`)."""

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise ValueError("run_dir must not be empty")
        self._check_stages()
        if self.mecefo.takeover_granularity == "sample" and (
            self.parallel.pipeline_model_parallel_size > 1
        ):
            raise ValueError(
                "mecefo.takeover_granularity: sample needs parallel.pipeline_model_parallel_size "
                "= 1: pipeline stages exchange activations of one fixed micro-batch shape, so a "
                "slice of a micro-batch cannot cross them; use microbatch"
            )
        if self.mecefo.enabled and self.mecefo.takeover_policy == "hybrid":
            self._check_accuracy_costs()

    def _check_stages(self) -> None:
        """The layers split over the pipeline stages as megatron splits them."""
        p, layers = self.parallel, self.model.num_layers
        pp = p.pipeline_model_parallel_size
        first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
        middle = layers - (first or 0) - (last or 0)
        stages = pp - (first is not None) - (last is not None)
        if middle < stages or middle % stages:
            raise ValueError(
                f"model.num_layers ({layers}) does not split over {pp} pipeline stages: "
                f"{middle} layers left for {stages} even stages"
                + (f" after first={first}, last={last}" if first or last else "")
                + "; set parallel.num_layers_in_first/last_pipeline_stage or another PP size"
            )

    def _check_accuracy_costs(self) -> None:
        """hybrid needs a measured accuracy cost for what it may degrade with: fail at start-up,
        not at the first failure."""
        from megatron_mecefo.plan.accuracy import load_accuracy_costs
        from megatron_mecefo.plan.techniques import candidate_techniques

        mec = self.mecefo
        table = load_accuracy_costs(mec.accuracy_costs or None)  # ValueError names the file
        if mec.hybrid_techniques == "auto":
            if not any(table.of(t) is not None for t in candidate_techniques(mec.techniques)):
                raise ValueError(
                    f"mecefo.accuracy_costs ({table.source}) has no cost for any subset of "
                    f"{mec.techniques.key!r}: hybrid_techniques=auto has nothing to choose from"
                )
        elif mec.techniques.names and table.of(mec.techniques) is None:
            raise ValueError(
                f"mecefo.accuracy_costs ({table.source}) has no cost for the configured technique "
                f"set {mec.techniques.key!r}, which hybrid degrades with; measure it with "
                "tools/bench/convergence.py --accuracy-costs or switch the techniques"
            )
