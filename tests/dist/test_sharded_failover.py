"""The distributed optimizer under failover, with real processes and real signals.

Each shard of the optimizer state is held by two live replicas (`failover.shard_copies=2`).
After every fault the checks of a normal failover hold (steps once, micro-batches once, the
failure-free loss curve with `spread`), and the shard audit (`audit/shards_rank*.jsonl`, every
holder's digest of every shard after every committed step) says:
- every shard was held after every step, by at most two replicas, and its holders agree bit for
  bit (an adopted shard that is one step old, or any other inexact copy, disagrees);
- before the failure, each shard equals the failure-free run's at the same step (after it the
  reduction runs over fewer members, in another float order, so only the curve is compared);
- at the end each replica holds its own shard again (shards are handed back).
A fault that takes both copies of a shard ends the job with one line, never on guessed state.
"""

from __future__ import annotations

import json
import signal
from collections import defaultdict
from pathlib import Path

import pytest

from tests.dist.test_failover import assert_recovered
from tests.dist.test_spares import _kill_node
from tests.helpers.launch import launch, launch_nodes, stop_after_event, wait_for_steps

pytestmark = pytest.mark.timeout(400)

SHARDED = ("mecefo.takeover_policy=spread", "training.use_distributed_optimizer=true")
STEPS = 30  # at least (the warm-up: a job stopped on request decays its rate over STEPS)


def shard_rows(run_dir: Path) -> dict[tuple[int, int, int], list[tuple[int, str]]]:
    """(state step, replica position, shard) -> [(replica, digest)] of every holder."""
    out: dict[tuple[int, int, int], list[tuple[int, str]]] = defaultdict(list)
    for path in sorted((Path(run_dir) / "audit").glob("shards_rank*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            for shard, digest in row["shards"].items():
                key = (row["next_step"], row["position"], int(shard))
                out[key].append((row["replica"], digest))
    return out


def assert_shards_exact(res, ref, *, steps, replicas=4, positions=1, clean_before=None):
    got, want = shard_rows(res.run_dir), shard_rows(ref.run_dir)
    for step in range(1, steps + 1):
        for pos in range(positions):
            for shard in range(replicas):
                rows = got.get((step, pos, shard))
                assert rows, f"shard {shard} (position {pos}) held by nobody after step {step}"
                holders = [r for r, _ in rows]
                assert len(holders) == len(set(holders)) <= 2, (step, shard, rows)
                assert len({d for _, d in rows}) == 1, f"holders of shard {shard} disagree {rows}"
                if clean_before is not None and step <= clean_before:
                    assert rows[0][1] == want[(step, pos, shard)][0][1], (step, shard)
    for pos in range(positions):  # handed back: the owner holds its own shard at the end
        for shard in range(replicas):
            assert shard in {r for r, _ in got[(steps, pos, shard)]}, (
                shard,
                got[(steps, pos, shard)],
            )


def assert_same_curve(res, ref, steps):
    ref_l, got = ref.losses(), res.losses()
    for step in range(steps):
        assert got[step] == pytest.approx(ref_l[step], rel=2e-5, abs=1e-6), step


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_data_dir):
    res = launch(
        tmp_path_factory.mktemp("ref"), demo_data_dir, steps=STEPS, overrides=SHARDED, name="ref"
    )
    assert res.returncode == 0, res.explain()
    assert res.event_types() == []
    return res


def test_kill_adopts_and_hands_back(tmp_path, demo_data_dir, reference):
    steps = STEPS
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=steps,
        inject=("kill:2:5:3",),
        overrides=SHARDED,
        until_rejoined=True,
    )
    assert_recovered(res, steps=steps)
    assert_shards_exact(res, reference, steps=len(res.metrics()), clean_before=5)
    assert_same_curve(res, reference, steps)
    moves = [e for e in res.events() if e["type"] == "shard_adopt"]
    # adopted after the death (at the step it died in), handed back at the rejoin
    assert len(moves) >= 2 and moves[0]["step"] == 5 and moves[-1]["step"] > 5, moves
    assert all(e["bytes"] > 0 for e in moves)


def test_two_kills_at_one_step(tmp_path, demo_data_dir, reference):
    # shard s is held by replicas s and s+1: replicas 0 and 2 never hold the same shard
    steps = STEPS
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=steps,
        inject=("kill:0:5:3", "kill:2:5:3"),
        overrides=SHARDED,
        until_rejoined=True,
    )
    assert_recovered(res, steps=steps, min_failures=2, min_rejoins=2)
    assert_shards_exact(res, reference, steps=len(res.metrics()), clean_before=5)
    assert_same_curve(res, reference, steps)


def test_both_copies_lost_without_saved_state_stops_with_one_line(tmp_path, demo_data_dir):
    # replicas 1 and 2 both hold shard 1: no exact copy is left, and nothing is saved
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=16,
        inject=("kill:1:5:3", "kill:2:5:3"),
        overrides=SHARDED,
    )
    assert res.returncode == 8, res.explain()  # JOB_ABORTED
    line = "optimizer shards [1] have no exact copy at step 5"
    assert line in res.output and "neither snapshots nor checkpoints" in res.output, res.explain()
    aborts = [e for e in res.events() if e["type"] == "abort"]
    assert aborts and "no exact copy" in aborts[0]["detail"]
    assert [m["step"] for m in res.metrics()] == list(range(5))  # nothing after, nothing guessed


ROLLBACK_STEPS = 20
ROLLBACK_KILLS = ("kill:1:7:3", "kill:2:7:3")
"""Both holders of shard 1 killed at step 7 and held back until job step 10, a step the job
cannot reach before it has rolled back: the agents must restart them when the job recovers."""


def _assert_rolled_back(res, reference, source: str) -> None:
    assert res.returncode == 0, res.explain()
    rollback = [e for e in res.events() if e["type"] == "rollback"]
    assert len(rollback) == 1 and rollback[0]["step"] == 7, rollback
    assert "rolling back to the newest saved state" in res.output
    assert source in res.output, res.explain()
    assert "restarts now, not at job step 10" in res.output, res.explain()
    # two replicas failed; the survivors' exits for the rollback are not failures
    assert res.summary()["failover"]["failures"] == 2, res.summary()["failover"]
    assert [m["step"] for m in res.metrics()] == list(range(ROLLBACK_STEPS))  # each kept once
    # exact state from the saved step on: the failure-free curve (up to the reduction order of
    # however many replicas have rejoined)
    assert_same_curve(res, reference, ROLLBACK_STEPS)


def test_both_copies_lost_rolls_back_to_the_checkpoint(tmp_path, demo_data_dir, reference):
    """Default (async) saves: the checkpoint of step 5 is still being written when the rollback
    is declared; it must be finished and committed before the committing rank exits."""
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=ROLLBACK_STEPS,
        inject=ROLLBACK_KILLS,
        overrides=(*SHARDED, "checkpoint.interval=5"),
    )
    _assert_rolled_back(res, reference, "recovered the state of step 5 from disk checkpoint")


def test_both_copies_lost_rolls_back_to_snapshots(tmp_path, demo_data_dir, reference):
    """No checkpoint: every rank, the killed ones included, reloads its node's snapshot."""
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=ROLLBACK_STEPS,
        inject=ROLLBACK_KILLS,
        overrides=(*SHARDED, "snapshot.interval=1"),
    )
    _assert_rolled_back(res, reference, "from this node's shared-memory snapshot")


@pytest.mark.parametrize("standby", [1, 0], ids=["standby", "no-standby"])
def test_node_loss(tmp_path, demo_data_dir, reference, standby):
    """Two nodes of two replicas: copies sit on the other node, so losing a node loses none.
    With a standby the job is stopped (SIGUSR1) a few steps after the standby's ranks are back:
    its length is a bound, never reached (an idle machine ran the 40 steps before the standby
    was given the node, 5 s after the loss); the data order and learning rate are the
    reference's (`lr_decay_steps`, one epoch of the corpus either way)."""
    steps = 400 if standby else STEPS

    def lose_node1(procs, run_dir):
        wait_for_steps(run_dir, 4)
        _kill_node(procs[1])
        if standby:
            stop_after_event(procs[0], run_dir, "node_replaced")

    res = launch_nodes(
        tmp_path,
        demo_data_dir,
        nnodes=2,
        nproc_per_node=2,
        standby=standby,
        steps=steps,
        while_running=lose_node1,
        overrides=(*SHARDED, f"training.lr_decay_steps={STEPS}"),
    )
    assert res.node_codes[1] == -signal.SIGKILL, res.explain()
    res.returncode = res.node_codes[0]
    if standby:
        assert_recovered(res, steps=None, min_failures=2, min_rejoins=2)
        assert res.metrics()[-1]["replicas_alive"] == 4
        steps = len(res.metrics())
    else:
        assert res.returncode == 0, res.explain()
        assert [m["step"] for m in res.metrics()] == list(range(steps)), res.explain()
        assert res.summary()["failover"]["samples_lost"] == 0
        assert res.metrics()[-1]["replicas_alive"] == 2
    assert_same_curve(res, reference, min(steps, STEPS))
    got = shard_rows(res.run_dir)
    for (step, _, shard), rows in got.items():
        assert len({d for _, d in rows}) == 1, (step, shard, rows)
    for step in range(1, steps + 1):
        assert all(got.get((step, 0, s)) for s in range(4)), step
    if not standby:  # the lost node's shards live on node 0: replicas 0, 1 hold all four
        last = {r for s in range(4) for r, _ in got[(steps, 0, s)]}
        assert last == {0, 1}


def test_tp2_dp2_kill(tmp_path, demo_data_dir):
    steps = STEPS
    overrides = (*SHARDED, "parallel.tensor_model_parallel_size=2")
    ref = launch(tmp_path, demo_data_dir, steps=steps, overrides=overrides, name="ref")
    assert ref.returncode == 0, ref.explain()
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=steps,
        inject=("kill:3:5:3",),
        overrides=overrides,
        until_rejoined=True,
    )
    assert_recovered(res, steps=steps, replicas=2, tp=2)
    last = len(res.metrics())
    assert_shards_exact(res, ref, steps=last, replicas=2, positions=2, clean_before=5)
    assert_same_curve(res, ref, steps)
