"""Hook points of the training loop, and the step control that plans and acknowledges each step.

Per step the loop runs `plan = control.begin_step(step)`, the hooks' `before_step`,
`result = engine.train_step(step, plan)`, then `control.end_step(result)`. The control is the one
object that knows whether replicas can be lost: `StepControl` itself is the failure-free one (the
default plan, nothing to acknowledge); failover's manager is the live one. Hooks observe
(checkpoints, snapshots, a stop request, failure injection); none of them plans.
"""

from __future__ import annotations

from typing import Any

from megatron_mecefo.plan.step_plan import RankStepPlan


class TrainHook:
    """Base hook: every method is a no-op. Subclass and override what you need."""

    def before_step(self, engine: Any, step: int) -> None:
        """Called on every rank after the step's plan is known, before it runs (each attempt)."""

    def after_step(self, engine: Any, result: Any, record: dict[str, Any]) -> None:
        """Called on every rank after a committed step; `record` is the metrics row (may be
        extended)."""

    def should_stop(self, engine: Any, result: Any) -> bool:
        """Called on every rank after a committed step, before `after_step`: True ends the run
        after this step (a stop was requested; every rank must return the same answer). The
        loop then marks the metrics row `stop_requested` so a checkpoint hook saves."""
        return False

    def on_train_end(self, engine: Any, summary: dict[str, Any]) -> None:
        """Called once after the last step."""

    def on_rollback(self, engine: Any) -> None:
        """Called on every rank of the job, at the same point, when the job rolls back to its
        newest saved state (every copy of some state was lost): the process exits after it, so
        a hook with saves in flight finishes them here (bounded)."""


class StepControl(TrainHook):
    """Plans each step and acknowledges its result. This base is the failure-free control: every
    replica runs its own micro-batches, exactly; a step that was not committed is simply redone.
    It is also a hook (called first), so a control can stop the run or add to the summary."""

    _tries: int = 0
    """Attempts of the current step voted down so far (set per instance by `end_step`)."""

    def begin_step(self, engine: Any, step: int) -> RankStepPlan:
        """This rank's plan for `step` (each attempt of it)."""
        return engine.default_plan()

    def end_step(self, engine: Any, result: Any) -> dict[str, Any]:
        """Called on every member after each attempt (`result.committed` False: it is redone);
        returns the fields a committed step adds to its metrics row. Without failover an attempt
        is voted down only for NaN/Inf: with no peer to tell bad data from a bad device, a step
        that stays non-finite for `anomaly.max_attempts` attempts stops the run."""
        self._tries = 0 if result.committed else self._tries + 1
        limit = engine.cfg.anomaly.max_attempts
        if self._tries >= limit:
            from megatron_mecefo.errors import NumericalFaultError

            raise NumericalFaultError(
                f"step {result.step}: loss or gradients NaN/Inf on {limit} attempts "
                f"({engine.anomaly.reason or 'on another rank'}); resume from the last "
                "checkpoint, or run under mecefo-launch, whose peers classify the fault"
            )
        return {}
