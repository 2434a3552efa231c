"""MeCeFO low-rank kernels on a real GPU: production shapes in bf16, dispatch, memory footprint.

The CPU suite (tests/unit/kernels) also runs natively on a GPU machine; this file adds what only a
GPU can show. Run it in its own pytest process without TRITON_INTERPRET (`pytest -m gpu tests/gpu`).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_mecefo.kernels import linear_with_projection, lowrank_weight_grad
from megatron_mecefo.kernels.reference import (
    linear_with_projection_torch,
    lowrank_weight_grad_torch,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") == "1", reason="TRITON_INTERPRET=1 is set"
    ),
]

# (b tokens, n in-features, m out-features): llama-350m fc1 / fc2, llama-1b fc2 with ragged tokens.
SHAPES = [(2048, 1024, 2 * 2736), (2048, 2736, 1024), (4093, 5461, 2048)]


def _rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32)
    return (t + 0.1 * torch.sign(t)).to(dtype)


def _assert_rel_close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} * max|want| {scale:.3g}"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rank", [64, 256])
def test_bf16_forward_and_grad_match_reference(shape, rank):
    b, n, m = shape
    x, w = _rand(b, n, seed=1), _rand(m, n, seed=2) / n**0.5
    v = torch.linalg.qr(_rand(n, rank, dtype=torch.float32, seed=3)).Q.to(torch.bfloat16)
    y, p = linear_with_projection(x, w, v, backend="triton")
    y0, p0 = linear_with_projection_torch(x.float(), w.float(), v.float())
    _assert_rel_close(y, y0, 1e-2)  # one bf16 rounding of an fp32-accumulated result
    _assert_rel_close(p, p0, 1e-2)

    g = _rand(b, m, seed=4)
    main_grad = _rand(m, n, dtype=torch.float32, seed=5)
    want = main_grad.clone()
    lowrank_weight_grad(g, p, v, out=main_grad, accumulate=True, backend="triton")
    lowrank_weight_grad_torch(g.float(), p.float(), v.float(), out=want, accumulate=True)
    _assert_rel_close(main_grad, want, 2e-3)  # stage 2 runs T V^T in tf32


def test_auto_dispatches_to_triton_on_cuda(monkeypatch):
    from megatron_mecefo.kernels import triton_lowrank

    calls = []
    real = triton_lowrank.lowrank_weight_grad_triton
    monkeypatch.setattr(
        triton_lowrank,
        "lowrank_weight_grad_triton",
        lambda *a, **k: calls.append(1) or real(*a, **k),
    )
    g, p, v = _rand(256, 512, seed=1), _rand(256, 64, seed=2), _rand(384, 64, seed=3)
    lowrank_weight_grad(g, p, v, out=torch.zeros(512, 384, device="cuda"), accumulate=True)
    assert calls == [1]


def test_grad_does_not_materialise_m_by_n():
    """Extra memory of the fused backward is T's split partials (<= 32 MiB + T), not m x n."""
    b, n, m, r = 4096, 11008, 4096, 256  # llama-7b fc2
    g, p, v = _rand(b, m, seed=1), _rand(b, r, seed=2), _rand(n, r, seed=3)
    main_grad = torch.zeros(m, n, device="cuda")
    lowrank_weight_grad(g, p, v, out=main_grad, accumulate=True, backend="triton")  # warm up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lowrank_weight_grad(g, p, v, out=main_grad, accumulate=True, backend="triton")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 32 * 2**20 + m * r * 4 + 2**20, f"{extra} bytes extra"
    assert extra < m * n * 2 // 2, f"{extra} bytes extra, an m x n bf16 tensor is {m * n * 2}"
