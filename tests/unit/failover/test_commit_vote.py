"""The commit vote with threads as ranks (each with its own store client): every member reaches
the same verdict, and an update is committed only when every member's reduction succeeded."""

from __future__ import annotations

import dataclasses
import datetime
import json
import threading
import time

import pytest
import torch.distributed as dist

from megatron_mecefo.config.run import RunConfig
from megatron_mecefo.failover import keys
from megatron_mecefo.failover.config import FailoverConfig
from megatron_mecefo.failover.manager import FailoverManager

pytestmark = pytest.mark.timeout(60)


@dataclasses.dataclass
class _Beat:
    latest_gen: int = 1


def _setup(n=3):
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    store.set(keys.gen_record(1), json.dumps({"members": list(range(n))}))
    store.set(keys.GEN, "1")
    cfg = RunConfig(failover=FailoverConfig(failure_wait_s=0.3, regroup_timeout_s=20))
    managers = []
    for r in range(n):
        m = FailoverManager(
            cfg,
            address=f"127.0.0.1:{store.port}",
            rank=r,
            world_size=n,
            tp_size=1,
            incarnation=0,
            backend="gloo",
        )
        m.hb = _Beat()
        m.membership.members, m.membership.generation = tuple(range(n)), 1
        managers.append(m)
    return store, managers


def _vote(managers, oks, step=7, voters=None):
    out = {}

    def run(i):
        out[i] = managers[i].commit_vote(step, oks[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in (voters or range(len(managers)))]
    for t in threads:
        t.start()
    return threads, out


def test_all_succeed_commit():
    _, ms = _setup()
    threads, out = _vote(ms, [True, True, True])
    for t in threads:
        t.join(10)
    assert out == {0: True, 1: True, 2: True}
    assert all(m._pending is None and m.attempt == 0 for m in ms)


def test_one_failed_reduction_means_nobody_commits():
    _, ms = _setup()
    threads, out = _vote(ms, [True, True, False])
    for t in threads:
        t.join(10)
    assert out == {0: False, 1: False, 2: False}
    # same membership, so the group is rebuilt under a fresh key and the attempt advances
    assert {m._pending for m in ms} == {(1, "pg/1/s7a0")}
    assert all(m.attempt == 1 for m in ms)


def test_member_dies_before_voting_then_new_generation_aborts():
    store, ms = _setup()
    threads, out = _vote(ms, [True, True, True], voters=[0, 2])  # replica 1 never votes
    store.set(keys.gen_record(2), json.dumps({"members": [0, 2]}))
    store.set(keys.GEN, "2")
    for t in threads:
        t.join(10)
    assert out == {0: False, 2: False}
    assert ms[0]._pending == ms[2]._pending == (2, "pg/2")


def test_verdicts_agree_when_the_generation_changes_during_the_vote():
    # replica 2 votes last while the coordinator publishes a generation without it: whether the
    # step commits (its vote completed the count) or aborts (someone saw the new generation
    # first), the compare-and-set decision key makes every member apply the same verdict
    store, ms = _setup()
    threads, out = _vote(ms, [True, True, True], voters=[0, 1])
    deadline = time.monotonic() + 10
    while keys.get_int(store, keys.vote(1, 7, 0)) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)  # replicas 0 and 1 have voted; replica 2's vote will be the last
    store.set(keys.gen_record(2), json.dumps({"members": [0, 1]}))
    store.set(keys.GEN, "2")
    ms[2].hb.latest_gen = 2
    last = ms[2].commit_vote(7, True)
    for t in threads:
        t.join(10)
    assert out[0] == out[1] == last
    assert {m._pending for m in ms} == {(2, "pg/2")}  # and everyone moves to generation 2
