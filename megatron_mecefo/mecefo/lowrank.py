"""The rank-r basis V of each FFN linear's low-rank weight gradient, and its per-layer cache.

Two bases (`MecefoConfig.lowrank_basis`): `weight_svd`, the top-r right singular vectors of W (the
paper's; computed from the weight only, so every replica holding the same weights gets the same
V without communication), and `activation`, the top-r eigenvectors of a running second moment
E[x x^T] of the linear's input collected on exact micro-batches (`InputSecondMoment`; local to
the replica, so replicas may hold different V: that changes only their local gradient estimate,
never replica consistency). `randomized` draws its test matrix from a private generator seeded
by (layer, weight, refresh bucket), never from torch's global RNG.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

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
class InputSecondMoment:
    """Running second moment E[x x^T] [n, n] of one linear's input, from exact micro-batches.

    A plain mean over the first `window` updates, then an exponential average with decay
    1 - 1/window (window = tau steps: the statistics follow the weights as V does). Each update
    samples at most `max_tokens` tokens, evenly strided, so it costs ~max_tokens x n^2 FLOPs.
    """

    max_tokens: int
    """Tokens sampled per update."""
    window: int
    """Effective averaging window in updates (tau)."""
    moment: Tensor | None = None
    """E[x x^T] [n, n] in fp32 (fp64 for fp64 inputs); None before the first update."""
    updates: int = 0
    tokens_seen: int = 0

    def update(self, x: Tensor, transform: Callable[[Tensor], Tensor] | None = None) -> None:
        """Fold in the input x [..., n] of one exact micro-batch (detached, sub-sampled).

        Args:
            x: The linear's input (or what `transform` maps to it), any leading shape.
            transform: Applied to the sampled tokens [k, n] first (e.g. the RMSNorm that
                Transformer Engine fuses into linear_fc1).
        """
        x2d = x.detach().reshape(-1, x.shape[-1])
        stride = max(1, -(-x2d.shape[0] // self.max_tokens))
        sample = x2d[::stride]
        if transform is not None:
            with torch.no_grad():
                sample = transform(sample)
        sample = sample.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        m = sample.T @ sample / sample.shape[0]
        self.updates += 1
        self.tokens_seen += sample.shape[0]
        if self.moment is None:
            self.moment = m
        else:
            weight = max(1.0 / self.updates, 1.0 / self.window)
            self.moment = self.moment.lerp(m, weight)

    @property
    def ready(self) -> bool:
        """Enough tokens for a full-rank moment: the basis can come from the statistics."""
        return self.moment is not None and self.tokens_seen >= self.moment.shape[0]

    def clear(self) -> None:
        self.moment, self.updates, self.tokens_seen = None, 0, 0


@dataclasses.dataclass
class SingularVectorCache:
    """Cached V of one FFN linear, refreshed when the step enters a new tau-bucket (step // tau).

    The refresh is lazy: V is computed on the first degraded forward of a bucket, from the weights
    of that step (weights do not change inside a step) or, with `stats` ready, from the input's
    second moment, so failure-free training pays nothing for V. With the weight basis, replicas
    that enter degraded mode at the same step compute bitwise-identical V.
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
    stats: InputSecondMoment | None = None
    """activation basis: the input statistics (None: weight_svd)."""
    source: str | None = None
    """Where the cached V came from: "weight_svd" or "activation"."""

    def get(self, weight: Tensor, bucket: int) -> Tensor:
        """V for `bucket`, (re)computed if empty or cached for another bucket: from the input's
        second moment when `stats` is ready (its eigenvectors = right singular vectors of the
        symmetric PSD moment), else from `weight`."""
        if self.vectors is None or self.bucket != bucket:
            seed = self.seed * 1_000_003 + bucket
            use_stats = self.stats is not None and self.stats.ready
            source = self.stats.moment if use_stats else weight
            v = top_right_singular_vectors(source, self.rank, method=self.method, seed=seed)
            # a new tensor, never in place: micro-batches already in flight keep their old V
            self.vectors = v.to(weight.dtype)
            self.bucket = bucket
            self.source = "activation" if use_stats else "weight_svd"
        return self.vectors

    def clear(self) -> None:
        """Forget V and the input statistics (e.g. after loading new weights)."""
        self.vectors, self.bucket, self.source = None, None, None
        if self.stats is not None:
            self.stats.clear()
