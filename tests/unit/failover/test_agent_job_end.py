"""A node whose ranks were still starting when the job finished (a standby that took a node as the
job ended): once the agent has read the job's DONE flag, a rank that finds no store and the store
going away end the node with exit 0, at once, not COORDINATOR_LOST (6) after 10 s of retries."""

from __future__ import annotations

import types

from megatron_mecefo.control import keys
from megatron_mecefo.control.store_errors import StoreError
from megatron_mecefo.errors import ExitCode
from megatron_mecefo.failover.node.agent import Agent


class _Exited:
    pid = 1234

    def __init__(self, rc):
        self.rc = rc

    def poll(self):
        return self.rc


def _node(flags: bytes, rc: int):
    said = []
    store = types.SimpleNamespace(
        multi_get=lambda names: [b"3", flags, b"0", b"7"],  # GEN, FLAGS, EVICT_SEQ, node_owner
        set=lambda key, value: None,
    )
    fake = types.SimpleNamespace(
        stop_reason=None,
        store=store,
        node=1,
        agent_id=7,
        smp=None,
        fork_server=None,
        procs={1: _Exited(rc)},
        restart_at={},
        ranks=[1],
        finished=set(),
        evicted=set(),
        preempted=False,
        log=said.append,
        _top_up_spares=lambda: None,
        _report_liveness=lambda gen, flags, stop_set: None,
        evict_seq_seen=b"0",
        replica_size=1,
        saw_done=False,
    )
    return fake, said


def test_a_rank_that_finds_no_store_after_the_job_finished_ends_well(monkeypatch):
    monkeypatch.setattr("megatron_mecefo.failover.node.agent.signal_group", lambda p, s: None)
    fake, said = _node(f"{keys.DONE};".encode(), int(ExitCode.COORDINATOR_LOST))
    assert Agent._tick(fake) is None
    assert fake.finished == {1} and fake.saw_done, said
    assert "the job had finished" in said[0]
    # the same exit while the job runs stops the node with it
    fake, said = _node(b"", int(ExitCode.COORDINATOR_LOST))
    assert Agent._tick(fake) == ExitCode.COORDINATOR_LOST
    assert fake.finished == set() and not fake.saw_done


def _watching(saw_done: bool):
    def tick():
        raise StoreError("store 127.0.0.1:1: connection closed by the server")

    said = []
    fake = types.SimpleNamespace(
        node=1,
        ranks=[1],
        finished=set(),
        term_deadline=None,
        lease=None,
        saw_done=saw_done,
        preempted=False,
        log=said.append,
        _tick=tick,
    )
    return fake, said


def test_the_store_gone_after_done_ends_the_node_at_once(monkeypatch):
    fake, said = _watching(saw_done=True)
    assert Agent._watch(fake) == ExitCode.OK
    assert said == ["the job finished and its store is gone; stopping this node"]
    # before DONE it is a lost coordinator, after the 10 s of retries (the clock is sped up)
    clock = iter(range(0, 1000, 5))
    monkeypatch.setattr("megatron_mecefo.failover.node.agent.time.monotonic", lambda: next(clock))
    monkeypatch.setattr("megatron_mecefo.failover.node.agent.time.sleep", lambda s: None)
    fake, said = _watching(saw_done=False)
    assert Agent._watch(fake) == ExitCode.COORDINATOR_LOST
    assert "coordinator unreachable" in said[-1]
