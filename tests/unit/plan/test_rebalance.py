"""Uneven shares for a straggler (`plan/rebalance.py`): every sample of the global batch exactly
once, exact tasks only, shares in proportion to the speeds, and the failure-free plans back when
the speeds are equal."""

from __future__ import annotations

from collections import Counter

import pytest

from megatron_mecefo.plan.rebalance import rebalanced_plans, sample_shares
from megatron_mecefo.plan.step_plan import failure_free_plan


def _samples(plans, b):
    seen = Counter()
    for plan in plans.values():
        for t in plan.tasks:
            lo, hi = t.samples or (0, b)
            seen.update((t.source_dp_rank, t.micro_index, s) for s in range(lo, hi))
    return seen


@pytest.mark.parametrize(
    "speeds, m, b",
    [
        ({0: 1.0, 1: 1.0, 2: 0.5, 3: 1.0}, 2, 4),
        ({0: 0.4, 1: 1.0}, 3, 8),
        ({0: 1.0, 1: 0.9, 2: 0.3}, 1, 5),
        ({0: 1.0, 1: 1.0, 2: 1.0, 3: 0.01}, 2, 1),  # micro-batches of one sample
    ],
)
def test_every_sample_once_exactly_and_shares_follow_the_speeds(speeds, m, b):
    plans = rebalanced_plans(speeds, num_microbatches=m, micro_batch_size=b)
    n = len(speeds)
    seen = _samples(plans, b)
    assert set(seen.values()) == {1} and len(seen) == n * m * b
    assert not any(t.degraded for p in plans.values() for t in p.tasks)
    shares = {r: sum(t.num_samples(b) for t in p.tasks) for r, p in plans.items()}
    assert shares == sample_shares(speeds, n * m * b)
    total = sum(speeds.values())
    for r, v in speeds.items():
        assert abs(shares[r] - n * m * b * v / total) < 1.0 or shares[r] == 1, (r, shares)
    for p in plans.values():
        assert p.num_replicas == n and p.microbatches_per_replica == m and p.masked_scale is None


def test_a_half_speed_replica_keeps_its_first_samples_and_hands_out_the_rest():
    plans = rebalanced_plans(
        {0: 1.0, 1: 1.0, 2: 0.5, 3: 1.0}, num_microbatches=2, micro_batch_size=4
    )
    # 32 samples: 9, 9, 5, 9. Replica 2 keeps micro-batch 0 and sample 0 of micro-batch 1
    assert [(t.source_dp_rank, t.micro_index, t.samples) for t in plans[2].tasks] == [
        (2, 0, None),
        (2, 1, (0, 1)),
    ]
    taken = [(r, t.micro_index, t.samples) for r in (0, 1, 3) for t in plans[r].tasks[2:]]
    assert taken == [(0, 1, (1, 2)), (1, 1, (2, 3)), (3, 1, (3, 4))]


def test_equal_speeds_give_the_failure_free_plans():
    plans = rebalanced_plans({r: 2.0 for r in range(3)}, num_microbatches=2, micro_batch_size=4)
    for r, p in plans.items():
        assert p.tasks == failure_free_plan(r, 3, 2).tasks


def test_bad_speeds_are_refused():
    with pytest.raises(ValueError, match="speed > 0"):
        sample_shares({0: 1.0, 1: 0.0}, 8)
    with pytest.raises(ValueError, match="every replica"):
        rebalanced_plans({0: 1.0, 2: 1.0}, num_microbatches=1, micro_batch_size=2)


def test_with_pipeline_stages_shares_are_whole_micro_batches():
    """`whole_microbatches` (PP > 1: the stages exchange one fixed micro-batch shape): no slice,
    every micro-batch once, each replica's count in proportion to its speed."""
    speeds = {0: 1.0, 1: 0.5}
    plans = rebalanced_plans(
        speeds, num_microbatches=4, micro_batch_size=4, whole_microbatches=True
    )
    assert not any(t.is_slice for p in plans.values() for t in p.tasks)
    assert all(p.micro_batch_size is None for p in plans.values())
    seen = Counter((t.source_dp_rank, t.micro_index) for p in plans.values() for t in p.tasks)
    assert set(seen.values()) == {1} and len(seen) == 8
    assert {r: len(p.tasks) for r, p in plans.items()} == sample_shares(speeds, 8) == {0: 5, 1: 3}
    sliced = rebalanced_plans(speeds, num_microbatches=4, micro_batch_size=4)
    assert any(t.is_slice for p in sliced.values() for t in p.tasks)  # in samples, it would cut
