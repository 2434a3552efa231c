"""The group kill of the peers benchmark (`tools/bench/peers_group.py`) with real processes: a
launcher and the worker it started die together by SIGKILL when the trigger fires, and the new
launch starts `down_s` later; the triggers read a trainer's hold and a job going past the step."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tools.bench.peers_group import GroupKill, Job, log_fired, marker_fired, step_fired

pytestmark = pytest.mark.timeout(60)
LAUNCHER = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "time.sleep(60)\n"
)


def _until(check, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_whole_tree_dies_and_a_new_launch_follows(tmp_path):
    import psutil

    job = Job(tmp_path, 30)
    env = dict(os.environ)
    marker = tmp_path / "group_kill"

    def relaunch(j):
        return j.start("grp.relaunch", [sys.executable, "-c", "pass"], env, role="grp")

    group = GroupKill(5, 0.3, "grp", marker_fired(marker), relaunch=relaunch)
    try:
        launcher = job.start("grp", [sys.executable, "-c", LAUNCHER], env)
        _until(lambda: psutil.Process(launcher.pid).children())
        worker = psutil.Process(launcher.pid).children()[0]
        group.poll(job)
        assert group.record() is None and not group.pending  # not fired yet
        marker.write_text(str(time.time()))
        group.poll(job)
        assert group.pending and group.processes == 2
        assert launcher.wait(timeout=10) == -9  # the launcher itself, not only its worker
        _until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE)
        group.poll(job)
        assert group.pending  # down for 0.3 s
        _until(lambda: (group.poll(job), not group.pending)[1])
        assert time.time() - group.kill_time >= 0.3
        assert job.roles["grp"] is not launcher and job.roles["grp"].wait(timeout=20) == 0
        record = group.record()
        assert record["held"] is True and record["victim_rc"] == -9
        assert record["relaunched"] is True and record["new_launch_rc"] == 0
        group.poll(job)  # fires once
        assert job.roles["grp"].returncode == 0 and len(job.procs) == 2
    finally:
        job.close()


def test_disabled_never_fires(tmp_path):
    group = GroupKill(None, 0.0, "grp", lambda: True, lambda: True)
    group.poll(Job(tmp_path, 5))
    assert group.record() is None and not group.pending


def test_triggers(tmp_path):
    rows = tmp_path / "rows.jsonl"
    passed = step_fired(rows, 4)
    assert not passed()  # no file yet
    rows.write_text(json.dumps({"step": 3}) + "\n" + json.dumps({"step": 4, "committed": False}))
    assert not passed()  # below the step, and an uncommitted attempt (a partial line besides)
    with open(rows, "a") as fh:
        fh.write("\n" + json.dumps({"heal_bytes": 10}) + "\n")
    assert not passed()
    rows.write_text(json.dumps({"step": 3}) + "\n" + json.dumps({"step": 5}) + "\n")  # rewritten
    assert passed()
    log = tmp_path / "node1.log"
    held = log_fired(log, "stall at step 8")
    assert not held()
    log.write_text("[inject] rank 1: stall at st")
    assert not held()
    with open(log, "a") as fh:
        fh.write("ep 8\n")
    assert held()  # the text split across two reads
