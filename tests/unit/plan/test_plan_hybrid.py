"""`hybrid` against brute force: over every plan that exists (exact spread at micro-batch and
sample granularity, neighbour with each technique set, spread with ANY subset of each rank's tasks
degraded with any one technique set per rank), the choice is never dominated, never worse than
neighbour at the same or a higher time, and optimal for its objective."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from megatron_mecefo.plan import (
    AccuracyCosts,
    CostModel,
    DegradedTechniques,
    MicroBatchTask,
    candidate_techniques,
    load_accuracy_costs,
    make_step_plans,
    plan_step_times,
)
from megatron_mecefo.plan.takeover import (
    _assign_neighbor,
    _assign_spread,
    _assign_spread_samples,
)

TOL = 1e-7  # the enumeration rounds to 1e-9 per rank and sums


def _instance(rng: random.Random):
    n = rng.randint(2, 4)
    dead = sorted(rng.sample(range(n), rng.randint(1, min(2, n - 1))))
    alive = [r for r in range(n) if r not in dead]
    m, b = rng.randint(1, 3), rng.randint(1, 4)
    sets = candidate_techniques(DegradedTechniques(True, False, True))  # skip, lowrank, both
    times = {t.key: rng.uniform(0.3, 1.2) for t in sets}
    cost = CostModel.from_measured(
        exact_microbatch_s=1.0,
        degraded_microbatch_s=times["skip+lowrank"],
        step_overhead_s=rng.uniform(0, 0.5),
        technique_microbatch_s=times,
        slice_overhead_s=rng.choice([0.0, 0.05]),
    )
    acc = AccuracyCosts(costs=tuple((t.key, rng.uniform(0.5, 20)) for t in sets))
    return dict(
        n=n,
        alive=alive,
        dead=dead,
        m=m,
        b=b,
        cost=cost,
        acc=acc,
        auto=rng.random() < 0.5,
        granularity=rng.choice(["microbatch", "sample"]),
        target=rng.uniform(1.0, 1.5),
        objective=rng.choice(["accuracy", "time"]),
        budget=rng.uniform(0, 6),
    )


def _accuracy(tasks_by_rank, acc, n, m, b, fixed):
    total = 0.0
    for ts in tasks_by_rank.values():
        for t in ts:
            if t.degraded:
                share = 1.0 if t.samples is None else t.num_samples(b) / b
                total += acc.of(t.techniques or fixed) * share / (n * m)
    return total


def _rank_time(ts, cost, b):
    total = cost.step_overhead_s
    for t in ts:
        share = 1.0 if t.samples is None else t.num_samples(b) / b
        total += cost.task_time(share, degraded=t.degraded, techniques=t.techniques)
    return total


def _universe(c):
    """(time, accuracy) of every plan in hybrid's search space, by enumeration."""
    n, m, b, cost, acc = c["n"], c["m"], c["b"], c["cost"], c["acc"]
    fixed = DegradedTechniques(True, False, True)  # the configured set (`fixed` mode)
    sets = list(cost.measured_techniques) if c["auto"] else [None]

    def fresh():
        return {r: [MicroBatchTask(r, i) for i in range(m)] for r in c["alive"]}

    bases = []
    whole = fresh()
    _assign_spread(whole, c["dead"], c["alive"], n, m)
    bases.append(whole)
    if c["granularity"] == "sample" and b > 1:
        sliced = fresh()
        _assign_spread_samples(sliced, c["dead"], c["alive"], n, m, b)
        bases.append(sliced)
    points = set()
    for base in bases:
        per_rank = []
        for r, ts in base.items():
            opts = set()
            for tech in sets:
                for flags in itertools.product([False, True], repeat=len(ts)):
                    tasks = [
                        MicroBatchTask(t.source_dp_rank, t.micro_index, True, tech, t.samples)
                        if f
                        else t
                        for t, f in zip(ts, flags)
                    ]
                    opts.add(
                        (
                            round(_rank_time(tasks, cost, b), 9),
                            round(_accuracy({r: tasks}, acc, n, m, b, fixed), 9),
                        )
                    )
            per_rank.append(_pareto(opts))
        for combo in itertools.product(*per_rank):
            points.add((max(t for t, _ in combo), round(sum(a for _, a in combo), 9)))
    for tech in sets:
        nb = fresh()
        _assign_neighbor(nb, c["dead"], c["alive"], n, m)
        nb = {
            r: [
                MicroBatchTask(t.source_dp_rank, t.micro_index, True, tech) if t.degraded else t
                for t in ts
            ]
            for r, ts in nb.items()
        }
        points.add(
            (
                round(max(_rank_time(ts, cost, b) for ts in nb.values()), 9),
                round(_accuracy(nb, acc, n, m, b, fixed), 9),
            )
        )
    return points, fixed


def _pareto(points):
    """The (time, accuracy) points no other point beats on both; a dominated option of one
    rank cannot give a job-level plan that no other plan dominates (step time is the ranks'
    max, accuracy their sum)."""
    return {
        (t, a)
        for t, a in points
        if not any(u <= t and v <= a and (u, v) != (t, a) for u, v in points)
    }


def _choose(c):
    plans = make_step_plans(
        alive=c["alive"],
        num_replicas=c["n"],
        num_microbatches=c["m"],
        policy="hybrid",
        cost=c["cost"],
        target_ratio=c["target"],
        choose_techniques=c["auto"],
        allowed_techniques=DegradedTechniques(True, False, True),
        granularity=c["granularity"],
        micro_batch_size=c["b"],
        objective=c["objective"],
        accuracy_budget=c["budget"],
        accuracy=c["acc"],
    )
    return plans


# 2456, 4261, 5050, 5460: instances where degrading the first slice alone (not a suffix of the
# rank's tasks) is the only optimum (found by planting that bug)
@pytest.mark.parametrize("seed", [*range(200), 2456, 4261, 5050, 5460])
def test_hybrid_is_optimal_and_never_dominated_by_brute_force(seed):
    c = _instance(random.Random(seed))
    points, fixed = _universe(c)
    plans = _choose(c)
    tasks = {r: list(p.tasks) for r, p in plans.items()}
    got_t = max(plan_step_times(plans, c["cost"]).values())
    got_a = _accuracy(tasks, c["acc"], c["n"], c["m"], c["b"], fixed)
    for t, a in points:  # never dominated
        assert not (t <= got_t + TOL and a <= got_a + TOL and (t < got_t - TOL or a < got_a - TOL))
    target_s = c["target"] * c["cost"].step_time(c["m"], 0)
    if c["objective"] == "accuracy":
        feasible = [(t, a) for t, a in points if t <= target_s + TOL]
        if feasible:
            assert got_t <= target_s + TOL
            assert got_a == pytest.approx(min(a for _, a in feasible), abs=1e-7)
        else:
            assert got_t == pytest.approx(min(t for t, _ in points), abs=1e-7)
    else:
        feasible = [(t, a) for t, a in points if a <= c["budget"] + TOL]
        assert got_a <= c["budget"] + 1e-7
        assert got_t == pytest.approx(min(t for t, _ in feasible), abs=1e-7)


def test_hybrid_is_never_worse_than_neighbor_at_the_same_or_higher_time():
    """The issue's case: n = 4, M = 2, 1 dead, degraded barely cheaper than exact (as on small
    CPU models). The old hybrid degraded more micro-batches than neighbour at a similar time."""
    cost = CostModel(exact_microbatch_s=1.0, degraded_microbatch_s=0.8)
    acc = AccuracyCosts(costs=(("skip+lowrank", 15.0),))
    kw = dict(alive=[0, 2, 3], num_replicas=4, num_microbatches=2, cost=cost, accuracy=acc)
    hybrid = make_step_plans(policy="hybrid", **kw)
    neighbor = make_step_plans(policy="neighbor", **kw)

    def point(plans):
        t = max(plan_step_times(plans, cost).values())
        degraded = sum(p.num_degraded for p in plans.values())
        return t, degraded * 15.0 / 8

    (ht, ha), (nt, na) = point(hybrid), point(neighbor)
    assert not (na < ha - TOL and nt <= ht + TOL)
    assert not (na <= ha + TOL and nt < ht - TOL)


def test_time_objective_takes_the_fastest_plan_within_the_budget():
    cost = CostModel(exact_microbatch_s=1.0, degraded_microbatch_s=0.5)
    acc = AccuracyCosts(costs=(("skip+lowrank", 8.0),))
    kw = dict(
        alive=[1, 2, 3],
        num_replicas=4,
        num_microbatches=4,
        policy="hybrid",
        cost=cost,
        accuracy=acc,
        objective="time",
    )
    free = make_step_plans(**kw, accuracy_budget=100.0)
    none = make_step_plans(**kw, accuracy_budget=0.0)
    assert sum(p.num_degraded for p in none.values()) == 0  # zero budget: exact spread
    t_free = max(plan_step_times(free, cost).values())
    t_none = max(plan_step_times(none, cost).values())
    assert t_free < t_none
    # a budget for exactly 2 degraded micro-batches (each 8 / 16 = 0.5)
    two = make_step_plans(**kw, accuracy_budget=1.0)
    assert sum(p.num_degraded for p in two.values()) <= 2
    assert max(plan_step_times(two, cost).values()) < t_none


def test_objective_and_budget_are_validated():
    kw = dict(alive=[1], num_replicas=2, num_microbatches=1, policy="hybrid", cost=CostModel())
    with pytest.raises(ValueError, match="objective"):
        make_step_plans(**kw, objective="speed")
    with pytest.raises(ValueError, match="accuracy_budget"):
        make_step_plans(**kw, accuracy_budget=-1.0)
    with pytest.raises(ValueError, match="no cost for the configured"):
        make_step_plans(**kw, accuracy=AccuracyCosts(costs=(("lowrank", 1.0),)))


def test_accuracy_costs_table(tmp_path):
    acc = AccuracyCosts(costs=(("skip+lowrank", 10.0), ("lowrank", 2.0)))
    assert acc.of(DegradedTechniques(True, True, True)) == 10.0  # recompute is exact
    assert acc.of(DegradedTechniques(False, True, False)) == 0.0
    assert acc.of(DegradedTechniques(True, False, False)) is None  # not measured
    half = acc.with_skip_fraction(0.25)  # skip in a quarter of the layers
    assert half.of(DegradedTechniques(True, False, True)) == pytest.approx(2.0 + 0.25 * 8.0)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"costs": {"skip+lowrank": {"mean": 3.0, "std": 1.0}}}))
    assert load_accuracy_costs(path).of(DegradedTechniques(True, False, True)) == 3.0
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_accuracy_costs(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_accuracy_costs(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=">= 0"):
        AccuracyCosts(costs=(("skip", -1.0),))
    shipped = load_accuracy_costs()
    assert shipped.of(DegradedTechniques(True, False, True)) > 0  # the default config's set


def test_config_rejects_a_table_without_the_configured_set(tmp_path):
    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig
    from megatron_mecefo.errors import ConfigError

    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"costs": {"lowrank": 1.0}}))
    base = ["mecefo.takeover_policy=hybrid", f"mecefo.accuracy_costs={path}"]
    with pytest.raises(ConfigError, match="no cost for the configured"):
        load_config(RunConfig, None, base)
    with pytest.raises(ConfigError, match="hybrid_objective"):
        load_config(RunConfig, None, ["mecefo.hybrid_objective=speed"])
    cfg = load_config(RunConfig, None, [*base, "mecefo.hybrid_techniques=auto"])
    assert cfg.mecefo.accuracy_costs == str(path)


def test_flop_model_prices_the_attention_skip_per_layer():
    from megatron_mecefo.plan.cost import LLAMA_350M_SHAPE, microbatch_flops

    full = microbatch_flops(**LLAMA_350M_SHAPE).degraded
    none = microbatch_flops(**LLAMA_350M_SHAPE, skip_attention_backward=False).degraded
    half = microbatch_flops(**LLAMA_350M_SHAPE, skip_layer_fraction=0.5).degraded
    assert full < half < none
    assert half == pytest.approx((full + none) / 2)
