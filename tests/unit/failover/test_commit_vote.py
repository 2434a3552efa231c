"""The commit vote with threads as ranks (each with its own store client and, for TP = 1, a real
gloo group): every member reaches the same verdict, and an update is committed only when every
member's reduction succeeded. TP = 1 votes with an all-reduce of success flags; TP > 1 with a
store counter over all ranks (both paths are tested)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import threading

import pytest
import torch.distributed as dist

from megatron_mecefo.config.run import RunConfig
from megatron_mecefo.failover import keys
from megatron_mecefo.failover.config import FailoverConfig
from megatron_mecefo.failover.manager import FailoverManager

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
    cfg = RunConfig(failover=FailoverConfig(failure_wait_s=0.3, regroup_timeout_s=20))
    cfg.parallel.timeout_s = 20
    ranks = []
    for r in range(N * tp):
        m = FailoverManager(
            cfg,
            address=f"127.0.0.1:{store.port}",
            rank=r,
            world_size=N * tp,
            tp_size=tp,
            incarnation=0,
            backend="gloo",
        )
        m.hb = _Beat()
        m.membership.members, m.membership.generation = tuple(range(N)), 1
        ranks.append(m)
    if tp == 1:  # a real DP group per rank, built concurrently like real ranks do

        def build(m):
            prefix = dist.PrefixStore("pg/1/tp0", keys.connect(m.address, 10))
            m.membership.group = dist.ProcessGroupGloo(
                prefix, m.replica, N, datetime.timedelta(seconds=20)
            )

        threads = [threading.Thread(target=build, args=(m,)) for m in ranks]
        [t.start() for t in threads]
        [t.join(20) for t in threads]
    _KEEP_ALIVE.append((store, ranks))
    return store, ranks


def _vote(ranks, oks, voters=None, step=7):
    out = {}

    def run(i):
        out[i] = ranks[i].commit_vote(step, oks[i])

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
    assert all(m._pending is None and m.attempt == 0 for m in ranks)


@pytest.mark.parametrize("tp", [1, 2])
def test_one_failed_reduction_means_nobody_commits(tp):
    _, ranks = _setup(tp)
    oks = [True] * len(ranks)
    oks[-1] = False
    threads, out = _vote(ranks, oks)
    _join(threads)
    assert set(out.values()) == {False} and len(out) == len(ranks)
    # same membership, so the group is rebuilt under a fresh key and the attempt advances
    assert {m._pending for m in ranks} == {(1, "pg/1/s7a0")}
    assert all(m.attempt == 1 for m in ranks)


@pytest.mark.parametrize("tp", [1, 2])
def test_member_lost_before_voting_then_new_generation_aborts(tp):
    store, ranks = _setup(tp)
    voters = [i for i, m in enumerate(ranks) if m.replica != 1]  # replica 1 never votes
    threads, out = _vote(ranks, [True] * len(ranks), voters=voters)
    store.set(keys.gen_record(2), json.dumps({"members": [0, 2]}))
    store.set(keys.GEN, "2")
    for m in ranks:
        m.hb.latest_gen = 2  # what each rank's heartbeat thread would now report
    _join(threads)
    assert set(out.values()) == {False} and sorted(out) == voters
    assert {ranks[i]._pending for i in voters} == {(2, "pg/2")}
