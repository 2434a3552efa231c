"""The straggler watch: a replica persistently slower than its peers gets a smaller share.

Each rank measures its own compute time on every committed step (`StepResult.compute_s`: forward
and backward, its waits in the gradient reduction excluded) and keeps those of the steps since
its work last changed, at most `straggler.window`. Every `straggler.interval` steps, each rank
shares the median of a full window (its pace) through the step's commit vote (`commit.py`), so
every member reads the same paces once the step commits and takes the same decision without
another round:

- a replica's pace is its slowest rank's. With even shares, a replica is a straggler when its
  pace is at least `straggler.factor` times the median of the others';
- then its weight becomes (the others' median pace / its pace), the others' stays 1, and every
  replica's share of the global batch is in proportion to its weight (`plan/rebalance.py`: exact
  tasks, every sample once) from the next step on. At each later comparison a straggler's weight
  is multiplied by (the healthy replicas' median pace / its pace) when its time is over the
  halfway mark (1.15 x theirs by default) or under 1 / `factor` x theirs, so its compute time
  converges to theirs (a little under theirs costs the job nothing, and shares come in whole
  samples, which a narrower band would chase back and forth).
  Only stragglers' weights move: the healthy replicas' times on a shared machine are noise.
  When every weight is back within that mark of 1 (the straggler recovered), the failure-free
  plans are back. The leader posts a `rebalanced` event at each change.

A replica slower than the others per sample (its pace over its weight) by `straggler.evict_factor`
is `too_slow`: the leader asks the coordinator to give its node(s) to a free standby
(`keys.RETIRE`, `authority/spare_pool.py`); with none free it keeps its smaller share.

A takeover (a replica lost) takes precedence (nothing is judged while one runs: its shares are
uneven by design), and a new generation starts the comparison afresh
(every member forgets the weights at once, and a rejoined rank has no pace yet).
Limits (`docs/anomalies.md`): with pipeline stages, the time a stage waits for its neighbours
counts as compute.
"""

from __future__ import annotations

import collections
import statistics

MIN_WEIGHT = 0.05
"""The smallest share weight (a replica always keeps some work: its plan needs a task)."""


class StragglerWatch:
    """One trainer's side (see the module docstring)."""

    def __init__(self, cfg, *, replica_size: int):
        self.cfg = cfg
        self.replica_size = replica_size
        self.window: collections.deque[float] = collections.deque(maxlen=cfg.window)
        self.speeds: dict[int, float] | None = None
        """Replica -> share weight (1: a healthy replica) while rebalancing, else None."""
        self.generation: int | None = None
        """The generation of the last committed step (`window` and `speeds` are its)."""
        self.too_slow: dict[int, float] = {}
        """Replica -> how many times slower per sample than the others, for the replicas past
        `evict_factor` at the last comparison."""

    @property
    def band(self) -> float:
        """The halfway mark: paces and weights within it of the reference are even."""
        return 1 + (self.cfg.factor - 1) / 2

    def pace(self, step: int) -> float | None:
        """This rank's pace to share with `step`'s vote: on the watch's steps, the median of its
        window (0.0 while the window is not full: not known yet); None on other steps."""
        if not self.cfg.enabled or step == 0 or step % self.cfg.interval:
            return None
        if len(self.window) < self.window.maxlen:
            return 0.0
        return statistics.median(self.window)

    def took(self, compute_s: float) -> None:
        """A committed step took this rank `compute_s` seconds of its own compute."""
        self.window.append(compute_s)

    def forget(self, generation: int) -> None:
        """A step committed in `generation`: weights decided in another one no longer hold, and
        the times of another generation's work are not this one's."""
        if generation != self.generation:
            if self.speeds is not None or self.generation is not None:
                self.window.clear()
            self.speeds, self.generation, self.too_slow = None, generation, {}

    def judge(self, paces: dict[int, float], members) -> bool:
        """Paces (global rank -> seconds) read after a committed vote: set `speeds`; True when
        they changed (this rank's window then starts again: its work changes next step)."""
        size = self.replica_size
        self.too_slow = {}
        known = {}
        for r in members:
            ranks = [paces.get(r * size + p, 0.0) for p in range(size)]
            if not all(x > 0 for x in ranks):
                return False  # a member without a full window yet: compare next time
            known[r] = max(ranks)
        if len(known) < 2:
            return False
        was = {r: (self.speeds or {}).get(r, 1.0) for r in members}
        weights = dict(was)
        for r, p in known.items():
            # the healthy replicas' median pace, r excluded (a straggler is not healthy itself)
            others = [x for q, x in known.items() if q != r and was[q] == 1.0]
            ref = statistics.median(others) if others else None
            if ref and self.cfg.evict_factor and p / was[r] / ref >= self.cfg.evict_factor:
                self.too_slow[r] = round(p / was[r] / ref, 2)  # per sample: pace over weight
            if was[r] == 1.0:  # a new straggler: slower than the others by `factor`
                if ref and p >= self.cfg.factor * ref:
                    weights[r] = max(MIN_WEIGHT, round(ref / p, 2))
            else:  # a straggler's weight follows its pace until its time is the others'
                ref = ref or p
                # down once it is slower than the band; up only once it is faster by `factor`:
                # a little faster costs the job nothing, and work comes in whole samples
                if p / ref >= self.band or p / ref <= 1 / self.cfg.factor:
                    weights[r] = max(MIN_WEIGHT, min(1.0, round(weights[r] * ref / p, 2)))
        speeds = None if min(weights.values()) * self.band > 1 else weights
        changed = speeds != self.speeds
        self.speeds = speeds
        if changed:
            self.window.clear()
        return changed
