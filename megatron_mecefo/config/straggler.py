"""Settings of the straggler watch (`failover/trainer/straggler.py`): pure dataclasses, below
`config.run`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(kw_only=True)
class StragglerConfig:
    """A replica that computes persistently slower than its peers gets a smaller share of the
    global batch (under failover; `docs/anomalies.md`)."""

    enabled: bool = True
    """Measure each rank's own compute time per sample (its waits in the gradient reduction
    excluded) and compare the replicas every `interval` steps."""
    interval: int = 10
    """Steps between comparisons. Each one adds a few bytes per rank to that step's commit
    vote (through the store)."""
    window: int = 20
    """Committed steps whose median time per sample is a rank's pace (a lone slow step is
    noise, not a straggler)."""
    factor: float = 1.3
    """A replica whose pace is this many times the median replica's is a straggler: its share
    becomes proportional to its speed. It stays one until its pace is back under the halfway
    mark (1.15 by default), so that shares do not flap."""
    evict_factor: float = 2.0
    """A replica this many times slower than the others per sample (its pace over its share)
    gives its node(s) to a free standby, whose ranks rejoin at full speed; with no standby free
    it keeps its smaller share. 0: never evicted."""

    def __post_init__(self) -> None:
        if self.interval < 1 or self.window < 1 or not self.factor > 1:
            raise ValueError("straggler.interval and window must be >= 1 and factor > 1")
        if self.evict_factor and not self.evict_factor >= self.factor:
            raise ValueError("straggler.evict_factor must be 0 (never) or >= straggler.factor")
