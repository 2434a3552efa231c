"""The live membership: `training.membership.Membership` whose collectives give up when the
membership moves on (`collectives.py`) and whose commit is the job-wide vote (`commit.py`).

Regroup (`regroup.py`) replaces its `generation`, `members` and `group`; the engine and the
gradient reducer only ever see the `Membership` protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_mecefo.training.membership import Membership


@dataclasses.dataclass
class LiveMembership(Membership):
    """A membership under failover (see the module docstring)."""

    vote: Any = None
    """`commit.CommitVote` of this trainer (set once it exists)."""
    compares_fingerprints = True

    def commit(
        self,
        step: int,
        ok: bool,
        anomaly: str | None = None,
        fingerprint: int | None = None,
        intact: bool | None = None,
    ) -> bool:
        return self.vote.vote(step, ok, anomaly, fingerprint, intact)
