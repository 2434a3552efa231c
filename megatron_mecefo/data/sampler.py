"""Addressable micro-batch sampler: any rank builds the micro-batch of any (step, dp_rank, micro).

Failover hands a dead replica's micro-batches to survivors, so a micro-batch is a pure function of
its address and the dataset, never of an iterator's position. Global sample position of element j
of micro-batch (step, dp_rank, micro_index):

    step * GBS + (dp_rank * M + micro_index) * mbs + j        (mod len(dataset))

with GBS = mbs * M * num_replicas. A step's micro-batches together cover the positions
[step * GBS, (step + 1) * GBS) whatever the factorisation num_replicas x M, so DP=2 x M=2 and
DP=1 x M=4 train on the same global batch. The dataset (a Megatron GPTDataset) is already shuffled.
A slice (`samples=(start, stop)`, sample-granular takeover) is elements start..stop-1 of the
micro-batch; `loss_tokens` gives the whole micro-batch's loss-token count, the denominator that
makes a slice's loss its exact share of the micro-batch's.
"""

from __future__ import annotations

import torch

from megatron_mecefo.errors import DataError

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class MicroBatchSampler:
    """Maps (step, dp_rank, micro_index) to sample indices and collated tensors."""

    def __init__(
        self, dataset, *, micro_batch_size: int, num_microbatches: int, num_replicas: int
    ) -> None:
        """
        Args:
            dataset: map-style dataset whose items hold `BATCH_KEYS` tensors of shape [S].
            micro_batch_size: samples per micro-batch (mbs).
            num_microbatches: micro-batches per replica per step (M).
            num_replicas: data-parallel replicas of the failure-free job (n).
        """
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("num_microbatches", num_microbatches),
            ("num_replicas", num_replicas),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if len(dataset) == 0:
            raise DataError("the dataset has no samples; use more data or a shorter seq_length")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.num_microbatches = num_microbatches
        self.num_replicas = num_replicas

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.num_replicas

    def sample_indices(
        self,
        step: int,
        dp_rank: int,
        micro_index: int,
        samples: tuple[int, int] | None = None,
    ) -> list[int]:
        """Dataset indices of micro-batch (step, dp_rank, micro_index), or of its slice
        `samples` = [start, stop) (0 <= start < stop <= micro_batch_size)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0 <= dp_rank < self.num_replicas:
            raise ValueError(f"dp_rank {dp_rank} out of range [0, {self.num_replicas})")
        if not 0 <= micro_index < self.num_microbatches:
            raise ValueError(f"micro_index {micro_index} out of range [0, {self.num_microbatches})")
        mbs = self.micro_batch_size
        first, stop = (0, mbs) if samples is None else samples
        if not 0 <= first < stop <= mbs:
            raise ValueError(f"slice {samples} out of range: need 0 <= start < stop <= {mbs}")
        start = (
            step * self.global_batch_size + (dp_rank * self.num_microbatches + micro_index) * mbs
        )
        n = len(self.dataset)
        return [(start + j) % n for j in range(first, stop)]

    def step_indices(self, step: int) -> list[int]:
        """All dataset indices of a step's global batch, in (dp_rank, micro_index) order."""
        return [
            i
            for r in range(self.num_replicas)
            for m in range(self.num_microbatches)
            for i in self.sample_indices(step, r, m)
        ]

    def get(
        self,
        step: int,
        dp_rank: int,
        micro_index: int,
        samples: tuple[int, int] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Collated micro-batch (or its slice `samples`): tokens/labels/position_ids int64
        [mbs or stop - start, S], loss_mask float32."""
        items = [self.dataset[i] for i in self.sample_indices(step, dp_rank, micro_index, samples)]
        batch = {key: torch.stack([s[key] for s in items]) for key in BATCH_KEYS}
        for key in ("tokens", "labels", "position_ids"):
            batch[key] = batch[key].to(torch.int64)
        batch["loss_mask"] = batch["loss_mask"].to(torch.float32)
        return batch

    def loss_tokens(self, step: int, dp_rank: int, micro_index: int) -> float:
        """Sum of the whole micro-batch's `loss_mask` (at least 1): the token mean's denominator
        of every slice of it. The mask is 0/1, so the sum is an exact integer in float32 whatever
        the order of summation, equal to what the whole micro-batch's loss divides by."""
        indices = self.sample_indices(step, dp_rank, micro_index)
        total = sum(float(self.dataset[i]["loss_mask"].float().sum()) for i in indices)
        return max(total, 1.0)
