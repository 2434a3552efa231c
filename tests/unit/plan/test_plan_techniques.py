"""hybrid with `hybrid_techniques: auto`: which techniques a degraded micro-batch uses, chosen by
least accuracy cost among the measured technique sets that meet the target (hand-made times and
accuracy costs; the general brute-force check is in test_plan_hybrid.py)."""

from __future__ import annotations

import json

import pytest

from megatron_mecefo.mecefo import MecefoConfig
from megatron_mecefo.plan import (
    ALL_TECHNIQUES,
    AccuracyCosts,
    CostModel,
    DegradedTechniques,
    MicroBatchTask,
    candidate_techniques,
    flop_cost_model,
    make_step_plans,
    plan_step_times,
)
from megatron_mecefo.plan.cost import LLAMA_350M_SHAPE

SKIP = DegradedTechniques(True, False, False)
LOWRANK = DegradedTechniques(False, False, True)
SKIP_LOWRANK = DegradedTechniques(True, False, True)
RECOMPUTE = DegradedTechniques(False, True, False)
# per whole-batch-degraded unit; only ratios matter here (skip 3x low-rank, as measured)
ACC = AccuracyCosts(costs=(("skip", 0.33), ("lowrank", 0.11), ("skip+lowrank", 0.44)))


def _cost(**technique_s):
    """exact micro-batch 1.0, no overhead; degraded times per technique key."""
    return CostModel.from_measured(
        exact_microbatch_s=1.0,
        degraded_microbatch_s=technique_s.get("skip+recompute+lowrank", 0.7),
        technique_microbatch_s={k.replace("_", "+"): v for k, v in technique_s.items()},
    )


def _auto(cost, n=4, m=8, target=1.15, allowed=ALL_TECHNIQUES):
    alive = list(range(1, n))  # replica 0 dead
    return make_step_plans(
        alive=alive,
        num_replicas=n,
        num_microbatches=m,
        policy="hybrid",
        cost=cost,
        target_ratio=target,
        choose_techniques=True,
        allowed_techniques=allowed,
        accuracy=ACC,
    )


def _degraded(plan):
    return [(t.source_dp_rank, t.micro_index, t.techniques) for t in plan.tasks if t.degraded]


def test_picks_the_least_accuracy_cost_set_that_meets_the_target():
    # n=4, M=8: ranks 1, 2 run 11 micro-batches, rank 3 runs 10; target 1.15 x 8 = 9.2.
    # rank 1 needs a saving of 1.8: low-rank (0.2 each) k=9, accuracy 9 x 0.11 = 0.99;
    # skip (0.4) k=5, 5 x 0.33 = 1.65; skip+low-rank (0.5) k=4, 4 x 0.44 = 1.76 (fastest);
    # recompute alone saves nothing (1.05 > 1). The least accuracy cost is low-rank alone.
    cost = _cost(skip=0.6, lowrank=0.8, skip_lowrank=0.5, recompute=1.05)
    plans = _auto(cost)
    assert {t.techniques for t in plans[1].tasks if t.degraded} == {LOWRANK}
    assert plans[1].num_degraded == 9 and plans[2].num_degraded == 9
    # rank 3 (10 micro-batches) needs 0.8: low-rank k=4 (0.44) beats skip k=2 (0.66)
    assert plans[3].num_degraded == 4 and _degraded(plans[3])[0][2] == LOWRANK
    # taken-over micro-batches are degraded first
    assert [t.degraded for t in plans[3].tasks] == [False] * 6 + [True] * 4
    times = plan_step_times(plans, cost)
    assert max(times.values()) <= 1.15 * 8 + 1e-9
    # nobody skips attention: every micro-batch computes attention grads, no masking
    assert all(p.masked_scale is None for p in plans.values())


def test_skip_alone_when_the_cheaper_accuracy_set_cannot_fit():
    # low-rank alone too slow to fit (saving 0.1: k = 18 > 11); skip (k=5, 1.65) beats
    # skip+low-rank (k=4, 1.76) although the latter is faster
    cost = _cost(skip=0.6, lowrank=0.9, skip_lowrank=0.5)
    plans = _auto(cost)
    assert {t.techniques for t in plans[1].tasks if t.degraded} == {SKIP}
    assert plans[1].num_degraded == 5
    # masked averaging: E = micro-batches computing attention grads = 32 - skipped ones
    skipped = sum(p.num_degraded for p in plans.values())
    assert plans[1].masked_scale == pytest.approx(8 / (32 - skipped))


def test_no_set_fits_degrades_everything_with_the_fastest_set():
    cost = _cost(skip=0.95, lowrank=0.97, skip_lowrank=0.9)
    plans = _auto(cost, target=1.0)  # 11 micro-batches into 8: impossible
    assert plans[1].num_degraded == 11
    assert {t.techniques for t in plans[1].tasks} == {SKIP_LOWRANK}


def test_allowed_techniques_bound_the_candidates():
    cost = _cost(skip=0.6, lowrank=0.8, skip_lowrank=0.5)
    no_lowrank = DegradedTechniques(True, True, False)
    plans = _auto(cost, allowed=no_lowrank)
    assert {t.techniques for t in plans[1].tasks if t.degraded} == {SKIP}
    assert candidate_techniques(no_lowrank) == [
        SKIP,
        RECOMPUTE,
        DegradedTechniques(True, True, False),
    ]


def test_a_rank_within_the_target_stays_exact():
    cost = _cost(skip=0.6, lowrank=0.8)
    plans = _auto(cost, n=32)  # 9 micro-batches <= 1.15 x 8
    assert all(p.num_degraded == 0 for p in plans.values())
    assert all(p.masked_scale is None for p in plans.values())


def test_fixed_mode_is_unchanged():
    cost = _cost(skip=0.6, lowrank=0.8, skip_lowrank=0.5)
    for n in (2, 4, 8):
        kw = dict(alive=range(1, n), num_replicas=n, num_microbatches=8, policy="hybrid")
        old = make_step_plans(**kw, cost=cost, accuracy=ACC)
        assert make_step_plans(**kw, cost=cost, choose_techniques=False, accuracy=ACC) == old
        assert all(t.techniques is None for p in old.values() for t in p.tasks)


def test_flop_fallback_prefers_dropping_recompute():
    """FLOP model at llama-350m: recompute alone costs more than exact and is never chosen."""
    cost = flop_cost_model(**LLAMA_350M_SHAPE, micro_batch_size=4)
    assert cost.degraded_time(RECOMPUTE) > 1.0
    assert cost.degraded_time(ALL_TECHNIQUES) == pytest.approx(cost.degraded_microbatch_s)
    plans = _auto(cost)
    used = {t.techniques for p in plans.values() for t in p.tasks if t.degraded}
    assert all(not t.recompute_ffn for t in used)


def test_cost_model_json_round_trip_and_validation():
    cost = _cost(skip=0.6, lowrank=0.8)
    again = CostModel.from_measured(**json.loads(json.dumps(vars(cost))))
    assert again == cost and again.degraded_time(SKIP) == 0.6
    assert again.degraded_time(SKIP_LOWRANK) is None
    with pytest.raises(ValueError, match="unknown technique"):
        CostModel.from_measured(
            exact_microbatch_s=1, degraded_microbatch_s=1, technique_microbatch_s={"fast": 0.5}
        )


def test_techniques_keys_and_task_validation():
    for t in candidate_techniques(ALL_TECHNIQUES):
        assert DegradedTechniques.from_key(t.key) == t
    assert DegradedTechniques.from_key("none").names == ()
    with pytest.raises(ValueError, match="exact micro-batch"):
        MicroBatchTask(0, 0, False, SKIP)
    assert MicroBatchTask(0, 0, True).skips_attention
    assert not MicroBatchTask(0, 0, True, LOWRANK).skips_attention


def test_config_hybrid_techniques():
    assert MecefoConfig().hybrid_techniques == "fixed"
    assert MecefoConfig(recompute_ffn=False).techniques == SKIP_LOWRANK
    with pytest.raises(ValueError, match="hybrid_techniques"):
        MecefoConfig(hybrid_techniques="best")
    with pytest.raises(ValueError, match="at least one"):
        MecefoConfig(
            hybrid_techniques="auto",
            skip_attention_backward=False,
            recompute_ffn=False,
            lowrank_ffn_grad=False,
        )
