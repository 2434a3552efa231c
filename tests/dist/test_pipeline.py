"""Pipeline parallelism under failover, with real processes and real signals: a replica is a
pipeline of TP x PP ranks; the death of any of them removes the whole replica, survivors take its
micro-batches (every stage of a covering pipeline runs them in the same schedule), and the
restarted ranks take their (TP, PP) position's state from the same position in a live replica.
After each: steps once, micro-batches once, every position's replicas bitwise equal, the summary
as events and metrics say, and with `spread` the failure-free loss curve."""

from __future__ import annotations

import pytest

from tests.dist.test_failover import assert_recovered
from tests.helpers.launch import launch, launch_nodes, stop_after_event, wait_for_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 30  # at least (the warm-up: a job stopped on request decays its rate over STEPS)
PP2 = ("parallel.pipeline_model_parallel_size=2", "mecefo.takeover_policy=spread")


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory, demo_data_dir):
    res = launch(tmp_path_factory.mktemp("pp"), demo_data_dir, steps=STEPS, overrides=PP2)
    assert res.returncode == 0, res.explain()
    assert res.summary()["failover"]["failures"] == 0
    return res


def _same_curve(res, ref, steps: int = STEPS) -> None:
    ref_losses, got = ref.losses(), res.losses()
    for step in range(steps):
        assert got[step] == pytest.approx(ref_losses[step], rel=2e-5, abs=1e-6), step


@pytest.mark.parametrize(
    "inject",
    [("kill:0:5:3",), ("kill:3:5:3",), ("kill:2:5:3", "kill:3:5:3")],
    ids=["first-stage", "last-stage", "whole-replica"],
)
def test_pp2_dp2_survives_a_kill_on_any_stage(tmp_path, demo_data_dir, failure_free, inject):
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=STEPS,
        inject=inject,
        overrides=PP2,
        until_rejoined=True,
    )
    assert_recovered(res, steps=STEPS, replicas=2, tp=2, min_rejoins=2)
    dead = {int(spec.split(":")[1]) // 2 for spec in inject}
    failures = [e for e in res.events() if e["type"] == "failure"]
    # the replica goes whole, and is one failure however many of its ranks died
    assert sorted(e["dp_rank"] for e in failures) == sorted(dead), failures
    assert {r for e in failures for r in e["ranks"]} == {2 * d + s for d in dead for s in (0, 1)}
    assert [e["time_s"] for e in failures] == sorted(e["time_s"] for e in failures)
    assert len(res.summary()["failover"]["detection_ms"]) == len(dead)
    _same_curve(res, failure_free)


def test_pp2_node_loss_with_a_standby(tmp_path, demo_data_dir, failure_free):
    """Each simulated node runs one replica (its two stages); node 1 is lost whole (agent and
    ranks SIGKILLed) and a standby node takes its ranks, which rejoin by position. The job is
    stopped (SIGUSR1) three steps after the node is replaced (its step count is a bound; the
    data order and learning rate are the failure-free run's: `lr_decay_steps`)."""
    import os
    import signal

    def lose_node_1(procs, run_dir):
        wait_for_steps(run_dir, 6, proc=procs[0], limit_s=240)
        os.killpg(procs[1].pid, signal.SIGKILL)
        stop_after_event(procs[0], run_dir, "node_replaced")

    res = launch_nodes(
        tmp_path,
        demo_data_dir,
        nnodes=2,
        nproc_per_node=2,
        steps=400,
        overrides=(*PP2, f"training.lr_decay_steps={STEPS}"),
        standby=1,
        while_running=lose_node_1,
    )
    res.returncode = res.node_codes[0]  # node 1 was killed on purpose
    assert res.node_codes[2] == res.returncode, res.explain()
    assert_recovered(res, steps=None, replicas=2, tp=2, min_rejoins=2)
    types = res.event_types()
    assert "node_lost" in types and "node_replaced" in types, types
    _same_curve(res, failure_free, min(STEPS, len(res.metrics())))


def test_tp2_pp2_dp2_one_kill(tmp_path, demo_data_dir):
    """8 processes: a replica is 4 ranks (2 stages x 2 TP shards); one of them is SIGKILLed."""
    res = launch(
        tmp_path,
        demo_data_dir,
        nproc=8,
        steps=16,
        inject=("kill:5:4:3",),
        overrides=(*PP2, "parallel.tensor_model_parallel_size=2"),
        timeout_s=400,
        until_rejoined=True,
    )
    assert_recovered(res, steps=16, replicas=2, world=8, tp=4, min_rejoins=4)
    failures = [e for e in res.events() if e["type"] == "failure"]
    assert {r for e in failures for r in e["ranks"]} == {4, 5, 6, 7}
