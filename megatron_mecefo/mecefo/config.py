"""MeCeFO degraded-mode and takeover-policy switches (pure dataclass)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

from megatron_mecefo.plan.techniques import DegradedTechniques


@dataclasses.dataclass(kw_only=True)
class MecefoConfig:
    """Degraded-mode techniques, low-rank settings and the takeover policy."""

    enabled: bool = True
    """Install the degraded-mode hooks (free until a plan marks micro-batches degraded)."""
    skip_attention_backward: bool = True
    """Technique 1: attention runs without a graph; gradient flows through the residual only."""
    skip_attention_layers: str = "last:75%"
    """Technique 1: the transformer layers (0-based, in model order) whose attention backward is
    skipped; the others run attention with its graph, as if the skip were off for them, and their
    attention / input-norm grads are ordinary (averaged over all replicas, not masked). `all` (the
    paper's); `first:K` / `last:K` (the first / last K layers); `first:P%` / `last:P%` (that share
    of the layers, rounded up, at least one); `every:K` (layers 0, K, 2K, ...); or a comma list of
    layer indices such as `0,2,5`. To skip no layer, set `skip_attention_backward: false`.
    Resolved against the model's layer count by `skip_layer_indices` (K or an index beyond it is
    an error). Default `last:75%`, by measurement (docs/mecefo.md, "Which layers skip"): on the
    8-layer model the gradient error of skipping the last 6 layers is 0.29x that of skipping all
    8 (the first layers cost the most: first:2 alone is 0.8x of all), for 75% of the time the
    skip saves; a 2-layer model still skips both layers."""
    recompute_ffn: bool = False
    """Technique 2: keep only the FFN input; recompute FFN intermediates in backward. Off by
    default, by measurement (`tools/bench/recompute_memory.py`, docs/mecefo.md): a covering rank
    runs its micro-batches one after another, so its peak is one micro-batch's activations, and
    without recompute that peak is still well below a normal rank's exact one (llama-350m shapes,
    4 layers: 0.67x with it off, 0.59x on), while recompute adds an fc1 forward to every
    degraded micro-batch. Switch it on where a degraded micro-batch must fit in less memory than
    an exact one (e.g. larger micro-batches on covering ranks)."""
    lowrank_ffn_grad: bool = True
    """Technique 3: FFN weight grads G_W ~= G_y (x^T V) V^T with V an orthonormal rank-r basis
    of each FFN linear's input space (chosen by `lowrank_basis`)."""
    lowrank_basis: Literal["weight_svd", "activation"] = "activation"
    """V of technique 3. `weight_svd`: top-r right singular vectors of W (the paper's).
    `activation`: top-r principal directions of the linear's input x, from a running second
    moment E[x x^T] collected on exact micro-batches (falls back to `weight_svd` until it has
    seen as many tokens as the input dimension). The default by measurement: relative FFN
    weight-gradient error at r = n/8 on a model trained on real text (docs/mecefo.md)."""
    activation_stats_interval: int = 10
    """activation basis: update the statistics on every this many steps only, so normal
    (failure-free) ranks pay ~1/interval of the already small sampling cost."""
    activation_stats_tokens: int = 256
    """activation basis: tokens sampled (evenly strided) from the first exact micro-batch of each
    step to update the second moment of each FFN linear's input (cost ~tokens x n^2 per linear)."""
    rank: float = 0.125
    """Low-rank r: an integer >= 1 is absolute; a value in (0, 1) is a fraction of the input dim."""
    tau: int = 50
    """Refresh the cached singular vectors every tau steps."""
    svd_method: Literal["exact", "randomized"] = "exact"
    """How V is computed: full SVD, or randomized range finder (cheaper at large shapes)."""
    takeover_policy: Literal["neighbor", "spread", "hybrid"] = "neighbor"
    """Who runs a dead replica's micro-batches: ring neighbour (MeCeFO), all survivors, hybrid."""
    takeover_granularity: Literal["microbatch", "sample"] = "microbatch"
    """`spread` / `hybrid`: what survivors take over. `microbatch`: whole micro-batches (the
    slowest survivor runs M + ceil(M d / (n - d)) of them). `sample`: the orphaned micro-batches
    are cut into sample slices so the slowest runs 1 + ceil(M b d / (n - d)) / (M b) of a normal
    load (b = micro-batch size); exact, since a slice's loss counts its samples' share of the
    micro-batch. `neighbor` always hands whole micro-batches to one neighbour."""
    hybrid_target_ratio: float = 1.15
    """hybrid: the slowest rank's step time must stay under this multiple of a normal rank's."""
    hybrid_techniques: Literal["fixed", "auto"] = "fixed"
    """hybrid: which techniques a degraded micro-batch uses. `fixed`: every switch above that is
    on. `auto`: per covering rank, the planner may use any non-empty subset of the switched-on
    techniques that has both a measured time (the cost model: `tools/bench/degraded.py`
    calibration, or its FLOP fallback) and a measured accuracy cost (`accuracy_costs`)."""
    hybrid_objective: Literal["accuracy", "time"] = "accuracy"
    """hybrid: how it chooses among the plans that exist (exact spread at micro-batch or sample
    granularity, neighbour, spread with k micro-batches degraded per technique set; never a
    dominated one). `accuracy`: the least accuracy cost whose predicted step time is <=
    `hybrid_target_ratio` x a normal step, else the fastest. `time`: the fastest whose accuracy
    cost is <= `hybrid_accuracy_budget`."""
    hybrid_accuracy_budget: float = 1.0
    """hybrid_objective=time: the largest accuracy cost allowed, in % perplexity if every step
    ran the plan (the unit of `accuracy_costs`; e.g. neighbour with 1 of 4 replicas dead costs
    about half the skip+lowrank entry)."""
    accuracy_costs: str = ""
    """hybrid: the measured accuracy-cost table (JSON written by `tools/bench/convergence.py
    --accuracy-costs`); empty = the one shipped in megatron_mecefo/plan/accuracy_costs.json."""

    @property
    def techniques(self) -> DegradedTechniques:
        """The switched-on techniques (what `fixed` runs; `auto`'s candidates are its subsets)."""
        return DegradedTechniques(
            skip_attention_backward=self.skip_attention_backward,
            recompute_ffn=self.recompute_ffn,
            lowrank_ffn_grad=self.lowrank_ffn_grad,
        )

    def __post_init__(self) -> None:
        _parse_skip_layers(self.skip_attention_layers)  # syntax only; the range needs the model
        if self.rank <= 0 or (self.rank >= 1 and not float(self.rank).is_integer()):
            raise ValueError(
                f"rank must be an integer >= 1 (absolute) or a fraction in (0, 1), got {self.rank}"
            )
        if self.lowrank_basis not in ("weight_svd", "activation"):
            raise ValueError(
                f"lowrank_basis must be 'weight_svd' or 'activation', got {self.lowrank_basis!r}"
            )
        if self.activation_stats_interval < 1:
            raise ValueError(
                f"activation_stats_interval must be >= 1 step, got {self.activation_stats_interval}"
            )
        if self.activation_stats_tokens < 1:
            raise ValueError(
                f"activation_stats_tokens must be >= 1, got {self.activation_stats_tokens}"
            )
        if self.tau < 1:
            raise ValueError(f"tau must be >= 1 step, got {self.tau}")
        if self.takeover_granularity not in ("microbatch", "sample"):
            raise ValueError(
                "takeover_granularity must be 'microbatch' or 'sample', got "
                f"{self.takeover_granularity!r}"
            )
        if self.hybrid_target_ratio < 1.0:
            raise ValueError("hybrid_target_ratio must be >= 1.0 (a multiple of a normal step)")
        if self.hybrid_objective not in ("accuracy", "time"):
            raise ValueError(
                f"hybrid_objective must be 'accuracy' or 'time', got {self.hybrid_objective!r}"
            )
        if not self.hybrid_accuracy_budget >= 0:
            raise ValueError(
                f"hybrid_accuracy_budget must be >= 0, got {self.hybrid_accuracy_budget}"
            )
        if self.hybrid_techniques not in ("fixed", "auto"):
            raise ValueError(
                f"hybrid_techniques must be 'fixed' or 'auto', got {self.hybrid_techniques!r}"
            )
        if self.hybrid_techniques == "auto" and not self.techniques.names:
            raise ValueError(
                "hybrid_techniques=auto needs at least one of skip_attention_backward, "
                "recompute_ffn, lowrank_ffn_grad switched on (its candidates are their subsets)"
            )

    def resolve_rank(self, dim: int) -> int:
        """Absolute rank for an input dimension `dim` (clamped to [1, dim])."""
        r = int(self.rank) if self.rank >= 1 else round(self.rank * dim)
        return max(1, min(dim, r))

    def skip_layer_indices(self, num_layers: int) -> frozenset[int]:
        """Layers (0-based) whose attention backward technique 1 skips, for a model of
        `num_layers` transformer layers (`skip_attention_layers` resolved; ignores whether
        `skip_attention_backward` is on).

        Raises:
            ValueError: K of `first:K` / `last:K` / `every:K`, or a listed index, does not fit in
                `num_layers` layers.
        """
        kind, value = _parse_skip_layers(self.skip_attention_layers)
        key = f"mecefo.skip_attention_layers={self.skip_attention_layers!r}"
        if kind == "all":
            return frozenset(range(num_layers))
        if kind in ("first%", "last%"):  # a share of the layers, at least one
            count = min(num_layers, max(1, math.ceil(value * num_layers / 100 - 1e-9)))
            kind, value = kind[:-1], count
        if kind == "list":
            bad = sorted(i for i in value if i >= num_layers)
            if bad:
                raise ValueError(
                    f"{key}: layer index {bad[0]} out of range, the model has {num_layers} "
                    f"transformer layers (indices 0..{num_layers - 1})"
                )
            return frozenset(value)
        if value > num_layers:
            raise ValueError(
                f"{key}: K = {value} exceeds the model's {num_layers} transformer layers"
                + ("; use `all` to skip every layer" if kind != "every" else "")
            )
        if kind == "first":
            return frozenset(range(value))
        if kind == "last":
            return frozenset(range(num_layers - value, num_layers))
        return frozenset(range(0, num_layers, value))


_DIGITS = re.compile(r"[0-9]+")
_PERCENT = re.compile(r"[0-9]+(\.[0-9]+)?")
_SKIP_LAYERS_FORMS = (
    "'all', 'first:K', 'last:K', 'every:K' (K >= 1), 'first:P%', 'last:P%' (0 < P <= 100) or "
    "a comma list like '0,2,5'"
)


def _parse_skip_layers(spec: str) -> tuple[str, int | frozenset[int] | None]:
    """Syntax of `skip_attention_layers`: ("all", None), ("first" | "last" | "every", K) or
    ("list", indices). Raises ValueError naming the accepted forms."""
    text = str(spec).strip().lower()
    where = f"skip_attention_layers={spec!r}"
    if text == "all":
        return "all", None
    if text == "none":
        raise ValueError(
            f"{where}: to skip attention backward in no layer, set "
            "mecefo.skip_attention_backward=false (skip_attention_layers picks which layers skip)"
        )
    kind, sep, k = text.partition(":")
    if sep:
        k = k.strip()
        if kind in ("first", "last") and k.endswith("%"):
            pct = k[:-1].strip()
            if not _PERCENT.fullmatch(pct) or not 0 < float(pct) <= 100:
                raise ValueError(f"{where}: a share must be in (0, 100]%, got {k!r}")
            return f"{kind}%", float(pct)
        if kind not in ("first", "last", "every") or not _DIGITS.fullmatch(k) or int(k) < 1:
            raise ValueError(f"{where}: expected {_SKIP_LAYERS_FORMS}")
        return kind, int(k)
    items = [item.strip() for item in text.split(",")]
    if not all(_DIGITS.fullmatch(item) for item in items):
        raise ValueError(f"{where}: expected {_SKIP_LAYERS_FORMS}")
    indices = [int(item) for item in items]
    if len(set(indices)) != len(indices):
        raise ValueError(f"{where}: a layer index is listed twice")
    return "list", frozenset(indices)
