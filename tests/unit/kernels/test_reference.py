"""Torch reference and dispatch of `megatron_mecefo.kernels` (no Triton needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_mecefo.kernels import linear_with_projection, lowrank_weight_grad, triton_available
from megatron_mecefo.kernels.reference import (
    linear_with_projection_torch,
    lowrank_weight_grad_torch,
)

pytestmark = pytest.mark.timeout(60)


def _rand(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float64)
    return (t + 0.1 * torch.sign(t)).to(dtype)  # bounded away from zero


def test_forward_matches_formulas():
    x, w, v = _rand(37, 19, seed=1), _rand(23, 19, seed=2), _rand(19, 5, seed=3)
    y, p = linear_with_projection(x, w, v, backend="torch")
    torch.testing.assert_close(y, x @ w.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p, x @ v, rtol=1e-12, atol=1e-12)


def test_full_rank_orthonormal_v_gives_exact_gradient():
    """With r = n and V orthonormal (full SVD of W), G_y (x^T V) V^T == G_y x^T exactly."""
    b, m, n = 41, 13, 11
    w, x, g = _rand(m, n, seed=4), _rand(b, n, seed=5), _rand(b, m, seed=6)
    v = torch.linalg.svd(w, full_matrices=True).Vh.T  # [n, n]
    _, p = linear_with_projection_torch(x, w, v)
    torch.testing.assert_close(lowrank_weight_grad_torch(g, p, v), g.T @ x, rtol=1e-10, atol=1e-10)


def test_low_rank_differs_from_exact():
    b, m, n, r = 41, 13, 11, 3
    w, x, g = _rand(m, n, seed=4), _rand(b, n, seed=5), _rand(b, m, seed=6)
    v = torch.linalg.svd(w).Vh[:r].T
    _, p = linear_with_projection_torch(x, w, v)
    approx = lowrank_weight_grad_torch(g, p, v)
    # The low-rank gradient is the exact one projected on span(V): G_W V V^T.
    exact = g.T @ x
    torch.testing.assert_close(approx, exact @ v @ v.T, rtol=1e-10, atol=1e-10)
    assert (approx - exact).abs().max() > 1e-3


@pytest.mark.parametrize("accumulate", [False, True])
def test_out_strided_view_write_and_accumulate(accumulate):
    b, m, n, r = 29, 17, 12, 4
    g, p, v = _rand(b, m, seed=7), _rand(b, r, seed=8), _rand(n, r, seed=9)
    buf = _rand(m + 3, n + 5, dtype=torch.float32, seed=10)
    out = buf[1 : m + 1, 2 : n + 2]  # non-contiguous view into a larger main_grad buffer
    before, buf_before = out.clone(), buf.clone()
    res = lowrank_weight_grad(g.float(), p.float(), v.float(), out=out, accumulate=accumulate)
    assert res.data_ptr() == out.data_ptr()
    want = (g.T @ p @ v.T).float() + (before if accumulate else 0)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[1 : m + 1, 2 : n + 2] = False
    assert torch.equal(buf[outside], buf_before[outside])


def test_overwrite_ignores_nan_in_out():
    g, p, v = _rand(8, 4, seed=1), _rand(8, 2, seed=2), _rand(3, 2, seed=3)
    out = torch.full((4, 3), float("nan"))
    lowrank_weight_grad(g.float(), p.float(), v.float(), out=out, accumulate=False)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype):
    x, w, v = _rand(33, 16, seed=1), _rand(20, 16, seed=2), _rand(16, 4, seed=3)
    xl, wl, vl = x.to(dtype), w.to(dtype), v.to(dtype)
    y, p = linear_with_projection(xl, wl, vl)
    assert y.dtype == p.dtype == dtype
    # One rounding of an fp32-accumulated product of the rounded inputs.
    torch.testing.assert_close(y, (xl.double() @ wl.double().T).to(dtype))
    g = _rand(33, 20, seed=4).to(dtype)
    out = torch.zeros(20, 16)
    lowrank_weight_grad(g, p, vl, out=out, accumulate=True)
    want = g.double().T @ p.double() @ vl.double().T
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
    assert lowrank_weight_grad(g, p, vl).dtype == dtype


def test_input_validation():
    x, w, v = _rand(4, 3), _rand(5, 3), _rand(3, 2)
    with pytest.raises(ValueError, match="inner dimensions"):
        linear_with_projection(x, _rand(5, 4), v)
    with pytest.raises(ValueError, match="2-D"):
        linear_with_projection(x[None], w, v)
    with pytest.raises(ValueError, match="one dtype"):
        linear_with_projection(x.float(), w, v)
    g, p = _rand(4, 5), _rand(4, 2)
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        lowrank_weight_grad(g, p, v, accumulate=True)
    with pytest.raises(ValueError, match="shape"):
        lowrank_weight_grad(g, p, v, out=torch.zeros(3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32 or float64"):
        lowrank_weight_grad(g.half(), p.half(), v.half(), out=torch.zeros(5, 3).half())
    with pytest.raises(ValueError, match="backend"):
        lowrank_weight_grad(g, p, v, backend="cuda")


def test_auto_on_cpu_is_the_torch_reference():
    x, w, v = _rand(9, 6, seed=1), _rand(7, 6, seed=2), _rand(6, 3, seed=3)
    ya, pa = linear_with_projection(x, w, v, backend="auto")
    yt, pt = linear_with_projection_torch(x, w, v)
    assert torch.equal(ya, yt) and torch.equal(pa, pt)


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w, v = _rand(4, 3), _rand(5, 3), _rand(3, 2)
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    assert not triton_available()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        linear_with_projection(x, w, v, backend="triton")


def test_package_imports_without_triton():
    """Importing the package never imports triton, and works when triton is missing."""
    code = (
        "import sys; import megatron_mecefo.kernels as k; assert 'triton' not in sys.modules;"
        "sys.modules['triton'] = None;"  # makes `import triton` fail, find_spec still finds it
        "import importlib.util as u; u.find_spec = lambda name, *a: None;"
        "assert not k.triton_available();"
        "import torch; x = torch.ones(2, 3); print(k.linear_with_projection(x, x, x.T)[0].sum())"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "tensor(12.)"
