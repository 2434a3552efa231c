"""The training loop: plan -> step -> acknowledge -> (eval) -> log, with hooks. Nothing else
lives here.

    plan = control.begin_step(step)
    result = engine.train_step(step, plan)
    control.end_step(result)

A step whose update was not committed (a member was lost mid-step) is redone here, under the plan
the control gives for the new membership; that is the loop's only reaction to failures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from megatron_mecefo.errors import RollbackError
from megatron_mecefo.metrics.logger import MetricsLogger
from megatron_mecefo.metrics.mfu import mfu, peak_flops
from megatron_mecefo.training.engine import Engine
from megatron_mecefo.training.hooks import StepControl, TrainHook


def train(
    engine: Engine,
    logger: MetricsLogger,
    hooks: Sequence[TrainHook] = (),
    *,
    control: StepControl | None = None,
    start_step: int = 0,
) -> dict[str, Any]:
    """Run steps `start_step .. max_steps-1` under `control` (default: failure-free); returns a
    summary (losses, val losses, throughput)."""
    control = control or StepControl()
    hooks = [control, *hooks]
    try:
        return _train(engine, logger, hooks, control, start_step)
    except RollbackError:  # the job rolls back: saves in flight must land first
        for hook in hooks:
            hook.on_rollback(engine)
        raise


def _train(engine, logger, hooks, control, start_step: int) -> dict[str, Any]:
    tc = engine.cfg.training
    peak = peak_flops(_device_name(engine))
    flops_per_token = engine.cfg.model.flops_per_token()
    losses, val_losses, tok_rates = [], [], []
    step = start_step
    stopped_at = None
    while step < tc.max_steps:
        plan = control.begin_step(engine, step)
        for hook in hooks:
            hook.before_step(engine, step)
        result = engine.train_step(step, plan)
        extra = control.end_step(engine, result)
        if not result.committed:
            continue
        tokens_per_s = result.global_tokens / max(result.step_time_s, 1e-9)
        record: dict[str, Any] = {
            "step": step,
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens_per_s": tokens_per_s,
            "step_time_s": result.step_time_s,
            "degraded_microbatches": plan.num_degraded,
            "global_microbatches": result.global_microbatches,  # trained on, as counted
            **extra,
        }
        util = mfu(tokens_per_s, flops_per_token, engine.ctx.world_size, peak)
        if util is not None:
            record["mfu"] = util
        stop = any([h.should_stop(engine, result) for h in hooks])  # every hook, every rank
        if stop:
            record["stop_requested"] = True
        last = step == tc.max_steps - 1 or stop
        if tc.eval_interval and ((step + 1) % tc.eval_interval == 0 or last):
            record["val_loss"] = engine.evaluate()
            val_losses.append((step, record["val_loss"]))
        for hook in hooks:
            hook.after_step(engine, result, record)
        logger.log_step(record)
        losses.append(result.loss)
        if step > start_step:  # the first step includes one-off warm-up costs
            tok_rates.append(tokens_per_s)
        if not math.isfinite(result.loss):
            logger.print(f"warning: non-finite loss at step {step}")
        step += 1
        if stop:
            stopped_at = step
            logger.print(f"stop requested: stopping after step {step - 1}")
            break
    summary = {
        "stopped_at": stopped_at,
        "steps": len(losses),
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "val_losses": val_losses,
        "final_val_loss": val_losses[-1][1] if val_losses else None,
        "mean_tokens_per_s": sum(tok_rates) / len(tok_rates) if tok_rates else None,
        "entropy_floor_nats_per_token": engine.data.entropy_floor_nats_per_token,
        "spike_peaks": engine.anomaly.peaks(),
    }
    for hook in hooks:
        hook.on_train_end(engine, summary)
    return summary


def _device_name(engine: Engine) -> str | None:
    if engine.ctx.on_cpu:
        return None
    import torch

    return torch.cuda.get_device_name(engine.ctx.device)
