"""Hook points of the training loop. The failover manager (a later stage) is a hook: it supplies
each step's plan and reacts to step results; the loop itself knows nothing about failures."""

from __future__ import annotations

from typing import Any

from megatron_mecefo.training.step_plan import RankStepPlan


class TrainHook:
    """Base hook: every method is a no-op. Subclass and override what you need."""

    def plan_for_step(self, engine: Any, step: int) -> RankStepPlan | None:
        """Return the plan for `step`, or None to leave it to the next hook / the default plan."""
        return None

    def after_step(self, engine: Any, result: Any, record: dict[str, Any]) -> None:
        """Called on every rank after a step; `record` is the metrics row (may be extended)."""

    def on_train_end(self, engine: Any, summary: dict[str, Any]) -> None:
        """Called once after the last step."""
