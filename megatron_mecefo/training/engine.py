"""The training engine: builds model, DDP, optimizer, data and degraded-mode hooks; runs one step.

`train_step(step, plan)` is the whole step, readable top to bottom: set LR, refresh low-rank bases,
zero grads, run the plan's micro-batches through megatron's schedule (each in its own mode), reduce
gradients with the plan's scaling over the `Membership`, ask it to commit, optimizer step. Failover
changes only the plan and supplies a live membership (its group, generation and commit vote); the
step never branches on failures. A step that is not committed leaves the model untouched and is
redone by the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from megatron_mecefo.config.run import RunConfig
from megatron_mecefo.data import DataBundle, MicroBatchSampler, check_vocab, prepare_data
from megatron_mecefo.mcore import stack
from megatron_mecefo.mcore.model import build_gpt_model
from megatron_mecefo.mcore.parallel import (
    ParallelContext,
    data_parallel_layout,
    init_parallel,
    seed_everything,
)
from megatron_mecefo.mecefo import install_degraded_mode
from megatron_mecefo.plan.step_plan import MicroBatchTask, RankStepPlan, failure_free_plan
from megatron_mecefo.training.anomaly import AnomalyGuard, state_fingerprint
from megatron_mecefo.training.lr_schedule import lr_at
from megatron_mecefo.training.membership import Membership


@dataclasses.dataclass
class StepResult:
    """What one step produced (loss is the global-batch mean over all ranks' micro-batches)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    num_tokens: int
    """Tokens this rank processed."""
    global_tokens: int
    """Tokens of the whole global batch."""
    step_time_s: float
    updated: bool
    """False when the optimizer skipped the update (non-finite grads)."""
    committed: bool = True
    """False when the commit vote rejected the step: no update was applied, redo it."""
    global_microbatches: int = 0
    """Whole micro-batches' worth the whole group ran this step: its samples // micro-batch size
    (n x M when nothing was lost; a lost slice makes it fall short)."""
    global_samples: int = 0
    """Samples the whole group ran this step (n x M x micro-batch size when nothing was lost)."""
    compute_s: float = 0.0
    """This rank's own forward and backward time, its reductions excluded: on CPU this thread's
    CPU time (what it computed, whatever else shares the cores), on a GPU wall time
    (`failover/trainer/straggler.py` compares it across replicas)."""


class Engine:
    """Holds the built components; see `build_engine`."""

    def __init__(
        self,
        cfg: RunConfig,
        ctx: ParallelContext,
        model,
        ddp,
        tcfg,
        optimizer,
        data: DataBundle,
        controller,
        reducer: stack.PlanGradReducer,
        membership: Membership,
    ):
        self.cfg = cfg
        self.ctx = ctx
        self.model = model
        self.ddp = ddp
        self.tcfg = tcfg
        self.optimizer = optimizer
        self.data = data
        self.controller = controller
        self.reducer = reducer
        self.membership = membership
        self.anomaly = AnomalyGuard(cfg.anomaly)
        """This rank's NaN/Inf and spike verdict on each step attempt (`training/anomaly.py`)."""
        reducer.check_grad = self.anomaly.check_grad
        reducer.clock = time.thread_time if ctx.on_cpu else time.perf_counter
        reducer.before_reduce = self._slow_down
        self._t_compute = 0.0
        self.slow_factor = 1.0
        """Injected: this rank computes this many times slower (`--inject slow:...`)."""
        self._after_update: tuple[int, int] = (-1, 0)
        """(next step, state fingerprint) right after this rank's last update, kept with 2
        members: the commit vote's tie-breaker (`failover/trainer/commit.py`)."""
        self.last_compute_s = 0.0
        """The last attempt's `StepResult.compute_s` (the tasks audit logs it)."""
        self.before_update: list[Callable[[], None]] = []
        """Called just before the optimizer update of a committed step (a snapshot still copying
        the previous state waits here)."""
        self.after_update: list[Callable[[], None]] = []
        """Called right after the optimizer's update, before this rank fingerprints its result
        (fault injection: `bitflip:RANK:STEP:update`)."""
        tc = cfg.training
        self.train_sampler = MicroBatchSampler(
            data.train,
            micro_batch_size=tc.micro_batch_size,
            num_microbatches=tc.num_microbatches,
            num_replicas=membership.num_replicas,
        )
        self.valid_sampler = MicroBatchSampler(
            data.valid,
            micro_batch_size=tc.micro_batch_size,
            num_microbatches=tc.eval_microbatches,
            num_replicas=1,
        )

    # ------------------------------------------------------------------ plans
    def default_plan(self) -> RankStepPlan:
        """Failure-free plan: this rank's own micro-batches, exact."""
        m = self.membership
        return failure_free_plan(m.replica, m.num_replicas, self.cfg.training.num_microbatches)

    # ------------------------------------------------------------------ step
    def train_step(self, step: int, plan: RankStepPlan | None = None) -> StepResult:
        """One optimizer step following `plan` (all members call this together).

        The update is applied only if the membership commits it; otherwise gradients are discarded
        and the result has `committed=False` (the loop redoes the step under a new plan).
        """
        plan = plan or self.default_plan()
        if not plan.tasks:
            raise ValueError("a rank's step plan must contain at least one micro-batch")
        tc = self.cfg.training
        start = time.perf_counter()
        lr = lr_at(step, tc)
        stack.set_lr(self.optimizer, lr, tc.weight_decay)
        self.controller.on_step_start(step)
        self.membership.begin_attempt()
        self.anomaly.begin_attempt(step)
        every = self.cfg.anomaly.fingerprint_interval
        # the state this step starts from, which every replica must hold bit for bit
        check = every and step % every == 0 and self.membership.compares_fingerprints
        fp = state_fingerprint(self) if check else None
        # did this state change since this rank's own last update (a flip at rest)?
        intact = (
            None if fp is None or self._after_update[0] != step else fp == self._after_update[1]
        )
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.reducer.set_scales(plan.grad_scale, plan.attention_grad_scale)
        # megatron divides each task's loss by len(tasks); rescale so a whole micro-batch weighs
        # 1/M (see step_plan); a slice's loss is already its share of its micro-batch's
        loss_scale = len(plan.tasks) / plan.microbatches_per_replica
        sampler = self._sampler_for(plan)
        clock = self.reducer.clock
        self.reducer.comm_s = 0.0
        t_compute = self._t_compute = clock()
        fwd = functools.partial(
            self._forward_step, sampler=sampler, step=step, loss_scale=loss_scale
        )
        outputs = stack.forward_backward(
            self.ddp,
            fwd,
            iter(plan.tasks),
            num_microbatches=len(plan.tasks),
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=tc.micro_batch_size,
        )
        self.controller.set_degraded(False)
        if not self.ctx.on_cpu:
            torch.cuda.synchronize()
        compute_s = clock() - t_compute - self.reducer.comm_s
        self.last_compute_s = compute_s
        samples = sum(t.num_samples(tc.micro_batch_size) for t in plan.tasks)
        task_losses = [float(o["loss"]) for o in outputs]  # none off the last pipeline stage
        self.anomaly.check_losses(task_losses, units=samples / tc.micro_batch_size)
        judged = self._judged(plan, step)
        ordinary = judged and self._own(plan)
        self.anomaly.check_spikes(loss_ok=judged, grad_ok=ordinary)
        loss, global_samples = self._global_mean_loss(outputs)
        # a rank whose last parameter all-gather failed has stale parameters: never commit on them
        fresh = not getattr(self.optimizer, "stale", False)
        committed = self.membership.commit(
            step,
            self.membership.failed is None and fresh,
            anomaly=self._anomaly_record(plan, task_losses),
            fingerprint=fp,
            intact=intact,
        )
        updated, grad_norm = False, 0.0
        if committed:
            self.anomaly.accept(loss_ok=judged, grad_ok=ordinary)
            for wait in self.before_update:
                wait()
            # E = 0: no member computed attention grads; AdamW must not move those weights
            held = self.reducer.masked_params if plan.holds_masked_params else ()
            with stack.hold_params(self.optimizer, held):
                updated, grad_norm, _ = self.optimizer.step()
            for hook in self.after_update:
                hook()
            m = self.membership
            if every and (step + 1) % every == 0 and m.compares_fingerprints and m.size == 2:
                # 2 members cannot outvote each other: each keeps its own mark to name a flip
                self._after_update = (step + 1, state_fingerprint(self))
        else:
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        tokens = samples * self.cfg.model.seq_length
        global_tokens = (
            plan.num_replicas
            * plan.microbatches_per_replica
            * tc.micro_batch_size
            * self.cfg.model.seq_length
        )
        return StepResult(
            step=step,
            loss=loss,
            grad_norm=float(grad_norm or 0.0),
            lr=lr,
            num_tokens=tokens,
            global_tokens=global_tokens,
            step_time_s=time.perf_counter() - start,
            updated=bool(updated),
            committed=committed,
            global_microbatches=global_samples // tc.micro_batch_size,
            global_samples=global_samples,
            compute_s=compute_s,
        )

    def _slow_down(self) -> None:
        """An injected straggler (`--inject slow:...`): its compute so far, stretched
        `slow_factor` times, before it joins the reductions (the others wait there for it)."""
        if self.slow_factor > 1:
            clock = self.reducer.clock
            _stall((self.slow_factor - 1) * (clock() - self._t_compute), clock)

    def _judged(self, plan: RankStepPlan, step: int) -> bool:
        """No task of `plan` is skipped as bad data: its loss can be judged (a degraded task's
        forward pass is exact: MeCeFO's techniques change the backward only)."""
        return not any(
            self.anomaly.is_skipped(step, t.source_dp_rank, t.micro_index) for t in plan.tasks
        )

    def _own(self, plan: RankStepPlan) -> bool:
        """Is `plan` this rank's failure-free work (its own micro-batches, whole, exact)? Only
        then is its local gradient norm comparable from step to step."""
        r, m = self.membership.replica, self.cfg.training.num_microbatches
        return [(t.source_dp_rank, t.micro_index, t.samples, t.degraded) for t in plan.tasks] == [
            (r, i, None, False) for i in range(m)
        ]

    def _sampler_for(self, plan: RankStepPlan) -> MicroBatchSampler:
        s = self.train_sampler
        if (
            plan.num_replicas == s.num_replicas
            and plan.microbatches_per_replica == s.num_microbatches
        ):
            return s
        return MicroBatchSampler(
            self.data.train,
            micro_batch_size=self.cfg.training.micro_batch_size,
            num_microbatches=plan.microbatches_per_replica,
            num_replicas=plan.num_replicas,
        )

    def _forward_step(
        self, data_iterator, model, *, sampler, step: int, loss_scale: float, training=True
    ):
        """megatron forward_step_func: one micro-batch in the mode its task asks for."""
        task: MicroBatchTask = next(data_iterator)
        batch = sampler.get(step, task.source_dp_rank, task.micro_index, task.samples)
        skipped = training and self.anomaly.is_skipped(step, task.source_dp_rank, task.micro_index)
        if skipped:  # bad data: a zero-weight stand-in keeps the slot (and the collectives)
            batch = {k: torch.zeros_like(v) for k, v in batch.items()}
        # a slice divides by its whole micro-batch's loss tokens: its share, not its own mean
        denominator = (
            sampler.loss_tokens(step, task.source_dp_rank, task.micro_index)
            if task.is_slice
            else None
        )
        self.controller.set_degraded(task.degraded, task.techniques)
        device = self.ctx.device
        tokens = batch["tokens"].to(device, non_blocking=True)
        position_ids = batch["position_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        loss_mask = batch["loss_mask"].to(device, non_blocking=True)
        output = model(tokens, position_ids, None, labels=labels)
        poison = self.anomaly.poison(step, task.source_dp_rank) if training else None
        if poison is not None and not skipped:
            output = output * poison  # an injected fault (`--inject nan:...`, `spike:...`)
        return output, functools.partial(
            _masked_mean_loss, loss_mask, loss_scale, denominator, skipped
        )

    def _global_mean_loss(self, outputs: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
        """(mean of the micro-batch losses of all members, samples they ran in total).

        Each output's loss is its micro-batch's, or a slice's share of it; dividing the sum by
        samples / micro-batch size counts a micro-batch once however it was cut. A member may
        contribute none. NaN if the reduction failed (the step will not commit).
        """
        mbs = self.cfg.training.micro_batch_size
        total = torch.tensor(
            [
                sum(float(o["loss"]) for o in outputs),
                float(sum(int(o.get("samples", mbs)) for o in outputs)),
            ],
            dtype=torch.float64,
            device=self.ctx.device,
        )
        if self.ctx.pp_group is not None:  # only the last stage has losses: every stage needs them
            dist.broadcast(total, src=self.ctx.pp_last_rank, group=self.ctx.pp_group)
        if not self.membership.all_reduce(total):
            return math.nan, 0
        return float(total[0] / max(float(total[1]) / mbs, 1.0)), int(total[1])

    def _anomaly_record(self, plan: RankStepPlan, task_losses: list[float]) -> str | None:
        """What this rank flagged in this attempt, with the tasks it ran and each one's mean loss
        (a slice's loss is its share of its micro-batch's), for the vote; None when nothing
        was flagged (the common case costs nothing)."""
        if self.anomaly.reason is None:
            return None
        b = self.cfg.training.micro_batch_size
        means = [x * b / t.num_samples(b) for x, t in zip(task_losses, plan.tasks)] or None
        return self.anomaly.record([(t.source_dp_rank, t.micro_index) for t in plan.tasks], means)

    @torch.no_grad()
    def forward_check(self, step: int, pairs: list[tuple[int, int]]) -> list[float] | None:
        """Recompute the micro-batches `pairs` (source replica, index) of `step` forward-only with
        this rank's parameters (which equal the suspect's: replicas are bitwise equal): each
        one's loss. None on a rank without losses (not the last pipeline stage). The rerun of a
        suspect's step on a healthy peer (`failover/trainer/rerun.py`)."""
        tasks = [MicroBatchTask(source, i) for source, i in pairs]
        outputs = self._forward_only(tasks, self.train_sampler, step, training=True)
        return [float(o["loss"]) for o in outputs] if outputs else None

    def _forward_only(self, tasks, sampler, step: int, *, training: bool) -> list:
        """megatron's schedule over `tasks`, forward only: each task's loss report."""
        fwd = functools.partial(
            self._forward_step, sampler=sampler, step=step, loss_scale=1.0, training=training
        )
        return stack.forward_backward(
            self.ddp,
            fwd,
            iter(tasks),
            num_microbatches=len(tasks),
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=self.cfg.training.micro_batch_size,
            forward_only=True,
        )

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over a fixed set of micro-batches, split across the members.

        NaN if a member was lost during evaluation (nothing is updated by it).
        """
        num = self.cfg.training.eval_microbatches
        m = self.membership
        mine = [MicroBatchTask(0, i) for i in range(m.position, num, m.size)]
        outputs = []
        if mine:
            outputs = self._forward_only(mine, self.valid_sampler, 0, training=False)
        self.membership.begin_attempt()
        return self._global_mean_loss(outputs)[0]

    def close(self) -> None:
        from megatron_mecefo.mcore.parallel import destroy_parallel

        destroy_parallel()


def _stall(seconds: float, clock) -> None:
    """Take `seconds` more of `clock`: on CPU (this thread's CPU time) a busy loop, as a slower
    CPU would; on a GPU (wall time) a sleep, as a host waiting for a slower device."""
    if clock is time.perf_counter:
        time.sleep(seconds)
        return
    end = clock() + seconds
    while clock() < end:
        pass


def _masked_mean_loss(
    loss_mask: torch.Tensor,
    loss_scale: float,
    denominator: float | None,
    skipped: bool,
    output: torch.Tensor,
):
    """Token-mean loss over `loss_mask`; the backward loss is scaled so micro-batches weigh 1/M.

    A slice (`denominator` = its whole micro-batch's loss tokens) divides its token sum by the
    micro-batch's count, so its slices' losses add up to the micro-batch's token mean.
    """
    mask = loss_mask.reshape(-1).float()
    if denominator is None:
        loss = (output.float().reshape(-1) * mask).sum() / mask.sum().clamp(min=1.0)
    else:
        loss = (output.float().reshape(-1) * mask).sum() / denominator
    samples = 0 if skipped else loss_mask.shape[0]  # a skipped micro-batch trained on nothing
    report = {"loss": loss.detach().clone(), "samples": torch.tensor(samples)}
    return loss * loss_scale, report


def resolve_bf16(cfg: RunConfig, ctx: ParallelContext) -> bool:
    """precision=auto: bf16 on GPU, fp32 on CPU."""
    precision = cfg.training.precision
    if precision == "auto":
        return not ctx.on_cpu
    return precision == "bf16"


def build_engine(
    cfg: RunConfig,
    ctx: ParallelContext | None = None,
    *,
    log: Any = None,
    membership: Membership | None = None,
    data_rank: int | None = None,
    data_barrier: Callable[[], None] | None = None,
    data_guard: Callable[[], AbstractContextManager] | None = None,
    shard_placement: dict[str, int] | None = None,
    init_weights: bool = True,
) -> Engine:
    """Initialise distributed state (if not given) and build every component of a run.

    Args:
        cfg: the run config.
        ctx: the TP layout (initialised from `cfg.parallel` if None).
        log: called with one-line progress messages.
        membership: the DP membership; default: static, megatron's DP group. Failover passes its
            own (megatron then sees one replica; cross-replica traffic is the membership's).
        data_rank, data_barrier: who builds the data and how ranks wait for it (default: the
            global rank and `ctx.barrier`; failover passes store-based ones across replicas).
        data_guard: held around data preparation (failover: a lock among the builders).
        shard_placement: `copies`, `replicas_per_node` and `placed` of the distributed
            optimizer's shards (default: one copy each, placed now; failover keeps two, placed
            at its first regroup).
        init_weights: False for a rank whose every weight will come from saved state or a
            peer (a restarted rank under failover): the random draw would be thrown away.
    """
    ctx = ctx or init_parallel(cfg.parallel)
    membership = membership or Membership.static(*data_parallel_layout())
    tc = cfg.training
    n = membership.num_replicas
    with data_guard() if data_guard is not None else contextlib.nullcontext():
        rank = ctx.rank if data_rank is None else data_rank
        data = prepare_run_data(cfg, n, rank=rank, barrier=data_barrier or ctx.barrier)
    check_vocab(data.tokenizer.vocab_size, cfg.model.vocab_size)
    seed_everything(tc.seed)
    bf16 = resolve_bf16(cfg, ctx)
    p = cfg.parallel
    model, tcfg, spec_name = build_gpt_model(
        cfg.model,
        tp_size=ctx.tp_size,
        pp_size=ctx.pp_size,
        stages=(p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage),
        bf16=bf16,
        seed=tc.seed,
        init=init_weights,
    )
    if not ctx.on_cpu:
        model = model.cuda()
    controller = install_degraded_mode(model, cfg.mecefo)  # disabled: installs nothing
    ddp = stack.wrap_ddp(model, tcfg)
    if tc.use_distributed_optimizer:
        optimizer = _sharded_optimizer(ddp, model, membership, tc, shard_placement or {})
    else:
        optimizer = stack.build_optimizer(
            ddp,
            lr=tc.lr,
            min_lr=tc.min_lr,
            weight_decay=tc.weight_decay,
            betas=(tc.adam_beta1, tc.adam_beta2),
            eps=tc.adam_eps,
            clip_grad=tc.clip_grad,
            bf16=bf16,
        )
    reducer = stack.PlanGradReducer(ddp, membership, controller.is_masked_param)
    stack.install_grad_reducer(ddp, tcfg, reducer)
    if log is not None:
        log(
            f"model {cfg.model.name}: {cfg.model.num_parameters() / 1e6:.2f}M params, "
            f"spec={spec_name}, {'bf16' if bf16 else 'fp32'}, "
            f"DP={membership.num_replicas} TP={ctx.tp_size} PP={ctx.pp_size}, "
            f"backend={ctx.backend}"
        )
    return Engine(cfg, ctx, model, ddp, tcfg, optimizer, data, controller, reducer, membership)


def _sharded_optimizer(ddp, model, membership: Membership, tc, placement: dict[str, int]):
    from megatron_mecefo.optim.sharded import AdamHyper, ShardedOptimizer

    return ShardedOptimizer(
        stack.optimizer_param_groups(ddp),
        {p: n for n, p in model.named_parameters()},
        membership,
        AdamHyper(betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps, clip_grad=tc.clip_grad),
        lr=tc.lr,
        weight_decay=tc.weight_decay,
        copies=placement.get("copies", 1),
        replicas_per_node=placement.get("replicas_per_node", 1),
        placed=placement.get("placed", True),
    )


def prepare_run_data(cfg: RunConfig, n: int, *, rank: int, barrier):
    """The run's data for `n` replicas: every step's global batch indexed, and the validation
    micro-batches (also what a peer system is given, so that it trains on the same samples)."""
    tc = cfg.training
    return prepare_data(
        cfg.data,
        seq_length=cfg.model.seq_length,
        num_train_samples=tc.max_steps * tc.micro_batch_size * tc.num_microbatches * n,
        num_valid_samples=tc.eval_microbatches * tc.micro_batch_size,
        seed=tc.seed,
        rank=rank,
        barrier=barrier,
    )
