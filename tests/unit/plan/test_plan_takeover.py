"""Takeover planner: coverage of the global batch, modes per policy, gradient-scaling contract."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_mecefo.plan.cost import LLAMA_350M_SHAPE, CostModel, microbatch_flops
from megatron_mecefo.plan.takeover import make_step_plans, neighbor_of, plan_step_times

COST = CostModel()  # FLOP defaults: degraded ~0.73 of an exact micro-batch


def _plans(alive, n, m, policy, cost=COST, target=1.15):
    return make_step_plans(
        alive=alive,
        num_replicas=n,
        num_microbatches=m,
        policy=policy,
        cost=cost,
        target_ratio=target,
    )


def _check_coverage(plans, n, m):
    """Every (replica, micro-batch) of the failure-free job runs exactly once."""
    seen = [(t.source_dp_rank, t.micro_index) for p in plans.values() for t in p.tasks]
    assert sorted(seen) == [(r, i) for r in range(n) for i in range(m)]
    for p in plans.values():
        assert p.num_replicas == n and p.microbatches_per_replica == m
        assert p.grad_scale == pytest.approx(1 / n)


@pytest.mark.parametrize("policy", ["neighbor", "spread", "hybrid"])
def test_failure_free_plan_is_plain(policy):
    plans = _plans(range(4), 4, 3, policy)
    _check_coverage(plans, 4, 3)
    for r, p in plans.items():
        assert [(t.source_dp_rank, t.degraded) for t in p.tasks] == [(r, False)] * 3
        assert p.masked_scale is None and p.attention_grad_scale == pytest.approx(1 / 4)


def test_neighbor_of_ring_order_and_wraparound():
    assert neighbor_of(2, [0, 1, 3], 4) == 3
    assert neighbor_of(3, [0, 1, 2], 4) == 0
    assert neighbor_of(1, [0, 3], 4) == 3  # 2 also dead: skip it
    assert neighbor_of(0, [2], 4) == 2


def test_neighbor_single_failure_matches_mecefo():
    n, m = 4, 3
    plans = _plans([0, 1, 3], n, m, "neighbor")
    _check_coverage(plans, n, m)
    assert [t.degraded for t in plans[3].tasks] == [True] * 6  # covers 2: everything degraded
    assert [t.source_dp_rank for t in plans[3].tasks] == [3] * 3 + [2] * 3  # own first
    assert all(not t.degraded for r in (0, 1) for t in plans[r].tasks)
    # masked averaging over N = healthy non-covering replicas {0, 1}: 1/|N|
    assert plans[0].masked_scale == pytest.approx(1 / 2)
    assert len({p.masked_scale for p in plans.values()}) == 1


def test_neighbor_two_dead_in_a_row_and_all_but_one():
    plans = _plans([0, 3], 4, 2, "neighbor")  # 1 and 2 dead: both go to 3
    _check_coverage(plans, 4, 2)
    assert len(plans[3].tasks) == 6 and plans[3].num_degraded == 6
    assert plans[0].num_degraded == 0 and plans[0].masked_scale == pytest.approx(1.0)
    plans = _plans([1], 4, 2, "neighbor")  # the lone survivor covers everyone
    _check_coverage(plans, 4, 2)
    assert plans[1].num_degraded == 8
    assert plans[1].masked_scale == 0.0  # no exact micro-batch: attention grads are zero


def test_spread_balances_exact_work():
    n, m = 4, 4
    plans = _plans([0, 1, 3], n, m, "spread")
    _check_coverage(plans, n, m)
    loads = sorted(len(p.tasks) for p in plans.values())
    assert loads == [5, 5, 6] and all(p.num_degraded == 0 for p in plans.values())
    assert max(loads) == m + -(-m // (n - 1))  # M + ceil(M / (n - 1)), as in DESIGN.md
    assert plans[3].tasks[4].source_dp_rank == 2  # the ring neighbour gets the first orphan
    assert all(p.masked_scale is None for p in plans.values())


def test_hybrid_degrades_only_what_the_target_needs():
    n, m = 4, 4
    cost = CostModel(exact_microbatch_s=1.0, degraded_microbatch_s=0.6, step_overhead_s=0.0)
    plans = _plans([0, 1, 3], n, m, "hybrid", cost=cost, target=1.15)
    _check_coverage(plans, n, m)
    times = plan_step_times(plans, cost)
    normal = cost.step_time(m)
    assert max(times.values()) <= 1.15 * normal + 1e-9
    # 6 tasks: (6 - k) + 0.6 k <= 4.6 -> k = 4; 5 tasks: k = 1 (minimal counts)
    assert sorted(p.num_degraded for p in plans.values()) == [1, 1, 4]
    # taken-over micro-batches are degraded before own ones
    for r, p in plans.items():
        flags = [t.degraded for t in p.tasks]
        assert flags == sorted(flags)
        if p.num_degraded <= len(p.tasks) - m:
            assert all(t.source_dp_rank != r for t in p.tasks if t.degraded)
    exact = sum(len(p.tasks) - p.num_degraded for p in plans.values())
    assert plans[0].masked_scale == pytest.approx(m / exact)


def test_hybrid_is_exact_when_spread_already_fits():
    plans = _plans([r for r in range(32) if r != 5], 32, 8, "hybrid")
    assert all(p.num_degraded == 0 for p in plans.values())  # 9/8 = 1.125 <= 1.15
    assert all(p.masked_scale is None for p in plans.values())


def test_hybrid_never_slower_than_spread_or_neighbor():
    cost = CostModel.from_flops(
        microbatch_flops(
            **LLAMA_350M_SHAPE,
            micro_batch_size=4,
        ),
        step_overhead_fraction=0.2,
    )
    for n, m in [(4, 4), (8, 8), (32, 8)]:
        alive = list(range(1, n))
        worst = {
            pol: max(plan_step_times(_plans(alive, n, m, pol, cost=cost), cost).values())
            for pol in ("neighbor", "spread", "hybrid")
        }
        assert worst["hybrid"] <= worst["spread"] + 1e-9
        assert worst["hybrid"] <= worst["neighbor"] + 1e-9


def test_randomized_alive_sets_keep_the_contract():
    rng = random.Random(0)
    for _ in range(200):
        n, m = rng.randint(1, 8), rng.randint(1, 5)
        alive = sorted(rng.sample(range(n), rng.randint(1, n)))
        for policy in ("neighbor", "spread", "hybrid"):
            plans = _plans(alive, n, m, policy)
            assert set(plans) == set(alive)
            _check_coverage(plans, n, m)
            exact = sum(len(p.tasks) - p.num_degraded for p in plans.values())
            scales = {p.masked_scale for p in plans.values()}
            assert len(scales) == 1
            (scale,) = scales
            if exact == n * m:
                assert scale is None
            else:
                assert scale == (pytest.approx(m / exact) if exact else 0.0)
            if policy == "spread":
                loads = [len(p.tasks) for p in plans.values()]
                assert max(loads) - min(loads) <= 1


def test_scaling_contract_reproduces_global_averages():
    """Pre-scale + SUM all-reduce gives the failure-free mean (ordinary) and the mean over exact
    micro-batches (attention), with scalar stand-ins for each micro-batch's gradient."""
    n, m = 5, 3
    grad = {(r, i): 1.0 + r * m + i for r in range(n) for i in range(m)}  # per-micro-batch grad
    target = sum(grad.values()) / (n * m)
    for alive, policy in itertools.product(([0, 1, 3, 4], [0, 4], [2]), ("neighbor", "hybrid")):
        plans = _plans(alive, n, m, policy, cost=CostModel(degraded_microbatch_s=0.5))
        ordinary = attention = 0.0
        exact_grads = []
        for p in plans.values():
            local = sum(grad[t.source_dp_rank, t.micro_index] / m for t in p.tasks)
            local_attn = sum(
                grad[t.source_dp_rank, t.micro_index] / m for t in p.tasks if not t.degraded
            )
            exact_grads += [
                grad[t.source_dp_rank, t.micro_index] for t in p.tasks if not t.degraded
            ]
            ordinary += p.grad_scale * local
            attention += p.attention_grad_scale * local_attn
        assert ordinary == pytest.approx(target)
        if exact_grads:
            assert attention == pytest.approx(sum(exact_grads) / len(exact_grads))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(alive=[], num_replicas=3), "no survivor"),
        (dict(alive=[0, 3], num_replicas=3), "out of range"),
        (dict(alive=[0, 0], num_replicas=3), "duplicate"),
        (dict(alive=[0], num_replicas=3, policy="nearest"), "unknown takeover policy"),
        (dict(alive=[0], num_replicas=3, num_microbatches=0), "num_microbatches"),
        (dict(alive=[0], num_replicas=3, target_ratio=0.9), "target_ratio"),
    ],
)
def test_invalid_plan_inputs_raise(kwargs, match):
    args = dict(num_microbatches=2, policy="neighbor", cost=COST) | kwargs
    with pytest.raises(ValueError, match=match):
        make_step_plans(**args)


def test_invalid_neighbor_inputs_raise():
    with pytest.raises(ValueError, match="out of range"):
        neighbor_of(4, [0, 1], 4)
    with pytest.raises(ValueError, match="listed as alive"):
        neighbor_of(1, [0, 1], 4)
    with pytest.raises(ValueError, match="no survivor"):
        neighbor_of(1, [], 4)


def test_cost_model_from_flops_and_measured():
    flops = microbatch_flops(
        **LLAMA_350M_SHAPE,
        micro_batch_size=4,
    )
    assert 0.5 < flops.ratio < 0.8  # MeCeFO neighbour: 1 + ratio ~ 1.5-1.75x a normal rank
    off = microbatch_flops(
        **LLAMA_350M_SHAPE,
        skip_attention_backward=False,
        recompute_ffn=False,
        lowrank_ffn_grad=False,
    )
    assert off.ratio == pytest.approx(1.0)  # all techniques off: degraded == exact
    cost = CostModel.from_measured(
        exact_microbatch_s=0.2, degraded_microbatch_s=0.1, step_overhead_s=0.05
    )
    assert cost.step_time(4, 2) == pytest.approx(0.05 + 0.8 + 0.2)
    with pytest.raises(ValueError):
        CostModel(exact_microbatch_s=0.0)


def test_cost_model_intercept_may_be_negative_but_not_absurd():
    # a chord fitted over M..2M on a convex cost curve has a negative intercept
    cost = CostModel.from_measured(
        exact_microbatch_s=0.165, degraded_microbatch_s=0.12, step_overhead_s=-0.08
    )
    assert cost.step_time(8, 0) == pytest.approx(8 * 0.165 - 0.08)
    plans = make_step_plans(
        alive=[1, 2, 3], num_replicas=4, num_microbatches=8, policy="hybrid", cost=cost
    )
    normal = cost.step_time(8, 0)
    assert (
        max(cost.step_time(len(p.tasks) - p.num_degraded, p.num_degraded) for p in plans.values())
        <= 1.15 * normal + 1e-12
    )
    with pytest.raises(ValueError, match="positive one-micro-batch step time"):
        CostModel.from_measured(
            exact_microbatch_s=0.1, degraded_microbatch_s=0.05, step_overhead_s=-0.2
        )
