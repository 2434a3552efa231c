"""Which parameters masked averaging applies to (technique 4); the scaling itself is the trainer's.

Degraded micro-batches produce no gradient for a layer's attention branch (input norm, self-
attention including TE's fused `linear_qkv.layer_norm_weight`, and the cross-attention pieces that
GPT leaves as identities). The trainer pre-scales those gradients by `plan.attention_grad_scale`
instead of `plan.grad_scale` before its single SUM all-reduce.
"""

from __future__ import annotations

import re

# A parameter is masked if any dotted path component is one of these TransformerLayer submodules.
MASKED_SUBMODULES = (
    "input_layernorm",
    "self_attention",
    "pre_cross_attn_layernorm",
    "cross_attention",
)
_MASKED_RE = re.compile(r"(?:^|\.)(?:" + "|".join(MASKED_SUBMODULES) + r")\.")


def is_attention_branch_param(name: str) -> bool:
    """True for parameters of a layer's attention branch, whatever the wrapper prefix.

    Args:
        name: A name from `named_parameters()` of the model, possibly wrapped (`module.` prefixes).

    Examples:
        `decoder.layers.3.self_attention.linear_qkv.weight` -> True;
        `module.module.decoder.layers.0.input_layernorm.weight` -> True;
        `decoder.layers.0.mlp.linear_fc1.layer_norm_weight` (TE pre-MLP norm) -> False.
    """
    return _MASKED_RE.search(name) is not None
