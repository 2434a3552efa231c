"""The coordinator's spare-node pool on a real in-process TCPStore: a node whose agent falls silent
is lost, given to a free standby, and replaced once its ranks are members again."""

from __future__ import annotations

import json

import pytest

from megatron_mecefo.control import keys
from megatron_mecefo.control.records import NodeReport, posted_events
from megatron_mecefo.failover.authority.spare_pool import SparePool
from megatron_mecefo.failover.liveness.evidence import NodeWatch

pytestmark = pytest.mark.timeout(60)

RANKS = {0: {0: 0, 1: 0}, 1: {2: 0, 3: 0}}


def _standby(store, agent_id: int, seq: int) -> None:
    if keys.get_int(store, keys.AGENT_IDS) < agent_id:
        store.add(keys.AGENT_IDS, 1)
        store.append(keys.STANDBY_LOG, f"{agent_id},")
    store.set(keys.standby(agent_id), json.dumps({"seq": seq}))


def _watch(now: float) -> NodeWatch:
    watch = NodeWatch(agent_timeout_s=1.0)
    watch.update(0, NodeReport(1, {}), now=now)
    watch.update(1, NodeReport(1, {}), now=now)
    return watch


def test_lost_node_goes_to_a_free_standby_then_is_replaced(store):
    pool = SparePool(store, agent_timeout_s=1.0, log=lambda m: None)
    watch = _watch(now=0.0)
    _standby(store, 1, seq=1)
    pool.read(now=0.0)
    watch.update(0, NodeReport(2, {}), now=1.5)  # node 0 beats, node 1 does not
    _standby(store, 1, seq=2)
    pool.read(now=1.5)
    back = {"done": False}
    pool.tick(1.5, watch, RANKS, lambda node, at_loss: back["done"], step=7)
    assert store.get(keys.assign(1)) == b"1" and store.get(keys.node_owner(1)) == b"1"
    assert pool.free(now=1.5) == []  # taken
    lost = [e for e in posted_events(store)[0] if e["type"] == "node_lost"]
    assert [(e["ranks"], e["step"]) for e in lost] == [([2, 3], 7)]
    pool.tick(1.55, watch, RANKS, lambda node, at_loss: back["done"], step=8)
    assert "node_replaced" not in [e["type"] for e in posted_events(store)[0]]  # ranks not back yet
    back["done"] = True
    pool.tick(1.6, watch, RANKS, lambda node, at_loss: back["done"], step=9)
    replaced = [e for e in posted_events(store)[0] if e["type"] == "node_replaced"]
    assert [e["ranks"] for e in replaced] == [[2, 3]] and replaced[0]["latency_ms"] > 0
    assert pool.lost == {} and not store.check([keys.replacement(1)])


def test_without_a_standby_the_node_waits_and_its_agent_may_come_back(store):
    pool = SparePool(store, agent_timeout_s=1.0, log=lambda m: None)
    watch = _watch(now=0.0)
    _standby(store, 1, seq=1)
    pool.read(now=0.0)  # it beat once, long ago: not free
    pool.tick(2.0, watch, RANKS, lambda n, a: False, step=3)
    assert set(pool.lost) == {0, 1} and not store.check([keys.assign(1)])
    watch.update(1, NodeReport(2, {}), now=2.5)  # node 1's agent resumes
    pool.tick(2.6, watch, RANKS, lambda n, a: False, step=4)
    assert set(pool.lost) == {0}


def test_a_restarted_coordinator_finishes_a_replacement_in_flight(store):
    pool = SparePool(store, agent_timeout_s=1.0, log=lambda m: None)
    watch = _watch(now=0.0)
    _standby(store, 1, seq=1)
    pool.read(now=0.0)
    pool.tick(0.5, NodeWatch(1.0), RANKS, lambda n, a: False, step=0)  # nothing known yet
    watch.update(0, NodeReport(2, {}), now=1.5)
    _standby(store, 1, seq=2)
    pool.read(now=1.5)
    pool.tick(1.5, watch, RANKS, lambda n, a: False, step=1)
    again = SparePool(store, agent_timeout_s=1.0, log=lambda m: None)
    again.restore({0, 1})
    assert again.lost[1]["standby"] == 1
    again.tick(1.6, watch, RANKS, lambda n, a: n == 1, step=2)
    assert [e["type"] for e in posted_events(store)[0]].count("node_replaced") == 1


def test_a_replaced_node_is_at_full_strength_once_its_ranks_train(store):
    from megatron_mecefo.failover.authority.coordinator import Coordinator
    from megatron_mecefo.failover.liveness.detector import DetectorConfig

    c = Coordinator(store, 4, DetectorConfig(), log=lambda m: None)
    c.replica_size, c.members, c.detector.job_step = 1, (0, 1, 2), 20
    for r, inc in ((2, 1), (3, 1)):
        c.ranks[r].incarnation, c.ranks[r].progress = inc, f"{inc}:-1:idle"
    at_loss = {2: 0, 3: 0}
    assert not c._trains_again(at_loss)  # rank 3's replica is not a member yet
    c.members = (0, 1, 2, 3)
    assert not c._trains_again(at_loss)  # admitted (at job step 20) but receiving the state
    c.ranks[2].progress, c.ranks[3].progress = "1:20:compute", "1:21:compute"
    assert not c._trains_again(at_loss)  # rank 2 still in the step it was admitted at
    c.ranks[2].progress = "1:21:reduce"
    assert c._trains_again(at_loss)
    assert not c._trains_again({2: 0, 3: 1})  # rank 3 in the incarnation that was lost


def test_on_etcd_a_node_is_lost_when_its_agents_lease_expires(store):
    """With leases the agent's lease, not its report's age, decides: a node whose report is old
    but whose agent holds its lease is not lost; one whose agent's lease is gone is, at once;
    the standby it is given is not judged by the dead agent's lease before it reports."""
    pool = SparePool(store, agent_timeout_s=1.0, log=lambda m: None)
    watch = NodeWatch(agent_timeout_s=1.0)
    watch.update(0, NodeReport("5:1", {}), now=0.0)  # agent 5 reports for node 0
    watch.update(1, NodeReport("6:1", {}), now=0.0)  # agent 6 for node 1
    _standby(store, 1, seq=1)
    pool.read(now=0.3)
    watch.leases = {5, 6}
    pool.tick(3.0, watch, RANKS, lambda n, a: False, step=2)  # reports 3 s old, leases held
    assert pool.lost == {}
    watch.leases = {5}  # agent 6's lease expired
    assert watch.lost(1, 0.4) == "agent 6's etcd lease expired"
    _standby(store, 1, seq=2)
    pool.read(now=0.4)
    pool.tick(0.4, watch, RANKS, lambda n, a: False, step=3)
    assert set(pool.lost) == {1} and store.get(keys.assign(1)) == b"1"
    lost = [e for e in posted_events(store)[0] if e["type"] == "node_lost"]
    assert "agent 6's etcd lease expired" in lost[0]["detail"]
    assert watch.lost(1, 0.9) is None  # given to the standby: its first report is awaited
    assert watch.lost(1, 1.5) is not None  # ... for agent_timeout_s at most
    watch.update(1, NodeReport("7:1", {}), now=1.0)  # the standby (agent 7) reports
    watch.leases = {5, 7}
    assert watch.lost(1, 1.5) is None


def test_a_straggler_s_node_goes_to_a_free_standby_and_its_agent_is_retired(store):
    """The leader's `keys.RETIRE` request: without a free standby it stays (the straggler keeps
    its smaller share), nor while its node holds every live member; with one, replica 3's node
    (node 1) is given to it, `evicted` names the
    node and the slowdown, the old agent is marked RETIRED, and the replacement completes as for
    a lost node."""
    pool = SparePool(store, agent_timeout_s=1.0, log=lambda m: None)
    watch = _watch(now=0.0)
    store.set(keys.node_owner(1), "4")  # node 1's agent
    store.set(keys.RETIRE, json.dumps({"replicas": {"3": 2.6}, "step": 21}))
    ranks_of = lambda replica: [replica]  # noqa: E731 - TP x PP = 1
    pool.retire(0.5, watch, RANKS, ranks_of, [0, 1, 2, 3], step=20)
    assert pool.lost == {} and store.check([keys.RETIRE])  # no standby yet: left for later
    _standby(store, 1, seq=1)
    pool.read(now=0.6)
    pool.retire(0.6, watch, RANKS, ranks_of, [2, 3], step=20)  # node 1 holds every live member
    assert pool.lost == {} and store.check([keys.RETIRE])
    pool.retire(0.6, watch, RANKS, ranks_of, [0, 1, 2, 3], step=20)
    assert store.get(keys.node_owner(1)) == b"1" and store.get(keys.assign(1)) == b"1"
    assert store.get(keys.assign(4)).decode() == keys.RETIRED
    assert not store.check([keys.RETIRE]) and pool.lost[1]["incarnations"] == {2: 0, 3: 0}
    evicted = [e for e in posted_events(store)[0] if e["type"] == "evicted"]
    assert [(e["dp_rank"], e["ranks"], e["step"]) for e in evicted] == [(3, [2, 3], 21)]
    assert "2.6x slower per sample" in evicted[0]["detail"]
    assert watch.lost(1, 0.7) is None  # its old agent's silence is not a second loss
    pool.tick(0.8, watch, RANKS, lambda node, at_loss: True, step=22)
    assert [e["type"] for e in posted_events(store)[0]][-1] == "node_replaced"
