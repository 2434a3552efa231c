"""The commit vote with threads as ranks (each with its own store client and, for TP = 1, a real
gloo group): every member reaches the same verdict, and an update is committed only when every
member's reduction succeeded. A one-rank replica votes with an all-reduce of success flags; a
replica of several ranks (TP x PP > 1) with a store counter over all ranks (both paths are
tested)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import threading
import time

import pytest
import torch.distributed as dist

from megatron_mecefo.control import keys
from megatron_mecefo.failover.trainer.collectives import AbortableCollectives
from megatron_mecefo.failover.trainer.commit import CommitVote
from megatron_mecefo.failover.trainer.membership import LiveMembership
from megatron_mecefo.failover.trainer.plane import ControlPlane
from megatron_mecefo.training.stop import StopFlag

pytestmark = pytest.mark.timeout(60)
N = 3
# Groups whose collective was abandoned still hold gloo work until their timeout; destroying one
# blocks until then (the product keeps them too and ends with os._exit). Never let the garbage
# collector destroy them in the middle of a later test.
_KEEP_ALIVE: list = []


@dataclasses.dataclass
class _Beat:
    latest_gen: int = 1
    job_done: bool = False
    beat_dir: None = None  # no agent: records come from the store


def _setup(tp):
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    store.set(keys.gen_record(1), json.dumps({"members": list(range(N))}))
    store.set(keys.GEN, "1")
    address = f"127.0.0.1:{store.port}"
    ranks = []
    for r in range(N * tp):
        plane = ControlPlane(address, 10.0, incarnation=0)
        plane.hb = _Beat()
        membership = LiveMembership(
            num_replicas=N, replica=r // tp, members=tuple(range(N)), group=None, generation=1
        )
        membership.collectives = AbortableCollectives(
            "gloo",
            lambda p=plane, m=membership: p.membership_lost(m.generation, m.members),
            lambda: None,
        )
        membership.vote = CommitVote(
            plane,
            membership,
            rank=r,
            replica_size=tp,
            stop_flag=StopFlag(),
            failure_wait_s=0.3,
            regroup_timeout_s=20,
        )
        ranks.append(membership.vote)
    if tp == 1:  # a real DP group per rank, built concurrently like real ranks do

        def build(v):
            prefix = dist.PrefixStore("pg/1/tp0", keys.connect(address, 10))
            v.membership.group = dist.ProcessGroupGloo(
                prefix, v.membership.replica, N, datetime.timedelta(seconds=20)
            )

        threads = [threading.Thread(target=build, args=(v,)) for v in ranks]
        [t.start() for t in threads]
        [t.join(20) for t in threads]
    _KEEP_ALIVE.append((store, ranks))
    return store, ranks


def _vote(ranks, oks, voters=None, step=7, anomalies=None):
    out = {}

    def run(i):
        anomaly = (anomalies or {}).get(i)
        out[i] = ranks[i].membership.commit(step, oks[i], anomaly=anomaly)

    threads = [threading.Thread(target=run, args=(i,)) for i in (voters or range(len(ranks)))]
    [t.start() for t in threads]
    return threads, out


def _join(threads):
    for t in threads:
        t.join(20)
        assert not t.is_alive(), "a voter hung"


@pytest.mark.parametrize("tp", [1, 2])
def test_all_succeed_commit(tp):
    _, ranks = _setup(tp)
    threads, out = _vote(ranks, [True] * len(ranks))
    _join(threads)
    assert set(out.values()) == {True} and len(out) == len(ranks)
    assert all(m.pending is None and m.attempt == 0 for m in ranks)


@pytest.mark.parametrize("tp", [1, 2])
def test_one_failed_reduction_means_nobody_commits(tp):
    _, ranks = _setup(tp)
    oks = [True] * len(ranks)
    oks[-1] = False
    threads, out = _vote(ranks, oks)
    _join(threads)
    assert set(out.values()) == {False} and len(out) == len(ranks)
    # same membership, so the group is rebuilt under a fresh key and the attempt advances
    assert {m.pending for m in ranks} == {(1, "pg/1/s7a0")}
    assert all(m.attempt == 1 for m in ranks)


@pytest.mark.parametrize("tp", [1, 2])
def test_member_lost_before_voting_then_new_generation_aborts(tp):
    store, ranks = _setup(tp)
    voters = [i for i, m in enumerate(ranks) if m.membership.replica != 1]  # replica 1 never votes
    threads, out = _vote(ranks, [True] * len(ranks), voters=voters)
    store.set(keys.gen_record(2), json.dumps({"members": [0, 2]}))
    store.set(keys.GEN, "2")
    for m in ranks:
        m.plane.hb.latest_gen = 2  # what each rank's heartbeat thread would now report
    _join(threads)
    assert set(out.values()) == {False} and sorted(out) == voters
    assert {ranks[i].pending for i in voters} == {(2, "pg/2")}


def test_a_new_generation_votes_from_attempt_zero():
    """Vote keys are per (generation, step, attempt): after an aborted attempt the old members are
    at attempt 1, but in the next generation everyone (a joiner included) votes on attempt 0."""
    store, ranks = _setup(2)  # TP 2: the vote is a store counter, no group needed
    threads, out = _vote(ranks, [False] * len(ranks))
    _join(threads)
    assert set(out.values()) == {False} and all(v.attempt == 1 for v in ranks)
    for v in ranks:
        v.membership.generation = 2
    threads, out = _vote(ranks, [True] * len(ranks))
    _join(threads)
    assert set(out.values()) == {True}
    assert store.check([keys.decision(2, 7, 0)]) and not store.check([keys.decision(2, 7, 1)])


@pytest.mark.parametrize("tp", [1, 2])
def test_an_anomaly_is_decided_at_once_with_its_suspects_and_no_rebuild(tp):
    """A member whose local loss is NaN reduced fine but votes the step down: every member
    aborts at once (well under the 0.3 s failure wait), names the same suspect, keeps its group
    (no rebuild key), and the next attempt commits."""
    store, ranks = _setup(tp)
    suspect = [i for i, v in enumerate(ranks) if v.membership.replica == 1]
    start = time.monotonic()
    threads, out = _vote(ranks, [True] * len(ranks), anomalies={i: "loss nan" for i in suspect})
    _join(threads)
    assert time.monotonic() - start < 0.3 * 0.9  # decided at once, not after the failure wait
    assert set(out.values()) == {False} and len(out) == len(ranks)
    assert store.get(keys.decision(1, 7, 0)) == b"abort:1:anomaly"
    assert {v.last_anomaly for v in ranks} == {(1, 7, 0)}
    assert {tuple(v.suspects(1, 7, 0)) for v in ranks} == {(1,)}
    assert all(v.pending is None and v.attempt == 1 for v in ranks)
    threads, out = _vote(ranks, [True] * len(ranks))
    _join(threads)
    assert set(out.values()) == {True} and {v.last_anomaly for v in ranks} == {None}


@pytest.mark.parametrize("tp", [1, 2])
def test_a_replica_whose_state_differs_from_the_majority_is_named_by_every_member(tp):
    """Fingerprints in the vote: replica 2's state differs (a flipped bit), so every member
    aborts the step with the same verdict naming replica 2; equal fingerprints commit."""
    store, ranks = _setup(tp)
    prints = [111 if v.membership.replica != 2 else 112 for v in ranks]
    out = {}

    def run(i):
        out[i] = ranks[i].membership.commit(7, True, fingerprint=prints[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
    [t.start() for t in threads]
    _join(threads)
    assert set(out.values()) == {False}
    assert store.get(keys.decision(1, 7, 0)) == b"abort:1:corrupt:2"
    assert {tuple(v.last_corrupt) for v in ranks} == {(2,)}
    assert all(v.pending is None for v in ranks)  # no group rebuild: the members are fine
    out.clear()

    def again(i):
        out[i] = ranks[i].membership.commit(7, True, fingerprint=111)

    threads = [threading.Thread(target=again, args=(i,)) for i in range(len(ranks))]
    [t.start() for t in threads]
    _join(threads)
    assert set(out.values()) == {True} and {v.last_corrupt for v in ranks} == {None}


def test_without_a_majority_nobody_is_named():
    from megatron_mecefo.failover.trainer.commit import _corrupt

    unknown = -1  # (fingerprint, intact code): -1 not known, 1 intact, 0 changed at rest
    assert _corrupt(3, {0: (5, unknown), 1: (5, unknown), 2: (6, unknown)}) == "abort:3:corrupt:2"
    assert _corrupt(3, {0: (5, 1), 1: (5, 1), 2: (6, 1)}) == "abort:3:corrupt:2"  # majority wins
    assert _corrupt(3, {0: (5, unknown), 1: (6, unknown)}) == "abort:3:corrupt:"  # a tie
    # 2 replicas: the one whose state changed since its own last update is named
    assert _corrupt(3, {0: (5, 1), 1: (6, 0)}) == "abort:3:corrupt:1"
    assert _corrupt(3, {0: (5, 0), 1: (6, 1)}) == "abort:3:corrupt:0"
    assert _corrupt(3, {0: (5, 1), 1: (6, 1)}) == "abort:3:corrupt:"  # both intact: the updates
    assert _corrupt(3, {0: (5, 0), 1: (6, 0)}) == "abort:3:corrupt:"
    assert _corrupt(3, {0: (5, 1), 1: (5, 0)}) is None and _corrupt(3, None) is None


@pytest.mark.parametrize("tp", [1, 2])
def test_paces_ride_on_the_vote_and_each_rank_keeps_only_its_latest_keys(tp):
    """On the straggler watch's steps every rank sets its pace before it votes; once the step
    commits every member reads the same paces. A rank deletes its previous pace and fingerprint
    keys when it sets the next ones: the store does not grow with the steps."""
    store, ranks = _setup(tp)
    for v in ranks:
        v.pace_of = lambda step, r=v.rank: 0.1 * (r + 1) if step % 2 == 0 else None
    out = {}

    def run(i, step):
        out[i] = ranks[i].membership.commit(step, True, fingerprint=111)

    for step in (2, 3, 4):
        threads = [threading.Thread(target=run, args=(i, step)) for i in range(len(ranks))]
        [t.start() for t in threads]
        _join(threads)
        assert set(out.values()) == {True}, step
        want = None if step % 2 else {r: 0.1 * (r + 1) for r in range(N * tp)}
        assert all(v.last_paces == want for v in ranks), step
    for r in range(N * tp):
        assert not store.check([keys.pace(1, 2, 0, r)]) and store.check([keys.pace(1, 4, 0, r)])
        if tp > 1:  # the store path keeps fingerprints in the store
            assert not store.check([keys.fingerprint(1, 3, 0, r)])
            assert store.check([keys.fingerprint(1, 4, 0, r)])


@pytest.mark.parametrize("tp", [1, 2])
def test_a_step_s_shared_keys_are_deleted_two_commits_later(tp):
    """The decision and counter keys of each step (and every attempt of it) go once nobody reads
    them: the store holds the last two committed steps', however long the job runs."""
    store, ranks = _setup(tp)
    oks = [True] * len(ranks)
    oks[-1] = False
    _join(_vote(ranks, oks, step=2)[0])  # attempt 0 of step 2 fails: attempt 1 commits
    for v in ranks:
        v.pending = None  # the group is fine (a stand-in failure)
    for step in range(2, 7):
        threads, out = _vote(ranks, [True] * len(ranks), step=step)
        _join(threads)
        assert set(out.values()) == {True}, step
    gone = [keys.decision(1, 2, 0), keys.decision(1, 2, 1), keys.decision(1, 4, 0)]
    assert not any(store.check([k]) for k in gone)
    assert store.check([keys.decision(1, 5, 0)]) and store.check([keys.decision(1, 6, 0)])
    if tp > 1:  # the store path's counters too
        assert not store.check([keys.vote(1, 4, 0)]) and store.check([keys.vote(1, 6, 0)])
