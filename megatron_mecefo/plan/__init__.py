"""Step plans, the takeover planner and its cost model: pure data and logic, no torch.

This package sits below `training/` (which runs plans), `mecefo/` (which computes degraded
micro-batches) and `failover/` (which asks the planner for plans on membership changes).
"""

from megatron_mecefo.plan.accuracy import AccuracyCosts, load_accuracy_costs
from megatron_mecefo.plan.cost import CostModel, FlopBreakdown, flop_cost_model, microbatch_flops
from megatron_mecefo.plan.hybrid import OBJECTIVES
from megatron_mecefo.plan.step_plan import MicroBatchTask, RankStepPlan, failure_free_plan
from megatron_mecefo.plan.takeover import (
    POLICIES,
    make_step_plans,
    neighbor_of,
    plan_step_times,
)
from megatron_mecefo.plan.techniques import (
    ALL_TECHNIQUES,
    DegradedTechniques,
    candidate_techniques,
)

__all__ = [
    "ALL_TECHNIQUES",
    "AccuracyCosts",
    "OBJECTIVES",
    "POLICIES",
    "CostModel",
    "DegradedTechniques",
    "FlopBreakdown",
    "candidate_techniques",
    "MicroBatchTask",
    "RankStepPlan",
    "failure_free_plan",
    "flop_cost_model",
    "load_accuracy_costs",
    "make_step_plans",
    "microbatch_flops",
    "neighbor_of",
    "plan_step_times",
]
