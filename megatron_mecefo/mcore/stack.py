"""Megatron DDP + optimizer + forward-backward schedule, with the gradient reduction owned by us.

Megatron's DDP binds its DP group and `1/dp` scaling at construction. Instead of rebuilding it on
every membership change, `PlanGradReducer` is installed as `finalize_model_grads_func`: it scales
the contiguous grad buffers per parameter (ordinary 1/n, attention/input-norm `masked_scale`)
before ONE SUM all-reduce per buffer over the current `Membership` (failover swaps its group and
makes the collective abortable; a failed reduction is recorded there and decided at the commit).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


def wrap_ddp(model: torch.nn.Module, tcfg: Any) -> torch.nn.Module:
    """Megatron `DistributedDataParallel` with fp32 grad buffers and no overlapped reduction."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=False,
    )
    return DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=model)


def build_optimizer(
    ddp: torch.nn.Module,
    *,
    lr: float,
    min_lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    clip_grad: float,
    bf16: bool,
):
    """`get_megatron_optimizer` AdamW (torch fallback without TE/Apex)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        clip_grad=clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=False,
    )
    return get_megatron_optimizer(ocfg, [ddp])


def optimizer_param_groups(ddp: torch.nn.Module) -> list[dict[str, Any]]:
    """megatron's AdamW parameter groups, in its order: `params`, `wd_mult` (0 for biases and
    1-D parameters), `lr_mult`. Collective over the default group (megatron aligns the groups of
    every rank): all its ranks call this together."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    groups = _get_param_groups([ddp], OptimizerConfig(optimizer="adam", lr=1.0), None)
    return [
        {"params": g["params"], "wd_mult": g["wd_mult"], "lr_mult": g["lr_mult"]} for g in groups
    ]


def counts_in_grad_norm(param: torch.Tensor) -> bool:
    """megatron's filter for the gradient norm: shared parameters and tensor-parallel duplicates
    (a norm's weight on TP ranks > 0) are counted once."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)


def grad_norm(grads: list[torch.Tensor]) -> float:
    """The global L2 norm of `grads` over this replica's model-parallel ranks (TP x PP), as
    megatron's non-distributed optimizer computes it (collective over that group)."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    return float(get_grad_norm_fp32(grads, grad_stats_parallel_group=ps.get_model_parallel_group()))


def set_lr(optimizer, lr: float, weight_decay: float) -> None:
    """This step's learning rate and weight decay, per parameter group, as megatron's
    `OptimizerParamScheduler` sets them: weight decay times the group's `wd_mult` (0 for biases
    and 1-D parameters such as norms), learning rate times its `lr_mult`. The optimizer's own
    default would decay every group alike."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


@contextlib.contextmanager
def hold_params(optimizer, params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Restore `params`, their fp32 master copies and their optimizer moments after the optimizer
    step run inside: a step that computed no gradient for them (masked averaging with E = 0) must
    not move them. Their reduced gradient is zero, but AdamW would still step them by its
    momentum (exp_avg / sqrt(exp_avg_sq) decays slowly: ~0.92 per step with betas (0.9, 0.95))
    and weight decay, along a direction no data of this step supports. The step count advances
    as for every parameter (megatron keeps one). Every replica restores the same values."""
    if not params:
        yield
        return
    tensors = [p.data for p in params] + optimizer_tensors(optimizer, params)
    saved = [t.detach().clone() for t in tensors]
    yield
    with torch.no_grad():
        for tensor, value in zip(tensors, saved):
            tensor.copy_(value)


def optimizer_tensors(optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The optimizer's tensors that belong to `params`: master copies (bf16 training) and every
    per-parameter state tensor but the step count; the sharded optimizer names its own."""
    if hasattr(optimizer, "state_views"):
        return optimizer.state_views(params)
    out: list[torch.Tensor] = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        main_of = {  # Float16OptimizerWithFloat16Params: model param -> its fp32 master
            id(model): main
            for models, mains in zip(
                getattr(opt, "float16_groups", ()), getattr(opt, "fp32_from_float16_groups", ())
            )
            for model, main in zip(models, mains)
        }
        for param in params:
            main = main_of.get(id(param), param)
            if main is not param:
                out.append(main.data)
            state = opt.optimizer.state.get(main, {})
            out += [v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)]
    return out


def forward_backward(
    ddp: torch.nn.Module,
    forward_step: Callable,
    data_iterator: Iterator,
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Run megatron's (non-pipelined) schedule; returns the per-micro-batch reporting dicts."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=[ddp],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


class PlanGradReducer:
    """Pre-scale + SUM all-reduce of megatron DDP grad buffers on an explicit DP group.

    Args:
        ddp: the megatron DDP module whose `buffers` hold contiguous `grad_data`.
        membership: the DP membership (its `all_reduce` runs on the current generation's group).
        is_masked_param: name -> True for attention / input-norm params (masked averaging).
    """

    def __init__(
        self,
        ddp,
        membership,
        is_masked_param: Callable[[str], bool] | None = None,
    ):
        self.ddp = ddp
        self.membership = membership
        self.grad_scale = 1.0
        self.attention_grad_scale = 1.0
        self._masks = self._build_masks(ddp, is_masked_param) if is_masked_param else None
        self.masked_params = (
            [p for n, p in ddp.module.named_parameters() if is_masked_param(n)]
            if is_masked_param
            else []
        )
        """The parameters `attention_grad_scale` applies to (held on a step with E = 0)."""
        self.check_grad: Callable[[torch.Tensor], None] | None = None
        """Sees each local gradient buffer before it is scaled and reduced (NaN/Inf checks)."""
        self.comm_s = 0.0
        """`clock` seconds spent in the reductions (waits for slower members included); the
        engine zeroes it each step to tell a rank's own compute time from its waits."""
        self.clock: Callable[[], float] = time.perf_counter
        """The engine's compute clock (`Engine.train_step`)."""
        self.before_reduce: Callable[[], None] | None = None
        """Called once per step after the last backward, before any reduction (an injected
        straggler's extra compute goes here, where a slow device would spend it)."""

    @staticmethod
    def _build_masks(ddp, is_masked_param) -> list[torch.Tensor | None]:
        names = {p: n for n, p in ddp.module.named_parameters()}
        masks = []
        for buffer in ddp.buffers + ddp.expert_parallel_buffers:
            mask = torch.zeros(
                buffer.grad_data.numel(), dtype=torch.bool, device=buffer.grad_data.device
            )
            for param, (start, end, _bucket) in buffer.param_index_map.items():
                if is_masked_param(names[param]):
                    mask[start:end] = True
            masks.append(mask if bool(mask.any()) else None)
        return masks

    def set_scales(self, grad_scale: float, attention_grad_scale: float) -> None:
        self.grad_scale = grad_scale
        self.attention_grad_scale = attention_grad_scale

    def __call__(
        self, model_chunks=None, num_tokens=None, pg_collection=None, force_all_reduce=False
    ):
        """Signature of megatron's `finalize_model_grads_func`; all DP ranks call this in order."""
        if self.before_reduce is not None:
            self.before_reduce()
        buffers = self.ddp.buffers + self.ddp.expert_parallel_buffers
        for i, buffer in enumerate(buffers):
            grad = buffer.grad_data
            if self.check_grad is not None:
                self.check_grad(grad)
            mask = self._masks[i] if self._masks else None
            if mask is None or self.attention_grad_scale == self.grad_scale:
                grad.mul_(self.grad_scale)
            else:
                scale = torch.where(mask, self.attention_grad_scale, self.grad_scale)
                grad.mul_(scale.to(grad.dtype))
            # a failure is recorded in membership.failed (the commit vote then discards this
            # step); the remaining buffers are still reduced so every member issues the same
            # collectives
            t0 = self.clock()
            self.membership.all_reduce(grad)
            self.comm_s += self.clock() - t0


def install_grad_reducer(ddp, tcfg, reducer: PlanGradReducer) -> None:
    """Make megatron's schedule call `reducer` after the last backward of a step."""
    tcfg.finalize_model_grads_func = reducer
    tcfg.no_sync_func = None
    tcfg.grad_sync_func = None
