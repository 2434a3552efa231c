"""Telling slow from gone, and a coordinator that takes over from a dead one: the agents' node
reports (`failover/liveness/evidence.py`) and `Coordinator.restore`, on a real in-process
TCPStore."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from megatron_mecefo.control import keys
from megatron_mecefo.control.proc import proc_state
from megatron_mecefo.control.records import NodeReport, node_report, post_event, posted_events
from megatron_mecefo.failover.authority.coordinator import Coordinator
from megatron_mecefo.failover.liveness.evidence import NodeWatch, Verdict
from tests.unit.failover.test_coordinator import make, members, register, run_ticks

pytestmark = pytest.mark.timeout(60)


def report(state: str, inc: int = 0, seq: int = 1) -> NodeReport:
    return NodeReport.from_json(json.dumps({"seq": seq, "ranks": {"2": [inc, 1234, state, 10]}}))


def test_proc_state_reads_the_kernel():
    assert proc_state(os.getpid())[0] in "RS"
    child = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while proc_state(child.pid)[0] != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc_state(child.pid)[0] == "T"
        raw = json.loads(node_report(7, {5: (3, child.pid)}))
        assert raw == {"seq": 7, "ranks": {"5": [3, child.pid, "T", raw["ranks"]["5"][3]]}}
    finally:
        child.kill()
        child.wait()
    assert proc_state(child.pid) is None
    assert json.loads(node_report(1, {5: (0, child.pid)}))["ranks"]["5"][2] == "X"


@pytest.mark.parametrize(
    "state, inc, expected",
    [
        ("R", 0, Verdict.SLOW),
        ("S", 0, Verdict.SLOW),
        ("D", 0, Verdict.SLOW),
        ("T", 0, Verdict.GONE),
        ("Z", 0, Verdict.GONE),
        ("X", 0, Verdict.GONE),
        ("R", 1, Verdict.GONE),
    ],  # the agent already runs a newer incarnation
)
def test_verdicts(state, inc, expected):
    watch = NodeWatch(agent_timeout_s=1.0)
    watch.update(0, report(state, inc), now=100.0)
    assert watch.verdict(2, 0, now=100.5)[0] is expected
    assert watch.verdict(3, 0, now=100.5)[0] is Verdict.UNKNOWN  # nobody reports rank 3


def test_a_silent_agent_means_its_ranks_are_gone():
    watch = NodeWatch(agent_timeout_s=1.0)
    watch.update(0, report("R"), now=100.0)
    watch.update(0, report("R"), now=101.5)  # same seq: the agent did not move
    assert watch.verdict(2, 0, now=101.5)[0] is Verdict.GONE
    watch.refresh(now=101.5)  # the coordinator was paused: ages restart
    assert watch.verdict(2, 0, now=101.6)[0] is Verdict.SLOW


def _with_agent(store, state: str, ranks=range(4)):
    seq = keys.get_int(store, "test/seq") + 1
    store.set("test/seq", str(seq))
    store.set(
        keys.node_key(0),
        json.dumps(
            {"seq": seq, "ranks": {str(r): [0, 1, state if r == 2 else "S", 1] for r in ranks}}
        ),
    )


def _tick_with_agent(c, store, state, seconds, beating=(0, 1, 3)):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _with_agent(store, state)
        run_ticks(c, store, beating=beating, seconds=0.05)


def _register_on_node(store):
    for r in range(4):
        register(store, r)
        reg = json.loads(store.get(keys.registration(r)))
        keys.register(store, r, json.dumps({**reg, "node": 0}))


def test_silent_but_running_rank_is_slow_until_the_hard_timeout(store):
    c = make(store, heartbeat_timeout_s=0.8, heartbeat_hard_timeout_s=2.0)
    _register_on_node(store)
    c.tick()
    _tick_with_agent(c, store, "R", 1.5)
    assert members(store) == (1, [0, 1, 2, 3])  # silent 1.5 s > soft 0.8 s, but alive
    _tick_with_agent(c, store, "R", 0.8)
    assert members(store) == (2, [0, 1, 3])  # past the hard timeout
    fail = next(e for e in posted_events(store)[0] if e["type"] == "failure")
    assert "alive (state R)" in fail["detail"]


def test_silent_and_stopped_rank_is_dead_at_the_soft_timeout(store):
    c = make(store, heartbeat_timeout_s=0.3, heartbeat_hard_timeout_s=30)
    _register_on_node(store)
    c.tick()
    _tick_with_agent(c, store, "T", 0.6)
    assert members(store) == (2, [0, 1, 3])
    assert "state T" in next(e for e in posted_events(store)[0] if e["type"] == "failure")["detail"]


def test_a_report_from_before_the_silence_does_not_vouch(store):
    """A node that died whole: its agent's last report still shows the rank running."""
    c = make(store, heartbeat_timeout_s=0.8, heartbeat_hard_timeout_s=30, agent_timeout_s=5.0)
    _register_on_node(store)
    _with_agent(store, "R")
    c.tick()
    run_ticks(c, store, beating=(0, 1, 3), seconds=1.0)  # no agent report after the silence
    assert members(store) == (2, [0, 1, 3])
    fail = next(e for e in posted_events(store)[0] if e["type"] == "failure")
    assert "has not reported since it fell silent" in fail["detail"]


def test_silent_rank_whose_agent_is_silent_too_is_dead(store):
    c = make(store, heartbeat_timeout_s=0.3, heartbeat_hard_timeout_s=30, agent_timeout_s=0.2)
    _register_on_node(store)
    _with_agent(store, "R")
    c.tick()
    run_ticks(c, store, beating=(0, 1, 3), seconds=0.6)  # the agent stopped reporting
    assert members(store) == (2, [0, 1, 3])


def test_a_paused_coordinator_does_not_blame_the_ranks(store):
    c = make(store, heartbeat_timeout_s=0.3)
    for r in range(4):
        register(store, r)
    c.tick()
    time.sleep(1.3)  # neither the coordinator nor the ranks' heartbeats ran (a starved host)
    c.tick()  # it wakes up first and sees heartbeats "silent" for 1.3 s
    c.tick()
    assert members(store) == (1, [0, 1, 2, 3])
    run_ticks(c, store, beating=range(4), seconds=0.2)
    assert members(store) == (1, [0, 1, 2, 3])
    assert not store.check([keys.ABORT])
    assert not [e for e in posted_events(store)[0] if e["type"] == "failure"]


def test_restored_coordinator_goes_on_without_repeating_events(store, tmp_path):
    first = make(store)
    first.restore()
    for r in range(4):
        register(store, r)
    store.set(keys.RUN_DIR, f"{tmp_path}|{time.time()}")
    first.tick()
    keys.report_dead(store, 2, 0)
    first.tick()
    first.close()  # SIGKILL in real life; the file holds what it wrote
    assert members(store) == (2, [0, 1, 3])
    second = make(store)
    second.restore()
    assert (second.gen, second.members, second.epoch) == (2, (0, 1, 3), 2)
    assert first.superseded() and not second.superseded()
    register(store, 2, inc=1)  # the agent restarted it; it joins the restored coordinator
    run_ticks(second, store, beating=range(4), seconds=0.2)
    assert members(store) == (3, [0, 1, 2, 3])
    second.close()
    rows = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [r["type"] for r in rows].count("failure") == 1
    assert [r["seq"] for r in rows] == list(range(1, len(rows) + 1))


def test_restore_removes_a_member_that_restarted_while_no_coordinator_ran(store):
    first = make(store)
    first.restore()
    for r in range(4):
        register(store, r)
    first.tick()
    assert members(store) == (1, [0, 1, 2, 3])
    register(store, 1, inc=1)  # rank 1 died and was restarted while the coordinator was down
    second = make(store)
    second.restore()
    run_ticks(second, store, beating=range(4), seconds=0.2)
    gens = [json.loads(store.get(keys.gen_record(g))) for g in (2, 3)]
    assert gens[0]["members"] == [0, 2, 3] and gens[1]["members"] == [0, 1, 2, 3]
    assert gens[1]["incarnations"]["1"] == 1
    assert keys.get_int(store, keys.evict(1), -1) == 0  # the dead one, never the new one
    fails = [e for e in posted_events(store)[0] if e["type"] == "failure"]
    assert [f["ranks"] for f in fails] == [[1]]


def test_restart_keeps_the_start_deadline(store):
    first = make(store, start_timeout_s=0.5)
    first.restore()
    time.sleep(0.6)
    second = make(store, start_timeout_s=0.5)
    second.restore()
    second.tick()  # no rank registered within 0.5 s of the FIRST start: abort, not a new clock
    assert store.check([keys.ABORT])
    assert isinstance(second, Coordinator)


@pytest.mark.parametrize("recoverable", [False, True])
def test_the_last_holder_of_state_dying_while_a_replica_rejoins_is_every_replica_lost(
    store, recoverable
):
    """Replica 1 died and its restart is ready to join when replica 0, the only one with state,
    dies too: a generation of the stateless joiner alone would have nobody to learn from. It is
    the every-replica-lost case: abort (with its event) without saved state, else recover."""
    from tests.unit.failover.test_coordinator import _recovery

    c = make(store, world=2)
    if recoverable:
        _recovery(store)
    for r in range(2):
        register(store, r, world=2)
    c.tick()
    keys.report_dead(store, 1, 0)
    c.tick()
    assert members(store) == (2, [0])
    register(store, 1, inc=1, world=2)
    store.add(keys.heartbeat(1), 1)
    keys.report_dead(store, 0, 0)
    c.ticks |= 1  # the next tick reads heartbeats: rank 1 is ready as rank 0 is removed
    c.tick()
    if not recoverable:
        assert store.check([keys.ABORT])
        assert any(e["type"] == "abort" for e in posted_events(store)[0])
        return
    assert not store.check([keys.ABORT]) and c.members == ()
    register(store, 0, inc=1, world=2)
    run_ticks(c, store, beating=(0, 1), seconds=0.2)
    record = json.loads(store.get(keys.gen_record(keys.get_int(store, keys.GEN))))
    assert record["members"] == [0, 1] and record["reason"] == "recover"


def test_a_long_tick_is_not_a_pause(store):
    """At scale one tick can take over a second; measuring the pause from the previous tick's
    start would reset every silence clock on every tick, and no silent rank would ever die."""
    c = make(store, heartbeat_timeout_s=3.0)  # > 2 ticks: heartbeats are read every other one
    for r in range(4):
        register(store, r)
    c.tick()
    slow = c.detector.read_dead_reports

    def long_read():
        time.sleep(0.6)  # called twice a tick: every tick takes 1.2 s > PAUSE_S
        slow()

    c.detector.read_dead_reports = long_read
    run_ticks(c, store, beating=(0, 1, 3), seconds=6.0)
    assert members(store) == (2, [0, 1, 3])


def test_an_event_whose_poster_died_midway_does_not_block_the_rest(store, tmp_path, monkeypatch):
    """A process that bumps the event counter and dies before writing the value: the coordinator
    skips that number after a bounded wait, and later events still reach events.jsonl."""
    from megatron_mecefo.failover.authority import event_log

    monkeypatch.setattr(event_log, "EVENT_WAIT_S", 0.3)
    c = make(store)
    store.set(keys.RUN_DIR, f"{tmp_path}|{time.time()}")
    store.add(keys.EVENT_SEQ, 1)  # the dead poster's half
    post_event(store, "abort", step=1, dp_rank=None, detail="after the gap")
    c.tick()
    assert not (tmp_path / "events.jsonl").read_text().strip()
    time.sleep(0.4)
    c.tick()
    c.close()
    rows = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(r["type"], r["seq"]) for r in rows] == [("abort", 2)]


def test_the_written_mark_follows_events_jsonl_across_a_coordinator_restart(store, tmp_path):
    """The job's leader ends only once `EVENTS_WRITTEN` reaches the posted count: each drain
    moves it, and a new coordinator whose predecessor wrote every line before dying (mark not
    yet set) sets it from the file."""
    from megatron_mecefo.failover.authority.event_log import EventLog

    store.set(keys.RUN_DIR, f"{tmp_path}|{time.time()}")
    for i in range(3):
        post_event(store, "failure", step=i, dp_rank=0)
    first = EventLog(store)
    first.drain()
    assert keys.get_int(store, keys.EVENTS_WRITTEN) == 3
    post_event(store, "rejoin", step=4, dp_rank=0)
    first.drain()
    assert keys.get_int(store, keys.EVENTS_WRITTEN) == 4
    store.set(keys.EVENTS_WRITTEN, "3")  # as if it died between the line and the mark
    EventLog(store).drain()
    assert keys.get_int(store, keys.EVENTS_WRITTEN) == 4
    rows = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(x)["seq"] for x in rows] == [1, 2, 3, 4]  # no line twice


def _aggregated_report(store, seq: int, beats: dict[int, int], state: str = "S") -> None:
    entries = {str(r): [0, 1, state, 1, b, "0:3:compute"] for r, b in beats.items()}
    store.set(keys.node_key(0), json.dumps({"seq": seq, "ranks": entries}))


def test_aggregated_beats_count_and_a_stalled_agent_hands_over_to_the_ranks_keys(store):
    """Beats come from the node report while it moves; when the agent stalls the coordinator
    reads the ranks' own keys (they beat there meanwhile): the live ranks stay, the one that
    stopped beating is dead at the soft timeout, and switching sources is no beat."""
    c = make(store, heartbeat_timeout_s=1.6, heartbeat_hard_timeout_s=30, agent_timeout_s=30)
    _register_on_node(store)
    c.tick()
    seq, start = 1, time.monotonic()
    while time.monotonic() - start < 0.6:  # the agent reports beats of every rank
        seq += 1
        _aggregated_report(store, seq, dict.fromkeys(range(4), seq))
        c.tick()
        time.sleep(0.02)
    assert {c.ranks[r].hb_source for r in range(4)} == {"agent"}
    assert c.ranks[2].progress == "0:3:compute" and members(store) == (1, [0, 1, 2, 3])
    # the agent stalls (its report frozen); ranks 0, 1, 3 beat to their own keys, rank 2 died
    run_ticks(c, store, beating=(0, 1, 3), seconds=2.0)  # switching counted as a beat: 2.1 s+
    assert c.ranks[0].hb_source == "store"
    assert members(store) == (2, [0, 1, 3])
    fail = next(e for e in posted_events(store)[0] if e["type"] == "failure")
    assert fail["ranks"] == [2] and "no heartbeat" in fail["detail"]


def test_every_member_silent_at_once_waits_for_the_hard_timeout_unless_the_kernel_says(store):
    """All ranks and their agent fall silent together (the store or the host stalled, or the
    whole job died): silence alone removes nobody before the hard timeout; a rank the agent's
    last report shows stopped is still dead at the soft timeout."""
    c = make(store, heartbeat_timeout_s=0.3, heartbeat_hard_timeout_s=1.6, agent_timeout_s=0.2)
    _register_on_node(store)
    _with_agent(store, "T")  # rank 2 stopped, the others running, then nothing moves
    c.tick()
    run_ticks(c, store, beating=(), seconds=0.9)
    assert members(store) == (2, [0, 1, 3])  # only the kernel's evidence acted
    run_ticks(c, store, beating=(), seconds=1.2)  # past the hard timeout
    assert b"every replica is lost" in store.get(keys.ABORT)
