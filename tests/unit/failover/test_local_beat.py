"""Aggregated heartbeats: the trainer's beat through its node agent's folder, the agent's node
report carrying it, and the control file carrying generation, abort and stop back."""

from __future__ import annotations

import json
import os
import threading
import time
import types

import pytest

from megatron_mecefo.control import keys, local_beat
from megatron_mecefo.errors import ExitCode
from megatron_mecefo.failover.liveness.heartbeat import Heartbeat
from megatron_mecefo.failover.node.agent import Agent
from megatron_mecefo.training.stop import StopFlag

pytestmark = pytest.mark.timeout(60)


def test_beats_of_the_current_incarnation_only(tmp_path):
    local_beat.write_beat(tmp_path, 3, 1, 7, "1:5:compute", None)
    local_beat.write_beat(tmp_path, 4, 0, 2, "0:5:reduce", "SIGUSR1")
    beats = local_beat.read_beats(tmp_path, {3: 1, 4: 1, 5: 0})
    assert list(beats) == [3]  # rank 4's file is its previous incarnation's, rank 5 has none
    assert beats[3] == {"inc": 1, "beats": 7, "progress": "1:5:compute", "stop": None}
    local_beat.write_control(tmp_path, local_beat.Control(seq=4, gen=2, stop="node 0: x"))
    assert local_beat.read_control(tmp_path) == local_beat.Control(seq=4, gen=2, stop="node 0: x")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left


def _address(store) -> str:
    return f"127.0.0.1:{store.port}"


def _heartbeat(store, tmp_path, **kw) -> tuple[Heartbeat, list]:
    hb = Heartbeat(
        _address(store),
        2,
        interval_s=0.05,
        coordinator_timeout_s=kw.pop("coordinator_timeout_s", 5.0),
        incarnation=1,
        beat_dir=str(tmp_path),
        **kw,
    )
    exits: list = []

    def fake_exit(code, message):
        exits.append((code, message))
        hb.stop()  # the loop ends at its next wait, as os._exit would end the process

    hb._exit = fake_exit
    return hb, exits


def _wait(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_heartbeat_goes_to_the_agent_and_takes_the_job_state_from_it(store, tmp_path):
    flag = StopFlag()
    hb, exits = _heartbeat(store, tmp_path, stop_flag=flag)
    hb.progress = "1:4:compute"
    hb.start()
    try:
        _wait(lambda: (local_beat.read_beats(tmp_path, {2: 1}).get(2) or {}).get("beats", 0) >= 2)
        beat = local_beat.read_beats(tmp_path, {2: 1})[2]
        assert beat["progress"] == "1:4:compute" and beat["stop"] is None
        # no request per beat reaches the store: its heartbeat key holds the start-up add only
        assert int(store.get(keys.heartbeat(2))) == 1
        local_beat.write_control(tmp_path, local_beat.Control(seq=1, gen=6))
        _wait(lambda: hb.latest_gen == 6)
        local_beat.write_control(tmp_path, local_beat.Control(seq=2, gen=6, stop="node 1: SIGUSR1"))
        _wait(lambda: flag.is_set)
        assert flag.reason == "node 1: SIGUSR1"
        local_beat.write_control(tmp_path, local_beat.Control(seq=3, gen=7, abort="too few"))
        _wait(lambda: bool(exits))
        assert exits[0][0] == ExitCode.JOB_ABORTED and "too few" in exits[0][1]
    finally:
        hb.stop()
        hb.join(5)


def test_a_local_stop_request_rides_on_the_beat(store, tmp_path):
    flag = StopFlag()
    hb, _ = _heartbeat(store, tmp_path, stop_flag=flag)
    hb.start()
    try:
        local_beat.write_control(tmp_path, local_beat.Control(seq=1, gen=1))
        flag.request("SIGUSR1")
        _wait(lambda: (local_beat.read_beats(tmp_path, {2: 1}).get(2) or {}).get("stop"))
        assert not store.check([keys.STOP])  # the agent posts it, not the rank
    finally:
        hb.stop()
        hb.join(5)


def test_a_stalled_agent_makes_the_rank_beat_to_the_store_until_it_moves(store, tmp_path):
    hb, exits = _heartbeat(store, tmp_path)
    hb.start()
    try:
        for seq in range(1, 8):  # the agent ticks every 0.1 s: nothing goes to the store
            local_beat.write_control(tmp_path, local_beat.Control(seq=seq, gen=1))
            time.sleep(0.1)
        assert int(store.get(keys.heartbeat(2))) == 1
        store.set(keys.GEN, "4")
        _wait(lambda: int(store.get(keys.heartbeat(2))) >= 3, timeout_s=3.0)  # frozen > 0.5 s
        assert hb.latest_gen == 4 and store.get(keys.progress(2)) == b"idle"
        counts = []
        for seq in range(9, 17):  # the agent moves again: back to the agent only
            local_beat.write_control(tmp_path, local_beat.Control(seq=seq, gen=4))
            time.sleep(0.1)
            counts.append(int(store.get(keys.heartbeat(2))))
        assert counts[2] == counts[-1] and not exits, counts
    finally:
        hb.stop()
        hb.join(5)


def _fake_agent(store, tmp_path, procs, channel=None) -> types.SimpleNamespace:
    """The agent's state `_report_liveness` uses; `channel`: a real `ChannelFolder` (else the
    folder `tmp_path`, never removed)."""
    fake = types.SimpleNamespace(
        store=store,
        node=0,
        agent_id=3,
        report_seq=0,
        beat_dir=channel.path if channel else tmp_path,
        beat_channel=channel or types.SimpleNamespace(ensure=lambda: False),
        channel_error=None,
        procs=procs,
        incarnation=dict.fromkeys(procs, 1),
        record_gen=10**9,  # records: their own test
        flag_values={},
        lines=[],
    )
    fake.log = fake.lines.append
    for name in ("_flag_value", "_report_liveness", "_channel_ready", "_channel_unusable"):
        setattr(fake, name, getattr(Agent, name).__get__(fake))
    return fake


def test_the_agent_aggregates_beats_and_relays_the_flags(store, tmp_path):
    keys.control_keys(store)
    me = types.SimpleNamespace(pid=os.getpid())
    agent = _fake_agent(store, tmp_path, {0: me, 1: me})
    local_beat.write_beat(tmp_path, 0, 1, 9, "1:3:reduce", None)
    agent._report_liveness(4, store.get(keys.FLAGS), False)
    report = json.loads(store.get(keys.node_key(0)))
    assert report["ranks"]["0"][4:] == [9, "1:3:reduce"]
    assert len(report["ranks"]["1"]) == 4  # no beat yet: /proc only (per-rank keys apply)
    control = local_beat.read_control(tmp_path)
    assert (control.seq, control.gen, control.abort, control.stop) == (1, 4, None, None)
    # rank 1 was asked to stop: the agent raises the job's flag once, for every member
    local_beat.write_beat(tmp_path, 1, 1, 1, "1:3:compute", "SIGUSR1")
    agent._report_liveness(4, store.get(keys.FLAGS), False)
    assert store.get(keys.STOP).decode() == "rank 1: SIGUSR1"
    assert keys.flag_raised(store.get(keys.FLAGS), keys.STOP)
    assert local_beat.read_control(tmp_path).stop == "rank 1: SIGUSR1"
    keys.raise_flag(store, keys.ABORT, "no state")
    agent._report_liveness(5, store.get(keys.FLAGS), True)
    control = local_beat.read_control(tmp_path)
    assert (control.seq, control.gen, control.abort) == (3, 5, "no state")


def test_control_keys_exist_once_and_keep_their_values(store):
    keys.control_keys(store)
    assert store.multi_get([keys.GEN, keys.FLAGS]) == [b"0", b""]
    store.set(keys.GEN, "3")
    keys.raise_flag(store, keys.DONE, "1")
    keys.control_keys(store)  # a second agent starting later changes nothing
    assert store.get(keys.GEN) == b"3" and keys.flag_raised(store.get(keys.FLAGS), keys.DONE)
    assert not keys.flag_raised(store.get(keys.FLAGS), keys.ABORT)


def _progress(n: int) -> str:
    """A beat whose length changes with its counter, so a torn read cannot pass for a whole one."""
    return f"{n}:" + "x" * (4096 if n % 2 else 16)


def test_threads_beat_concurrently_without_torn_reads(tmp_path):
    assert local_beat.read_beats(tmp_path, {0: 0}) == {}  # before the first write only
    local_beat.write_beat(tmp_path, 0, 0, 1, _progress(1), None)
    stop = threading.Event()

    def writer():
        n = 1
        while not stop.is_set():
            n += 1
            local_beat.write_beat(tmp_path, 0, 0, n, _progress(n), None)

    t = threading.Thread(target=writer)
    t.start()
    try:
        last = 1
        for _ in range(2000):
            beat = local_beat.read_beats(tmp_path, {0: 0}).get(0)
            # whole, old or new: never missing once written, never half of one write
            assert beat is not None, "a reader saw no beat after the first write"
            assert beat["progress"] == _progress(beat["beats"]), beat["beats"]
            assert beat["beats"] >= last  # never an older beat than one already seen
            last = beat["beats"]
    finally:
        stop.set()
        t.join()
    assert last > 1  # the writer did write while the reader read


def test_records_are_kept_for_the_last_two_generations(tmp_path):
    for gen in (1, 2, 3):
        local_beat.write_record(tmp_path, gen, json.dumps({"members": [gen]}).encode())
    assert local_beat.read_record(tmp_path, 1) is None
    assert json.loads(local_beat.read_record(tmp_path, 3)) == {"members": [3]}
    assert local_beat.read_record(tmp_path, 2) is not None


def test_the_agent_fetches_each_new_record_once_for_the_node(store, tmp_path):
    keys.control_keys(store)
    store.set(keys.gen_record(2), json.dumps({"members": [0, 1]}))
    agent = _fake_agent(store, tmp_path, {})
    agent.record_gen = 0  # none yet
    agent._report_liveness(2, store.get(keys.FLAGS), False)
    assert json.loads(local_beat.read_record(tmp_path, 2)) == {"members": [0, 1]}
    store.set(keys.gen_record(2), json.dumps({"members": ["changed"]}))
    agent._report_liveness(2, store.get(keys.FLAGS), False)  # same generation: not read again
    assert json.loads(local_beat.read_record(tmp_path, 2)) == {"members": [0, 1]}


def test_folders_of_agents_that_are_gone_are_removed(tmp_path):
    import subprocess
    import sys

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead_pid = int(gone.stdout)
    orphan = tmp_path / f"mecefo-beat-{dead_pid}-abc"
    orphan.mkdir()
    (orphan / "rank0").write_text("{}")
    os.utime(orphan, (time.time() - 120, time.time() - 120))  # not one being created now
    live = tmp_path / f"mecefo-beat-{os.getpid()}-def"
    live.mkdir()
    mine = local_beat.make_folder(str(tmp_path)).path
    assert not orphan.exists() and live.exists() and mine.exists()
    assert mine.name.startswith(f"mecefo-beat-{os.getpid()}-")


def _dead_pid() -> int:
    import subprocess
    import sys

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(gone.stdout)


def test_a_live_agents_folder_is_never_removed_whatever_its_pid(tmp_path):
    """Issue 32, item 4: the owner lock, not the pid in the name, says whether a folder's agent
    lives (a pid is reused; an agent in another pid namespace has a pid this one cannot see)."""
    old = time.time() - 120
    live = local_beat.make_folder(str(tmp_path))  # a live agent whose pid looks dead here
    renamed = tmp_path / f"mecefo-beat-{_dead_pid()}-live"
    live.path.rename(renamed)
    os.utime(renamed, (old, old))
    gone = local_beat.make_folder(str(tmp_path))  # an agent SIGKILLed: its lock is released,
    os.close(gone._lock_fd)  # and its pid (ours here) was reused since
    legacy_new = tmp_path / f"mecefo-beat-{_dead_pid()}-new"  # no owner file: being created
    legacy_new.mkdir()
    removed = local_beat.remove_orphans(tmp_path)
    assert removed == [gone.path] and renamed.exists() and legacy_new.exists()
    os.utime(legacy_new, (old, old))  # an older version's folder, its agent long gone
    assert local_beat.remove_orphans(tmp_path) == [legacy_new] and renamed.exists()


def test_a_removed_folder_is_recreated_with_its_record_and_control(store, tmp_path):
    """Issue 32, item 4: the agent's next tick recreates its folder (locked again) and rewrites
    the current generation's record and the control file, in one line."""
    import shutil

    keys.control_keys(store)
    store.set(keys.gen_record(2), json.dumps({"members": [0, 1]}))
    channel = local_beat.make_folder(str(tmp_path))
    agent = _fake_agent(store, tmp_path, {}, channel)
    agent.record_gen = 0
    agent._report_liveness(2, store.get(keys.FLAGS), False)
    shutil.rmtree(channel.path)
    agent._report_liveness(2, store.get(keys.FLAGS), False)
    assert json.loads(local_beat.read_record(channel.path, 2)) == {"members": [0, 1]}
    assert local_beat.read_control(channel.path).seq == 2
    assert agent.lines == [f"the node-local folder {channel.path} was removed; recreated it"]
    assert local_beat.remove_orphans(tmp_path) == []  # locked again: still a live agent's
    agent._report_liveness(2, store.get(keys.FLAGS), False)
    assert len(agent.lines) == 1


def test_a_folder_that_cannot_be_recreated_costs_one_line_not_the_node(store, tmp_path):
    import shutil

    keys.control_keys(store)
    (tmp_path / "shm").mkdir()
    channel = local_beat.make_folder(str(tmp_path / "shm"))
    me = types.SimpleNamespace(pid=os.getpid())
    agent = _fake_agent(store, tmp_path, {0: me}, channel)
    shutil.rmtree(tmp_path / "shm")  # its parent too: mkdir fails
    for _ in range(3):
        agent._report_liveness(1, store.get(keys.FLAGS), False)  # no exception
    report = json.loads(store.get(keys.node_key(0)))
    assert report["seq"] == "3:3" and len(report["ranks"]["0"]) == 4  # per-rank keys apply
    assert len(agent.lines) == 1 and str(channel.path) in agent.lines[0], agent.lines
    assert "cannot be used" in agent.lines[0] and "No such file" in agent.lines[0]


def test_a_rank_started_while_the_folder_is_missing_beats_to_the_store(store, tmp_path):
    """A rank that starts while its agent's folder is gone does not fail: it beats to the store,
    and through the agent again once the folder is back."""
    folder = tmp_path / "channel"
    hb, exits = _heartbeat(store, folder)  # no such folder: no exception
    hb.start()
    try:
        _wait(lambda: int(store.get(keys.heartbeat(2))) >= 3)
        folder.mkdir()
        for seq in range(1, 6):
            local_beat.write_control(folder, local_beat.Control(seq=seq, gen=1))
            time.sleep(0.1)
        assert local_beat.read_beats(folder, {2: 1}), "back to the agent's folder"
        assert not exits
    finally:
        hb.stop()
        hb.join(5)
