"""Cost model of one micro-batch, exact and degraded, for the takeover planner (pure; no torch).

The planner only needs relative times: how long an exact and a degraded micro-batch take and a fixed
per-step overhead (optimizer, all-reduce). Defaults come from FLOP counts; measured times (the
benchmark, or a calibration pass) replace them via `CostModel.from_measured`.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_mecefo.plan.techniques import (
    ALL_TECHNIQUES,
    DegradedTechniques,
    candidate_techniques,
)


@dataclasses.dataclass(frozen=True)
class FlopBreakdown:
    """Training FLOPs of one micro-batch, exact and in MeCeFO degraded mode."""

    exact: float
    """Forward + backward of every layer and the output head."""
    degraded: float
    """Forward of every layer, FFN recompute, exact FFN input grads, low-rank FFN weight grads,
    no attention backward; the output head stays exact."""

    @property
    def ratio(self) -> float:
        """degraded / exact."""
        return self.degraded / self.exact


def microbatch_flops(
    *,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    seq_length: int,
    vocab_size: int,
    micro_batch_size: int = 1,
    num_kv_channels: int | None = None,
    rank_fraction: float = 0.125,
    skip_attention_backward: bool = True,
    recompute_ffn: bool = True,
    lowrank_ffn_grad: bool = True,
    skip_layer_fraction: float = 1.0,
) -> FlopBreakdown:
    """FLOPs of one micro-batch (matmuls only, 2 FLOPs per multiply-add; causal masking ignored).

    Args:
        num_layers: Transformer layers.
        hidden_size: d.
        ffn_hidden_size: SwiGLU inner width f (linear_fc1 is 2f x d, linear_fc2 is d x f).
        seq_length: s.
        vocab_size: Output-head rows.
        micro_batch_size: Sequences per micro-batch.
        num_kv_channels: Width of K and V together divided by 2 (GQA); None means d (MHA).
        rank_fraction: Low-rank r as a fraction of each FFN linear's input dimension.
        skip_attention_backward: Technique 1 on.
        recompute_ffn: Technique 2 on.
        lowrank_ffn_grad: Technique 3 on.
        skip_layer_fraction: Share of the layers whose attention backward technique 1 skips
            (`mecefo.skip_attention_layers`); the others run it.

    Returns:
        The exact and degraded FLOPs.
    """
    d, f, s = hidden_size, ffn_hidden_size, seq_length
    kv = d if num_kv_channels is None else num_kv_channels
    b = micro_batch_size * s  # tokens in the micro-batch
    attn_fwd = 2.0 * b * (d * (d + 2 * kv) + d * d) + 4.0 * b * s * d  # qkv + proj + scores + AV
    fc1_fwd, fc2_fwd = 2.0 * b * 2 * f * d, 2.0 * b * d * f
    ffn_fwd = fc1_fwd + fc2_fwd
    head = 3.0 * 2.0 * b * d * vocab_size
    exact_layer = 3.0 * (attn_fwd + ffn_fwd)

    def weight_grad(m: int, n: int) -> float:
        if not lowrank_ffn_grad:
            return 2.0 * b * m * n
        r = max(1, round(rank_fraction * n))
        return 2.0 * b * r * (n + m) + 2.0 * r * m * n  # x V in forward, G_y^T (xV), (.) V^T

    degraded_layer = attn_fwd + ffn_fwd  # full forward (attention without graph)
    skipped = skip_layer_fraction if skip_attention_backward else 0.0
    degraded_layer += (1.0 - skipped) * 2.0 * attn_fwd
    degraded_layer += fc1_fwd if recompute_ffn else 0.0  # fc2 output is not needed in backward
    degraded_layer += ffn_fwd  # exact input grads G_x = W^T G_y of both FFN linears
    degraded_layer += weight_grad(2 * f, d) + weight_grad(d, f)
    return FlopBreakdown(
        exact=num_layers * exact_layer + head, degraded=num_layers * degraded_layer + head
    )


# The llama-350m shape (configs/model/llama-350m.yaml), as `microbatch_flops` keyword arguments.
LLAMA_350M_SHAPE = dict(
    num_layers=24, hidden_size=1024, ffn_hidden_size=2736, seq_length=1024, vocab_size=32000
)
# llama-350m, micro-batch 4 x 1024 tokens, r = d/8: about 0.73.
DEFAULT_DEGRADED_FRACTION = microbatch_flops(**LLAMA_350M_SHAPE, micro_batch_size=4).ratio


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Step time of a rank = overhead + #exact x exact time + #degraded x degraded time."""

    exact_microbatch_s: float = 1.0
    """Time of one exact micro-batch (forward + backward); any unit, only ratios matter."""
    degraded_microbatch_s: float = DEFAULT_DEGRADED_FRACTION
    """Time of one degraded micro-batch (default: the FLOP ratio at llama-350m shapes)."""
    step_overhead_s: float = 0.0
    """Fixed per-step time (optimizer step, gradient all-reduce), paid once whatever the load. As
    the intercept of an affine fit over the takeover range (M..2M micro-batches) it may be
    negative: where step time grows faster than linearly, the chord's intercept is below zero."""
    technique_microbatch_s: tuple[tuple[str, float], ...] = ()
    """Measured time of one degraded micro-batch per technique set, as (`DegradedTechniques.key`,
    seconds) pairs: the candidates `hybrid` may choose among with `hybrid_techniques: auto` (a set
    without an entry is never chosen). `degraded_microbatch_s` is the configured set's time."""
    slice_overhead_s: float = 0.0
    """Sample granularity: a slice of k of a micro-batch's b samples costs k/b of a whole
    micro-batch (exact or degraded) plus this fixed time (per-task work that does not shrink with
    the samples: Python, kernel launches, data, a device's lower efficiency on small batches).
    0.0 = proportional. Measured by `tools/bench/granularity.py`."""

    def __post_init__(self) -> None:
        if self.exact_microbatch_s <= 0 or self.degraded_microbatch_s <= 0:
            raise ValueError("micro-batch times must be > 0")
        pairs = tuple((str(k), float(v)) for k, v in self.technique_microbatch_s)
        object.__setattr__(self, "technique_microbatch_s", pairs)  # JSON lists -> tuples
        for key, seconds in pairs:
            DegradedTechniques.from_key(key)  # raises on an unknown label
            if seconds <= 0:
                raise ValueError(f"technique set {key!r}: micro-batch time must be > 0")
        if not math.isfinite(self.slice_overhead_s) or self.slice_overhead_s < 0:
            raise ValueError(
                f"slice_overhead_s must be finite and >= 0, got {self.slice_overhead_s}"
            )
        if not math.isfinite(self.step_overhead_s) or self.step_time(1, 0) <= 0:
            raise ValueError(
                "step_overhead_s must be finite and leave a positive one-micro-batch step time"
            )

    def step_time(self, num_exact: int, num_degraded: int = 0) -> float:
        """Predicted step time of a rank running these micro-batches."""
        return (
            self.step_overhead_s
            + num_exact * self.exact_microbatch_s
            + num_degraded * self.degraded_microbatch_s
        )

    def task_time(
        self,
        fraction: float = 1.0,
        *,
        degraded: bool = False,
        techniques: DegradedTechniques | None = None,
    ) -> float | None:
        """Time of one task: a whole micro-batch (`fraction` 1.0) or a slice running `fraction`
        of its samples (pays `slice_overhead_s` on top of its share). None if degraded with a
        technique set that was not measured."""
        whole = self.exact_microbatch_s if not degraded else self.degraded_time(techniques)
        if whole is None:
            return None
        if fraction >= 1.0:
            return whole
        return fraction * whole + self.slice_overhead_s

    def degraded_time(self, techniques: DegradedTechniques | None = None) -> float | None:
        """Time of one degraded micro-batch with these techniques (None: the configured set);
        None if that set was not measured."""
        if techniques is None:
            return self.degraded_microbatch_s
        return dict(self.technique_microbatch_s).get(techniques.key)

    @property
    def measured_techniques(self) -> list[DegradedTechniques]:
        """Technique sets with a cost entry (the candidates of `hybrid_techniques: auto`)."""
        return [DegradedTechniques.from_key(k) for k, _ in self.technique_microbatch_s]

    @classmethod
    def from_measured(
        cls,
        *,
        exact_microbatch_s: float,
        degraded_microbatch_s: float,
        step_overhead_s: float = 0.0,
        technique_microbatch_s: dict[str, float] | tuple | list = (),
        slice_overhead_s: float = 0.0,
    ) -> CostModel:
        """A cost model from measured times (seconds); `technique_microbatch_s` maps
        `DegradedTechniques.key` to a degraded micro-batch's time with that set."""
        pairs = technique_microbatch_s
        if isinstance(pairs, dict):
            pairs = tuple(pairs.items())
        return cls(
            exact_microbatch_s=exact_microbatch_s,
            degraded_microbatch_s=degraded_microbatch_s,
            step_overhead_s=step_overhead_s,
            technique_microbatch_s=tuple(tuple(p) for p in pairs),
            slice_overhead_s=slice_overhead_s,
        )

    @classmethod
    def from_flops(cls, flops: FlopBreakdown, *, step_overhead_fraction: float = 0.0) -> CostModel:
        """A cost model in units of one exact micro-batch, from a `microbatch_flops` result.

        Args:
            flops: Exact and degraded FLOPs of one micro-batch.
            step_overhead_fraction: Per-step overhead as a multiple of one exact micro-batch.
        """
        return cls(
            exact_microbatch_s=1.0,
            degraded_microbatch_s=flops.ratio,
            step_overhead_s=step_overhead_fraction,
        )


def flop_cost_model(
    *,
    allowed: DegradedTechniques = ALL_TECHNIQUES,
    step_overhead_fraction: float = 0.0,
    **shape,
) -> CostModel:
    """The FLOP fallback cost model, with a cost for every candidate technique set.

    Args:
        allowed: The configured techniques: `degraded_microbatch_s` is theirs, and every
            non-empty subset gets a `technique_microbatch_s` entry.
        step_overhead_fraction: Per-step overhead as a multiple of one exact micro-batch.
        **shape: `microbatch_flops` shape arguments (num_layers, hidden_size, ..., rank_fraction).
    """

    def ratio(t: DegradedTechniques) -> float:
        return microbatch_flops(**shape, **{n: getattr(t, n) for n in _FLAGS}).ratio

    return CostModel(
        exact_microbatch_s=1.0,
        degraded_microbatch_s=ratio(allowed),
        step_overhead_s=step_overhead_fraction,
        technique_microbatch_s=tuple((t.key, ratio(t)) for t in candidate_techniques(allowed)),
    )


_FLAGS = ("skip_attention_backward", "recompute_ffn", "lowrank_ffn_grad")
