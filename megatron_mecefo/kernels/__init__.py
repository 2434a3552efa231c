"""Fused kernels for MeCeFO's low-rank FFN weight-gradient path, with a torch fallback.

Public API (the only thing MeCeFO code should import from here):
`linear_with_projection` (forward: y = x W^T and x_proj = x V in one GEMM), `lowrank_weight_grad`
(backward: main_grad (+)= (G_y^T x_proj) V^T without an m x n temporary) and `triton_available`.
Triton is imported lazily, only when the Triton backend is used; this module never imports it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

import torch
from torch import Tensor

from megatron_mecefo.kernels.reference import (
    check_inputs_forward,
    check_inputs_grad,
    linear_with_projection_torch,
    lowrank_weight_grad_torch,
)

__all__ = ["Backend", "linear_with_projection", "lowrank_weight_grad", "triton_available"]

Backend = Literal["auto", "torch", "triton"]
_BACKENDS = ("auto", "torch", "triton")


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    """True when Triton's CPU interpreter is on (TRITON_INTERPRET=1), as used by the CPU tests."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    """Whether the Triton backend can run here.

    Returns:
        True if triton is importable and either a CUDA device is present or the Triton CPU
        interpreter is enabled (`TRITON_INTERPRET=1`, tests only: it is orders of magnitude slow).
    """
    if not _triton_importable():
        return False
    return torch.cuda.is_available() or _interpreting()


def _use_triton(backend: str, *tensors: Tensor) -> bool:
    """Resolve `backend` for these inputs; raise if "triton" was asked for and cannot run."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        # fp64 is a test dtype, never a training one: leave it to cuBLAS.
        return on_cuda and tensors[0].dtype != torch.float64 and triton_available()
    if not triton_available():
        raise RuntimeError(
            "backend='triton' needs triton installed and a CUDA device (or TRITON_INTERPRET=1 for "
            "CPU tests); use backend='auto' to fall back to torch"
        )
    if not on_cuda and not _interpreting():
        raise RuntimeError(
            "backend='triton' got CPU tensors; that only works with TRITON_INTERPRET=1"
        )
    return True


def linear_with_projection(
    x: Tensor, weight: Tensor, v: Tensor, *, backend: Backend = "auto"
) -> tuple[Tensor, Tensor]:
    """Forward of an FFN linear plus its low-rank projection, as one GEMM against [W; V^T].

    Args:
        x: Activations [b, n] (2-D: callers flatten [s, mb, n] to [s*mb, n]); any strides.
        weight: Linear weight W [m, n].
        v: Top-r right singular vectors of W, [n, r].
        backend: "auto" (Triton for CUDA tensors when available, else torch), "torch" or "triton".

    Returns:
        (y, x_proj): y = x @ weight.T [b, m] and x_proj = x @ v [b, r], both in x.dtype, accumulated
        in fp32 (fp64 for fp64 inputs). All inputs must share one dtype and device.
    """
    check_inputs_forward(x, weight, v)
    if _use_triton(backend, x, weight, v):
        from megatron_mecefo.kernels import triton_lowrank

        return triton_lowrank.linear_with_projection_triton(x, weight, v)
    return linear_with_projection_torch(x, weight, v)


def lowrank_weight_grad(
    grad_output: Tensor,
    x_proj: Tensor,
    v: Tensor,
    *,
    out: Tensor | None = None,
    accumulate: bool = False,
    backend: Backend = "auto",
) -> Tensor:
    """Low-rank weight gradient G_W ~= (grad_output.T @ x_proj) @ v.T, optionally into main_grad.

    Args:
        grad_output: G_y [b, m].
        x_proj: x @ v saved by the forward, [b, r].
        v: The same V [n, r] as in the forward.
        out: Optional fp32 (or fp64) [m, n] buffer, e.g. Megatron's `main_grad` view; any strides.
            It is written in place and no extra m x n tensor is materialised.
        accumulate: Add into `out` (gradient accumulation) instead of overwriting it; needs `out`.
        backend: "auto", "torch" or "triton" (see `linear_with_projection`).

    Returns:
        `out` if given, else a new [m, n] tensor in grad_output.dtype.
    """
    check_inputs_grad(grad_output, x_proj, v, out)
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the main_grad buffer to add into)")
    tensors = (grad_output, x_proj, v) if out is None else (grad_output, x_proj, v, out)
    if _use_triton(backend, *tensors):
        from megatron_mecefo.kernels import triton_lowrank

        return triton_lowrank.lowrank_weight_grad_triton(
            grad_output, x_proj, v, out=out, accumulate=accumulate
        )
    return lowrank_weight_grad_torch(grad_output, x_proj, v, out=out, accumulate=accumulate)
