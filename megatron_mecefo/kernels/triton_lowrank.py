"""Triton kernels for the MeCeFO low-rank FFN path (imported lazily, only when Triton is used).

Forward: one GEMM of x against the virtual concatenation [W; V^T] writes y and x_proj = x V.
Backward: T = G_y^T x_proj ([m, r], split over tokens) then main_grad (+)= T V^T tile by tile, so
the m x n low-rank product exists only as registers inside the read-modify-write of main_grad.
This module must not be imported where triton is missing; `megatron_mecefo.kernels` dispatches here.
Under TRITON_INTERPRET=1 (CPU tests) bf16 operands are upcast before `tl.dot`, which the interpreter
mis-computes for bf16.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_mecefo.kernels.reference import accumulation_dtype

_TL_DTYPE = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@dataclass(frozen=True, kw_only=True)
class TileConfig:
    """Tile sizes and launch knobs of one kernel launch."""

    block_m: int
    """Rows of the output tile (tokens b in the forward, m in both backward stages)."""
    block_n: int
    """Columns of the output tile (m or r in the forward, r in stage 1, n in stage 2)."""
    block_k: int
    """Reduction chunk (n in the forward, tokens b in stage 1, r in stage 2)."""
    num_warps: int = 4
    """Warps per program (GPU only)."""
    num_stages: int = 3
    """Software-pipelining depth of the K loop (GPU only)."""


def _default_tiles(dtype: torch.dtype, kind: str) -> TileConfig:
    """Heuristic tiles: 128x128 bf16/fp16, narrower K for fp32 and smaller tiles for fp64.

    Under the interpreter, speed scales with the number of `tl.dot` calls, so tiles are 64^3
    regardless of dtype (the interpreter has no shared-memory limit).
    """
    if _interpreting():
        return TileConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=1)
    if dtype == torch.float64:
        return TileConfig(block_m=64, block_n=64, block_k=16, num_warps=4, num_stages=2)
    if kind == "expand" or dtype == torch.float32:
        # Stage 2 multiplies fp32 T by V upcast to fp32 (tf32 tensor cores for bf16/fp16 inputs).
        return TileConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3)
    return TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


# --------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _dot_acc(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc += a @ b; with UPCAST, operands go to fp32 first (interpreter bf16 workaround)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tile_matmul(
    a_ptr,
    stride_a_row,
    stride_a_k,
    b_ptr,
    stride_b_k,
    stride_b_col,
    offs_row,
    offs_col,
    rows,
    cols,
    k_begin,
    k_end,
    ACC_DTYPE: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    BLOCK_COL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """A[offs_row, k_begin:k_end] @ B[k_begin:k_end, offs_col] as a [BLOCK_ROW, BLOCK_COL] tile.

    A and B are addressed through explicit strides, so transposed or non-contiguous views (W read as
    W^T, G_y read as G_y^T) cost nothing. Rows/cols beyond `rows`/`cols` and k beyond `k_end` are
    masked to zero.
    """
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = offs_row[:, None] < rows
    col_mask = offs_col[None, :] < cols
    a_ptrs = a_ptr + offs_row[:, None].to(tl.int64) * stride_a_row
    b_ptrs = b_ptr + offs_col[None, :].to(tl.int64) * stride_b_col
    acc = tl.zeros((BLOCK_ROW, BLOCK_COL), dtype=ACC_DTYPE)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < k_end
        a = tl.load(a_ptrs + ks[None, :].to(tl.int64) * stride_a_k, mask=row_mask & k_ok[None, :])
        b = tl.load(b_ptrs + ks[:, None].to(tl.int64) * stride_b_k, mask=k_ok[:, None] & col_mask)
        acc = _dot_acc(a, b, acc, UPCAST, PRECISION)
    return acc


@triton.jit
def _store_tile(
    c_ptr, stride_c_row, stride_c_col, offs_row, offs_col, rows, cols, acc, ACCUMULATE: tl.constexpr
):
    """C[offs_row, offs_col] (+)= acc, masked; rounds once to C's element type."""
    mask = (offs_row[:, None] < rows) & (offs_col[None, :] < cols)
    ptrs = (
        c_ptr
        + offs_row[:, None].to(tl.int64) * stride_c_row
        + offs_col[None, :].to(tl.int64) * stride_c_col
    )
    if ACCUMULATE:
        acc = acc + tl.load(ptrs, mask=mask).to(acc.dtype)
    tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Forward: [y | x_proj] = x @ [W; V^T]^T


@triton.jit
def _linear_with_projection_kernel(
    x_ptr,
    w_ptr,
    v_ptr,
    y_ptr,
    p_ptr,
    B,
    N,
    M,
    R,
    stride_xb,
    stride_xn,
    stride_wm,
    stride_wn,
    stride_vn,
    stride_vr,
    stride_yb,
    stride_ym,
    stride_pb,
    stride_pr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_B: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Output is the virtual [B, M + R] matrix [y | x_proj]; column tiles 0..tiles_m-1 belong to y
    # (B operand W^T, read through W's strides), the remaining tiles_r column tiles to x_proj
    # (B operand V). No concatenated weight is ever built.
    pid = tl.program_id(0)
    tiles_b = tl.cdiv(B, BLOCK_B)
    tiles_m = tl.cdiv(M, BLOCK_C)
    tiles_c = tiles_m + tl.cdiv(R, BLOCK_C)
    # Grouped ordering: GROUP_B row tiles sweep all column tiles together, so the x row blocks and
    # the weight column blocks they share stay in L2.
    per_group = GROUP_B * tiles_c
    first_b = (pid // per_group) * GROUP_B
    group_size = tl.minimum(tiles_b - first_b, GROUP_B)
    pid_b = first_b + (pid % per_group) % group_size
    pid_c = (pid % per_group) // group_size
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    if pid_c < tiles_m:
        offs_m = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        acc = _tile_matmul(
            x_ptr, stride_xb, stride_xn, w_ptr, stride_wn, stride_wm, offs_b, offs_m, B, M, 0, N,
            ACC_DTYPE, BLOCK_B, BLOCK_C, BLOCK_K, UPCAST, PRECISION,
        )  # fmt: skip
        _store_tile(y_ptr, stride_yb, stride_ym, offs_b, offs_m, B, M, acc, False)
    else:
        offs_r = (pid_c - tiles_m) * BLOCK_C + tl.arange(0, BLOCK_C)
        acc = _tile_matmul(
            x_ptr, stride_xb, stride_xn, v_ptr, stride_vn, stride_vr, offs_b, offs_r, B, R, 0, N,
            ACC_DTYPE, BLOCK_B, BLOCK_C, BLOCK_K, UPCAST, PRECISION,
        )  # fmt: skip
        _store_tile(p_ptr, stride_pb, stride_pr, offs_b, offs_r, B, R, acc, False)


# --------------------------------------------------------------------------------------------------
# Backward stage 1: T_s = G_y[tokens of split s]^T @ x_proj[tokens of split s]  ([m, r] per split)


@triton.jit
def _grad_proj_kernel(
    g_ptr,
    p_ptr,
    t_ptr,
    B,
    M,
    R,
    tokens_per_split,
    stride_gb,
    stride_gm,
    stride_pb,
    stride_pr,
    stride_ts,
    stride_tm,
    stride_tr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Grid (tiles_m, tiles_r, splits). The reduction runs over tokens b, which is long (thousands)
    # while m x r is small, so the token range is split to fill the GPU; partials are summed on the
    # host side (deterministic, unlike atomics).
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    k_begin = split * tokens_per_split
    k_end = tl.minimum(k_begin + tokens_per_split, B)
    # A = G_y^T [m, b]: row stride of A is G's column stride and vice versa.
    acc = _tile_matmul(
        g_ptr, stride_gm, stride_gb, p_ptr, stride_pb, stride_pr, offs_m, offs_r, M, R,
        k_begin, k_end, ACC_DTYPE, BLOCK_M, BLOCK_R, BLOCK_K, UPCAST, PRECISION,
    )  # fmt: skip
    _store_tile(t_ptr + split * stride_ts, stride_tm, stride_tr, offs_m, offs_r, M, R, acc, False)


# --------------------------------------------------------------------------------------------------
# Backward stage 2: out[m, n] (+)= T[m, r] @ V^T[r, n], fused into the main_grad read-modify-write


@triton.jit
def _expand_into_kernel(
    t_ptr,
    v_ptr,
    out_ptr,
    M,
    N,
    R,
    stride_tm,
    stride_tr,
    stride_vn,
    stride_vr,
    stride_om,
    stride_on,
    ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Each program owns one [BLOCK_M, BLOCK_N] tile of main_grad: it reduces over the short rank
    # dimension r (T tile [BLOCK_M, BLOCK_K] in ACC_DTYPE, V^T tile [BLOCK_K, BLOCK_N] read through
    # V's strides and upcast to ACC_DTYPE), then reads main_grad once, adds, writes once.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m[:, None] < M
    n_mask = offs_n[None, :] < N
    t_ptrs = t_ptr + offs_m[:, None].to(tl.int64) * stride_tm
    v_ptrs = v_ptr + offs_n[None, :].to(tl.int64) * stride_vn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k0 in range(0, R, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < R
        t = tl.load(t_ptrs + ks[None, :] * stride_tr, mask=m_mask & k_ok[None, :])
        v = tl.load(v_ptrs + ks[:, None] * stride_vr, mask=k_ok[:, None] & n_mask).to(ACC_DTYPE)
        acc = _dot_acc(t, v, acc, UPCAST, PRECISION)
    _store_tile(out_ptr, stride_om, stride_on, offs_m, offs_n, M, N, acc, ACCUMULATE)


# --------------------------------------------------------------------------------------------------
# Host wrappers


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (like torch's default matmul); half inputs ignore it.
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def linear_with_projection_triton(
    x: Tensor, weight: Tensor, v: Tensor, *, tiles: TileConfig | None = None, group_b: int = 8
) -> tuple[Tensor, Tensor]:
    """Triton forward: (x @ weight.T, x @ v) from one launch; see `kernels.linear_with_projection`.

    Args:
        x: [b, n]; weight: [m, n]; v: [n, r]; one dtype, any strides (not validated here).
        tiles: Tile override (tests); block_m tiles tokens, block_n tiles both m and r.
        group_b: Row tiles per L2 group.

    Returns:
        (y [b, m], x_proj [b, r]) in x.dtype.
    """
    b, n = x.shape
    m, r = weight.shape[0], v.shape[1]
    y = torch.empty((b, m), dtype=x.dtype, device=x.device)
    x_proj = torch.empty((b, r), dtype=x.dtype, device=x.device)
    if b == 0 or m + r == 0:
        return y, x_proj
    if n == 0:
        return y.zero_(), x_proj.zero_()
    cfg = tiles or _default_tiles(x.dtype, "forward")
    grid = (
        triton.cdiv(b, cfg.block_m) * (triton.cdiv(m, cfg.block_n) + triton.cdiv(r, cfg.block_n)),
    )
    _linear_with_projection_kernel[grid](
        x, weight, v, y, x_proj, b, n, m, r,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), v.stride(0), v.stride(1),
        y.stride(0), y.stride(1), x_proj.stride(0), x_proj.stride(1),
        ACC_DTYPE=_TL_DTYPE[accumulation_dtype(x.dtype)],
        BLOCK_B=cfg.block_m, BLOCK_C=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_B=group_b,
        UPCAST=_interpreting() and x.dtype == torch.bfloat16, PRECISION=_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y, x_proj


_MAX_PARTIAL_BYTES = 32 * 2**20


def _choose_split(
    b: int, tiles: int, block_k: int, partial_bytes: int, device: torch.device
) -> int:
    """Token splits for stage 1: enough programs for ~2 waves, each split >= 4 K-blocks long, and
    the [splits, m, r] partials under 32 MiB (they are the only temporaries of the backward)."""
    if _interpreting():
        return 1
    want = triton.cdiv(2 * _num_sms(device), max(tiles, 1))
    most = max(1, b // (4 * block_k))
    fits = max(1, _MAX_PARTIAL_BYTES // max(partial_bytes, 1))
    return max(1, min(want, most, fits, 64))


def grad_projection_triton(
    grad_output: Tensor,
    x_proj: Tensor,
    *,
    tiles: TileConfig | None = None,
    split_k: int | None = None,
) -> Tensor:
    """Stage 1: T = grad_output.T @ x_proj, [m, r] in the accumulation dtype (fp32 or fp64).

    Args:
        grad_output: [b, m]; x_proj: [b, r]; any strides.
        tiles: Tile override; block_m tiles m, block_n tiles r, block_k tiles tokens.
        split_k: Number of token splits (partials summed afterwards); None picks one from the SMs.

    Returns:
        T [m, r], contiguous, fp32 (fp64 for fp64 inputs).
    """
    b, m = grad_output.shape
    r = x_proj.shape[1]
    acc_dtype = accumulation_dtype(grad_output.dtype)
    cfg = tiles or _default_tiles(grad_output.dtype, "grad_proj")
    if cfg.block_n > 16 and r <= cfg.block_n // 2:
        # Narrow ranks: don't waste half of every tile on masked columns.
        cfg = TileConfig(
            block_m=cfg.block_m,
            block_n=max(16, triton.next_power_of_2(r)),
            block_k=cfg.block_k,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    tiles_mr = triton.cdiv(m, cfg.block_m) * triton.cdiv(r, cfg.block_n)
    partial_bytes = m * r * (8 if acc_dtype == torch.float64 else 4)
    splits = split_k or _choose_split(b, tiles_mr, cfg.block_k, partial_bytes, grad_output.device)
    splits = max(1, min(splits, triton.cdiv(max(b, 1), cfg.block_k)))
    # Whole K-blocks per split, so only the last split has a ragged end.
    tokens_per_split = triton.cdiv(triton.cdiv(max(b, 1), splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(max(b, 1), tokens_per_split)
    partials = torch.empty((splits, m, r), dtype=acc_dtype, device=grad_output.device)
    if m == 0 or r == 0:
        return partials.sum(0)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(r, cfg.block_n), splits)
    _grad_proj_kernel[grid](
        grad_output, x_proj, partials, b, m, r, tokens_per_split,
        grad_output.stride(0), grad_output.stride(1), x_proj.stride(0), x_proj.stride(1),
        partials.stride(0), partials.stride(1), partials.stride(2),
        ACC_DTYPE=_TL_DTYPE[acc_dtype], BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_n,
        BLOCK_K=cfg.block_k, UPCAST=_interpreting() and grad_output.dtype == torch.bfloat16,
        PRECISION=_precision(grad_output.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return partials[0] if splits == 1 else partials.sum(0)


def expand_into_triton(
    t: Tensor,
    v: Tensor,
    out: Tensor,
    *,
    accumulate: bool,
    tiles: TileConfig | None = None,
    group_m: int = 8,
) -> Tensor:
    """Stage 2: out (+)= t @ v.T without an m x n temporary (fused into out's read-modify-write).

    Args:
        t: [m, r] in the accumulation dtype (from `grad_projection_triton`).
        v: [n, r], any floating dtype (upcast to t.dtype in registers).
        out: [m, n] destination, any strides and floating dtype (rounded once on store).
        accumulate: Add to out's contents instead of overwriting them.
        tiles: Tile override; block_m tiles m, block_n tiles n, block_k tiles r.
        group_m: Row tiles per L2 group.

    Returns:
        `out`.
    """
    m, r = t.shape
    n = v.shape[0]
    if m == 0 or n == 0:
        return out
    cfg = tiles or _default_tiles(v.dtype, "expand")
    if r == 0:
        if not accumulate:
            out.zero_()
        return out
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(r)))
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _expand_into_kernel[grid](
        t, v, out, m, n, r,
        t.stride(0), t.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        ACC_DTYPE=_TL_DTYPE[t.dtype], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        GROUP_M=group_m, ACCUMULATE=accumulate, UPCAST=False,
        PRECISION="ieee" if v.dtype in (torch.float32, torch.float64) else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def lowrank_weight_grad_triton(
    grad_output: Tensor,
    x_proj: Tensor,
    v: Tensor,
    *,
    out: Tensor | None = None,
    accumulate: bool = False,
    tiles_proj: TileConfig | None = None,
    tiles_expand: TileConfig | None = None,
    split_k: int | None = None,
) -> Tensor:
    """Triton backward: (grad_output.T @ x_proj) @ v.T into `out`; see `lowrank_weight_grad`.

    Two launches: stage 1 reduces over tokens into the small T [m, r] (fp32), stage 2 expands T by
    V^T tile by tile straight into `out` (main_grad). Only T (m x r) is materialised.
    """
    m, n = grad_output.shape[1], v.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=grad_output.dtype, device=grad_output.device)
        accumulate = False
    t = grad_projection_triton(grad_output, x_proj, tiles=tiles_proj, split_k=split_k)
    return expand_into_triton(t, v, out, accumulate=accumulate, tiles=tiles_expand)
