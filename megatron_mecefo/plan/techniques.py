"""Which MeCeFO techniques a degraded micro-batch uses (pure; no torch).

A `DegradedTechniques` is a plan field: the takeover planner may choose one per degraded
micro-batch (`mecefo.hybrid_techniques: auto`) and the degraded-mode controller runs exactly it.
Their accuracy costs are measured (`plan/accuracy.py`).
"""

from __future__ import annotations

import dataclasses
import itertools

TECHNIQUE_NAMES = ("skip_attention_backward", "recompute_ffn", "lowrank_ffn_grad")
_SHORT = {
    "skip_attention_backward": "skip",
    "recompute_ffn": "recompute",
    "lowrank_ffn_grad": "lowrank",
}


@dataclasses.dataclass(frozen=True)
class DegradedTechniques:
    """The techniques one degraded micro-batch runs with."""

    skip_attention_backward: bool = True
    """Technique 1: attention branch without a graph, gradient through the residual only."""
    recompute_ffn: bool = True
    """Technique 2: keep only the FFN input, recompute the FFN intermediates in backward."""
    lowrank_ffn_grad: bool = True
    """Technique 3: rank-r FFN weight gradients."""

    @property
    def names(self) -> tuple[str, ...]:
        """Names of the techniques switched on, in `TECHNIQUE_NAMES` order."""
        return tuple(n for n in TECHNIQUE_NAMES if getattr(self, n))

    @property
    def key(self) -> str:
        """Short stable label, e.g. "skip+recompute+lowrank" or "none" (JSON / cost tables)."""
        return "+".join(_SHORT[n] for n in self.names) or "none"

    @classmethod
    def from_key(cls, key: str) -> DegradedTechniques:
        """Inverse of `key`.

        Raises:
            ValueError: an unknown technique label.
        """
        parts = set() if key == "none" else set(key.split("+"))
        unknown = parts - set(_SHORT.values())
        if unknown:
            raise ValueError(f"unknown technique(s) {sorted(unknown)} in {key!r}")
        return cls(**{n: _SHORT[n] in parts for n in TECHNIQUE_NAMES})

    @property
    def computes_attention_grads(self) -> bool:
        """Whether the micro-batch produces attention / input-norm gradients (skip off)."""
        return not self.skip_attention_backward

    def issubset(self, other: DegradedTechniques) -> bool:
        """Every technique on here is also on in `other`."""
        return set(self.names) <= set(other.names)


ALL_TECHNIQUES = DegradedTechniques()


def candidate_techniques(allowed: DegradedTechniques) -> list[DegradedTechniques]:
    """Every non-empty subset of `allowed`'s techniques, in a fixed order (fewest first)."""
    on = allowed.names
    out = []
    for size in range(1, len(on) + 1):
        for subset in itertools.combinations(on, size):
            out.append(DegradedTechniques(**{n: n in subset for n in TECHNIQUE_NAMES}))
    return out
