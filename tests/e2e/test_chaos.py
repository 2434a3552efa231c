"""`tools/chaos/run.py` end to end: a short fixed-seed soak against real `mecefo-launch` jobs (2
simulated nodes x 2 ranks, tiny model, 30 steps), every invariant checked by the tool. Seven jobs
(~5 minutes on this 2-core machine when it is quiet): rank faults, coordinator kill under a CPU hog
(with pipeline parallelism: a replica is 2 stages, and a rank's fault takes both out), a restarted
leader, an agent kill and a whole node lost; on `--store etcd`, etcd's leader killed and the
coordinating node lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.etcd import needs_etcd

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CASES = [
    # seed 0, schedules 1-2 (`--list`): rank 0 (the leader) stopped 0.7 s right after the first
    # generation formed (before step 0), then node 1's snapshot process killed; rank 3 hit three
    # times: an exception, a 6.3 s stop (past the 3 s heartbeat timeout: evicted, restarted),
    # another exception
    pytest.param("kill,stop,exception,smp_kill", 0, "1,2", (), id="rank-faults"),
    # seed 43, schedule 0, pipeline-parallel (2 replicas of 2 stages, each on its node): the
    # coordinator SIGKILLed right after the first generation formed, a busy loop on every core
    # for 17 s, rank 2 (stage 0 of replica 1) SIGKILLed under it: replica 1 leaves and rejoins
    # whole
    pytest.param(
        "coordinator_kill,cpu_hog,kill,stop", 43, "0", ("--pp", "2"), id="coordinator-and-hog-pp"
    ),
    # seed 4, schedule 2: an exception on rank 1 before step 0, then the leader (rank 0) killed:
    # the summary, written by whichever rank leads at the end, covers the whole job
    pytest.param("kill,stop,exception,smp_kill", 4, "2", (), id="leader-restarted"),
    # seed 1, schedules 0-1: node 1's agent SIGKILLed (its ranks and snapshot process die with
    # it: nothing left behind), then node 1 lost whole
    pytest.param("agent_kill,node_loss", 1, "0,1", (), id="agent-and-node-loss"),
    # on --store etcd, seed 7 schedule 0: etcd's leader SIGKILLed right after the first
    # generation formed and restarted 6.9 s later, then the node whose candidate coordinates
    # lost whole (tests/dist/test_etcd_failover.py times these faults exactly)
    pytest.param(
        "etcd_kill,head_node_loss,coordinator_kill,kill", 7, "0", (), id="etcd", marks=needs_etcd
    ),
]


@pytest.mark.parametrize(("kinds", "seed", "only", "layout"), CASES)
def test_chaos_soak_survives(tmp_path, demo_data_dir, kinds, seed, only, layout):
    out = tmp_path / "chaos"
    store = ["--store", "etcd"] if "etcd_kill" in kinds else []
    cmd = [
        sys.executable, "tools/chaos/run.py", "--seed", str(seed), "--only", only,
        "--kinds", kinds, "--nodes", "2", "--nproc", "2", "--max-steps", "30",
        "--out", str(out), "--demo-dir", demo_data_dir, "--job-timeout-s", "240", *store,
        *layout,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=570)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    results = json.loads((out / "chaos.json").read_text())["results"]
    assert [r["index"] for r in results] == [int(i) for i in only.split(",")], report
    for r in results:
        assert r["violations"] == [], (r["schedule"]["describe"], r["violations"], report)
        assert r["outcome"].startswith("ok"), report
        assert all(e["fired"] for e in r["fired"]), r["fired"]  # every fault landed
        assert not [n for n in r["notes"] if "never fired" in n], r["notes"]
        if any(f["kind"] in ("kill", "exception") for f in r["schedule"]["faults"]):
            assert r["events"].get("failure", 0) >= 1, r["events"]
        if "--pp" in layout:  # one failure per lost replica, naming every rank of it
            assert r["failures"] and all(f.startswith("r[2, 3] @") for f in r["failures"]), r
    assert proc.returncode == 0, report
    assert "schedules ended acceptably" in proc.stdout
