"""What one data-parallel rank computes in one step: the seam between the trainer and failover.

A `RankStepPlan` lists the micro-batches a rank runs (whose data, which index, exact or degraded)
and the gradient scaling that keeps global-batch semantics when replicas are missing. Pure data.
A task may be a *slice* of a micro-batch (`samples=(start, stop)`, `takeover_granularity:
sample`): it runs those samples only, and its loss counts them as their share of the whole
micro-batch (token sum over the slice / tokens of the whole micro-batch), so the slices of one
micro-batch add up to exactly that micro-batch's contribution.

Scaling contract (DESIGN.md section 3): every micro-batch loss is scaled by
`1/microbatches_per_replica` whatever the number of micro-batches the rank runs, so a rank covering
another counts as two replicas' worth. Before the single all-reduce (SUM) every rank multiplies its
local gradients by `1/num_replicas` (ordinary parameters) or `masked_scale` (attention and
input-norm parameters, which degraded micro-batches do not produce): `masked_scale = M / E`, with
E = exact micro-batches in the whole group this step, i.e. the average over the replicas-worth that
actually computed them. With E = 0 nobody computed them: the step holds those parameters
(`holds_masked_params`) instead of letting AdamW's momentum move them on a zero gradient.
"""

from __future__ import annotations

import dataclasses

from megatron_mecefo.plan.techniques import DegradedTechniques


@dataclasses.dataclass(frozen=True)
class MicroBatchTask:
    """One micro-batch of work."""

    source_dp_rank: int
    """Logical replica whose data this is (index into the original `num_replicas`)."""
    micro_index: int
    """Micro-batch index within that replica's share of the global batch."""
    degraded: bool = False
    """Run in MeCeFO degraded mode (attention-backward skip, FFN recompute, low-rank FFN grads)."""
    techniques: DegradedTechniques | None = None
    """Degraded only: the techniques this micro-batch uses (chosen by `hybrid` with
    `mecefo.hybrid_techniques: auto`); None = every technique the `mecefo` config switches on."""
    samples: tuple[int, int] | None = None
    """A slice: samples [start, stop) of the micro-batch (0 <= start < stop <= micro-batch
    size); None = the whole micro-batch."""

    def __post_init__(self) -> None:
        if self.techniques is not None and not self.degraded:
            raise ValueError("an exact micro-batch (degraded=False) cannot carry techniques")
        if self.samples is not None:
            start, stop = self.samples
            if not 0 <= start < stop:
                raise ValueError(f"a slice needs 0 <= start < stop, got samples={self.samples}")

    @property
    def is_slice(self) -> bool:
        """Runs only part of its micro-batch."""
        return self.samples is not None

    def num_samples(self, micro_batch_size: int) -> int:
        """Samples this task runs, out of a micro-batch of `micro_batch_size`."""
        if self.samples is None:
            return micro_batch_size
        if self.samples[1] > micro_batch_size:
            raise ValueError(
                f"slice {self.samples} exceeds the micro-batch size {micro_batch_size}"
            )
        return self.samples[1] - self.samples[0]

    @property
    def skips_attention(self) -> bool:
        """Produces no attention / input-norm gradients (for masked averaging). A degraded task
        with `techniques=None` counts as skipping, as the configured default does."""
        if not self.degraded:
            return False
        return self.techniques is None or self.techniques.skip_attention_backward


@dataclasses.dataclass(frozen=True)
class RankStepPlan:
    """All work of one rank for one step, plus its gradient scaling."""

    tasks: tuple[MicroBatchTask, ...]
    num_replicas: int
    """n: replicas in the failure-free job; ordinary gradients are averaged over n."""
    microbatches_per_replica: int
    """M: loss scaling is 1/M per micro-batch."""
    masked_scale: float | None = None
    """Pre-reduction scale of attention/input-norm grads; None means 1/num_replicas (no masking)."""
    micro_batch_size: int | None = None
    """Samples per micro-batch; needed (and checked) when a task is a slice, None otherwise."""

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.microbatches_per_replica < 1:
            raise ValueError("num_replicas and microbatches_per_replica must be >= 1")
        if any(t.is_slice for t in self.tasks):
            if self.micro_batch_size is None or self.micro_batch_size < 1:
                raise ValueError("a plan with slices needs micro_batch_size >= 1")
            for t in self.tasks:
                t.num_samples(self.micro_batch_size)  # raises on a slice past the micro-batch

    @property
    def grad_scale(self) -> float:
        return 1.0 / self.num_replicas

    @property
    def attention_grad_scale(self) -> float:
        return self.grad_scale if self.masked_scale is None else self.masked_scale

    @property
    def holds_masked_params(self) -> bool:
        """No member computes attention / input-norm gradients this step (E = 0,
        `masked_scale` 0.0): the optimizer must leave those parameters and their moments as they
        are. A zero gradient is not enough: AdamW would still move them along its momentum."""
        return self.masked_scale == 0.0

    @property
    def num_degraded(self) -> int:
        return sum(t.degraded for t in self.tasks)

    def task_fraction(self, task: MicroBatchTask) -> float:
        """The share of a whole micro-batch that `task` runs (1.0 unless it is a slice)."""
        if task.samples is None:
            return 1.0
        return task.num_samples(self.micro_batch_size) / self.micro_batch_size

    @property
    def microbatch_equivalents(self) -> float:
        """Work in whole micro-batches (slices count their share)."""
        return sum(self.task_fraction(t) for t in self.tasks)


def failure_free_plan(dp_rank: int, num_replicas: int, num_microbatches: int) -> RankStepPlan:
    """The ordinary plan: rank `dp_rank` runs its own `num_microbatches` micro-batches, exact."""
    tasks = tuple(MicroBatchTask(dp_rank, i) for i in range(num_microbatches))
    return RankStepPlan(
        tasks=tasks, num_replicas=num_replicas, microbatches_per_replica=num_microbatches
    )
