"""Fault-tolerance strategies as small state machines over the set of dead DP groups.

Each strategy answers three questions for the simulator: is this failure fatal (job restart), what
is the per-step time multiplier now (relative to a failure-free step without redundancy), and what
does a rejoin do. Strategies: checkpoint-restart, r-fold replication, SPARe, MeCeFO failover
(neighbor / spread / hybrid) and in-memory snapshot recovery. All but snapshot also take disk
checkpoints; the simulator owns time, checkpoints and restarts.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.sim import spare
from megatron_mecefo.sim.matching import min_stack_after_failure, min_stack_fast

STRATEGY_NAMES = ("ckpt", "replication", "spare", "mecefo", "snapshot")


MEASURED_NEIGHBOR_STEP_RATIO = 1.37
"""Step time of a MeCeFO neighbour (own + a dead replica's micro-batches, degraded) over a normal
rank's, measured by `tools/bench/degraded.py` (real `Engine.train_step`, `small` model, CPU,
default techniques: FFN recompute off; README). 1.51 with recompute on; the paper's FLOP estimate
is ~1.56."""

MEASURED_SNAPSHOT_RESTART_S = 4.8
"""Failure -> training again after every trainer was killed and restarted from the node's
in-memory snapshot, measured end to end by `tools/bench/recovery.py` (2 ranks, CPU/gloo; README):
mostly process restart, no disk I/O, no step recomputed. Like the failover figure it does not
include a cluster's job relaunch and communicator set-up at scale: pass `--snapshot-restart-s`."""
MEASURED_SNAPSHOT_OVERHEAD = 0.005
"""Step-time cost of an every-step snapshot: the time the step waits for it, 0.49% of a step on
the `small` model (`tools/bench/recovery.py`; the tiny model's fixed ~1.6 ms is 3.7%)."""

MECEFO_MEASURED_FAILOVER_S = 3.5
"""Failure -> survivors training on the new membership, measured by `tools/bench/failover.py` on
CPU/gloo (README): about 0.3-0.5 s when the dead process's agent reports it, about 3.3 s when only
the 3 s heartbeat timeout can tell (SIGSTOP, node loss: the case that dominates on a cluster)."""

MEASURED_REPLACE_S = 5.4
"""Spare nodes: failure -> the lost node's ranks running again on a standby node, at full
data-parallel width (detection, assignment, warm start, state from a live peer).
PROVISIONAL: the median of `tools/bench/node_loss.py --rounds 3` in the README (tiny model,
2 simulated nodes x 2 ranks on one 2-core CPU machine: 5.4 s, range 5.3-6.0); the spare-node
replacement is being re-measured (issue 16), and a cluster adds the transfer of a real model's
state. Pass `--replace-s` to try other values."""


@dataclass(kw_only=True)
class StrategyConfig:
    """One fault-tolerance strategy and its knobs."""

    name: Literal["ckpt", "replication", "spare", "mecefo", "snapshot"]
    """ckpt: checkpoint-restart; replication: r-fold replication + ckpt; spare: SPARe + ckpt;
    mecefo: MeCeFO failover + ckpt; snapshot: restart from the in-memory snapshot."""
    redundancy: int = 1
    """r for replication (copies of each shard) and SPARe (stack depth); r <= N."""
    takeover_policy: Literal["neighbor", "spread", "hybrid"] = "hybrid"
    """MeCeFO: who runs a dead group's micro-batches (DESIGN.md section 3)."""
    neighbor_step_ratio: float = MEASURED_NEIGHBOR_STEP_RATIO
    """MeCeFO: step time of a neighbour covering one dead group (2M micro-batches, degraded mode)
    over a normal step; one degraded micro-batch costs neighbor_step_ratio / 2 of an exact one."""
    microbatches_per_rank: int = 8
    """MeCeFO spread/hybrid: micro-batches per rank per step (M)."""
    granularity: Literal["microbatch", "sample"] = "microbatch"
    """MeCeFO spread/hybrid: survivors take over whole micro-batches (slowest extra
    ceil(M d / (n - d)) / M) or sample slices (ceil(M b d / (n - d)) / (M b))."""
    micro_batch_size: int = 4
    """MeCeFO at sample granularity: samples per micro-batch (b)."""
    pipeline_stages: int = 1
    """P: pipeline stages of a group (PP). A 1F1B step of W micro-batches takes W + P - 1
    micro-batch slots, so extra work costs e / (M + P - 1), not e / M."""
    unit: Literal["replica", "stage"] = "replica"
    """MeCeFO: what a failure takes out. replica: the whole group (a pipeline) leaves and its
    micro-batches go to the other groups (what the trainer does). stage: only the dead GPU's
    stage is rerouted, to the same stage of the other pipelines, first into their P - 1 bubble
    slots (ReCycle, SOSP 2024; modelled only: cross-pipeline activation traffic is free here)."""
    min_alive_fraction: float = 0.5
    """MeCeFO: below this fraction of live groups the job restarts instead of failing over."""
    failover_s: float | None = None
    """Pause per masked failure (detection + regroup). null: MECEFO_MEASURED_FAILOVER_S for mecefo,
    0 for spare and replication (the SPARe paper's model)."""
    restart_s: float | None = None
    """Restart cost in seconds. null: the job's restart_s (T_r); snapshot: snapshot_restart_s."""
    snapshot_restart_s: float = MEASURED_SNAPSHOT_RESTART_S
    """snapshot: restart cost from the in-memory snapshot (measured; see the constant)."""
    snapshot_overhead: float = MEASURED_SNAPSHOT_OVERHEAD
    """snapshot: fractional step-time overhead of the every-step snapshot (measured)."""
    checkpoint_interval_s: float | None = None
    """Disk checkpoint period T_c in seconds. null: the optimum T_c* for this strategy's MTBF."""

    def __post_init__(self) -> None:
        if self.name not in STRATEGY_NAMES:
            raise ConfigError(
                f"unknown strategy {self.name!r} (allowed: {', '.join(STRATEGY_NAMES)})"
            )
        if self.redundancy < 1:
            raise ConfigError(f"redundancy must be >= 1, got {self.redundancy}")
        if self.name in ("ckpt", "mecefo", "snapshot") and self.redundancy != 1:
            raise ConfigError(f"strategy {self.name!r} has no redundancy knob; leave it at 1")
        if self.neighbor_step_ratio < 1.0:
            raise ConfigError(f"neighbor_step_ratio must be >= 1, got {self.neighbor_step_ratio}")
        if self.microbatches_per_rank < 1 or self.micro_batch_size < 1:
            raise ConfigError("microbatches_per_rank and micro_batch_size must be >= 1")
        if self.pipeline_stages < 1 or self.unit not in ("replica", "stage"):
            raise ConfigError("pipeline_stages must be >= 1 and unit 'replica' or 'stage'")
        if self.granularity not in ("microbatch", "sample"):
            raise ConfigError(
                f"granularity must be 'microbatch' or 'sample', got {self.granularity!r}"
            )
        if not 0.0 < self.min_alive_fraction <= 1.0:
            raise ConfigError(
                f"min_alive_fraction must be in (0, 1], got {self.min_alive_fraction}"
            )
        for name in ("failover_s", "restart_s", "checkpoint_interval_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        if self.snapshot_restart_s < 0 or self.snapshot_overhead < 0:
            raise ConfigError("snapshot_restart_s and snapshot_overhead must be >= 0")

    @property
    def label(self) -> str:
        """Short display name, e.g. 'spare r=8' or 'mecefo hybrid'."""
        if self.name in ("replication", "spare"):
            return f"{self.name} r={self.redundancy}"
        if self.name == "mecefo":
            if self.unit == "stage":
                return "mecefo stage"
            sliced = self.granularity == "sample" and self.takeover_policy != "neighbor"
            return f"mecefo {self.takeover_policy}" + ("/sample" if sliced else "")
        return self.name


class Strategy:
    """Base: every failure is fatal (checkpoint-restart), multiplier 1."""

    uses_disk_checkpoints = True

    def __init__(self, config: StrategyConfig, num_groups: int, job_restart_s: float) -> None:
        self.config = config
        self.num_groups = num_groups
        self.dead = np.zeros(num_groups, dtype=bool)
        self.num_dead = 0
        default_restart = job_restart_s
        if config.name == "snapshot":
            default_restart = config.snapshot_restart_s
        self.restart_s = default_restart if config.restart_s is None else config.restart_s
        default_failover = MECEFO_MEASURED_FAILOVER_S if config.name == "mecefo" else 0.0
        self.failover_s = default_failover if config.failover_s is None else config.failover_s

    def reset(self) -> None:
        """All groups alive again (after a restart)."""
        self.dead[:] = False
        self.num_dead = 0

    def fail(self, group: int) -> bool:
        """Mark `group` dead; True when the job must restart."""
        self.dead[group] = True
        self.num_dead += 1
        return True

    def rejoin(self, group: int) -> None:
        """`group` is back (repaired) and rejoins without a restart."""
        if self.dead[group]:
            self.dead[group] = False
            self.num_dead -= 1

    def multiplier(self) -> float:
        """Step time now / failure-free step time without redundancy."""
        return 1.0

    def mtbf_factor(self) -> float:
        """Expected failures per fatal failure (T_f = factor * m), used to pick T_c*."""
        return 1.0


class Snapshot(Strategy):
    """Every failure restarts the job, from the every-step in-memory snapshot (no disk rollback)."""

    uses_disk_checkpoints = False

    def multiplier(self) -> float:
        return 1.0 + self.config.snapshot_overhead


class Replication(Strategy):
    """floor(N/r) disjoint replica sets (the last one absorbs N mod r extra groups), each computing
    r shards' worth per step; a set whose groups are all dead loses its shards (fatal)."""

    def __init__(self, config: StrategyConfig, num_groups: int, job_restart_s: float) -> None:
        super().__init__(config, num_groups, job_restart_s)
        r = config.redundancy
        if r > num_groups:
            raise ConfigError(f"replication r={r} exceeds the number of groups N={num_groups}")
        num_sets = num_groups // r
        self.set_of = np.minimum(np.arange(num_groups) // r, num_sets - 1)
        self.set_size = np.bincount(self.set_of, minlength=num_sets)
        self.set_dead = np.zeros(num_sets, dtype=np.int64)

    def reset(self) -> None:
        super().reset()
        self.set_dead[:] = 0

    def fail(self, group: int) -> bool:
        self.dead[group] = True
        self.num_dead += 1
        s = self.set_of[group]
        self.set_dead[s] += 1
        return bool(self.set_dead[s] >= self.set_size[s])

    def rejoin(self, group: int) -> None:
        if self.dead[group]:
            self.set_dead[self.set_of[group]] -= 1
        super().rejoin(group)

    def multiplier(self) -> float:
        return float(self.config.redundancy)

    def mtbf_factor(self) -> float:
        if self.config.redundancy == 1:
            return 1.0
        return spare.endurable_failures_replication(self.num_groups, self.config.redundancy)


class Spare(Strategy):
    """SPARe: cyclic stacks; step cost = minimum stack number S; fatal when r consecutive die."""

    def __init__(self, config: StrategyConfig, num_groups: int, job_restart_s: float) -> None:
        super().__init__(config, num_groups, job_restart_s)
        spare.check_layout(num_groups, config.redundancy)
        self.dead_sorted: list[int] = []
        self.stacks = 1

    def reset(self) -> None:
        super().reset()
        self.dead_sorted = []
        self.stacks = 1

    def fail(self, group: int) -> bool:
        self.dead[group] = True
        self.num_dead += 1
        bisect.insort(self.dead_sorted, group)
        if spare.dead_run_length(self.dead, group) >= self.config.redundancy:
            return True
        self.stacks = min_stack_after_failure(
            np.array(self.dead_sorted),
            group,
            self.stacks,
            self.num_groups,
            self.config.redundancy,
        )
        return False

    def rejoin(self, group: int) -> None:
        if not self.dead[group]:
            return
        super().rejoin(group)
        self.dead_sorted.remove(group)
        s = min_stack_fast(np.array(self.dead_sorted), self.num_groups, self.config.redundancy)
        self.stacks = 1 if s is None else s

    def multiplier(self) -> float:
        return float(self.stacks)

    def mtbf_factor(self) -> float:
        if self.config.redundancy == 1:
            return 1.0
        return spare.endurable_failures(self.num_groups, self.config.redundancy)


class Mecefo(Strategy):
    """MeCeFO failover: survivors take over the dead groups' micro-batches; no restart."""

    def fail(self, group: int) -> bool:
        self.dead[group] = True
        self.num_dead += 1
        alive = self.num_groups - self.num_dead
        return alive < self.config.min_alive_fraction * self.num_groups or alive == 0

    def multiplier(self) -> float:
        """Step time over the failure-free one. In micro-batch slots of one stage, a 1F1B step
        of W micro-batches takes W + P - 1 (P = 1: W); failure-free W = M."""
        d = self.num_dead
        if d == 0:
            return 1.0
        cfg = self.config
        m, bubble = cfg.microbatches_per_rank, cfg.pipeline_stages - 1
        base = m + bubble
        if cfg.unit == "stage":  # the dead stages' slots, to the same stage of the others
            extra = math.ceil(m * d / (self.num_groups - d))
            return 1.0 + max(0, extra - bubble) / base
        if cfg.takeover_policy == "neighbor":
            # the next healthy group in ring order covers a whole run of j dead groups
            work = (1 + self._longest_dead_run()) * m * cfg.neighbor_step_ratio / 2.0
            return (work + bubble) / base
        units = m * (cfg.micro_batch_size if cfg.granularity == "sample" else 1)
        extra = math.ceil(units * d / (self.num_groups - d)) / units * m  # in micro-batches
        if cfg.takeover_policy == "spread":
            return 1.0 + extra / base
        return 1.0 + extra * min(1.0, cfg.neighbor_step_ratio / 2.0) / base

    def _longest_dead_run(self) -> int:
        if self.num_dead == self.num_groups:
            return self.num_groups
        # rotate so that index 0 is alive, then measure runs of True
        start = int(np.flatnonzero(~self.dead)[0])
        rolled = np.concatenate([np.roll(self.dead, -start), [False]]).astype(np.int8)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], rolled])))
        return int((edges[1::2] - edges[0::2]).max()) if edges.size else 0

    def mtbf_factor(self) -> float:
        return max(1.0, (1.0 - self.config.min_alive_fraction) * self.num_groups)


def build_strategy(config: StrategyConfig, num_groups: int, job_restart_s: float) -> Strategy:
    """Instantiate the strategy state machine for `num_groups` DP groups."""
    classes = {
        "ckpt": Strategy,
        "snapshot": Snapshot,
        "replication": Replication,
        "spare": Spare,
        "mecefo": Mecefo,
    }
    return classes[config.name](config, num_groups, job_restart_s)
