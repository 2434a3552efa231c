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
    vote = types.SimpleNamespace(
        last_corrupt=None, last_anomaly=None, last_fingerprint=None, replica_size=1
    )
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


def _suspected(store, rerun, step: int, record: dict, peer_losses: list[float]):
    """`rerun`'s member sees replica 1 flagged at `step` twice (a rerun that reproduced), with
    replica 0 the healthy peer that recomputes its micro-batches (`peer_losses`)."""
    import json

    from megatron_mecefo.control import keys

    g = 1
    asked: list = []
    rerun.vote.suspects = lambda *_: [1]
    engine = types.SimpleNamespace(
        cfg=types.SimpleNamespace(
            training=types.SimpleNamespace(num_microbatches=2, micro_batch_size=4)
        ),
        forward_check=lambda step, pairs: (asked.append(list(pairs)), list(peer_losses))[1],
        train_sampler=types.SimpleNamespace(
            sample_indices=lambda step, source, i: [source * 8 + i * 4 + k for k in range(4)]
        ),
        anomaly=types.SimpleNamespace(skipped=set()),
        asked=asked,
    )
    for a in (0, 1):
        store.set(keys.anomaly(g, step, a, 1), json.dumps(record))
        rerun.vote.last_anomaly = (g, step, a)
        rerun.after_attempt(engine, step, committed=False)
    return engine


SPIKE = {
    "what": "loss spike 310 > 3 x median 6.2 of the last 20 steps",
    "kind": "loss",
    "limit": 18.6,
    "tasks": [[1, 0], [1, 1]],  # replica 1's own
    "losses": [6.2, 310.0],
}


def test_a_spike_that_a_healthy_peer_does_not_reproduce_evicts_the_suspect():
    store = dist.HashStore()
    _suspected(store, _rerun(store, replica=0, leader=True), 7, SPIKE, [6.1, 6.3])
    with pytest.raises(EvictedError, match="loss spike 310 .* reproduced on this rank only"):
        _suspected(store, _rerun(store, replica=1), 7, SPIKE, [])
    posted = [(e["type"], e.get("kind"), e["step"]) for e in posted_events(store)[0]]
    assert sorted(posted, key=str) == [  # the suspect posts its anomaly on each attempt
        ("anomaly", None, 7),
        ("anomaly", None, 7),
        ("classified", "persistent", 7),
        ("evicted", None, 7),
        ("rerun", None, 7),
    ]


def test_a_spike_that_reproduces_on_a_healthy_peer_is_bad_data_and_skipped():
    store = dist.HashStore()
    engine = _suspected(store, _rerun(store, replica=0, leader=True), 7, SPIKE, [6.1, 310.0])
    assert engine.anomaly.skipped == {(7, 1, 1)}
    data = next(e for e in posted_events(store)[0] if e["type"] == "classified")
    assert (data["kind"], data["microbatches"], data["samples"]) == (
        "data",
        [[1, 1]],
        [12, 13, 14, 15],
    )
    assert engine.asked == [[(1, 0), (1, 1)]]  # what the suspect's record names
    assert data["detail"].startswith("loss spike 310")


def test_the_peer_recomputes_what_the_suspect_ran_and_skips_that():
    """A suspect that ran a straggler's or a dead replica's micro-batch names it in its record:
    the peer recomputes exactly those, and the bad one is skipped by its source (replica 2's
    micro-batch 1 here, which replica 1 computed), not replica 1's own."""
    store = dist.HashStore()
    record = {**SPIKE, "tasks": [[1, 0], [1, 1], [2, 1]], "losses": [6.1, 6.2, 300.0]}
    engine = _suspected(store, _rerun(store, replica=0, leader=True), 7, record, [6.1, 6.2, 300])
    assert engine.asked == [[(1, 0), (1, 1), (2, 1)]]
    assert engine.anomaly.skipped == {(7, 2, 1)}
    data = next(e for e in posted_events(store)[0] if e["type"] == "classified")
    assert data["microbatches"] == [[2, 1]] and data["samples"] == [20, 21, 22, 23]


def test_unchecked_data_skips_what_the_suspect_s_own_losses_name():
    """Every member flagged (no peer): the suspect's own per-micro-batch losses say which are at
    fault; when they cannot tell, everything it ran."""
    from megatron_mecefo.failover.trainer.rerun import unchecked_faults

    ran = [(0, 0), (0, 1), (1, 3)]
    tasks = [list(p) for p in ran]
    spike = {**SPIKE, "tasks": tasks, "losses": [6.1, 6.3, 301.0]}
    assert unchecked_faults(spike, ran) == [(1, 3)]
    nan = {"what": "loss NaN/Inf", "kind": "nan", "limit": None, "tasks": tasks}
    assert unchecked_faults({**nan, "losses": [6.1, float("nan"), 6.0]}, ran) == [(0, 1)]
    assert unchecked_faults({**nan, "losses": [6.1, 6.2, 6.0]}, ran) == ran  # a gradient fault
    assert unchecked_faults({**spike, "kind": "grad"}, ran) == ran
    assert unchecked_faults({**spike, "losses": None}, ran) == ran  # not the last stage


def test_a_diverged_update_is_redone_then_the_wrong_replica_named_and_its_keys_swept():
    """2 replicas whose states differ after step 5's update, neither changed at rest: each notes
    its fingerprint and rolls back (`DivergedUpdateError`); after the redo commits step 6, the
    replica whose noted fingerprint the redo does not reproduce is named, and the divergence
    keys are deleted at the next commit (every member has read them by then)."""
    from megatron_mecefo.control import keys
    from megatron_mecefo.errors import DivergedUpdateError

    store = dist.HashStore()

    def member(replica: int, fingerprint: int):
        rerun = _rerun(store, replica, leader=replica == 0)
        rerun.membership.members = (0, 1)
        rerun.can_roll_back = True
        rerun.vote.last_fingerprint = fingerprint
        return rerun

    for replica, first in ((0, 111), (1, 999)):  # replica 1 computed its update wrong
        voted = member(replica, first)
        voted.vote.last_corrupt = []  # the states differ and no majority names one
        with pytest.raises(DivergedUpdateError):
            voted.after_attempt(None, 6, committed=False)
    assert keys.get_int(store, keys.ROLLBACK_BOUND, -1) == 5
    leader, other = member(0, 111), member(1, 111)  # the redo: both reproduce replica 0's
    leader.after_attempt(None, 6, committed=True)
    other.after_attempt(None, 6, committed=True)  # after the leader: the keys are still there
    posted = [(e["type"], e.get("kind"), e["dp_rank"]) for e in posted_events(store)[0]]
    assert posted[-3:] == [
        ("anomaly", None, 1),
        ("classified", "corruption", 1),
        ("healed", None, 1),
    ], posted
    assert int(store.add(keys.corruptions(1, 0), 0)) == 1  # replica 1 counted it itself
    assert not store.check([keys.ROLLBACK_BOUND])
    names = [keys.diverged_at(6), keys.divergence(6, 0, 0), keys.divergence(6, 1, 0)]
    assert all(store.check([n]) for n in names)
    leader.after_attempt(None, 7, committed=True)
    assert not any(store.check([n]) for n in names)
