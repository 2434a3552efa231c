"""Numerical checks of one step attempt on one rank, before the reduction mixes its results into
every replica's update:

- NaN/Inf in the local loss or in the local gradients;
- spikes: the mean loss of this rank's micro-batches, or the norm of its local gradients, above
  `factor` x the median of the same statistic over its last committed steps (`SpikeWindow`; the
  factors and why they are what they are: `config/anomaly.py`, `docs/anomalies.md`). The loss is
  checked on every attempt (slices count their share of a micro-batch; a degraded micro-batch's
  forward pass is exact); the gradient norm only on this rank's failure-free work, since a
  takeover or a rebalanced share changes how much a rank sums and which gradients it computes.

The engine asks `record` after the backward pass and votes the step down when it is set (the
failover rerun, `failover/trainer/rerun.py`, then classifies the fault from it). `skip` marks
micro-batches classified as bad data: they are replaced by a zero-weight stand-in (the slot stays,
so every member issues the same collectives), and their samples are reported as not trained on.
Injected faults (`--inject nan:...`, `spike:...`, `testing/inject.py`) enter through `poison_*`.
"""

from __future__ import annotations

import collections
import json
import math
import statistics
from typing import Any

import torch

from megatron_mecefo.config.anomaly import AnomalyConfig

SPIKE = 50.0
"""What an injected spike multiplies a micro-batch's per-token losses (and so its gradients) by."""


class SpikeWindow:
    """One statistic's values on the last `size` committed ordinary steps of this rank."""

    def __init__(self, factor: float, size: int, warmup: int):
        self.factor = factor
        self.warmup = warmup
        self.values: collections.deque[float] = collections.deque(maxlen=size)
        self.peak = 0.0
        """The largest value / median seen on a committed step (how close the run came)."""
        self.checked = 0
        """Committed steps that were checked (the window held `warmup` values)."""

    def median(self) -> float | None:
        return statistics.median(self.values) if len(self.values) >= self.warmup else None

    def limit(self) -> float | None:
        """The value above which this step is a spike; None while warming up or when off."""
        med = self.median()
        return None if med is None or self.factor <= 0 else self.factor * med

    def accept(self, value: float) -> None:
        med = self.median()
        if med is not None and med > 0:
            self.peak = max(self.peak, value / med)
            self.checked += 1
        self.values.append(value)


class AnomalyGuard:
    """This rank's numerical verdict on the current step attempt."""

    def __init__(self, cfg: AnomalyConfig | None = None):
        cfg = cfg or AnomalyConfig()
        self.enabled = cfg.enabled
        self.loss = SpikeWindow(cfg.loss_spike_factor, cfg.spike_window, cfg.spike_warmup)
        self.grad_norm = SpikeWindow(cfg.grad_spike_factor, cfg.spike_window, cfg.spike_warmup)
        self.reason: str | None = None
        """Why this attempt's local results are not to be trusted, or None."""
        self.kind: str | None = None
        """`nan`, `loss` (a loss spike) or `grad` (a gradient-norm spike)."""
        self.limit: float | None = None
        """A loss spike's limit: a peer that recomputes the micro-batches compares with it."""
        self.skipped: set[tuple[int, int, int]] = set()
        """(step, source replica, micro-batch) classified as bad data: never computed again."""
        self.poison_attempts = 0
        """Injected: poison every micro-batch this rank computes in this many attempts."""
        self.poison_from: int | None = None
        """Injected: poison every micro-batch this rank computes from this step on (a device)."""
        self.poison_value = math.nan
        """Injected: what a poisoned micro-batch's per-token losses are multiplied by."""
        self.poison_data: dict[tuple[int, int], float] = {}
        """Injected: (step, source replica) -> multiplier of its micro-batches, on any rank."""
        self._attempt_poisoned = False
        self._losses: list[float] = []
        self._units = 0.0
        self._grad_sq = 0.0

    def begin_attempt(self, step: int) -> None:
        self.reason = self.kind = self.limit = None
        self._losses, self._units, self._grad_sq = [], 0.0, 0.0
        self._attempt_poisoned = self.poison_attempts > 0 or (
            self.poison_from is not None and step >= self.poison_from
        )
        if self.poison_attempts > 0:
            self.poison_attempts -= 1

    def poison(self, step: int, source: int) -> float | None:
        """The multiplier an injected fault applies to this micro-batch's output, or None."""
        if self._attempt_poisoned:
            return self.poison_value
        return self.poison_data.get((step, source))

    def is_skipped(self, step: int, source: int, micro: int) -> bool:
        return (step, source, micro) in self.skipped

    def _flag(self, kind: str, reason: str, limit: float | None = None) -> None:
        if self.reason is None:
            self.kind, self.reason, self.limit = kind, reason, limit

    def check_losses(self, losses: list[float], units: float | None = None) -> None:
        """The losses of the tasks this rank computed in this attempt (a slice's is its share of
        its micro-batch's); `units`: how many whole micro-batches they make (default: one
        each)."""
        self._losses = list(losses)
        self._units = float(len(losses) if units is None else units)
        if self.enabled:
            bad = [x for x in losses if not math.isfinite(x)]
            if bad:
                self._flag("nan", f"loss {bad[0]}")

    def check_grad(self, grad: torch.Tensor) -> None:
        """A local gradient buffer, before it is scaled and reduced: one pass gives its norm,
        which is NaN/Inf when an element is (or when the norm overflows: a spike past measure)."""
        if not self.enabled:
            return
        norm = float(torch.linalg.vector_norm(grad))
        if not math.isfinite(norm):
            self._flag("nan", "gradient NaN/Inf")
        else:
            self._grad_sq += norm * norm

    def check_spikes(self, loss_ok: bool, grad_ok: bool) -> None:
        """After the backward pass: is this attempt's loss (if `loss_ok`: no micro-batch skipped)
        or gradient norm (if `grad_ok`: the failure-free work) a spike?"""
        if not self.enabled or self.reason is not None:
            return
        loss, norm = self._stats()
        limit = self.loss.limit()
        if loss_ok and loss is not None and limit is not None and loss > limit:
            self._flag("loss", f"loss spike {loss:.4g} > {self._why(self.loss)}", limit)
            return
        limit = self.grad_norm.limit()
        if grad_ok and limit is not None and norm > limit:
            self._flag("grad", f"gradient-norm spike {norm:.4g} > {self._why(self.grad_norm)}")

    def accept(self, loss_ok: bool, grad_ok: bool) -> None:
        """The attempt committed: the statistics it was judged on join their windows."""
        if not self.enabled:
            return
        loss, norm = self._stats()
        if loss_ok and loss is not None:
            self.loss.accept(loss)
        if grad_ok:
            self.grad_norm.accept(norm)

    def record(self, tasks, losses) -> str | None:
        """What this rank found, for the commit vote and the rerun (JSON), or None. `tasks`: the
        (source replica, micro-batch) of each task it ran; `losses`: each task's mean loss (None
        off the last pipeline stage). The rerun judges and skips those tasks, wherever their data
        came from (a straggler's share, a dead replica's)."""
        if self.reason is None:
            return None
        return json.dumps(
            {
                "what": self.reason,
                "kind": self.kind,
                "limit": self.limit,
                "tasks": [list(t) for t in tasks],
                "losses": losses,
            }
        )

    def peaks(self) -> dict[str, Any]:
        """How close this rank's committed steps came to the spike limits (summary.json's
        `spike_peaks`, the leader's): the largest value / median of each statistic."""
        return {
            "loss": round(self.loss.peak, 4) if self.loss.checked else None,
            "grad_norm": round(self.grad_norm.peak, 4) if self.grad_norm.checked else None,
            "steps_checked": max(self.loss.checked, self.grad_norm.checked),
        }

    def _stats(self) -> tuple[float | None, float]:
        loss = sum(self._losses) / self._units if self._losses and self._units else None
        return loss, math.sqrt(self._grad_sq)

    @staticmethod
    def _why(w: SpikeWindow) -> str:
        return f"{w.factor:g} x median {w.median():.4g} of the last {len(w.values)} steps"


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
