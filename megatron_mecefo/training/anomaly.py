"""Numerical checks of one step attempt on one rank: NaN/Inf in the local loss or in the local
gradients, caught before the reduction mixes them into every replica's update.

The engine asks `reason` after the backward pass and votes the step down when it is set (the
failover rerun, `failover/trainer/rerun.py`, then classifies the fault). `skip` marks
micro-batches classified as bad data: they are replaced by a zero-weight stand-in (the slot stays,
so every member issues the same collectives), and their samples are reported as not trained on.
Injected faults (`--inject nan:...`, `testing/inject.py`) enter through `poison_*`.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class AnomalyGuard:
    """This rank's numerical verdict on the current step attempt."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.reason: str | None = None
        """Why this attempt's local results are not finite, or None."""
        self.skipped: set[tuple[int, int, int]] = set()
        """(step, source replica, micro-batch) classified as bad data: never computed again."""
        self.poison_attempts = 0
        """Injected: poison every micro-batch this rank computes in this many attempts."""
        self.poison_from: int | None = None
        """Injected: poison every micro-batch this rank computes from this step on (a device)."""
        self.poison_data: set[tuple[int, int]] = set()
        """Injected: (step, source replica) whose micro-batches are poison on any rank (data)."""
        self._attempt_poisoned = False

    def begin_attempt(self, step: int) -> None:
        self.reason = None
        self._attempt_poisoned = self.poison_attempts > 0 or (
            self.poison_from is not None and step >= self.poison_from
        )
        if self.poison_attempts > 0:
            self.poison_attempts -= 1

    def poisoned(self, step: int, source: int) -> bool:
        """Does an injected fault turn this micro-batch's output into NaN?"""
        return self._attempt_poisoned or (step, source) in self.poison_data

    def is_skipped(self, step: int, source: int, micro: int) -> bool:
        return (step, source, micro) in self.skipped

    def check_losses(self, losses: list[float]) -> None:
        """The micro-batch losses this rank computed in this attempt."""
        if self.enabled and self.reason is None:
            bad = [x for x in losses if not math.isfinite(x)]
            if bad:
                self.reason = f"loss {bad[0]}"

    def check_grad(self, grad: torch.Tensor) -> None:
        """A local gradient buffer, before it is scaled and reduced."""
        if self.enabled and self.reason is None and not bool(torch.isfinite(grad).all()):
            self.reason = "gradient NaN/Inf"


def fingerprint(tensors) -> int:
    """An order-insensitive integer fingerprint of `tensors`: the sum of their elements' bit
    patterns as integers (int64, wrapping). Any single flipped bit changes it (by +-2^k); it
    costs one read of each tensor and one device sync. Replicas that hold bitwise-equal state
    have equal fingerprints."""
    sums = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.dtype.is_floating_point or flat.dtype == torch.bool:
            ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            flat = flat.view(ints[flat.element_size()])
        sums.append(flat.sum(dtype=torch.int64))
    return int(torch.stack(sums).sum()) if sums else 0


def state_fingerprint(engine: Any) -> int:
    """The fingerprint of this replica's parameters and, with a replicated optimizer, its
    optimizer state (a sharded optimizer's shards differ by design between replicas: they are
    covered by the shard digests of the audit, not here)."""
    from megatron_mecefo.mcore import stack
    from megatron_mecefo.mcore.checkpointing import is_sharded

    params = [p for p in engine.ddp.module.parameters()]
    tensors = list(params)
    if not is_sharded(engine.optimizer):
        tensors += stack.optimizer_tensors(engine.optimizer, params)
    return fingerprint(tensors)
