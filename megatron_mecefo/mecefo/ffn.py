"""Degraded-mode FFN: pre-MLP norm + SwiGLU MLP as one autograd function (techniques 2 and 3).

Forward keeps only the FFN input (recompute on) and the rank-r projections x V (low-rank on);
backward recomputes norm, fc1 and the activation, computes exact input gradients and low-rank weight
gradients `G_W ~= (G_y^T (x V)) V^T` (written into megatron's `main_grad` when it exists). Weights
are read by duck typing from megatron's local spec (`pre_mlp_layernorm.weight`) or the Transformer
Engine spec (`linear_fc1.layer_norm_weight`); no megatron import. Tensor-parallel shards are handled
with explicit all-reduces on the layer's TP group; sequence parallelism is not supported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron_mecefo.kernels import linear_with_projection, lowrank_weight_grad


@dataclasses.dataclass
class FfnWeights:
    """Where one layer's FFN parameters live and how its norm and activation are computed."""

    norm_weight: torch.nn.Parameter
    """RMSNorm gain [d] (local: pre_mlp_layernorm.weight; TE: linear_fc1.layer_norm_weight)."""
    norm_eps: float
    zero_centered_gamma: bool
    """TE/megatron option: the stored gain is (gamma - 1)."""
    fc1: torch.nn.Parameter
    """Fused [gate; up] weight, local shard [2f/tp, d] (or [f/tp, d] without GLU)."""
    fc2: torch.nn.Parameter
    """Down projection, local shard [d, f/tp]."""
    activation: Callable[[Tensor], Tensor]
    gated: bool
    glu_linear_offset: float
    clamp_value: float | None
    tp_group: dist.ProcessGroup | None
    """Tensor-parallel group of the shards; None or size 1 means no TP communication."""


def resolve_ffn_weights(layer: torch.nn.Module) -> FfnWeights:
    """Find a TransformerLayer's FFN parameters in either the local or the TE layout.

    Raises:
        NotImplementedError: MoE MLP, biases, LayerNorm (not RMSNorm), or sequence parallelism.
    """
    cfg = layer.config
    mlp = layer.mlp
    fc1_mod = getattr(mlp, "linear_fc1", None)
    fc2_mod = getattr(mlp, "linear_fc2", None)
    if fc1_mod is None or fc2_mod is None:
        raise NotImplementedError("MeCeFO's degraded FFN needs a dense MLP (linear_fc1/linear_fc2)")
    if getattr(cfg, "sequence_parallel", False):
        raise NotImplementedError("MeCeFO's degraded FFN does not support sequence parallelism")
    if getattr(cfg, "normalization", "RMSNorm") != "RMSNorm":
        raise NotImplementedError(f"degraded FFN supports RMSNorm only, not {cfg.normalization}")
    for mod in (fc1_mod, fc2_mod):
        bias = getattr(mod, "bias", None)
        if isinstance(bias, torch.Tensor) and bias.numel() > 0:
            raise NotImplementedError("degraded FFN does not support biases in linear_fc1/fc2")
    te_norm = getattr(fc1_mod, "layer_norm_weight", None)
    if isinstance(te_norm, torch.Tensor):  # TE spec: norm fused into linear_fc1 (LayerNormLinear)
        norm_weight = te_norm
        eps = float(getattr(fc1_mod, "eps", cfg.layernorm_epsilon))
        zero_centered = bool(getattr(fc1_mod, "zero_centered_gamma", False))
    else:  # local spec: a separate norm module (torch RMSNorm, or TENorm)
        norm = layer.pre_mlp_layernorm
        norm_weight = norm.weight
        eps = getattr(norm, "eps", None)
        eps = float(cfg.layernorm_epsilon if eps is None else eps)
        zero_centered = bool(getattr(norm, "zero_centered_gamma", False))
    tp_group = getattr(fc1_mod, "tp_group", None)
    return FfnWeights(
        norm_weight=norm_weight,
        norm_eps=eps,
        zero_centered_gamma=zero_centered,
        fc1=fc1_mod.weight,
        fc2=fc2_mod.weight,
        activation=cfg.activation_func,
        gated=bool(cfg.gated_linear_unit),
        glu_linear_offset=float(getattr(cfg, "glu_linear_offset", 0.0) or 0.0),
        clamp_value=getattr(cfg, "activation_func_clamp_value", None),
        tp_group=tp_group,
    )


@dataclasses.dataclass(frozen=True)
class FfnCall:
    """Per-forward options of the degraded FFN (captured in the autograd context)."""

    weights: FfnWeights
    v1: Tensor | None
    """V of linear_fc1 [d, r1]; None = exact weight gradient."""
    v2: Tensor | None
    """V of linear_fc2 [f/tp, r2]; None = exact weight gradient."""
    recompute: bool
    """Keep only the FFN input; recompute norm, fc1 and activation in backward."""


def _tp_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def rms_norm(x: Tensor, w: FfnWeights, gain: Tensor) -> Tensor:
    """The pre-MLP RMSNorm of `w` on x [..., d] with this gain."""
    g = gain + 1 if w.zero_centered_gamma else gain
    return F.rms_norm(x, (x.shape[-1],), g, w.norm_eps)


def _activation(a: Tensor, w: FfnWeights) -> Tensor:
    """Megatron's MLP activation on the local fc1 output a [t, 2f/tp] (GLU) or [t, f/tp]."""
    if not w.gated:
        return w.activation(a)
    gate, up = torch.chunk(a, 2, dim=-1)
    if w.clamp_value is not None:
        gate = gate.clamp(min=None, max=w.clamp_value)
        up = up.clamp(min=-w.clamp_value, max=w.clamp_value)
    return w.activation(gate) * (up + w.glu_linear_offset)


def _matmul_and_project(
    x: Tensor, weight: Tensor, v: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    if v is None:
        return x @ weight.t(), None
    return linear_with_projection(x, weight, v)  # (x W^T [t, m], x V [t, r])


def _weight_grad(param: torch.nn.Parameter, g_out: Tensor, x_or_proj: Tensor, v: Tensor | None):
    """Weight gradient G_y^T x (or its low-rank form), into `main_grad` when megatron DDP owns it.

    Returns the tensor to hand back to autograd: the gradient itself, or (main_grad path) None,
    so autograd leaves `param.grad` empty and megatron's DDP hook adds nothing. Megatron's own
    gradient-accumulation fusion sets `grad_added_to_main_grad` instead, but that flag stays set
    until the next step's `zero_grad_buffer`, so an exact micro-batch after a degraded one in the
    same step would have its FFN weight gradients dropped by the hook (tested).
    """
    main_grad = getattr(param, "main_grad", None)
    if main_grad is not None and hasattr(param, "grad_added_to_main_grad"):
        if v is not None:
            lowrank_weight_grad(g_out, x_or_proj, v, out=main_grad, accumulate=True)
        else:
            main_grad.addmm_(g_out.t().to(main_grad.dtype), x_or_proj.to(main_grad.dtype))
        return None
    if v is not None:
        return lowrank_weight_grad(g_out, x_or_proj, v).to(param.dtype)
    return (g_out.t() @ x_or_proj).to(param.dtype)


class DegradedFfnFunction(torch.autograd.Function):
    """out = fc2(act(fc1(rmsnorm(x)))) with recompute and low-rank weight grads (no residual)."""

    @staticmethod
    def forward(ctx, x, norm_weight, fc1, fc2, call: FfnCall):  # noqa: D102
        w = call.weights
        shape = x.shape  # [s, b, d]
        x2d = x.reshape(-1, shape[-1])  # [t, d], t = s * b tokens
        ln = rms_norm(x2d, w, norm_weight)  # [t, d]
        a, x1_proj = _matmul_and_project(ln, fc1, call.v1)  # a [t, 2f/tp], x1_proj [t, r1]
        act = _activation(a, w)  # [t, f/tp]
        out, x2_proj = _matmul_and_project(act, fc2, call.v2)  # partial sum [t, d], x2_proj [t, r2]
        if _tp_size(w.tp_group) > 1:  # row-parallel fc2: sum the partial outputs over TP
            dist.all_reduce(out, group=w.tp_group)
        # Saved activations. Recompute: only x (+ the rank-r projections). Otherwise the fc1
        # output a (activation input), and ln / act only where an exact weight grad needs them.
        saved = {"x": x2d}
        if call.v1 is not None:
            saved["x1_proj"] = x1_proj
        if call.v2 is not None:
            saved["x2_proj"] = x2_proj
        if not call.recompute:
            saved["a"] = a
            if call.v1 is None:
                saved["ln"] = ln
            if call.v2 is None:
                saved["act"] = act
        ctx.names = tuple(saved)
        ctx.save_for_backward(*saved.values())
        ctx.call, ctx.shape = call, shape
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        call: FfnCall = ctx.call
        w = call.weights
        saved = dict(zip(ctx.names, ctx.saved_tensors))
        g = grad_out.reshape(-1, ctx.shape[-1])  # G_y of fc2 [t, d] (replicated over TP)
        need_norm_w = ctx.needs_input_grad[1]
        # The elementwise pieces (norm, activation) are re-run with a local graph so autograd gives
        # their exact backward; the matmuls are done by hand below.
        with torch.enable_grad():
            x_leaf = saved["x"].detach().requires_grad_(True)
            gain = w.norm_weight.detach().requires_grad_(need_norm_w)
            ln = rms_norm(x_leaf, w, gain)
        a = saved["a"] if "a" in saved else ln.detach() @ w.fc1.t()  # recompute fc1 [t, 2f/tp]
        with torch.enable_grad():
            a_leaf = a.detach().requires_grad_(True)
            act = _activation(a_leaf, w)
        # fc2: exact input grad, (low-rank) weight grad
        g_act = g @ w.fc2  # [t, f/tp]
        grad_fc2 = None
        if ctx.needs_input_grad[3]:
            x2 = saved["x2_proj"] if call.v2 is not None else saved.get("act", act.detach())
            grad_fc2 = _weight_grad(w.fc2, g, x2, call.v2)
        (g_a,) = torch.autograd.grad(act, a_leaf, g_act)  # [t, 2f/tp]
        g_ln = g_a @ w.fc1  # [t, d], partial over TP
        if _tp_size(w.tp_group) > 1:  # column-parallel fc1: input grad sums over TP
            dist.all_reduce(g_ln, group=w.tp_group)
        grad_fc1 = None
        if ctx.needs_input_grad[2]:
            x1 = saved["x1_proj"] if call.v1 is not None else saved.get("ln", ln.detach())
            grad_fc1 = _weight_grad(w.fc1, g_a, x1, call.v1)
        inputs = (x_leaf, gain) if need_norm_w else (x_leaf,)
        grads = torch.autograd.grad(ln, inputs, g_ln)
        grad_norm = grads[1] if need_norm_w else None
        return grads[0].view(ctx.shape), grad_norm, grad_fc1, grad_fc2, None


def degraded_ffn(x: Tensor, call: FfnCall) -> Tensor:
    """MLP branch output [s, b, d] of the FFN input x [s, b, d] (the caller adds the residual)."""
    w = call.weights
    return DegradedFfnFunction.apply(x, w.norm_weight, w.fc1, w.fc2, call)
