"""Uneven shares for a straggler (pure; no torch): every replica alive, each one's share of the
global batch's samples in proportion to its measured speed.

The global batch is unchanged (n x M micro-batches of b samples, each sample run exactly once)
and every task is exact, so the update is the failure-free one up to the order of summation. A
replica whose share is under its M x b own samples keeps its first ones (whole micro-batches,
then a slice) and hands the rest out; replicas over it take them, in (replica, micro-batch,
sample) order, cut as takeover's sample granularity cuts (`plan/takeover.py`): a slice never
crosses a micro-batch. With pipeline stages (`whole_microbatches`) shares come in whole
micro-batches instead: the stages exchange activations of one fixed micro-batch shape.
"""

from __future__ import annotations

import math

from megatron_mecefo.plan.step_plan import MicroBatchTask, RankStepPlan


def sample_shares(speeds: dict[int, float], total: int) -> dict[int, int]:
    """`total` samples split in proportion to `speeds` (largest remainder; ties to the lower
    replica), at least one each."""
    if not speeds or any(not v > 0 for v in speeds.values()):
        raise ValueError(f"every replica needs a speed > 0, got {speeds}")
    if total < len(speeds):
        raise ValueError(f"{total} samples cannot give {len(speeds)} replicas one each")
    whole = sum(speeds.values())
    raw = {r: total * v / whole for r, v in speeds.items()}
    shares = {r: max(1, math.floor(x)) for r, x in raw.items()}
    by_remainder = sorted(speeds, key=lambda r: (-(raw[r] - math.floor(raw[r])), r))
    k = 0
    while sum(shares.values()) < total:
        shares[by_remainder[k % len(by_remainder)]] += 1
        k += 1
    while sum(shares.values()) > total:  # the floor of one was raised to 1
        r = max(shares, key=lambda r: (shares[r] - raw[r], r))
        shares[r] -= 1
    return shares


def rebalanced_plans(
    speeds: dict[int, float],
    *,
    num_microbatches: int,
    micro_batch_size: int,
    whole_microbatches: bool = False,
) -> dict[int, RankStepPlan]:
    """One plan per replica of `speeds` (all of the job's replicas, alive); shares in whole
    micro-batches when `whole_microbatches` (pipeline stages), else in samples."""
    n, m = len(speeds), num_microbatches
    b = 1 if whole_microbatches else micro_batch_size  # the unit a share counts in, per micro-batch
    if sorted(speeds) != list(range(n)):
        raise ValueError(f"rebalancing needs every replica 0..{n - 1}, got {sorted(speeds)}")
    own = m * b
    shares = sample_shares(speeds, n * own)
    tasks: dict[int, list[MicroBatchTask]] = {r: [] for r in range(n)}
    given: list[tuple[int, int, int, int]] = []  # (replica, micro-batch, start, stop) handed out
    for r in range(n):
        keep = min(shares[r], own)
        for i in range(m):
            lo, hi = i * b, (i + 1) * b
            mine = (lo, min(hi, keep)) if keep > lo else None
            if mine is not None:
                tasks[r].append(_task(r, i, mine[0] - lo, mine[1] - lo, b))
            if keep < hi:
                given.append((r, i, max(lo, keep) - lo, b))
    cursor = 0
    for r in range(n):
        need = shares[r] - own
        while need > 0:
            src, i, start, stop = given[cursor]
            take = min(need, stop - start)
            tasks[r].append(_task(src, i, start, start + take, b))
            need -= take
            if start + take == stop:
                cursor += 1
            else:
                given[cursor] = (src, i, start + take, stop)
    assert cursor == len(given), "every handed-out sample is taken once"
    sliced = any(t.is_slice for ts in tasks.values() for t in ts)
    return {
        r: RankStepPlan(
            tasks=tuple(tasks[r]),
            num_replicas=n,
            microbatches_per_replica=m,
            micro_batch_size=micro_batch_size if sliced else None,
        )
        for r in range(n)
    }


def _task(src: int, i: int, start: int, stop: int, b: int) -> MicroBatchTask:
    if (start, stop) == (0, b):
        return MicroBatchTask(src, i)
    return MicroBatchTask(src, i, False, None, (start, stop))
