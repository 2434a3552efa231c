"""Decisions of the in-job rerun (`failover/trainer/rerun.py`) on stand-in store and members:
what a replica named as corrupt does the first and the second time (across incarnations), what
the others record, and a tie that names nobody."""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from megatron_mecefo.control.records import posted_events
from megatron_mecefo.errors import CorruptStateError, EvictedError, NumericalFaultError
from megatron_mecefo.failover.trainer.rerun import AnomalyRerun


def _rerun(store, replica: int, leader: bool = False):
    membership = types.SimpleNamespace(replica=replica, members=(0, 1, 2))
    plane = types.SimpleNamespace(store=store)
    vote = types.SimpleNamespace(last_corrupt=None, last_anomaly=None)
    return AnomalyRerun(
        plane, membership, vote, position=0, writes_events=lambda: leader, timeout_s=1.0
    )


def test_a_corrupt_replica_rejoins_the_first_time_and_is_evicted_the_second():
    store = dist.HashStore()
    named = _rerun(store, replica=2)
    named.vote.last_corrupt = [2]
    with pytest.raises(CorruptStateError, match="rejoining with a healthy peer's state"):
        named.after_attempt(None, 4, committed=False)
    leader = _rerun(store, replica=0, leader=True)
    leader.vote.last_corrupt = [2]
    leader.after_attempt(None, 4, committed=False)  # the others redo the step
    assert leader.healing == {2}
    leader.membership.members = (0, 1)
    leader.vote.last_corrupt = None
    leader.after_attempt(None, 5, committed=True)  # not back yet: not healed
    assert leader.healing == {2}
    leader.membership.members = (0, 1, 2)
    leader.after_attempt(None, 9, committed=True)
    assert leader.healing == set()
    posted = [(e["type"], e.get("kind"), e["step"]) for e in posted_events(store)[0]]
    assert posted == [
        ("anomaly", None, 4),
        ("classified", "corruption", 4),
        ("healed", None, 9),
    ]
    again = _rerun(store, replica=2)  # a new incarnation: the count lives in the store
    again.vote.last_corrupt = [2]
    with pytest.raises(EvictedError, match="twice"):
        again.after_attempt(None, 12, committed=False)


def test_no_majority_stops_the_job():
    rerun = _rerun(dist.HashStore(), replica=0)
    rerun.vote.last_corrupt = []
    with pytest.raises(NumericalFaultError, match="no majority"):
        rerun.after_attempt(None, 3, committed=False)
