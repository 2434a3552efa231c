"""In-memory snapshot and recovery settings of `snapshot/` (pure dataclasses; here, below
`snapshot/`, so that `config.run` composes them without an upward import)."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(kw_only=True)
class SnapshotConfig:
    """REFT-style snapshots into the node's shared memory (`docs/snapshot.md`)."""

    interval: int = 0
    """Snapshot every this many steps (1 = every step); 0 = off. The copy runs in a background
    thread while the next step computes; only the next optimizer update waits for it."""
    dir: str | None = None
    """Shared-memory root; null = `$MECEFO_SHM_DIR` or `/dev/shm`. Each run gets its own folder
    (named after its run_dir), one sub-folder per node."""
    parity: Literal["none", "xor", "rs"] = "xor"
    """Erasure coding of each node's snapshot across the nodes of its parity group (kept by the
    per-node snapshot process): xor survives one lost node per group, rs `rs_parity` nodes."""
    parity_group: int = 0
    """Nodes per parity group; 0 = all nodes of the job in one group (needs >= 2 nodes)."""
    rs_parity: int = 2
    """Parity units per stripe for `parity: rs` (tolerated node losses per group)."""
    verify_on_load: bool = True
    """Check every shard's CRC32 before a snapshot is used (a corrupt one is never loaded)."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"snapshot.interval must be >= 0 steps, got {self.interval}")
        if self.parity not in ("none", "xor", "rs"):
            raise ValueError(f"snapshot.parity must be none, xor or rs, got {self.parity!r}")
        if self.parity_group < 0 or self.parity_group == 1:
            raise ValueError("snapshot.parity_group must be 0 (all nodes) or >= 2 nodes")
        if self.rs_parity < 1:
            raise ValueError(f"snapshot.rs_parity must be >= 1, got {self.rs_parity}")

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    @property
    def parity_units(self) -> int:
        """Parity units per stripe (0: no parity)."""
        return {"none": 0, "xor": 1, "rs": self.rs_parity}[self.parity]

    def parity_groups(self, nnodes: int) -> list[list[int]]:
        """Consecutive node ranks in groups of `parity_group` (0 = one group); a short tail
        joins the last group."""
        size = nnodes if self.parity_group <= 0 else self.parity_group
        groups = [list(range(i, min(i + size, nnodes))) for i in range(0, nnodes, size)]
        if len(groups) > 1 and len(groups[-1]) < size:
            groups[-2].extend(groups.pop())
        return groups


@dataclasses.dataclass(kw_only=True)
class RecoveryConfig:
    """What happens when ranks die (`docs/snapshot.md`, "Recovery order")."""

    mode: Literal["failover", "restart"] = "failover"
    """failover: survivors keep training (MeCeFO) and the dead rejoin; restart: the classic
    checkpoint-restart baseline, every failure restarts all ranks from the newest valid state
    (own snapshot, parity rebuild, disk)."""
    wait_all_s: float = 60.0
    """After every replica was lost, how long the coordinator waits for all of them to come
    back before it resumes with those that did."""

    def __post_init__(self) -> None:
        if self.mode not in ("failover", "restart"):
            raise ValueError(f"recovery.mode must be failover or restart, got {self.mode!r}")
        if self.wait_all_s <= 0:
            raise ValueError(f"recovery.wait_all_s must be > 0, got {self.wait_all_s}")
