"""Hook points of the training loop.

Hooks supply each step's plan and observe results. Failover uses them for the plan, but it is more
than a hook: it also owns the engine's `membership` (group, generation) and `commit_vote`, and it
joins before the loop starts (see `megatron_mecefo.failover.manager`).
"""

from __future__ import annotations

from typing import Any

from megatron_mecefo.plan.step_plan import RankStepPlan


class TrainHook:
    """Base hook: every method is a no-op. Subclass and override what you need."""

    def plan_for_step(self, engine: Any, step: int) -> RankStepPlan | None:
        """Return the plan for `step`, or None to leave it to the next hook / the default plan."""
        return None

    def after_step(self, engine: Any, result: Any, record: dict[str, Any]) -> None:
        """Called on every rank after a committed step; `record` is the metrics row (may be
        extended)."""

    def on_step_aborted(self, engine: Any, result: Any) -> None:
        """Called on every member when a step was not committed; the loop redoes it next."""

    def should_stop(self, engine: Any, result: Any) -> bool:
        """Called on every rank after a committed step, before `after_step`: True ends the run
        after this step (a stop was requested; every rank must return the same answer). The
        loop then marks the metrics row `stop_requested` so a checkpoint hook saves."""
        return False

    def on_train_end(self, engine: Any, summary: dict[str, Any]) -> None:
        """Called once after the last step."""
