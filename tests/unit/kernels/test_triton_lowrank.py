"""Triton kernels vs the torch reference: interpreter on CPU (TRITON_INTERPRET=1), native on GPU.

Inputs are random and bounded away from zero, shapes are not multiples of the tiles, and views are
non-contiguous, so masking, stride and accumulation bugs show. Tolerances: fp64 1e-10 (exact up to
summation order); fp32 rtol 1e-5 / atol 1e-4 on O(10..1000) values; bf16/fp16 outputs one rounding
of the fp32 result (torch's default dtype tolerances).
"""

from __future__ import annotations

import pytest
import torch

from megatron_mecefo.kernels import linear_with_projection, lowrank_weight_grad
from megatron_mecefo.kernels.reference import (
    linear_with_projection_torch,
    lowrank_weight_grad_torch,
)

pytestmark = pytest.mark.timeout(120)

TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-5, atol=1e-4),
}


def _rand(*shape, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float64)
    return (t + 0.1 * torch.sign(t)).to(dtype=dtype, device=device)  # bounded away from zero


def _strided(t: torch.Tensor, kind: str) -> torch.Tensor:
    """Same values as `t` in a non-contiguous layout: a padded slice or a transposed copy."""
    if kind == "contiguous":
        return t
    if kind == "slice":
        buf = torch.full(
            (t.shape[0] + 3, t.shape[1] + 7), float("nan"), dtype=t.dtype, device=t.device
        )
        view = buf[2 : t.shape[0] + 2, 5 : t.shape[1] + 5]
        view.copy_(t)
        return view
    assert kind == "transposed"
    return t.T.contiguous().T


# (b, n, m, r): single element, ragged everything, r > n (projection wider than input), m < tile.
SHAPES = [(1, 1, 1, 1), (100, 70, 90, 20), (130, 33, 17, 65)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "slice", "transposed"])
def test_forward_fp64(tk, device, shape, layout):
    b, n, m, r = shape
    x = _strided(_rand(b, n, seed=1, device=device), layout)
    w = _strided(_rand(m, n, seed=2, device=device), "transposed" if layout == "slice" else layout)
    v = _strided(_rand(n, r, seed=3, device=device), layout)
    y, p = linear_with_projection(x, w, v, backend="triton")
    y0, p0 = linear_with_projection_torch(x, w, v)
    torch.testing.assert_close(y, y0, **TOL[torch.float64])
    torch.testing.assert_close(p, p0, **TOL[torch.float64])


def test_forward_small_tiles_many_groups(tk, device):
    """16^3 tiles: 10 row tiles (> GROUP_B=8, ragged last group), 5 K steps, ragged r tile."""
    b, n, m, r = 150, 70, 40, 20
    x, w, v = (_rand(*s, seed=i, device=device) for i, s in enumerate([(b, n), (m, n), (n, r)]))
    tiles = tk.TileConfig(block_m=16, block_n=16, block_k=16)
    y, p = tk.linear_with_projection_triton(x, w, v, tiles=tiles)
    torch.testing.assert_close(y, x @ w.T, **TOL[torch.float64])
    torch.testing.assert_close(p, x @ v, **TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_other_dtypes(tk, device, dtype):
    b, n, m, r = 100, 70, 90, 20
    x, w, v = (
        _rand(*s, dtype=dtype, seed=i, device=device)
        for i, s in enumerate([(b, n), (m, n), (n, r)])
    )
    y, p = linear_with_projection(x, w, v, backend="triton")
    assert y.dtype == p.dtype == dtype
    # Reference: exact product of the (already rounded) inputs, rounded once.
    y0 = (x.double() @ w.double().T).to(dtype)
    p0 = (x.double() @ v.double()).to(dtype)
    tol = TOL.get(dtype, {})
    torch.testing.assert_close(y, y0, **tol)
    torch.testing.assert_close(p, p0, **tol)


@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("accumulate", [False, True])
def test_grad_into_strided_main_grad_fp64(tk, device, split_k, accumulate):
    """b=150 with 64-token blocks: split 2 -> 128+22 tokens, split 3 -> 64+64+22."""
    b, n, m, r = 150, 70, 90, 20
    g = _strided(_rand(b, m, seed=4, device=device), "transposed")
    p = _strided(_rand(b, r, seed=5, device=device), "slice")
    v = _rand(n, r, seed=6, device=device)
    buf = _rand(m + 3, n + 5, seed=7, device=device)
    out = buf[1 : m + 1, 2 : n + 2]  # main_grad: a view into a bigger flat buffer
    ref = out.clone()
    buf_before = buf.clone()
    tiles = tk.TileConfig(block_m=64, block_n=64, block_k=64)
    res = tk.lowrank_weight_grad_triton(
        g, p, v, out=out, accumulate=accumulate, split_k=split_k, tiles_proj=tiles
    )
    lowrank_weight_grad_torch(g, p, v, out=ref, accumulate=accumulate)
    assert res.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, ref, **TOL[torch.float64])
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[1 : m + 1, 2 : n + 2] = False
    assert torch.equal(buf[outside], buf_before[outside]), "wrote outside the main_grad view"


def test_grad_transposed_out_and_small_tiles(tk, device):
    """Column-major main_grad, 16^3 tiles in both stages (several r steps, > GROUP_M groups)."""
    b, n, m, r = 40, 50, 150, 37
    g, p, v = (
        _rand(b, m, seed=1, device=device),
        _rand(b, r, seed=2, device=device),
        _rand(n, r, seed=3, device=device),
    )
    out = _strided(_rand(m, n, seed=4, device=device), "transposed")
    ref = out.clone()
    tiles = tk.TileConfig(block_m=16, block_n=16, block_k=16)
    tk.lowrank_weight_grad_triton(
        g, p, v, out=out, accumulate=True, tiles_proj=tiles, tiles_expand=tiles
    )
    torch.testing.assert_close(out, ref + g.T @ p @ v.T, **TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_accumulates_into_fp32_main_grad(tk, device, dtype):
    b, n, m, r = 130, 70, 90, 20
    g, p, v = (
        _rand(*s, dtype=dtype, seed=i, device=device)
        for i, s in enumerate([(b, m), (b, r), (n, r)])
    )
    out = _rand(m, n, dtype=torch.float32, seed=9, device=device)
    before = out.clone()
    lowrank_weight_grad(g, p, v, out=out, accumulate=True, backend="triton")
    want = before.double() + g.double().T @ p.double() @ v.double().T
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_grad_without_out_returns_input_dtype(tk, device, dtype):
    b, n, m, r = 33, 20, 25, 7
    g, p, v = (
        _rand(*s, dtype=dtype, seed=i, device=device)
        for i, s in enumerate([(b, m), (b, r), (n, r)])
    )
    res = lowrank_weight_grad(g, p, v, backend="triton")
    assert res.dtype == dtype and res.shape == (m, n)
    torch.testing.assert_close(res, lowrank_weight_grad_torch(g, p, v), **TOL.get(dtype, {}))


def test_overwrite_ignores_nan_in_main_grad(tk, device):
    g, p, v = (
        _rand(20, 9, seed=1, device=device),
        _rand(20, 4, seed=2, device=device),
        _rand(11, 4, seed=3, device=device),
    )
    out = torch.full((9, 11), float("nan"), dtype=torch.float64, device=device)
    lowrank_weight_grad(g, p, v, out=out, accumulate=False, backend="triton")
    torch.testing.assert_close(out, g.T @ p @ v.T, **TOL[torch.float64])


def test_full_rank_matches_exact_gradient(tk, device):
    """End to end through both kernels: r = n with V from the SVD of W gives G_y^T x."""
    b, n, m = 64, 24, 40
    w, x, g = _rand(m, n, seed=1), _rand(b, n, seed=2), _rand(b, m, seed=3)
    v = torch.linalg.svd(w, full_matrices=True).Vh.T.contiguous()
    x, w, g, v = (t.to(device) for t in (x, w, g, v))
    y, p = linear_with_projection(x, w, v, backend="triton")
    torch.testing.assert_close(y, x @ w.T, **TOL[torch.float64])
    out = torch.zeros(m, n, dtype=torch.float64, device=device)
    lowrank_weight_grad(g, p, v, out=out, accumulate=True, backend="triton")
    torch.testing.assert_close(out, g.T @ x, **TOL[torch.float64])


# Opt-in shared memory per block: A100 (sm_80) 163 KiB, H100 (sm_90) 227 KiB.
_SHARED_LIMIT = {80: 166912, 90: 232448}


@pytest.mark.timeout(180)
def test_kernels_compile_for_sm80_and_sm90(tk):
    """The compiled (non-interpreted) bf16 kernels build for A100/H100 and fit in shared memory."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("aot_compile.py")
    res = subprocess.run(
        [sys.executable, str(script), "80", "90"], capture_output=True, text=True, timeout=170
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line.split() for line in res.stdout.splitlines()]
    assert {(name, int(arch)) for name, arch, _ in rows} == {
        (name, arch) for name in ("forward", "grad_proj", "expand") for arch in (80, 90)
    }
    for name, arch, shared in rows:
        assert 0 < int(shared) <= _SHARED_LIMIT[int(arch)], (name, arch, shared)
