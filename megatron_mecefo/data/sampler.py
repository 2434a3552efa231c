"""Addressable micro-batch sampler: any rank builds the micro-batch of any (step, dp_rank, micro).

Failover hands a dead replica's micro-batches to survivors, so a micro-batch is a pure function of
its address and the dataset, never of an iterator's position. Global sample position of element j
of micro-batch (step, dp_rank, micro_index):

    step * GBS + (dp_rank * M + micro_index) * mbs + j        (mod len(dataset))

with GBS = mbs * M * num_replicas. A step's micro-batches together cover the positions
[step * GBS, (step + 1) * GBS) whatever the factorisation num_replicas x M, so DP=2 x M=2 and
DP=1 x M=4 train on the same global batch. The dataset (a Megatron GPTDataset) is already shuffled.
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

    def sample_indices(self, step: int, dp_rank: int, micro_index: int) -> list[int]:
        """Dataset indices of micro-batch (step, dp_rank, micro_index)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0 <= dp_rank < self.num_replicas:
            raise ValueError(f"dp_rank {dp_rank} out of range [0, {self.num_replicas})")
        if not 0 <= micro_index < self.num_microbatches:
            raise ValueError(f"micro_index {micro_index} out of range [0, {self.num_microbatches})")
        mbs = self.micro_batch_size
        start = (
            step * self.global_batch_size + (dp_rank * self.num_microbatches + micro_index) * mbs
        )
        n = len(self.dataset)
        return [(start + j) % n for j in range(mbs)]

    def step_indices(self, step: int) -> list[int]:
        """All dataset indices of a step's global batch, in (dp_rank, micro_index) order."""
        return [
            i
            for r in range(self.num_replicas)
            for m in range(self.num_microbatches)
            for i in self.sample_indices(step, r, m)
        ]

    def get(self, step: int, dp_rank: int, micro_index: int) -> dict[str, torch.Tensor]:
        """Collated micro-batch: tokens/labels/position_ids int64 [mbs, S], loss_mask float32."""
        samples = [self.dataset[i] for i in self.sample_indices(step, dp_rank, micro_index)]
        batch = {key: torch.stack([s[key] for s in samples]) for key in BATCH_KEYS}
        for key in ("tokens", "labels", "position_ids"):
            batch[key] = batch[key].to(torch.int64)
        batch["loss_mask"] = batch["loss_mask"].to(torch.float32)
        return batch
