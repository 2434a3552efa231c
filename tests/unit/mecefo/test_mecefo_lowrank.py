"""Low-rank FFN weight gradients and recompute on the functional degraded FFN (no megatron)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_mecefo.mecefo.ffn import DegradedFfnFunction, FfnCall, FfnWeights
from megatron_mecefo.mecefo.lowrank import SingularVectorCache, top_right_singular_vectors

D, FFN, TOKENS = 32, 48, 40


def _weights(seed: int = 0, dtype=torch.float64) -> FfnWeights:
    gen = torch.Generator().manual_seed(seed)

    def param(*shape, scale=0.2):
        return torch.nn.Parameter((torch.randn(*shape, generator=gen) * scale).to(dtype))

    return FfnWeights(
        norm_weight=torch.nn.Parameter(1 + param(D).detach()),
        norm_eps=1e-5,
        zero_centered_gamma=False,
        fc1=param(2 * FFN, D),
        fc2=param(D, FFN),
        activation=F.silu,
        gated=True,
        glu_linear_offset=0.0,
        clamp_value=None,
        tp_group=None,
    )


def _reference(x, w: FfnWeights):
    ln = F.rms_norm(x, (D,), w.norm_weight, w.norm_eps)
    gate, up = torch.chunk(ln @ w.fc1.t(), 2, dim=-1)
    return (F.silu(gate) * up) @ w.fc2.t()


def _grads(w: FfnWeights, fn, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS // 4, 4, D, generator=gen, dtype=w.fc1.dtype, requires_grad=True)
    g = torch.randn(TOKENS // 4, 4, D, generator=gen, dtype=w.fc1.dtype)
    for p in (w.norm_weight, w.fc1, w.fc2):
        p.grad = None
    out = fn(x, w)
    out.backward(g)
    return out.detach(), x.grad, w.norm_weight.grad, w.fc1.grad, w.fc2.grad


def _degraded(rank1, rank2, recompute=True):
    def fn(x, w):
        v1 = top_right_singular_vectors(w.fc1, rank1).to(w.fc1.dtype) if rank1 else None
        v2 = top_right_singular_vectors(w.fc2, rank2).to(w.fc2.dtype) if rank2 else None
        call = FfnCall(weights=w, v1=v1, v2=v2, recompute=recompute)
        return DegradedFfnFunction.apply(x, w.norm_weight, w.fc1, w.fc2, call)

    return fn


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("recompute", [True, False])
def test_full_rank_reproduces_exact_gradients(recompute):
    w = _weights()
    ref = _grads(w, lambda x, w: _reference(x, w))
    for rank1, rank2 in [(None, None), (D, FFN)]:  # r = n: V V^T = I
        got = _grads(w, _degraded(rank1, rank2, recompute))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b)


def test_error_shrinks_as_rank_grows():
    w = _weights()
    ref = _grads(w, lambda x, w: _reference(x, w))
    errs = []
    for frac in (0.125, 0.25, 0.5, 0.75, 1.0):
        got = _grads(w, _degraded(round(frac * D), round(frac * FFN)))
        torch.testing.assert_close(got[1], ref[1])  # input grads stay exact
        torch.testing.assert_close(got[2], ref[2])  # norm gain grad stays exact
        errs.append((_rel(got[3], ref[3]), _rel(got[4], ref[4])))
    for (a1, a2), (b1, b2) in zip(errs, errs[1:]):
        assert b1 < a1 and b2 < a2, errs
    assert errs[-1][0] < 1e-10 and errs[-1][1] < 1e-10
    print(f"relative FFN weight-grad error (fc1, fc2) at r/n = 1/8..1: {errs}")


def test_main_grad_accumulation_like_megatron_ddp():
    w32 = _weights(dtype=torch.float32)
    ref = _grads(w32, _degraded(8, 12))
    w = _weights(dtype=torch.float32)
    for p in (w.fc1, w.fc2):
        p.main_grad = torch.full_like(p, 0.5)  # already holds an earlier micro-batch's grad
        p.grad_added_to_main_grad = False
    _grads(w, _degraded(8, 12))
    for p, g in ((w.fc1, ref[3]), (w.fc2, ref[4])):
        assert p.grad_added_to_main_grad  # megatron DDP's hook will not add param.grad again
        torch.testing.assert_close(p.main_grad, g + 0.5)


def test_saved_tensors_are_input_and_projections_only():
    w = _weights(dtype=torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.shape) or t, lambda t: t
    ):
        x = torch.randn(TOKENS, 1, D, requires_grad=True)
        _degraded(4, 6)(x, w)
    assert sorted(tuple(s) for s in saved) == sorted([(TOKENS, D), (TOKENS, 4), (TOKENS, 6)])


def test_randomized_svd_is_deterministic_and_close_for_decaying_spectra():
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(96, 64, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen))
    w = u @ torch.diag(0.8 ** torch.arange(64.0)) @ v.T  # fast-decaying spectrum, like trained W
    exact = top_right_singular_vectors(w, 8)
    rand_a = top_right_singular_vectors(w, 8, method="randomized", seed=7)
    rand_b = top_right_singular_vectors(w, 8, method="randomized", seed=7)
    assert torch.equal(rand_a, rand_b)
    torch.testing.assert_close(rand_a @ rand_a.T, exact @ exact.T, atol=1e-4, rtol=0)
    torch.testing.assert_close(exact.T @ exact, torch.eye(8), atol=1e-5, rtol=0)


def test_cache_refreshes_per_bucket_and_never_in_place():
    w = torch.nn.Parameter(torch.randn(24, 16))
    cache = SingularVectorCache(rank=4, method="exact", seed=0)
    v0 = cache.get(w, 0)
    assert cache.get(w, 0) is v0  # same bucket: cached
    with torch.no_grad():
        w.mul_(torch.linspace(0.1, 3.0, 16))
    v1 = cache.get(w, 1)
    assert v1 is not v0 and not torch.allclose(v1 @ v1.T, v0 @ v0.T)
    with pytest.raises(ValueError, match="rank"):
        top_right_singular_vectors(w, 17)
