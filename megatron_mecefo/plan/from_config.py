"""Step plans for a membership, from a run config: the takeover planner's inputs (its FLOP cost
model and measured accuracy costs) built from the model shape and the `mecefo` settings.

Pure: no torch, no process groups. The failover trainer calls `plans_for_members` whenever its
membership changes; benchmarks call the same function to plan what a real run would.
"""

from __future__ import annotations

from typing import Any

from megatron_mecefo.plan.accuracy import AccuracyCosts, load_accuracy_costs
from megatron_mecefo.plan.cost import CostModel, flop_cost_model
from megatron_mecefo.plan.step_plan import RankStepPlan
from megatron_mecefo.plan.takeover import make_step_plans


def accuracy_costs(cfg: Any) -> AccuracyCosts:
    """The measured accuracy-cost table; where the run skips attention in other layers than the
    table was measured at, the skip's part is scaled by the ratio of skipped layers."""
    mec, layers = cfg.mecefo, cfg.model.num_layers
    table = load_accuracy_costs(mec.accuracy_costs or None)
    if table.skip_attention_layers == mec.skip_attention_layers:
        return table
    # the run's config class (`mecefo.config.MecefoConfig`, above this package) at the table's
    # setting, its other fields at their defaults
    measured = type(mec)(skip_attention_layers=table.skip_attention_layers)
    ours = len(mec.skip_layer_indices(layers))
    return table.with_skip_fraction(ours / len(measured.skip_layer_indices(layers)))


def cost_model(cfg: Any) -> CostModel:
    """FLOP fallback cost model, with a cost for every subset of the configured techniques (the
    candidates of `hybrid_techniques: auto`)."""
    mc, mec = cfg.model, cfg.mecefo
    return flop_cost_model(
        allowed=mec.techniques,
        num_layers=mc.num_layers,
        hidden_size=mc.hidden_size,
        ffn_hidden_size=mc.ffn_hidden_size,
        seq_length=mc.seq_length,
        vocab_size=mc.vocab_size,
        micro_batch_size=cfg.training.micro_batch_size,
        rank_fraction=mec.rank if mec.rank < 1 else mec.rank / mc.hidden_size,
        skip_layer_fraction=len(mec.skip_layer_indices(mc.num_layers)) / mc.num_layers,
    )


def plans_for_members(
    cfg: Any, members: tuple[int, ...], num_replicas: int
) -> dict[int, RankStepPlan]:
    """Every live replica's plan when only `members` of the `num_replicas` train, under the
    run's `mecefo.takeover_policy` (the global batch stays n x M micro-batches)."""
    mec = cfg.mecefo
    return make_step_plans(
        alive=members,
        num_replicas=num_replicas,
        num_microbatches=cfg.training.num_microbatches,
        policy=mec.takeover_policy,
        cost=cost_model(cfg),
        target_ratio=mec.hybrid_target_ratio,
        choose_techniques=mec.hybrid_techniques == "auto",
        allowed_techniques=mec.techniques,
        granularity=mec.takeover_granularity,
        micro_batch_size=cfg.training.micro_batch_size,
        objective=mec.hybrid_objective,
        accuracy_budget=mec.hybrid_accuracy_budget,
        accuracy=accuracy_costs(cfg) if mec.takeover_policy == "hybrid" else None,
    )
