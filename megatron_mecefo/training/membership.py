"""Who trains right now: the one object that owns the data-parallel membership, and the
protocol the engine speaks with it: the reduction (`all_reduce`) and the commit (`commit`).

The engine (default plan, loss reduction, evaluation split, sampler size, the step's commit) and
the gradient reducer read it; nothing else caches the DP size or group. `ParallelContext` keeps
only the static TP layout. Without failover it is static: megatron's DP group, all replicas,
blocking collectives, and a step commits locally. Under failover a live membership (a subclass in
`failover/trainer/membership.py`) has abortable collectives, commits by a job-wide vote, and has
its `generation`, `members` and `group` replaced at each regroup.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.distributed as dist


class Collectives(Protocol):
    """How the DP group's collectives run; errors are recorded, not raised mid-step."""

    failed: str | None
    """Reason the last collective of this step failed, or None."""

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
        """SUM all-reduce in place; False (and `failed` set) if it did not complete."""
        ...

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
        """`out` = every member's `tensor`, end to end in group order; False if it failed."""
        ...

    def reset(self) -> None:
        """Forget the error of a previous step."""
        ...


class BlockingCollectives:
    """Plain blocking collectives (no failover): an error propagates as an exception."""

    failed: str | None = None

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return True

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
        dist.all_gather_single(out, tensor, group=group)
        return True

    def reset(self) -> None:
        self.failed = None


@dataclasses.dataclass
class Membership:
    """The DP membership of one generation, as seen by this replica."""

    num_replicas: int
    """n: replicas of the failure-free job; the global batch is always n x M micro-batches."""
    replica: int
    """This process's logical replica index in [0, n), stable across generations."""
    members: tuple[int, ...]
    """Alive replicas of this generation (sorted logical indices)."""
    group: dist.ProcessGroup | None
    """DP group over `members` (this TP slice); position i in the group is `members[i]`."""
    generation: int = 0
    """Membership generation (0 = static, no failover)."""
    collectives: Collectives = dataclasses.field(default_factory=BlockingCollectives)
    """How collectives on `group` run (failover: abortable, recorded errors)."""
    compares_fingerprints = False
    """Does `commit` compare the members' state fingerprints (failover's vote does)?"""

    def __post_init__(self) -> None:
        self.members = tuple(sorted(self.members))
        if self.replica not in self.members:
            raise ValueError(f"replica {self.replica} is not a member of {self.members}")

    @classmethod
    def static(cls, dp_rank: int, dp_size: int, group: dist.ProcessGroup | None) -> Membership:
        """All `dp_size` replicas, megatron's DP group, blocking collectives."""
        return cls(
            num_replicas=dp_size, replica=dp_rank, members=tuple(range(dp_size)), group=group
        )

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def position(self) -> int:
        """This replica's rank in `group`."""
        return self.members.index(self.replica)

    @property
    def dead(self) -> tuple[int, ...]:
        """Replicas of the failure-free job that are not members now."""
        return tuple(r for r in range(self.num_replicas) if r not in self.members)

    def group_rank_of(self, replica: int) -> int:
        """Logical replica -> rank in `group` (the logical-to-physical map)."""
        return self.members.index(replica)

    def begin_attempt(self) -> None:
        """A step attempt starts: forget the errors of the previous one."""
        self.collectives.reset()

    def all_reduce(self, tensor: torch.Tensor) -> bool:
        """SUM over the members (a no-op for one member). False if it failed (see `failed`)."""
        if self.size == 1 or self.group is None:
            return True
        return self.collectives.all_reduce(tensor, self.group)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> bool:
        """Every member's `tensor` into `out` (size x its numel), in group order. False if it
        failed (see `failed`)."""
        if self.size == 1 or self.group is None:
            out.copy_(tensor.reshape(-1))
            return True
        return self.collectives.all_gather(out, tensor, self.group)

    @property
    def failed(self) -> str | None:
        """Why a collective of this attempt failed, or None."""
        return self.collectives.failed

    def commit(
        self,
        step: int,
        ok: bool,
        anomaly: str | None = None,
        fingerprint: int | None = None,
        intact: bool | None = None,
    ) -> bool:
        """Apply this step's update? Static: iff this rank's reductions succeeded (`ok`; with
        blocking collectives a failure raises before this) and no member found NaN/Inf in its
        local results (`anomaly`, agreed by one all-reduce). A live membership answers the same
        on every member (the commit vote), and compares the members' state `fingerprint`s
        (`intact`: does it equal this rank's own after its last update? None: not known)."""
        flag = torch.tensor([0.0 if anomaly is None else 1.0], dtype=torch.float64)
        if self.size > 1 and self.group is not None:
            self.all_reduce(flag)
        return ok and float(flag.item()) == 0.0
