"""Measured accuracy cost of degraded micro-batches, per technique set (pure; no torch).

Unit: the cost of a technique set T is the final perplexity gap, in % of the failure-free
perplexity, that a run would show if its WHOLE global batch ran degraded with T on every step. A
plan's cost is then the sum, over its degraded tasks, of cost(T) x (the task's share of the global
batch), i.e. "% perplexity if every step of the run used this plan". The numbers come from
`tools/bench/convergence.py --accuracy-costs`: a `neighbor` run with only T switched on, several
seeds, divided by the run's mean degraded share of the global batch (a linear model: the gap grows
in proportion to the degraded work; it is measured at one operating point, see the file's
`measured` block). FFN recompute is exact (bit-identical gradients, tested), so a set costs what it
costs without recompute; "none" and "recompute" cost 0.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

from megatron_mecefo.plan.techniques import DegradedTechniques

DEFAULT_COSTS_FILE = "accuracy_costs.json"
"""The measured table shipped with the package (megatron_mecefo/plan/accuracy_costs.json)."""


@dataclasses.dataclass(frozen=True)
class AccuracyCosts:
    """Accuracy cost per technique set (see the module docstring for the unit)."""

    costs: tuple[tuple[str, float], ...]
    """(`DegradedTechniques.key` without recompute, cost) pairs; keys are canonical."""
    source: str = ""
    """Where the numbers come from (file and command), for logs and errors."""
    skip_attention_layers: str = "all"
    """The `mecefo.skip_attention_layers` setting the sets with the skip were measured at."""
    skip_layer_fraction: float = 1.0
    """The run's skipped layers relative to `skip_attention_layers`' (1.0: the same setting);
    the skip's part of a cost is scaled by it (an interpolation: the measured per-layer costs
    are far from uniform, docs/mecefo.md, so a run whose setting differs from the table's gets
    an estimate, not a measurement)."""

    def __post_init__(self) -> None:
        canonical = []
        for key, value in self.costs:
            t = DegradedTechniques.from_key(str(key))  # raises on an unknown label
            value = float(value)
            if not value >= 0:  # also rejects NaN
                raise ValueError(f"accuracy cost of {key!r} must be >= 0, got {value}")
            canonical.append((_strip_recompute(t).key, value))
        object.__setattr__(self, "costs", tuple(canonical))
        if not 0.0 <= self.skip_layer_fraction < float("inf"):
            raise ValueError(f"skip_layer_fraction must be >= 0, got {self.skip_layer_fraction}")

    def of(self, techniques: DegradedTechniques) -> float | None:
        """Cost of one technique set, or None if it was not measured."""
        table = dict(self.costs)
        t = _strip_recompute(techniques)
        if not t.names:
            return 0.0
        full = table.get(t.key)
        if full is None or not t.skip_attention_backward or self.skip_layer_fraction == 1.0:
            return full
        without = _strip_recompute(dataclasses.replace(t, skip_attention_backward=False))
        base = 0.0 if not without.names else table.get(without.key)
        if base is None:
            return None
        return base + self.skip_layer_fraction * (full - base)

    def with_skip_fraction(self, fraction: float) -> AccuracyCosts:
        """The same table for a run that skips attention backward in `fraction` x the layers the
        table's setting skips."""
        return dataclasses.replace(self, skip_layer_fraction=fraction)

    @classmethod
    def from_dict(cls, data: dict, source: str = "") -> AccuracyCosts:
        """From the JSON layout `convergence.py --accuracy-costs` writes:
        {"costs": {key: {"mean": float, ...} | float}, ...}."""
        if not isinstance(data, dict) or not isinstance(data.get("costs"), dict):
            raise ValueError(f"{source or 'accuracy costs'}: expected a JSON object with 'costs'")
        pairs = []
        for key, value in data["costs"].items():
            value = value.get("mean") if isinstance(value, dict) else value
            if not isinstance(value, int | float):
                raise ValueError(f"{source}: cost of {key!r} is not a number: {value!r}")
            pairs.append((key, float(value)))
        return cls(
            costs=tuple(pairs),
            source=source,
            skip_attention_layers=str(data.get("skip_attention_layers", "all")),
        )


def load_accuracy_costs(path: str | Path | None = None) -> AccuracyCosts:
    """The measured table: `path` (a JSON file), or the one shipped with the package if None/"".

    Raises:
        ValueError: the file is missing, not JSON, or holds a bad table (the message names it).
    """
    if path:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"mecefo.accuracy_costs: cannot read {p}: {e}") from None
        source = str(p)
    else:
        text = resources.files("megatron_mecefo.plan").joinpath(DEFAULT_COSTS_FILE).read_text()
        source = f"megatron_mecefo/plan/{DEFAULT_COSTS_FILE}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not JSON ({e})") from None
    costs = AccuracyCosts.from_dict(data, source)
    if not costs.costs:
        raise ValueError(f"{source}: no technique set has a cost")
    return costs


def _strip_recompute(t: DegradedTechniques) -> DegradedTechniques:
    return dataclasses.replace(t, recompute_ffn=False)
