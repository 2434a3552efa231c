"""Spare nodes with real processes: two working nodes of two ranks and one standby agent on this
machine. Node 1 is lost for real (its agent, trainers and snapshot process SIGKILLed at once); the
coordinator gives node 1 to the standby, whose ranks rejoin from live peers, and the job ends at
full data-parallel width with every invariant of a normal failover."""

from __future__ import annotations

import os
import signal

import pytest

from tests.dist.test_failover import assert_recovered
from tests.helpers.launch import launch_nodes, wait_for_steps

pytestmark = pytest.mark.timeout(400)


def _kill_node(agent) -> None:
    """SIGKILL an agent and everything it started, at once (a node losing power)."""
    import psutil

    procs = [agent, *psutil.Process(agent.pid).children(recursive=True)]
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_lost_node_is_replaced_by_a_standby(tmp_path):
    steps = 20  # at least: the job goes on until the standby's ranks have rejoined

    def lose_node1(procs, run_dir):
        wait_for_steps(run_dir, 5, proc=procs[0])
        _kill_node(procs[1])

    res = launch_nodes(
        tmp_path,
        str(tmp_path / "fresh_demo"),  # built at start by whichever builder takes the lock first
        nnodes=2,
        nproc_per_node=2,
        standby=1,
        steps=steps,
        while_running=lose_node1,
        overrides=("training.micro_batch_size=2",),
        until_rejoined=True,
    )
    assert res.node_codes[2] == res.node_codes[0], res.explain()  # stopped together
    assert res.node_codes[1] == -signal.SIGKILL
    res.returncode = res.node_codes[0]  # the job's outcome is the head node's
    # strict: a rank logs its micro-batches before it votes (b9b394e), so a node killed between a
    # step's commit and its update still leaves that step's rows; every micro-batch once
    assert_recovered(res, steps=steps, replicas=4, world=4, min_failures=2, min_rejoins=2)
    events = res.events()
    lost = [e for e in events if e["type"] == "node_lost"]
    replaced = [e for e in events if e["type"] == "node_replaced"]
    assert [e["ranks"] for e in lost] == [[2, 3]], lost
    assert [e["ranks"] for e in replaced] == [[2, 3]], replaced
    assert 0 < replaced[0]["latency_ms"] < 60_000
    assert "taking over node 1: ranks [2, 3]" in res.output, res.explain()
    last = res.metrics()[-1]
    assert last["replicas_alive"] == 4  # ended at full data-parallel width
