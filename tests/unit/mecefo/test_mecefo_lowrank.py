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
        assert p.grad is None  # nothing for megatron DDP's hook to add again
        assert not p.grad_added_to_main_grad  # a later exact micro-batch's grad still counts
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


def _known_svd(m: int, n: int, seed: int = 0):
    """W [m, n] = U diag(s) V^T with distinct singular values 3.0 .. 0.1 and known V [n, n]."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, n, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    s = torch.linspace(3.0, 0.1, n, dtype=torch.float64)
    return u @ torch.diag(s) @ v.T, v


def _lowrank_error(x, g, v):
    """Relative error of G_W ~= (G_y^T (x V)) V^T against G_W = G_y^T x."""
    from megatron_mecefo.kernels import lowrank_weight_grad

    exact = g.T @ x
    return _rel(lowrank_weight_grad(g, x @ v, v), exact)


def test_weight_svd_basis_is_the_unique_exact_one_when_inputs_lie_in_its_span():
    """Inputs x in the span of W's top-r right singular vectors: that basis reproduces G_W exactly
    (error 0, the minimum); any other r-dimensional subspace drops part of x, so its error is
    > 0. A basis that is not W's top singular vectors (bottom ones, left ones, a random or a
    slightly rotated subspace) fails the first assertion."""
    m, n, r, t = 24, 16, 4, 64
    w, v_true = _known_svd(m, n)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(t, r, generator=gen, dtype=torch.float64) @ v_true[:, :r].T  # [t, n]
    g = torch.randn(t, m, generator=gen, dtype=torch.float64)
    v = top_right_singular_vectors(w, r)
    assert _lowrank_error(x, g, v) < 1e-12
    cache = SingularVectorCache(rank=r, method="exact", seed=0)
    assert _lowrank_error(x, g, cache.get(w, 0).double()) < 1e-12
    rotation = torch.linalg.matrix_exp(0.05 * (torch.eye(n) - torch.eye(n).roll(1, 0)).double())
    others = {
        "bottom singular vectors": v_true[:, n - r :],
        "random subspace": torch.linalg.qr(torch.randn(n, r, generator=gen).double())[0],
        "rotated by 0.05 rad": rotation @ v_true[:, :r],
    }
    for label, other in others.items():
        assert _lowrank_error(x, g, other) > 0.01, label


def test_activation_basis_follows_the_inputs_not_the_weight():
    """Inputs in W's *bottom* right singular subspace: the activation basis (top eigenvectors of
    E[x x^T]) is exact there, the weight basis loses almost everything."""
    from megatron_mecefo.mecefo.lowrank import InputSecondMoment

    m, n, r, t = 24, 16, 4, 64
    w, v_true = _known_svd(m, n)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(t, r, generator=gen, dtype=torch.float64) @ v_true[:, n - r :].T
    g = torch.randn(t, m, generator=gen, dtype=torch.float64)
    stats = InputSecondMoment(max_tokens=8, window=50)
    cache = SingularVectorCache(rank=r, method="exact", seed=0, stats=stats)
    stats.update(x[:8])  # 8 tokens < n = 16: not ready, V comes from the weight
    assert not stats.ready
    v_weight = cache.get(w, 0)
    assert cache.source == "weight_svd" and _lowrank_error(x, g, v_weight) > 0.9
    stats.update(x[8:40])  # strided to 8 of these 32 tokens
    assert stats.ready and stats.tokens_seen == 16 and stats.updates == 2
    torch.testing.assert_close(stats.moment, (x[:8].T @ x[:8] + x[8:40:4].T @ x[8:40:4]) / 16)
    assert cache.get(w, 0) is v_weight  # same bucket: cached
    v_act = cache.get(w, 1)
    assert cache.source == "activation" and _lowrank_error(x, g, v_act) < 1e-12
    cache.clear()
    assert cache.vectors is None and stats.moment is None and not stats.ready


def test_second_moment_is_a_mean_then_an_exponential_average():
    from megatron_mecefo.mecefo.lowrank import InputSecondMoment

    stats = InputSecondMoment(max_tokens=4, window=2)
    xs = [torch.full((4, 3), float(k), dtype=torch.float64) for k in (1, 2, 3)]
    for x in xs:
        stats.update(x)
    m = [x.T @ x / 4 for x in xs]
    # mean of the first two (window = 2), then decay 1 - 1/2
    torch.testing.assert_close(stats.moment, 0.5 * (0.5 * (m[0] + m[1])) + 0.5 * m[2])
