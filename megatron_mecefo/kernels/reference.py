"""Torch reference for the MeCeFO low-rank FFN path (forward projection and weight gradient).

This is the semantics the Triton kernels must match and the fallback wherever they cannot run (CPU,
no Triton). It owns only math on tensors: no autograd functions, no module state, no dispatch.

Shapes (Megatron layout, row-major): x [b, n], weight [m, n], v [n, r], y [b, m], x_proj [b, r],
grad_output [b, m], weight gradient [m, n].
"""

from __future__ import annotations

import torch
from torch import Tensor

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the products accumulate in: fp64 for fp64 inputs, fp32 for everything else.

    Args:
        dtype: Dtype of the input tensors.

    Returns:
        `torch.float64` for fp64 inputs, else `torch.float32`.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_inputs_forward(x: Tensor, weight: Tensor, v: Tensor) -> None:
    """Raise `ValueError` unless x [b, n], weight [m, n], v [n, r] agree in shape and dtype."""
    if x.dim() != 2 or weight.dim() != 2 or v.dim() != 2:
        raise ValueError(
            f"expected 2-D x [b, n], weight [m, n], v [n, r] (flatten tokens first); got "
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, v {tuple(v.shape)}"
        )
    n = x.shape[1]
    if weight.shape[1] != n or v.shape[0] != n:
        raise ValueError(
            f"inner dimensions disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"v {tuple(v.shape)} (need x [b, n], weight [m, n], v [n, r])"
        )
    _check_dtypes(x=x, weight=weight, v=v)


def check_inputs_grad(
    grad_output: Tensor, x_proj: Tensor, v: Tensor, out: Tensor | None
) -> tuple[int, int]:
    """Validate grad_output [b, m], x_proj [b, r], v [n, r], out [m, n]; return (m, n)."""
    if grad_output.dim() != 2 or x_proj.dim() != 2 or v.dim() != 2:
        raise ValueError(
            f"expected 2-D grad_output [b, m], x_proj [b, r], v [n, r]; got grad_output "
            f"{tuple(grad_output.shape)}, x_proj {tuple(x_proj.shape)}, v {tuple(v.shape)}"
        )
    if grad_output.shape[0] != x_proj.shape[0] or x_proj.shape[1] != v.shape[1]:
        raise ValueError(
            f"shapes disagree: grad_output {tuple(grad_output.shape)}, x_proj "
            f"{tuple(x_proj.shape)}, v {tuple(v.shape)} (need [b, m], [b, r], [n, r])"
        )
    _check_dtypes(grad_output=grad_output, x_proj=x_proj, v=v)
    m, n = grad_output.shape[1], v.shape[0]
    if out is not None:
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected [m, n] = [{m}, {n}]")
        if out.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"out (main_grad) must be float32 or float64, got {out.dtype}")
        if out.device != grad_output.device:
            raise ValueError(f"out is on {out.device}, inputs on {grad_output.device}")
    return m, n


def _check_dtypes(**tensors: Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"all inputs must share one dtype, got {dtypes}")
    dtype = next(iter(dtypes.values()))
    if dtype not in _SUPPORTED:
        raise ValueError(f"unsupported dtype {dtype}; use one of {_SUPPORTED}")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")


def linear_with_projection_torch(x: Tensor, weight: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Reference forward: y = x @ weight.T and x_proj = x @ v, both in x.dtype.

    Args:
        x: Activations [b, n].
        weight: Linear weight [m, n].
        v: Top-r right singular vectors of `weight`, [n, r].

    Returns:
        (y [b, m], x_proj [b, r]), computed with accumulation in fp32 (fp64 for fp64 inputs) and
        rounded once to x.dtype.
    """
    check_inputs_forward(x, weight, v)
    acc = accumulation_dtype(x.dtype)
    if x.dtype in _LOW_PRECISION and x.is_cuda:
        # cuBLAS accumulates half/bf16 GEMMs in fp32 already: no upcast copies needed.
        return x @ weight.t(), x @ v
    xa = x.to(acc)
    y = xa @ weight.to(acc).t()
    x_proj = xa @ v.to(acc)
    return y.to(x.dtype), x_proj.to(x.dtype)


def lowrank_weight_grad_torch(
    grad_output: Tensor,
    x_proj: Tensor,
    v: Tensor,
    *,
    out: Tensor | None = None,
    accumulate: bool = False,
) -> Tensor:
    """Reference low-rank weight gradient G_W ~= (grad_output.T @ x_proj) @ v.T, [m, n].

    The rank-r factor T = grad_output.T @ x_proj ([m, r]) is formed in the accumulation dtype, then
    expanded by v.T straight into `out` with `addmm_` (no separate m x n temporary from this code;
    torch may still copy internally when `out` is non-contiguous).

    Args:
        grad_output: G_y, [b, m].
        x_proj: x @ v from the forward, [b, r].
        v: Right singular vectors, [n, r].
        out: Optional fp32/fp64 [m, n] buffer (Megatron `main_grad`, any strides).
        accumulate: Add into `out` instead of overwriting it. Requires `out`.

    Returns:
        `out` when given; else a new [m, n] tensor in grad_output.dtype.
    """
    m, n = check_inputs_grad(grad_output, x_proj, v, out)
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the main_grad buffer to add into)")
    acc = accumulation_dtype(grad_output.dtype)
    t = grad_output.to(acc).t() @ x_proj.to(acc)  # [m, r], small
    if out is None:
        return (t @ v.to(acc).t()).to(grad_output.dtype)
    t = t.to(out.dtype)
    v_t = v.to(out.dtype).t()  # [r, n]
    # beta=0 ignores the old contents of out entirely (even NaN/inf), like a plain write.
    out.addmm_(t, v_t, beta=1.0 if accumulate else 0.0)
    return out
