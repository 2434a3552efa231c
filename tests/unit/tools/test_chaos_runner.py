"""`tools/chaos/run.py` on stand-in jobs (no trainer starts): a job that never progresses is
killed at its bound and reported as a hang with nothing left behind; a job whose "agent" exits 0
but leaves a tagged process behind is reported (and the process killed); a node loss takes every
process under the node's agent. The agent is a small Python process with the job's tag. An
etcd_kill on a real 3-member etcd counts as fired only once another member leads."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.etcd import cluster, needs_etcd  # noqa: F401 - a fixture
from tools.chaos import checks
from tools.chaos import run as chaos
from tools.chaos.schedule import Fault, Schedule

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(120)


# an "agent" that forks a child into its own session (as mecefo-launch does with its ranks),
# then sleeps (never progresses) or exits at once (leaving the child behind)
AGENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
time.sleep(float(sys.argv[1]))
"""


def _schedule(faults=(), nodes=1) -> Schedule:
    return Schedule(
        seed=0, index=0, nodes=nodes, nproc=1, max_steps=10, snapshot_interval=0,
        faults=list(faults), kinds=("kill",),
    )  # fmt: skip


@pytest.fixture
def fake_agents(monkeypatch):
    """Job.start runs AGENT per node; the store is never reachable."""
    lives = {}

    def start(job):
        job.folder.mkdir(parents=True, exist_ok=True)
        for node in range(job.s.nodes):
            job.agents[node] = subprocess.Popen(
                [sys.executable, "-c", AGENT, str(lives.get(node, 0))],
                env=job.env,
                start_new_session=True,
            )
        time.sleep(1.0)  # let them fork

    monkeypatch.setattr(chaos.Job, "start", start)
    monkeypatch.setattr(chaos.Probe, "_get", lambda self, key: None)
    return lives


def _args(tmp_path, **kw):
    args = chaos.parse_args(["--out", str(tmp_path), "--demo-dir", str(tmp_path / "demo")])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_a_job_that_never_progresses_is_killed_and_reported_as_a_hang(tmp_path, fake_agents):
    fake_agents[0] = 300
    res = chaos.run_schedule(_schedule(), _args(tmp_path, job_timeout_s=3))
    assert res["violations"][0].startswith("hang: the job ran past its 3 s limit"), res
    assert res["outcome"] == "FAIL"
    assert not any("leftover" in v for v in res["violations"]), res  # everything was killed
    assert checks.tagged_processes(res["tag"]) == []
    assert res["wall_s"] < 30


def test_a_process_left_behind_by_a_finished_job_is_reported_and_killed(
    tmp_path, fake_agents, monkeypatch
):
    monkeypatch.setattr(chaos, "LEFTOVER_GRACE_S", 1.0)
    fake_agents[0] = 0
    res = chaos.run_schedule(_schedule(), _args(tmp_path, job_timeout_s=60))
    left = [v for v in res["violations"] if v.startswith("leftover process")]
    assert len(left) == 1 and "time.sleep(120)" in left[0], res["violations"]
    assert res["exit_codes"] == {0: 0}
    deadline = time.monotonic() + 10  # and the tool killed it (SIGKILL lands asynchronously)
    while checks.tagged_processes(res["tag"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert checks.tagged_processes(res["tag"]) == []


def test_node_loss_kills_the_agent_and_everything_under_it(tmp_path, fake_agents):
    fake_agents.update({0: 300, 1: 300})
    s = _schedule([Fault(kind="node_loss", step=0, node=1)], nodes=2)
    job = chaos.Job(s, tmp_path, _args(tmp_path))
    try:
        job.start()
        faults = chaos.Faults(job, chaos.Probe(job))
        node1 = job.agents[1].pid
        deadline = time.monotonic() + 10  # the fake agent starts its child a moment later
        under = []
        while not under and time.monotonic() < deadline:
            under = [p.pid for p in job.processes() if p.ppid == node1]
            time.sleep(0.05)
        assert len(under) == 1
        faults.tick(step=0)
        assert faults.ledger[0]["fired"] and job.killed_agents == {1}
        deadline = time.monotonic() + 10  # SIGKILL lands when each is next scheduled
        while time.monotonic() < deadline and {node1, under[0]} & {p.pid for p in job.processes()}:
            time.sleep(0.05)
        alive = {p.pid for p in job.processes()}
        assert node1 not in alive and under[0] not in alive
        assert job.agents[0].pid in alive  # the other node is untouched
    finally:
        job.kill_all()
    assert checks.tagged_processes(job.tag) == []


@needs_etcd
@pytest.mark.parametrize("lands", [True, False], ids=["kill", "no-op kill"])
def test_etcd_kill_has_landed_only_once_another_member_leads(cluster, monkeypatch, lands):  # noqa: F811
    if not lands:
        monkeypatch.setattr(type(cluster), "kill", lambda self, i, sig=None: None)
    job = SimpleNamespace(etcd=cluster, s=SimpleNamespace(faults=[]))
    faults = chaos.Faults(job, probe=None)
    leader = cluster.leader()
    done, detail = faults._fire(Fault(kind="etcd_kill", step=0, hold_s=60.0))
    assert done == lands, detail
    if lands:
        assert cluster.procs[leader].poll() is not None, "the leader was not killed"
        assert cluster.leader() != leader and f"m{cluster.leader()} leads" in detail
        assert [t[1:] for t in faults.timers] == [("etcd_start", leader)]
    else:
        assert detail.endswith("it still leads")
