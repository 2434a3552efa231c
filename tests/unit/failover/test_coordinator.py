"""The coordinator's decisions, driven through a real in-process TCPStore: ranks are simulated
by writing the keys a trainer and an agent write (registration, heartbeats, progress, deaths)."""

from __future__ import annotations

import json
import os
import time

import pytest

from megatron_mecefo.control import keys
from megatron_mecefo.control.records import node_report, posted_events
from megatron_mecefo.failover.authority.coordinator import Coordinator
from megatron_mecefo.failover.liveness.detector import DetectorConfig

pytestmark = pytest.mark.timeout(60)


def make(store, world=4, **kw):
    cfg = DetectorConfig(
        heartbeat_timeout_s=kw.pop("heartbeat_timeout_s", 5.0),
        grace_s=kw.pop("grace_s", 0.0),
        hang_timeout_floor_s=kw.pop("hang_timeout_floor_s", 5.0),
        **kw,
    )
    return Coordinator(store, world, cfg, log=lambda m: None)


def register(store, rank, inc=0, tp=1, world=4):
    store.set(keys.progress(rank), f"{inc}:-1:idle")
    store.add(keys.heartbeat(rank), 1)
    reg = {"incarnation": inc, "pid": 1, "host": "h", "tp": tp, "world": world}
    keys.register(store, rank, json.dumps(reg))


def run_ticks(c, store, *, beating, seconds):
    """Tick the coordinator for `seconds` while the `beating` ranks keep heartbeating."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for r in beating:
            store.add(keys.heartbeat(r), 1)
        c.tick()
        time.sleep(0.02)


def members(store):
    gen = keys.get_int(store, keys.GEN)
    return gen, json.loads(store.get(keys.gen_record(gen)))["members"] if gen else None


def test_first_generation_waits_for_every_rank(store):
    c = make(store)
    for r in range(3):
        register(store, r)
    c.tick()
    assert keys.get_int(store, keys.GEN) == 0
    register(store, 3)
    c.tick()
    assert members(store) == (1, [0, 1, 2, 3])


def test_reported_death_removes_replica_and_evicts_it(store):
    c = make(store)
    for r in range(4):
        register(store, r)
    c.tick()
    store.set(keys.injected(2, 0), f"kill:{time.time() - 0.25}")
    keys.report_dead(store, 2, 0)
    c.tick()
    assert members(store) == (2, [0, 1, 3])
    assert store.get(keys.evict(2)) == b"0"
    evs = posted_events(store)[0]
    fail = next(e for e in evs if e["type"] == "failure")
    det = next(e for e in evs if e["type"] == "detection")
    assert fail["dp_rank"] == 2 and "injected kill" in fail["detail"]
    assert 250 <= det["latency_ms"] < 2000  # measured from the injection, not the report
    record = json.loads(store.get(keys.gen_record(2)))
    assert record["removed"] == [2] and record["failure_epoch_s"] < time.time() - 0.2


def test_report_of_an_older_incarnation_is_ignored(store):
    c = make(store)
    for r in range(4):
        register(store, r)
    c.tick()
    register(store, 1, inc=1)  # rank 1 restarted meanwhile (already re-registered)
    keys.report_dead(store, 1, 0)
    c.tick()
    assert members(store) == (1, [0, 1, 2, 3])


def test_heartbeat_silence_is_a_death(store):
    c = make(store, heartbeat_timeout_s=0.3)
    for r in range(4):
        register(store, r)
    c.tick()
    run_ticks(c, store, beating=(0, 1, 3), seconds=0.6)
    assert members(store) == (2, [0, 1, 3])
    fail = next(e for e in posted_events(store)[0] if e["type"] == "failure")
    assert "no heartbeat" in fail["detail"]


def test_simultaneous_failures_land_in_one_generation(store):
    c = make(store, grace_s=0.2)
    for r in range(4):
        register(store, r)
    c.tick()
    keys.report_dead(store, 1, 0)
    c.tick()
    assert keys.get_int(store, keys.GEN) == 1  # still inside the grace window
    keys.report_dead(store, 3, 0)
    time.sleep(0.25)
    c.tick()
    assert members(store) == (2, [0, 2])


def test_tp_replica_is_alive_only_with_all_its_ranks(store):
    c = make(store)
    for r in range(4):
        register(store, r, tp=2)
    c.tick()
    assert members(store) == (1, [0, 1])
    keys.report_dead(store, 3, 0)
    c.tick()
    assert members(store) == (2, [0])
    assert store.get(keys.evict(2)) == b"0" and store.get(keys.evict(3)) == b"0"


def test_restarted_replica_joins_once_all_its_ranks_registered(store):
    c = make(store)
    for r in range(4):
        register(store, r, tp=2)
    c.tick()
    keys.report_dead(store, 3, 0)
    c.tick()
    register(store, 3, inc=1, tp=2)
    c.tick()
    assert members(store) == (2, [0])  # rank 2 (evicted incarnation 0) has not come back yet
    register(store, 2, inc=1, tp=2)
    c.tick()
    assert members(store) == (3, [0, 1])
    assert json.loads(store.get(keys.gen_record(3)))["added"] == [1]


def test_hang_detected_when_others_wait_to_reduce(store):
    c = make(store, hang_timeout_floor_s=0.3)
    for r in range(4):
        register(store, r)
    c.tick()
    for r in range(4):
        store.set(keys.progress(r), f"0:5:{'compute' if r == 1 else 'reduce'}")
    run_ticks(c, store, beating=range(4), seconds=0.6)  # alive, but rank 1 never finishes its step
    assert members(store) == (2, [0, 2, 3])
    fail = next(e for e in posted_events(store)[0] if e["type"] == "failure")
    assert fail["dp_rank"] == 1 and "hung in step 5" in fail["detail"]


def test_no_hang_while_every_rank_computes(store):
    c = make(store, hang_timeout_floor_s=0.2)
    for r in range(4):
        register(store, r)
    c.tick()
    for r in range(4):
        store.set(keys.progress(r), "0:5:compute")  # a long step, everyone in it
    run_ticks(c, store, beating=range(4), seconds=0.5)
    assert keys.get_int(store, keys.GEN) == 1


def test_losing_every_replica_aborts_the_job(store):
    c = make(store, world=2)
    for r in range(2):
        register(store, r, world=2)
    c.tick()
    keys.report_dead(store, 0, 0)
    keys.report_dead(store, 1, 0)
    c.tick()
    assert b"neither snapshots nor checkpoints are enabled" in store.get(keys.ABORT)
    assert keys.get_int(store, keys.GEN) == 1


def test_a_replica_lost_once_is_one_failure_whatever_ranks_died(store):
    """A pipeline replica (2 ranks): one rank dies, the other leaves with it (evicted, no
    failure of its own); two replicas lost in one decision post their failures in time order."""
    c = make(store, world=6)
    for r in range(6):
        register(store, r, tp=2, world=6)
    c.tick()
    now = time.time()
    store.set(keys.injected(5, 0), f"kill:{now - 0.5}")  # replica 2 failed first
    store.set(keys.injected(1, 0), f"kill:{now - 0.2}")
    keys.report_dead(store, 1, 0)
    keys.report_dead(store, 5, 0)
    c.tick()
    assert members(store) == (2, [1])
    assert all(store.get(keys.evict(r)) == b"0" for r in (0, 1, 4, 5))  # the peers go too
    evs = posted_events(store)[0]
    fails = [e for e in evs if e["type"] == "failure"]
    dets = [e for e in evs if e["type"] == "detection"]
    assert [e["dp_rank"] for e in fails] == [2, 0] and [e["dp_rank"] for e in dets] == [2, 0]
    assert fails[0]["ranks"] == [4, 5] and fails[1]["ranks"] == [0, 1]
    assert "rank 1: injected kill" in fails[1]["detail"] and "rank 0" not in fails[1]["detail"]
    assert [e["epoch_s"] for e in fails] == sorted(e["epoch_s"] for e in fails)
    assert [e["type"] for e in evs].index("detection") == 2  # every failure before detections


def test_a_rollback_recovers_at_once_and_its_exits_are_no_failures(store):
    """A member found optimizer shards without a copy (`keys.rollback`): every member leaves
    for the recovery without eviction (one may be committing a checkpoint), `RECOVERING` tells
    the agents to restart held-back ranks, and the restarted ranks form the recovery generation."""
    c = make(store)
    _recovery(store)
    for r in range(4):
        register(store, r)
    c.tick()
    keys.report_dead(store, 1, 0)
    keys.report_dead(store, 2, 0)
    c.tick()
    assert members(store) == (2, [0, 3])
    store.add(keys.rollback(2), 1)
    c.tick()
    assert c.members == () and keys.get_int(store, keys.RECOVERING) == 1
    assert not store.check([keys.evict(0)]) and not store.check([keys.evict(3)])
    keys.report_dead(store, 3, 0)  # the members exit by themselves
    keys.report_dead(store, 0, 0)
    register(store, 3, inc=1)  # quick to restart: must not join before the others
    run_ticks(c, store, beating=[3], seconds=0.2)
    assert keys.get_int(store, keys.GEN) == 2
    for r in (0, 1, 2):
        register(store, r, inc=1)
    run_ticks(c, store, beating=[0, 1, 2, 3], seconds=0.2)
    gen, record = keys.get_int(store, keys.GEN), json.loads(store.get(keys.gen_record(3)))
    assert gen == 3 and record["members"] == [0, 1, 2, 3] and record["reason"] == "recover"
    assert keys.get_int(store, keys.RECOVERING) == 0
    fails = [e for e in posted_events(store)[0] if e["type"] == "failure"]
    assert sorted(e["dp_rank"] for e in fails) == [1, 2]  # the rollback's exits are not failures


def _recovery(store, mode="failover", wait_all_s=60.0):
    store.set(
        keys.RECOVERY,
        json.dumps({"mode": mode, "recoverable": True, "wait_all_s": wait_all_s}),
    )


def test_losing_every_replica_with_saved_state_waits_for_all_of_them(store):
    c = make(store, world=2)
    _recovery(store)
    for r in range(2):
        register(store, r, world=2)
    c.tick()
    keys.report_dead(store, 0, 0)
    keys.report_dead(store, 1, 0)
    c.tick()
    assert not store.check([keys.ABORT])
    assert c.members == () and keys.get_int(store, keys.GEN) == 1
    assert store.get(keys.evict(0)) == b"0" and store.get(keys.evict(1)) == b"0"
    register(store, 0, inc=1, world=2)  # one replica back: not enough yet
    c.tick()
    assert keys.get_int(store, keys.GEN) == 1
    register(store, 1, inc=1, world=2)
    c.tick()
    gen, record = 2, json.loads(store.get(keys.gen_record(2)))
    assert keys.get_int(store, keys.GEN) == gen
    assert record["members"] == [0, 1] and record["reason"] == "recover"
    assert record["failure_epoch_s"] is not None


def test_recovery_goes_on_without_a_replica_that_does_not_come_back(store):
    c = make(store, world=2)
    _recovery(store, wait_all_s=0.2)
    for r in range(2):
        register(store, r, world=2)
    c.tick()
    keys.report_dead(store, 0, 0)
    keys.report_dead(store, 1, 0)
    c.tick()
    register(store, 1, inc=1, world=2)
    c.tick()
    assert keys.get_int(store, keys.GEN) == 1  # still waiting for replica 0
    time.sleep(0.3)
    run_ticks(c, store, beating=[1], seconds=0.1)
    assert members(store) == (2, [1])


def test_recovery_waits_past_wait_all_s_for_ranks_their_agent_shows_starting(store):
    """A rank whose agent reports its restarted process (a cold start on a loaded node) is
    waited for past `wait_all_s`: its snapshot may hold shards no one else has."""
    c = make(store, world=2)
    _recovery(store, wait_all_s=0.2)
    for r in range(2):
        register(store, r, world=2)
    c.tick()
    keys.report_dead(store, 0, 0)
    keys.report_dead(store, 1, 0)
    c.tick()
    register(store, 1, inc=1, world=2)
    store.set(keys.node_key(0), node_report(1, {0: (1, os.getpid())}))  # rank 0 restarting
    time.sleep(0.3)
    run_ticks(c, store, beating=[1], seconds=0.3)
    assert keys.get_int(store, keys.GEN) == 1  # still waiting for rank 0
    register(store, 0, inc=1, world=2)
    run_ticks(c, store, beating=[0, 1], seconds=0.3)
    assert members(store) == (2, [0, 1])


def test_restart_mode_evicts_every_replica_on_one_failure(store):
    c = make(store, world=4)
    _recovery(store, mode="restart")
    for r in range(4):
        register(store, r)
    c.tick()
    keys.report_dead(store, 2, 0)
    c.tick()
    assert c.members == ()
    assert all(store.get(keys.evict(r)) == b"0" for r in range(4))
    failures = [
        json.loads(store.get(keys.event(i)))
        for i in range(1, keys.get_int(store, keys.EVENT_SEQ) + 1)
    ]
    assert [e["ranks"] for e in failures if e["type"] == "failure"] == [[2]]


def test_min_replicas_quorum(store):
    c = make(store, min_replicas=3)
    for r in range(4):
        register(store, r)
    c.tick()
    keys.report_dead(store, 0, 0)
    c.tick()
    assert members(store) == (2, [1, 2, 3])
    keys.report_dead(store, 1, 0)
    c.tick()
    assert b"below min_replicas" in store.get(keys.ABORT)


def test_no_decisions_after_done(store):
    c = make(store, heartbeat_timeout_s=0.1)
    for r in range(4):
        register(store, r)
    c.tick()
    store.set(keys.DONE, "1")
    time.sleep(0.2)  # every heartbeat is now stale: ranks exiting at the end are not failures
    c.tick()
    assert keys.get_int(store, keys.GEN) == 1


def test_hang_detected_when_a_rank_lags_a_whole_step(store):
    c = make(store, hang_timeout_floor_s=0.3)
    for r in range(4):
        register(store, r)
    c.tick()
    for r in range(4):  # rank 3 never started step 5; the others wait in its reduction
        store.set(keys.progress(r), "0:4:reduce" if r == 3 else "0:5:reduce")
    run_ticks(c, store, beating=range(4), seconds=0.6)
    assert members(store) == (2, [0, 1, 2])


def test_a_replaced_node_s_ranks_are_noted_admitted_in_one_pass(store):
    """`_trains_again` (is a standby's node training yet?) notes the admission step of every
    rank of the node at once: when it stopped at the first rank not yet training, the next rank's
    admission was noted a tick later, at a later job step, and `node_replaced` came late (a CI
    failure of `test_spares.py`)."""
    c = make(store)
    for r in range(4):
        register(store, r)
    c.tick()
    for r in (2, 3):
        keys.report_dead(store, r, 0)
    c.tick()
    assert members(store)[1] == [0, 1]
    for r in (2, 3):
        register(store, r, inc=1)
    run_ticks(c, store, beating=range(4), seconds=0.3)
    assert members(store)[1] == [0, 1, 2, 3]
    c.detector.job_step = 10
    c.ranks[2].progress, c.ranks[3].progress = "1:9:idle", "1:10:compute"  # 2 still loading
    assert not c._trains_again({2: 0, 3: 0})
    assert c._admitted_at[(2, 1)] == c._admitted_at[(3, 1)] == 10
    c.detector.job_step = 12
    c.ranks[2].progress = c.ranks[3].progress = "1:11:compute"
    assert c._trains_again({2: 0, 3: 0})  # both past the step they were admitted at
