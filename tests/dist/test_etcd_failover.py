"""Jobs on `--store etcd` with a real 3-member etcd cluster and real signals.

- The etcd leader SIGKILLed mid-run, then a rank: the job finishes with every invariant.
- The elected coordinator SIGKILLed twice, then a rank: a new one is elected each time (the
  node's agent restarts its candidate) and decides the failure.
- The head node lost (agent, coordinator candidate, trainers, snapshot process) with a standby,
  under `launch/local/run.sh`: another node's candidate is elected, the standby takes the lost
  ranks, the job finishes, and the script exits 0.
- Two of three etcd members SIGKILLed: every process stops within a bound (exit 6, the line names
  etcd); the same job id is then refused; with the members back, a new launch resumes from the
  last checkpoint and trains to the last step.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from megatron_mecefo.control import keys
from megatron_mecefo.control.etcd_store import EtcdStore, address
from megatron_mecefo.control.records import posted_events, read_generation
from megatron_mecefo.errors import ExitCode
from megatron_mecefo.failover.node.candidate import CandidateId
from megatron_mecefo.metrics.summary import check_summary
from tests.dist.test_failover import assert_recovered
from tests.dist.test_spares import _kill_node
from tests.helpers.etcd import cluster, needs_etcd  # noqa: F401 - a fixture
from tests.helpers.launch import launch, launch_script, script_agent, wait_for_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), needs_etcd]


def _etcd_args(cluster, job: str) -> tuple[str, ...]:
    return ("--store", "etcd", "--etcd-endpoints", ",".join(cluster.endpoints), "--job-id", job)


def _leader_pid(cluster, job: str) -> int:
    """The pid of the elected coordinator (its candidate id ends in the agent's pid; the
    coordinator is that agent's child)."""
    import psutil

    store = EtcdStore(address(cluster.endpoints, job), 5.0)
    agent = CandidateId.parse(store.get(keys.COORD_LEADER).decode()).agent_pid
    for child in psutil.Process(agent).children():
        if "--elect" in child.cmdline():
            return child.pid
    raise AssertionError(f"no candidate process under agent {agent}")


def test_etcd_leader_killed_mid_run(tmp_path, demo_data_dir, cluster):
    steps = 20
    killed = []

    def kill_etcd_leader(proc, run_dir):
        wait_for_steps(run_dir, 5)
        leader = cluster.leader()
        cluster.kill(leader)
        killed.append(leader)

    res = launch(
        tmp_path,
        demo_data_dir,
        steps=steps,
        inject=("kill:2:12:3",),
        launch_args=_etcd_args(cluster, "leader-kill"),
        while_running=kill_etcd_leader,
        until_rejoined=True,
    )
    assert killed and cluster.procs[killed[0]].poll() is not None
    assert_recovered(res, steps=steps)
    assert res.output.count("elected") == 1, res.explain()  # the coordinator never noticed


def test_coordinator_killed_twice(tmp_path, demo_data_dir, cluster):
    steps = 22
    job = "coord-kill"

    def kill_coordinator_twice(proc, run_dir):
        log = run_dir.parent / "run.log"
        for n, step in enumerate((3, 8)):
            wait_for_steps(run_dir, step + 1)
            deadline = time.monotonic() + 60  # the n-th election is over: kill that leader
            while log.read_text().count(" elected (") <= n:
                assert time.monotonic() < deadline, f"no election {n + 1}"
                time.sleep(0.05)
            os.kill(_leader_pid(cluster, job), signal.SIGKILL)

    res = launch(
        tmp_path,
        demo_data_dir,
        steps=steps,
        inject=("kill:1:16:3",),  # after both: the third coordinator must decide it
        launch_args=(*_etcd_args(cluster, job), "--coordinator-arg=--lease-ttl-s=3"),
        while_running=kill_coordinator_twice,
        until_rejoined=True,
    )
    assert_recovered(res, steps=steps)
    elected = re.findall(r"candidate \S+ elected \(lease TTL 3 s, epoch (\d+)", res.output)
    # (a coordinator starved past its lease on a loaded machine stands down too: more epochs)
    assert len(elected) >= 3 and [int(e) for e in elected] == list(range(1, len(elected) + 1))
    assert res.output.count("coordinator candidate exited (-9)") == 2
    failure = next(e for e in res.events() if e["type"] == "failure")
    assert failure["dp_rank"] == 1 and failure["step"] >= 16


def test_coordinator_killed_before_writing_the_last_events(tmp_path, demo_data_dir, cluster):
    """The elected coordinator is stopped as it publishes the rejoin generation and killed once
    the rejoin event is posted, so that event is in etcd but not in events.jsonl; a stop is then
    requested (SIGUSR1), so the job ends well within the lease TTL. The leader waits for a new
    coordinator to write the event before it declares the job done."""
    steps = 400  # never reached: the stop ends the job (however late the rejoin comes under load)
    job = "coord-late"
    posted = {}

    def kill_before_the_rejoin_is_written(proc, run_dir):
        store = EtcdStore(address(cluster.endpoints, job), 5.0)
        deadline = time.monotonic() + 150
        while keys.get_int(store, keys.GEN, 0) < 1:
            assert time.monotonic() < deadline, "no first generation"
            time.sleep(0.02)
        pid = _leader_pid(cluster, job)
        while True:  # the generation that admits rank 1 again: stop its publisher at once
            gen = keys.get_int(store, keys.GEN, 0)
            if gen > 1 and read_generation(store, gen).reason == "join":
                break
            assert time.monotonic() < deadline, "no join generation"
            time.sleep(0.005)
        os.kill(pid, signal.SIGSTOP)
        while not any(e["type"] == "rejoin" for e in posted_events(store)[0]):
            assert time.monotonic() < deadline, "no rejoin event"
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        posted["seq"] = keys.get_int(store, keys.EVENT_SEQ)
        posted["written"] = keys.get_int(store, keys.EVENTS_WRITTEN)
        proc.send_signal(signal.SIGUSR1)  # every rank stops at one step, within a second or two

    res = launch(
        tmp_path,
        demo_data_dir,
        steps=steps,
        inject=("kill:1:12:2",),
        launch_args=(*_etcd_args(cluster, job), "--warm-spares", "1"),
        while_running=kill_before_the_rejoin_is_written,
    )
    assert posted["written"] < posted["seq"], posted  # the kill left events unwritten
    assert res.returncode == ExitCode.PREEMPTED, res.explain()
    ran = [m["step"] for m in res.metrics()]
    assert ran == list(range(len(ran))) and 14 <= len(ran) < steps, res.explain()
    events = res.events()
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), events
    assert any(e["type"] == "rejoin" for e in events), res.explain()
    assert check_summary(res.run_dir) == []  # summary.json's events are events.jsonl's
    assert res.summary()["failover"]["samples_lost"] == 0
    assert res.output.count(" elected (") >= 2, res.explain()


def test_head_node_lost_with_a_standby(tmp_path, demo_data_dir, cluster):
    """`NNODES=2 NSPARE=1 MECEFO_STORE=etcd launch/local/run.sh`, as a user runs it: the head
    node (node 0: its agent, coordinator candidate, trainers, snapshot process) is lost whole,
    and so is the elected coordinator (node 0's, or else the leader's candidate is SIGKILLed at
    the same moment). Another candidate is elected, the standby takes the lost ranks, the job
    finishes, and run.sh exits 0 although the head's agent died of SIGKILL (issue 32, item 5)."""
    steps = 60
    job = "head-loss"
    leader = []

    def lose_head_node(proc, run_dir):
        wait_for_steps(run_dir, 6)
        store = EtcdStore(address(cluster.endpoints, job), 5.0)
        leader.append(CandidateId.parse(store.get(keys.COORD_LEADER).decode()).node)
        if leader[0] != 0:  # the coordinator is lost too, elsewhere: only its candidate
            os.kill(_leader_pid(cluster, job), signal.SIGKILL)
        _kill_node(script_agent(proc, 0))

    res = launch_script(
        tmp_path,
        demo_data_dir,
        env={
            "NNODES": "2",
            "NSPARE": "1",
            "NPROC": "2",
            "MECEFO_STORE": "etcd",
            "MECEFO_ETCD_ENDPOINTS": ",".join(cluster.endpoints),
            "MECEFO_JOB_ID": job,
        },
        steps=steps,
        overrides=("training.micro_batch_size=2",),
        while_running=lose_head_node,
    )
    assert res.returncode == 0, res.explain()  # the job trained to its last step
    assert "(node exit codes: 137 0 0): exit 0" in res.output, res.explain()
    lost = [e for e in res.events() if e["type"] == "node_lost"]
    assert [e["ranks"] for e in lost] == [[0, 1]], lost
    logged = [m["step"] for m in res.metrics()]
    # Known gap (docs/failover.md, "Metrics rows"): the leader, on the lost node, may die between
    # a step's commit and its metrics row, and the replacement that leads next never ran that
    # step, so that one row (just before the loss) is missing. Every other step is logged once.
    gaps = sorted(set(range(steps)) - set(logged))
    assert logged == sorted(set(logged)) and set(logged) <= set(range(steps)), logged
    assert gaps in ([], [lost[0]["step"] - 1]), (gaps, lost[0]["step"], res.explain())
    assert res.summary()["failover"]["samples_lost"] == 0
    assert "taking over node 0: ranks [0, 1]" in res.output, res.explain()
    elected = re.findall(r"candidate (node\d(?:-standby)?)@\S+ elected", res.output)
    # re-elected after the loss; the killed leader's agent restarts its candidate under the same
    # id, which may win again: only node 0 (lost) may not lead
    assert len(elected) >= 2 and elected[-1] != "node0", elected
    assert "etcd lease expired" in lost[0]["detail"], lost  # the lease, not the report's age
    assert res.metrics()[-1]["replicas_alive"] == 4
    assert check_summary(res.run_dir) == []


def test_quorum_lost_stops_cleanly_then_resumes(tmp_path, demo_data_dir, cluster):
    steps = 300
    overrides = ("checkpoint.interval=4", "checkpoint.async_save=false")
    down = {}

    def lose_quorum(proc, run_dir):
        wait_for_steps(run_dir, 10)
        leader = cluster.leader()
        other = (leader + 1) % 3
        cluster.kill(leader)
        cluster.kill(other)
        down["members"], down["t"] = [leader, other], time.monotonic()

    first = launch(
        tmp_path,
        demo_data_dir,
        nproc=2,
        steps=steps,
        overrides=overrides,
        launch_args=_etcd_args(cluster, "quorum-1"),
        while_running=lose_quorum,
    )
    stopped_s = time.monotonic() - down["t"]
    assert first.returncode == ExitCode.COORDINATOR_LOST, first.explain()
    assert "etcd unreachable" in first.output and "quorum lost?" in first.output
    assert "Traceback" not in first.output, first.explain()
    # ranks give up after their 5 s store timeout, agents after 10 s; nothing waits on the lost
    # store after that (an agent's goodbye did: 20 s more before)
    assert stopped_s < 25, f"the job took {stopped_s:.0f} s to stop after the quorum was lost"
    # every rank says where it stopped: no update without the vote, so at a step boundary
    kept = [int(n) for n in re.findall(r"the last step it committed is (-?\d+)", first.output)]
    assert len(kept) == 2, first.explain()
    last = first.metrics()[-1]["step"]  # a rank may not have seen the last commit's decision
    assert max(kept) - min(kept) <= 1 and last - 1 <= min(kept) <= max(kept) <= last + 1, (
        kept,
        last,
    )
    saved = sorted(
        int(p.name.split("_")[1]) for p in (first.run_dir / "checkpoints").glob("step_*")
    )
    assert saved and saved[-1] >= 8, saved

    for i in down["members"]:
        cluster.start_member(i)
    cluster.wait_healthy(30)
    again = launch(
        tmp_path,
        demo_data_dir,
        nproc=2,
        steps=steps,
        overrides=overrides,
        launch_args=_etcd_args(cluster, "quorum-1"),
        timeout_s=60,
    )
    assert again.returncode == ExitCode.CONFIG_ERROR, again.explain()
    assert "earlier launch of job 'quorum-1' that stopped" in again.output

    short = 24  # the resumed launch trains to its own last step
    resumed = launch(
        tmp_path,
        demo_data_dir,
        nproc=2,
        steps=short,
        overrides=overrides,
        launch_args=_etcd_args(cluster, "quorum-2"),
    )
    assert resumed.returncode == 0, resumed.explain()
    # from the node's shared-memory snapshot (it outlived the stop) or the last checkpoint
    found = re.search(
        r"recovered the state of step (\d+)|resumed from \S+ at step (\d+)", resumed.output
    )
    assert found, resumed.explain()
    start = int(found.group(1) or found.group(2))
    reached = first.metrics()[-1]["step"]
    assert saved[-1] <= start <= reached + 1, (saved, start, reached)
    steps = [m["step"] for m in resumed.metrics()]  # both launches' rows, in order
    steps_run = steps[len(steps) - 1 - steps[::-1].index(start) :]
    assert steps_run == list(range(start, short)), steps
