"""The step boundary this trainer process stands at: the last step it committed.

Under failover an update is applied only after the job-wide commit vote, which needs the store.
The vote notes each commit here; when the store is lost, the line that ends the process (from the
main thread or the heartbeat thread) says where this rank stopped.
"""

from __future__ import annotations

_last_committed: int | None = None  # None: not in the job yet


def note_committed(step: int) -> None:
    """`step` was committed by the vote (its update follows at once)."""
    global _last_committed
    _last_committed = step


def note_joined(next_step: int) -> None:
    """This rank joined the job to run `next_step` next."""
    note_committed(next_step - 1)


def describe() -> str:
    """Where this rank stopped, for the one line of a stop."""
    if _last_committed is None:
        return "stopped before joining the job"
    if _last_committed < 0:
        return "stopped at step 0: no step was applied"
    return (
        f"stopped at a step boundary: the last step it committed is {_last_committed}; no step "
        "after it was applied"
    )
