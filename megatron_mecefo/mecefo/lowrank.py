"""Top-r right singular vectors V of an FFN weight, and their per-layer cache (refreshed every tau).

V is computed from the weight only (never from gradients or the global RNG), so every replica
holding the same weights gets the same V without communication. `randomized` draws its test matrix
from a private generator seeded by (layer, weight, refresh bucket), never from torch's global RNG.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


def top_right_singular_vectors(
    weight: Tensor,
    rank: int,
    *,
    method: str = "exact",
    seed: int = 0,
    oversample: int = 8,
    power_iters: int = 2,
) -> Tensor:
    """V [n, rank]: orthonormal top right singular vectors of `weight` [m, n], computed in fp32+.

    For rank > min(m, n) the extra columns complete an orthonormal basis of R^n (so rank = n gives
    V V^T = I and the low-rank weight gradient is exact).

    Args:
        weight: W [m, n] (the local TP shard); not modified.
        rank: r in [1, n].
        method: "exact" (LAPACK/cuSOLVER SVD) or "randomized" (range finder with power iterations;
            falls back to exact when r + oversample >= min(m, n)).
        seed: Seed of the randomized test matrix (deterministic across replicas).
        oversample: Extra columns of the randomized range finder.
        power_iters: Power iterations of the randomized range finder.

    Returns:
        fp32 (fp64 for fp64 weights) tensor [n, rank] on the weight's device.
    """
    m, n = weight.shape
    if not 1 <= rank <= n:
        raise ValueError(f"rank must be in [1, {n}] for a weight of shape {tuple(weight.shape)}")
    if method not in ("exact", "randomized"):
        raise ValueError(f"svd method must be 'exact' or 'randomized', got {method!r}")
    # fp32 at least (bf16 SVD is not supported and too coarse); fp64 stays fp64 (tests)
    w = weight.detach().to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    k = rank + oversample
    if method == "exact" or k >= min(m, n):
        full = rank > min(m, n)  # need a complete basis of R^n, not only the row space
        _, _, vh = torch.linalg.svd(w, full_matrices=full)
        return vh[:rank].T.contiguous()
    gen = torch.Generator(device=w.device).manual_seed(seed)
    omega = torch.randn(m, k, generator=gen, device=w.device, dtype=w.dtype)
    q, _ = torch.linalg.qr(w.T @ omega)  # [n, k]: basis of W^T's range = W's row space
    for _ in range(power_iters):
        z, _ = torch.linalg.qr(w @ q)  # [m, k]
        q, _ = torch.linalg.qr(w.T @ z)  # [n, k]
    # W^T ~= Q Q^T W^T; the SVD of the small B = Q^T W^T [k, m] gives W's right vectors as Q U_B.
    u_b, _, _ = torch.linalg.svd(q.T @ w.T, full_matrices=False)  # u_b [k, k]
    return (q @ u_b[:, :rank]).contiguous()


@dataclasses.dataclass
class SingularVectorCache:
    """Cached V of one FFN linear, refreshed when the step enters a new tau-bucket (step // tau).

    The refresh is lazy: V is computed on the first degraded forward of a bucket, from the weights
    of that step (weights do not change inside a step), so failure-free training pays nothing.
    Replicas that enter degraded mode at the same step compute bitwise-identical V.
    """

    rank: int
    """Absolute r for this linear."""
    method: str
    """"exact" or "randomized"."""
    seed: int
    """Base seed for the randomized method (distinct per layer and per linear)."""
    bucket: int | None = None
    """step // tau of the cached V; None before the first computation."""
    vectors: Tensor | None = None
    """V [n, r] in the weight's dtype."""

    def get(self, weight: Tensor, bucket: int) -> Tensor:
        """V for `bucket`, (re)computed from `weight` if empty or cached for another bucket."""
        if self.vectors is None or self.bucket != bucket:
            v = top_right_singular_vectors(
                weight, self.rank, method=self.method, seed=self.seed * 1_000_003 + bucket
            )
            # a new tensor, never in place: micro-batches already in flight keep their old V
            self.vectors = v.to(weight.dtype)
            self.bucket = bucket
        return self.vectors

    def clear(self) -> None:
        """Forget V (e.g. after loading new weights)."""
        self.vectors, self.bucket = None, None
