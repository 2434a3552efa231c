"""Sample-granular takeover: every sample of the global batch runs exactly once, the slowest
survivor pays 1 + ceil(M b d / (n - d)) / (M b), the scaling contract holds with slices, and the
audit counts samples."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest

from megatron_mecefo.mecefo.config import MecefoConfig
from megatron_mecefo.plan.cost import CostModel
from megatron_mecefo.plan.step_plan import MicroBatchTask, RankStepPlan
from megatron_mecefo.plan.takeover import make_step_plans, plan_step_times
from tools.chaos.checks import committed_tasks

pytestmark = pytest.mark.timeout(60)


def _plans(alive, n, m, b, policy="spread", cost=None, granularity="sample", **kw):
    return make_step_plans(
        alive=alive,
        num_replicas=n,
        num_microbatches=m,
        policy=policy,
        cost=cost or CostModel(),
        granularity=granularity,
        micro_batch_size=b,
        **kw,
    )


def _samples(plans, b):
    """Every (replica, micro-batch, sample) the plans run, with repeats."""
    out = []
    for p in plans.values():
        for t in p.tasks:
            start, stop = t.samples or (0, b)
            out += [(t.source_dp_rank, t.micro_index, j) for j in range(start, stop)]
    return out


def _load(plan, b):
    return sum(t.num_samples(b) for t in plan.tasks)


def test_one_dead_replica_costs_the_slowest_survivor_ceil_mb_over_n_minus_1_samples():
    n, m, b = 4, 2, 4  # the demo job of the failover tests
    plans = _plans([0, 1, 3], n, m, b)
    assert Counter(_samples(plans, b)) == Counter(
        (r, i, j) for r in range(n) for i in range(m) for j in range(b)
    )
    loads = {r: _load(p, b) for r, p in plans.items()}
    assert loads == {3: 11, 0: 11, 1: 10}  # 8 orphaned samples: 3, 3, 2 (ring order after 2)
    assert max(loads.values()) / (m * b) == 1 + math.ceil(m * b / (n - 1)) / (m * b)
    # whole micro-batches: the slowest runs 3 micro-batches (1.5x), here 11/8 = 1.375x
    whole = _plans([0, 1, 3], n, m, b, granularity="microbatch")
    assert max(len(p.tasks) for p in whole.values()) == 3
    assert plans[3].micro_batch_size == b and whole[3].micro_batch_size is None


def test_random_alive_sets_cover_every_sample_once_and_balance_to_one_sample():
    rng = random.Random(0)
    for _ in range(300):
        n, m, b = rng.randint(1, 9), rng.randint(1, 5), rng.randint(1, 6)
        alive = sorted(rng.sample(range(n), rng.randint(1, n)))
        d = n - len(alive)
        for policy in ("spread", "hybrid"):
            plans = _plans(alive, n, m, b, policy=policy)
            seen = Counter(_samples(plans, b))
            want = {(r, i, j) for r in range(n) for i in range(m) for j in range(b)}
            assert set(seen) == want and max(seen.values()) == 1, (n, m, b, alive)
            if policy == "hybrid":  # may pick whole micro-batches or neighbour instead
                continue
            loads = [_load(p, b) for p in plans.values()]
            assert max(loads) - min(loads) <= 1
            assert max(loads) == m * b + math.ceil(d * m * b / len(alive))
            for p in plans.values():
                slices = [t for t in p.tasks if t.is_slice]
                assert len(slices) <= 2  # whole micro-batches first, slices only for the rest
                assert all(t.num_samples(b) < b for t in slices)
                assert [t.source_dp_rank for t in p.tasks[:m]] == [p.tasks[0].source_dp_rank] * m


def test_microbatch_granularity_and_b_1_give_the_old_plans():
    for alive, n, m in [([0, 1, 3], 4, 4), ([1, 2], 5, 3), ([0], 3, 2)]:
        for policy in ("spread", "hybrid", "neighbor"):
            old = make_step_plans(
                alive=alive, num_replicas=n, num_microbatches=m, policy=policy, cost=CostModel()
            )
            assert _plans(alive, n, m, 4, policy=policy, granularity="microbatch") == old
            assert _plans(alive, n, m, 1, policy=policy) == old  # b = 1: a sample is a micro-batch
    # neighbour hands whole micro-batches to one replica whatever the granularity
    assert _plans([0, 1, 3], 4, 2, 4, policy="neighbor") == _plans(
        [0, 1, 3], 4, 2, 4, policy="neighbor", granularity="microbatch"
    )


def test_scaling_contract_with_slices_reproduces_global_averages():
    """Scalar stand-ins per sample: a slice's gradient is its samples' share of the micro-batch's
    (the engine divides a slice's token sum by its micro-batch's token count). Pre-scale + SUM
    gives the failure-free mean (ordinary) and the mean over the exact micro-batch-equivalents
    (attention)."""
    cost = CostModel(degraded_microbatch_s=0.5)
    cases = [((5, 3, 4), alive, 1.15) for alive in ([0, 1, 3, 4], [0, 4], [2], [1, 2, 3])]
    # loads 2.75, 2.75, 2.5 micro-batches against a 2.6 target: two ranks degrade their slices,
    # the third keeps an exact slice while attention is masked (E counts its samples, not 1)
    cases.append(((4, 2, 4), [0, 1, 3], 1.3))
    mixed = 0
    for (n, m, b), alive, ratio in cases:
        grad = {(r, i, j): 1.0 + 0.37 * (r * m * b + i * b + j) for r in range(n)
                for i in range(m) for j in range(b)}  # fmt: skip
        target = sum(grad.values()) / (n * m * b)
        for policy in ("spread", "hybrid"):
            plans = _plans(alive, n, m, b, policy=policy, cost=cost, target_ratio=ratio)
            ordinary = attention = 0.0
            exact_sum, exact_samples = 0.0, 0
            for p in plans.values():
                for t in p.tasks:
                    start, stop = t.samples or (0, b)
                    g = sum(grad[t.source_dp_rank, t.micro_index, j] for j in range(start, stop))
                    g /= b  # token mean over the whole micro-batch (equal tokens per sample)
                    ordinary += p.grad_scale * g / m
                    if not t.degraded:
                        attention += p.attention_grad_scale * g / m
                        exact_sum += g * b
                        exact_samples += stop - start
                        mixed += t.is_slice and p.masked_scale is not None
            assert ordinary == pytest.approx(target)
            if exact_samples:
                assert attention == pytest.approx(exact_sum / exact_samples)
    assert mixed  # an exact slice in a masked step was checked


def test_hybrid_at_sample_granularity_meets_the_target_and_degrades_only_above_it():
    n, m, b = 4, 8, 4
    cost = CostModel(exact_microbatch_s=1.0, degraded_microbatch_s=0.6)
    sample = _plans([0, 1, 3], n, m, b, policy="hybrid", cost=cost)
    whole = _plans([0, 1, 3], n, m, b, policy="hybrid", cost=cost, granularity="microbatch")
    normal = cost.step_time(m)
    for plans in (sample, whole):
        assert max(plan_step_times(plans, cost).values()) <= 1.15 * normal + 1e-9
        for p in plans.values():  # whole micro-batches degrade from the end: taken-over first
            flags = [t.degraded for t in p.tasks if not t.is_slice]
            assert flags == sorted(flags)
            taken_whole = sum(not t.is_slice for t in p.tasks[m:])
            if sum(flags) <= taken_whole:  # own micro-batches stay exact
                assert not any(t.degraded for t in p.tasks[:m])
    # slices let hybrid degrade less work than whole micro-batches do for the same target
    degraded = [
        sum(p.task_fraction(t) for p in plans.values() for t in p.tasks if t.degraded)
        for plans in (sample, whole)
    ]
    assert degraded[0] < degraded[1]
    # a target between the slowest survivor's load at sample granularity (8 + 11/4 micro-
    # batches' worth: 43/32 = 1.344x) and at micro-batch granularity (11/8 = 1.375x): slices fit
    # it as they are, whole micro-batches must degrade
    target = 1.36
    loose = _plans([0, 1, 3], n, m, b, policy="hybrid", cost=cost, target_ratio=target)
    coarse = _plans(
        [0, 1, 3],
        n,
        m,
        b,
        policy="hybrid",
        cost=cost,
        target_ratio=target,
        granularity="microbatch",
    )
    assert all(p.num_degraded == 0 for p in loose.values())
    assert max(plan_step_times(loose, cost).values()) == pytest.approx(43 / 32 * normal)
    assert sum(p.num_degraded for p in coarse.values()) > 0


def test_hybrid_with_techniques_auto_at_sample_granularity_uses_measured_sets():
    from megatron_mecefo.plan.cost import LLAMA_350M_SHAPE, flop_cost_model

    cost = flop_cost_model(**LLAMA_350M_SHAPE, micro_batch_size=4)
    plans = _plans([0, 1, 3], 4, 8, 4, policy="hybrid", cost=cost, choose_techniques=True)
    chosen = {t.techniques.key for p in plans.values() for t in p.tasks if t.degraded}
    assert chosen and all(t != "none" for t in chosen)
    assert max(plan_step_times(plans, cost).values()) <= 1.15 * cost.step_time(8) + 1e-9


def test_slice_overhead_is_paid_per_slice():
    n, m, b = 4, 2, 4
    plans = _plans([0, 1, 3], n, m, b)
    base = CostModel(exact_microbatch_s=1.0)
    over = CostModel(exact_microbatch_s=1.0, slice_overhead_s=0.1)
    t0, t1 = plan_step_times(plans, base), plan_step_times(plans, over)
    for r, p in plans.items():
        slices = sum(t.is_slice for t in p.tasks)
        assert t0[r] == pytest.approx(_load(p, b) / b)
        assert t1[r] == pytest.approx(t0[r] + 0.1 * slices)
    assert over.task_time(0.25) == pytest.approx(0.35) and over.task_time(1.0) == 1.0
    with pytest.raises(ValueError, match="slice_overhead_s"):
        CostModel(slice_overhead_s=-1.0)


def test_invalid_granularity_inputs_raise():
    with pytest.raises(ValueError, match="granularity"):
        _plans([0], 2, 2, 4, granularity="token")
    with pytest.raises(ValueError, match="micro_batch_size"):
        _plans([0], 2, 2, 0)
    with pytest.raises(ValueError, match="start < stop"):
        MicroBatchTask(0, 0, samples=(2, 2))
    with pytest.raises(ValueError, match="micro_batch_size"):
        RankStepPlan(tasks=(MicroBatchTask(0, 0, samples=(0, 1)),), num_replicas=1,
                     microbatches_per_replica=1)  # fmt: skip
    with pytest.raises(ValueError, match="exceeds"):
        RankStepPlan(tasks=(MicroBatchTask(0, 0, samples=(0, 5)),), num_replicas=1,
                     microbatches_per_replica=1, micro_batch_size=4)  # fmt: skip
    with pytest.raises(ValueError, match="takeover_granularity"):
        MecefoConfig(takeover_granularity="token")


def _write_audit(run, rows_by_rank):
    (run / "audit").mkdir(parents=True)
    for rank, rows in rows_by_rank.items():
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (run / "audit" / f"tasks_rank{rank}.jsonl").write_text(text)


def test_audit_counts_a_sliced_micro_batch_once_when_every_sample_is_committed(tmp_path):
    plans = _plans([0, 1, 3], 4, 2, 4)
    rows = {
        r: [{"step": 0, "replica": r, "inc": 0, "micro_batch_size": 4,
             "tasks": [[t.source_dp_rank, t.micro_index, 0, *(t.samples or ())]
                       for t in p.tasks]}]
        for r, p in plans.items()
    }  # fmt: skip
    _write_audit(tmp_path / "ok", rows)
    counts, problems = committed_tasks(tmp_path / "ok")
    assert problems == []
    assert counts == Counter({(0, r, i): 1 for r in range(4) for i in range(2)})
    # drop one slice: the micro-batch is short of samples, and the audit says so
    rows[1][0]["tasks"] = [t for t in rows[1][0]["tasks"] if len(t) < 5]
    _write_audit(tmp_path / "dropped", rows)
    counts, problems = committed_tasks(tmp_path / "dropped")
    assert len(problems) == 1 and "unevenly" in problems[0], problems
