"""The chaos soak's pure parts: the schedule generator (reproducible, every kind and awkward moment
reachable, acceptable exits per schedule, the pipeline and distributed-optimizer layouts) and
each invariant check on hand-made run directories (a duplicated step, a missing micro-batch,
unequal digests per (stage, TP rank) position, holders of an optimizer shard that disagree, a
summary that disagrees with the events, an unacceptable exit code, a real leftover process,
leftover shared memory). No job runs here; tests/e2e/test_chaos.py runs the tool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megatron_mecefo.errors import ExitCode
from megatron_mecefo.metrics.summary import job_wide
from tools.chaos import checks
from tools.chaos.schedule import (
    FAIL_STOP,
    KINDS,
    PASSING_TODAY,
    Fault,
    Schedule,
    check_layout,
    generate,
    possible_kinds,
    schedules,
    shard_partners,
)

pytestmark = pytest.mark.timeout(60)
LAYOUT = dict(nodes=2, nproc=2, max_steps=40)


# ---------------------------------------------------------------------------- generator


def test_a_schedule_depends_only_on_seed_index_layout_and_kinds():
    a = generate(7, 3, kinds=KINDS, **LAYOUT)
    assert a.to_dict() == generate(7, 3, kinds=KINDS, **LAYOUT).to_dict()
    many = [generate(s, 3, kinds=KINDS, **LAYOUT).describe() for s in range(20)]
    assert len(set(many)) > 10  # the seed matters
    # the repro command names everything that decides the schedule
    assert "--seed 7 --only 3 --nodes 2 --nproc 2 --max-steps 40 --kinds kill," in a.repro()


def test_first_faults_cycle_through_the_kinds_and_stay_in_range():
    plans = schedules(1, 3 * len(KINDS), kinds=KINDS, store="etcd", **LAYOUT)
    firsts = {p.index % len(KINDS): p for p in plans}
    for i, kind in enumerate(KINDS):
        assert any(f.kind == kind for f in firsts[i].faults), (kind, firsts[i].describe())
    for p in plans:
        assert 1 <= len(p.faults) <= 3
        for f in p.faults:
            assert f.kind in KINDS
            if f.at == "step":
                assert 0 <= f.step < p.max_steps, p.describe()
            if f.rank is not None:
                assert 0 <= f.rank < p.world
            if f.node is not None:
                assert 0 <= f.node < p.nodes
        claims = [(f.rank, f.step) for f in p.faults if f.by_trainer]
        assert len(set(claims)) == len(claims), p.describe()  # one injection per (rank, step)


def test_kinds_that_need_a_node_or_snapshots_get_them():
    assert possible_kinds(KINDS, nodes=1) == tuple(
        k for k in KINDS if k not in ("agent_kill", "node_loss", "head_node_loss", "etcd_kill")
    )
    assert possible_kinds(KINDS, nodes=2, store="etcd") == KINDS
    assert "etcd_kill" not in possible_kinds(KINDS, nodes=2)  # tcp has no etcd to kill
    with pytest.raises(ValueError, match="unknown store"):
        possible_kinds(KINDS, nodes=2, store="zookeeper")
    etcd = generate(2, 0, kinds=("etcd_kill",), store="etcd", **LAYOUT)
    assert etcd.faults[0].kind == "etcd_kill" and etcd.faults[0].hold_s > 0
    assert etcd.repro().endswith("--kinds etcd_kill --store etcd")
    with pytest.raises(ValueError, match="none of the kinds"):
        generate(0, 0, nodes=1, nproc=2, max_steps=40, kinds=("node_loss",))
    with pytest.raises(ValueError, match="unknown fault kind"):
        generate(0, 0, kinds=("meteor",), **LAYOUT)
    for p in schedules(3, 40, kinds=("smp_kill", "kill"), **LAYOUT):
        if any(f.kind == "smp_kill" for f in p.faults):
            assert p.snapshot_interval == 1, p.describe()
    for p in schedules(3, 40, kinds=PASSING_TODAY, nodes=1, nproc=3, max_steps=30):
        assert all(f.node is None or f.node == 0 for f in p.faults)


def test_awkward_moments_are_drawn():
    plans = schedules(5, 300, kinds=("kill", "stop", "exception"), **LAYOUT)
    faults = [f for p in plans for f in p.faults]
    assert any(f.at == "start" for f in faults)  # before step 0
    assert any(f.at == "rejoin" and f.kind == "kill" for f in faults)  # during a state transfer
    assert any(f.rank == 0 for f in faults)  # the leader
    twice = [p for p in plans if len({f.rank for f in p.faults}) < len(p.faults)]
    assert twice  # the same rank twice
    holds = [f.hold_s for f in faults if f.kind == "stop"]
    assert min(holds) < 3.0 < max(holds)  # stops shorter and longer than the heartbeat timeout
    for p in plans:  # a kill during a rejoin needs an earlier death of another rank
        for f in p.faults:
            if f.at == "rejoin":
                assert any(g.rank != f.rank and g.at != "rejoin" for g in p.faults), p.describe()
    assert "--inject kill:" in " ".join(a for p in plans for a in p.inject_args())


def _schedule(faults, snapshot=0, nodes=1, nproc=2, **layout) -> Schedule:
    return Schedule(
        seed=0, index=0, nodes=nodes, nproc=nproc, max_steps=30,
        snapshot_interval=snapshot, faults=faults, kinds=KINDS, **layout,
    )  # fmt: skip


# ---------------------------------------------------------------------------- layouts


def test_layouts_must_split_into_whole_replicas():
    check_layout(2, 2, pp=2)
    check_layout(2, 4, tp=2, pp=2)
    check_layout(4, 1, pp=2)  # a replica on whole nodes
    with pytest.raises(ValueError, match="not divisible by TP x PP = 1 x 2"):
        check_layout(3, 1, pp=2)
    with pytest.raises(ValueError, match="straddle nodes"):
        check_layout(3, 2, pp=3)  # 6 ranks = 2 replicas of 3, but each node holds 2
    with pytest.raises(ValueError, match="not divisible"):
        _schedule([], nodes=1, nproc=3, pp=2)
    with pytest.raises(ValueError, match="at least 2 replicas"):
        generate(0, 0, nodes=2, nproc=2, max_steps=40, kinds=KINDS, pp=4)


def test_the_plain_layout_draws_what_it_drew_before_the_layouts_existed():
    # drawn by the generator before --tp/--pp/--dist-opt existed: old seeds still reproduce
    rank_faults = ("kill", "stop", "exception", "smp_kill")
    before = [
        (dict(seed=0, index=1, max_steps=30, kinds=rank_faults),  # the e2e rank-faults case
         "stop r0@start 0.7s, smp_kill n1@15 snap=1"),
        (dict(seed=101, index=5, max_steps=40, kinds=FAIL_STOP),  # README's soak (default)
         "coordinator_kill@start, coordinator_kill@3"),
        (dict(seed=11, index=3, max_steps=40, kinds=FAIL_STOP, store="etcd"),
         "cpu_hog@3 8.4s, smp_kill n1@7, agent_kill n1@22 snap=1 etcd"),
    ]  # fmt: skip
    for kw, drawn in before:
        plain = generate(kw.pop("seed"), kw.pop("index"), nodes=2, nproc=2, **kw)
        assert plain.describe() == drawn
        assert "--pp" not in plain.repro() and "--dist-opt" not in plain.repro()


def _rank_faults(p: Schedule):
    return [f for f in p.faults if f.rank is not None and f.at == "step"]


def test_pipeline_schedules_hit_whole_replicas():
    plans = schedules(9, 300, kinds=("kill", "stop", "exception"), pp=2, **LAYOUT)
    assert all(p.replica_size == 2 and p.num_replicas == 2 for p in plans)
    assert plans[0].repro().endswith("--pp 2") and " pp=2" in plans[0].describe()
    # both ranks of one replica (two stages) at one step: drawn, and one replica lost, not two
    together = [p for p in plans if any("another rank of replica" in f.why for f in p.faults)]
    assert together
    for p in together:
        f = next(f for f in p.faults if "another rank of replica" in f.why)
        peers = [g for g in _rank_faults(p) if g is not f and g.step == f.step]
        assert any(p.replica_of(g.rank) == p.replica_of(f.rank) != None for g in peers)  # noqa: E711
    assert {f.rank % 2 for p in plans for f in p.faults if f.rank is not None} == {0, 1}
    # one kill on each replica loses every replica: exit 8 without a snapshot (a TP 1 layout of
    # 4 replicas would keep two)
    two = [Fault(kind="kill", step=5, rank=1), Fault(kind="exception", step=5, rank=2)]
    assert sorted(_schedule(two, nodes=2, pp=2).acceptable_exits()) == [0, 8]
    assert sorted(_schedule(two, nodes=2).acceptable_exits()) == [0]
    same = [Fault(kind="kill", step=5, rank=2), Fault(kind="exception", step=5, rank=3)]
    assert sorted(_schedule(same, nodes=2, pp=2).acceptable_exits()) == [0]  # one replica


def test_distributed_optimizer_schedules_draw_both_holders_of_a_shard():
    # 2 nodes x 2 replicas: shard s on replica s and on the same place of the other node
    assert shard_partners(0, num_replicas=4, replicas_per_node=2) == [2]
    assert shard_partners(1, num_replicas=4, replicas_per_node=2) == [3]
    assert shard_partners(1, num_replicas=4, replicas_per_node=4) == [0, 2]  # one node: a ring
    plans = schedules(9, 300, kinds=("kill", "exception", "stop"), dist_opt=True, **LAYOUT)
    assert plans[0].repro().endswith("--dist-opt") and plans[0].describe().endswith("dist-opt")
    both = [p for p in plans if any("both holders" in f.why for f in p.faults)]
    assert both
    for p in both:
        f = next(f for f in p.faults if "both holders" in f.why)
        peers = {g.rank for g in _rank_faults(p) if g is not f and g.step == f.step}
        assert any(r + 2 == f.rank or r - 2 == f.rank for r in peers), p.describe()
    # snapshots more often than the plain layout's 30%: a rollback needs saved state
    snap = sum(p.snapshot_interval > 0 for p in plans) / len(plans)
    plain = schedules(9, 300, kinds=("kill", "exception", "stop"), **LAYOUT)
    assert snap > sum(p.snapshot_interval > 0 for p in plain) / len(plain) + 0.1
    # both holders lost at once, nothing saved: the job may abort (exit 8), never silently
    kills = [Fault(kind="kill", step=5, rank=0), Fault(kind="kill", step=5, rank=2)]
    assert sorted(_schedule(kills, nodes=2, dist_opt=True).acceptable_exits()) == [0, 8]
    assert sorted(_schedule(kills, nodes=2).acceptable_exits()) == [0]  # replicated: survives
    assert sorted(_schedule(kills, nodes=2, dist_opt=True, snapshot=1).acceptable_exits()) == [0]
    # one node's loss alone never takes both copies (they are on different nodes)
    node = [Fault(kind="node_loss", step=5, node=1)]
    assert sorted(_schedule(node, nodes=2, dist_opt=True).acceptable_exits()) == [0]


def test_acceptable_exits_follow_what_the_design_survives():
    both = [Fault(kind="kill", step=5, rank=0), Fault(kind="exception", step=7, rank=1)]
    assert sorted(_schedule(both).acceptable_exits()) == [0, 8]  # every replica may be lost
    assert sorted(_schedule(both, snapshot=1).acceptable_exits()) == [0]  # recovers in place
    short = [Fault(kind="kill", step=5, rank=0), Fault(kind="stop", step=7, rank=1, hold_s=1.0)]
    assert sorted(_schedule(short).acceptable_exits()) == [0]  # a short stop is not a death
    longer = [Fault(kind="kill", step=5, rank=0), Fault(kind="stop", step=7, rank=1, hold_s=5.0)]
    assert sorted(_schedule(longer).acceptable_exits()) == [0, 8]
    node = [Fault(kind="node_loss", step=5, node=1), Fault(kind="kill", step=9, rank=0)]
    assert 8 in _schedule(node, nodes=2, nproc=1).acceptable_exits()
    assert _schedule(node, nodes=2, nproc=1).agents_killed() == {1}
    assert sorted(_schedule([Fault(kind="coordinator_kill", step=3)]).acceptable_exits()) == [0]
    # the head node (node 0) starts the coordinator: losing it is losing the store
    head = [Fault(kind="node_loss", step=5, node=0)]
    assert sorted(_schedule(head, nodes=2).acceptable_exits()) == [6]
    assert sorted(
        _schedule([Fault(kind="node_loss", step=5, node=1)], nodes=2).acceptable_exits()
    ) == [0]
    agent = [Fault(kind="agent_kill", step=5, node=0)]
    assert sorted(_schedule(agent, nodes=2).acceptable_exits()) == [0, 6]


def test_on_etcd_no_node_is_the_head():
    def etcd(faults, nodes=2, nproc=2, snapshot=0):
        s = _schedule(faults, snapshot=snapshot, nodes=nodes, nproc=nproc)
        s.store = "etcd"
        return s

    head = [Fault(kind="head_node_loss", step=5)]
    assert sorted(_schedule(head, nodes=2).acceptable_exits()) == [6]  # tcp: node 0's store
    assert _schedule(head, nodes=2).agents_killed() == {0}
    assert sorted(etcd(head).acceptable_exits()) == [0]  # a candidate elsewhere is elected
    assert etcd(head).agents_killed() == set()  # the node elected then: known when it fires
    for kind in ("node_loss", "agent_kill"):
        assert sorted(etcd([Fault(kind=kind, step=5, node=0)]).acceptable_exits()) == [0]
    assert sorted(etcd([Fault(kind="etcd_kill", step=5, hold_s=3.0)]).acceptable_exits()) == [0]
    # a head loss plus a kill on the other node may lose every replica, whichever node leads
    both = head + [Fault(kind="kill", step=6, rank=0)]
    assert 8 in etcd(both, nproc=1).acceptable_exits()
    assert 8 not in etcd(both, nproc=1, snapshot=1).acceptable_exits()
    assert 8 not in etcd(head, nproc=1).acceptable_exits()


def test_fault_validation_and_inject_args():
    with pytest.raises(ValueError):
        Fault(kind="kill", at="step", rank=0)  # no step
    with pytest.raises(ValueError):
        Fault(kind="kill", at="start", step=3, rank=0)
    s = _schedule(
        [Fault(kind="exception", step=4, rank=1), Fault(kind="kill", at="rejoin", rank=0)]
    )
    assert s.inject_args() == ["--inject", "exception:1:4", "--inject", "kill:0:rejoin"]
    assert s.describe() == "exception r1@4, kill r0@rejoin"


# ---------------------------------------------------------------------------- run-dir checks


def _write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _good_run(tmp_path: Path, steps=6, replicas=2, micro=2) -> Path:
    run = tmp_path / "run"
    metrics = [
        {"step": s, "loss": 6.0 - s / 10, "global_microbatches": replicas * micro}
        for s in range(steps)
    ]
    _write_jsonl(run / "metrics.jsonl", metrics)
    for r in range(replicas):
        rows = [
            {"step": s, "replica": r, "inc": 0, "tasks": [[r, m, 0] for m in range(micro)]}
            for s in range(steps)
        ]
        _write_jsonl(run / "audit" / f"tasks_rank{r}.jsonl", rows)
        digest = {"next_step": steps, "model": "aa", "optimizer": "bb"}
        (run / "audit" / f"state_rank{r}.json").write_text(json.dumps(digest))
    events = [
        {"type": "failure", "step": 2, "dp_rank": 1, "time_s": 1.0, "ranks": [1]},
        {"type": "rejoin", "step": 3, "dp_rank": 1, "time_s": 2.0, "ranks": [1]},
    ]
    _write_jsonl(run / "events.jsonl", events)
    summary = job_wide(  # as the leader writes it
        {"stopped_at": None, "failover": {"regroups": 2}},
        run / "metrics.jsonl",
        start_step=0,
        expected_microbatches=replicas * micro,
        events=events,
        events_seq=len(events),
    )
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_a_clean_run_passes_every_check(tmp_path):
    run = _good_run(tmp_path)
    assert checks.check_metrics(run, 6) == []
    assert checks.check_audit(run, 6, 2, 2) == []
    assert checks.check_digests(run, 6, required={0, 1}) == []
    assert checks.check_summary(run) == []
    assert checks.check_exits({0: 0, 1: 0}, {0: "finished"}) == []
    assert checks.check_abort_reason(run, {0: 0}) == []


def test_a_duplicated_or_missing_step_in_metrics_is_reported(tmp_path):
    run = _good_run(tmp_path)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    _write_jsonl(run / "metrics.jsonl", rows[:4] + [rows[3]] + rows[4:])
    (v,) = checks.check_metrics(run, 6)
    assert "more than once: 3" in v
    _write_jsonl(run / "metrics.jsonl", rows[:2] + rows[3:])
    (v,) = checks.check_metrics(run, 6)
    assert "never logged: 2" in v
    assert checks.check_metrics(run, 6, complete=False) == []  # an aborted job ends early
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "loss"\n')
    assert any("not JSON" in v for v in checks.check_metrics(run, 6, complete=False))
    assert checks.check_metrics(tmp_path / "nowhere", 6) == ["metrics.jsonl is missing"]


def test_a_missing_or_doubled_micro_batch_in_the_audit_is_reported(tmp_path):
    run = _good_run(tmp_path)
    path = run / "audit" / "tasks_rank1.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows[4]["tasks"] = rows[4]["tasks"][:1]  # step 4, replica 1, micro-batch 1 never committed
    _write_jsonl(path, rows)
    (v,) = checks.check_audit(run, 6, 2, 2)
    assert "1 micro-batch(es) never committed: (4, 1, 1)" in v
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows[4]["tasks"] = [[1, 0, 0], [1, 1, 0]]
    rows.insert(3, dict(rows[2]))  # step 2 committed twice by the same incarnation
    _write_jsonl(path, rows)
    (v,) = checks.check_audit(run, 6, 2, 2)
    assert "committed more than once: (2, 1, 0), (2, 1, 1)" in v
    # the same repeat is no rollback: a recovery only discards an earlier incarnation's rows
    assert checks.check_audit(run, 6, 2, 2, rolled_back=True) != []


def test_a_rank_that_died_right_after_a_commit_leaves_a_gap_not_a_violation(tmp_path):
    run = _good_run(tmp_path)  # replica 1 fails at step 2 (events)
    path = run / "audit" / "tasks_rank1.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    _write_jsonl(path, rows[:1] + rows[2:])  # step 1 committed (metrics: 4 of 4), not logged
    gaps: list[str] = []
    assert checks.check_audit(run, 6, 2, 2, gaps=gaps) == []
    (gap,) = gaps
    assert "(1, 1, 0), (1, 1, 1) committed (metrics: 4 of 4" in gap and "failed at step 2" in gap
    _write_jsonl(path, rows[:4] + rows[5:])  # step 4: no failure follows: a real loss
    (v,) = checks.check_audit(run, 6, 2, 2, gaps=gaps)
    assert "never committed: (4, 1, 0), (4, 1, 1)" in v
    _write_jsonl(path, rows[:1] + rows[2:])
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    metrics[1]["global_microbatches"] = 2  # the step reduced only half the batch
    _write_jsonl(run / "metrics.jsonl", metrics)
    (v,) = checks.check_audit(run, 6, 2, 2, gaps=gaps)
    assert "never committed: (1, 1, 0), (1, 1, 1)" in v


def test_rows_logged_before_the_vote_count_only_for_the_committed_attempt(tmp_path):
    run = _good_run(tmp_path)  # replica 1 fails at step 2 (events)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # step 2's attempt 0 of generation 1 aborted; generation 2 redid it
        m.update(generation=2 if m["step"] >= 2 else 1, attempt=0)
    _write_jsonl(run / "metrics.jsonl", metrics)
    for r in range(2):
        path = run / "audit" / f"tasks_rank{r}.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        for row in rows:
            row.update(gen=2 if row["step"] >= 2 else 1, attempt=0)
        aborted = {**rows[2], "gen": 1}  # logged before a vote that aborted
        _write_jsonl(path, rows[:2] + [aborted] + rows[2:])
    assert checks.check_audit(run, 6, 2, 2) == []
    path = run / "audit" / "tasks_rank1.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    _write_jsonl(path, rows[:1] + rows[2:])  # step 1 missing: audited before the vote, no excuse
    gaps: list[str] = []
    (v,) = checks.check_audit(run, 6, 2, 2, gaps=gaps)
    assert "never committed: (1, 1, 0), (1, 1, 1)" in v and gaps == []


def test_rows_a_recovery_rolled_back_are_not_double_commits(tmp_path):
    run = _good_run(tmp_path)
    for r in range(2):  # both replicas lost after committing step 4; recovered from step 3
        path = run / "audit" / f"tasks_rank{r}.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        redo = [{**row, "inc": 1} for row in rows[3:]]
        _write_jsonl(path, rows[:5] + redo)
    assert any("more than once" in v for v in checks.check_audit(run, 6, 2, 2))
    assert checks.check_audit(run, 6, 2, 2, rolled_back=True) == []
    # a rollback (both holders of an optimizer shard lost) goes back like a recovery does
    assert checks.went_back([{"type": "rollback", "step": 3}])
    assert checks.went_back([{"type": "recovery", "step": 3}])
    assert not checks.went_back([{"type": "failure", "step": 3}, {"type": "rejoin", "step": 5}])


def test_unequal_digests_and_a_missing_survivor_digest_are_reported(tmp_path):
    run = _good_run(tmp_path)
    (run / "audit" / "state_rank1.json").write_text(
        json.dumps({"next_step": 6, "model": "aa", "optimizer": "cc"})
    )
    (v,) = checks.check_digests(run, 6)
    assert "optimizer states differ" in v
    (run / "audit" / "state_rank1.json").unlink()
    assert checks.check_digests(run, 6, required={0}) == []  # rank 1 died: no digest is fine
    (v,) = checks.check_digests(run, 6, required={0, 1})
    assert "rank(s) [1] never failed but wrote no final state digest" in v
    (v,) = checks.check_digests(run, 7, required={0})
    assert "not at step 7" in v


def _digests(run: Path, rows: dict[int, dict]) -> None:
    for path in (run / "audit").glob("state_rank*.json"):
        path.unlink()
    for rank, row in rows.items():
        (run / "audit" / f"state_rank{rank}.json").write_text(json.dumps({"next_step": 6, **row}))


def test_digests_are_compared_per_stage_and_tp_position(tmp_path):
    run = _good_run(tmp_path)
    # TP 1 x PP 2, 2 replicas: ranks 0 and 2 hold stage 0, ranks 1 and 3 stage 1
    stage = {0: {"model": "s0", "optimizer": "o0"}, 1: {"model": "s1", "optimizer": "o1"}}
    _digests(run, {r: stage[r % 2] for r in range(4)})
    assert checks.check_digests(run, 6, replica_size=2, required=range(4)) == []
    wrong = checks.check_digests(run, 6, replica_size=1, required=range(4))  # one group of 4
    assert any("model states differ (position 0)" in v for v in wrong), wrong
    _digests(run, {**{r: stage[r % 2] for r in range(4)}, 3: stage[0]})  # stage 1 of replica 1
    found = checks.check_digests(run, 6, replica_size=2, required=range(4))
    assert any("model states differ (position 1): {1: 's1', 3: 's0'}" in v for v in found), found
    assert not any("(position 0)" in v for v in found), found
    # TP 2 x PP 2: position = rank % 4, so ranks 1 and 5 must agree, 1 and 3 need not
    rows = {r: {"model": f"p{r % 4}", "optimizer": "o"} for r in range(8)}
    _digests(run, rows)
    assert checks.check_digests(run, 6, replica_size=4, required=range(8)) == []
    _digests(run, {**rows, 5: {"model": "p3", "optimizer": "o"}})
    (v,) = checks.check_digests(run, 6, replica_size=4, required=range(8))
    assert "(position 1)" in v


def test_holders_of_an_optimizer_shard_must_agree_and_every_shard_be_held(tmp_path):
    run = _good_run(tmp_path)
    # 4 replicas of one rank, each shard on two of them
    held = {0: {"0": "a", "3": "d"}, 1: {"1": "b", "0": "a"}, 2: {"2": "c", "1": "b"}}
    held[3] = {"3": "d", "2": "c"}
    rows = {r: {"model": "m", "optimizer": "o", "shards": held[r]} for r in range(4)}
    _digests(run, rows)
    assert checks.check_digests(run, 6, required=range(4), num_shards=4) == []
    rows[2]["shards"] = {"2": "c", "1": "B"}  # replica 2's copy of shard 1 is not exact
    _digests(run, rows)
    (v,) = checks.check_digests(run, 6, required=range(4), num_shards=4)
    assert "holders of optimizer shard 1 differ" in v
    rows[2]["shards"] = {"1": "b"}
    rows[3]["shards"] = {"3": "d"}  # shard 2 held by nobody
    _digests(run, rows)
    (v,) = checks.check_digests(run, 6, required=range(4), num_shards=4)
    assert "optimizer shard 2 (position 0) held by no rank" in v
    assert checks.check_digests(run, 6, required=range(4)) == []  # not a sharded run


def test_a_summary_that_disagrees_with_events_or_metrics_is_reported(tmp_path):
    run = _good_run(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    bad = {**summary, "steps": 4, "failover": {**summary["failover"], "failures": 0}}
    (run / "summary.json").write_text(json.dumps(bad))
    found = checks.check_summary(run)
    assert any("steps 4 but metrics.jsonl has 6" in v for v in found), found
    assert any("failover.failures = 0 but events.jsonl has 1" in v for v in found), found
    bad = {**summary, "final_loss": 1.0, "failover": {**summary["failover"], "samples_lost": 8}}
    (run / "summary.json").write_text(json.dumps(bad))
    found = checks.check_summary(run)
    assert any("final_loss 1.0" in v for v in found) and any("samples_lost = 8" in v for v in found)
    (run / "summary.json").unlink()
    assert "missing" in checks.check_summary(run)[0]


def test_exit_codes_outside_the_schedules_acceptable_set_are_reported(tmp_path):
    ok = {0: "finished"}
    (v,) = checks.check_exits({0: 0, 1: 6}, ok)
    assert "node 1's agent exited 6 (COORDINATOR_LOST)" in v
    assert checks.check_exits({0: 8, 1: 8}, {**ok, 8: "every replica lost"}) == []
    assert "did not exit" in checks.check_exits({0: None}, ok)[0]
    run = _good_run(tmp_path)
    (v,) = checks.check_abort_reason(run, {0: 8})  # an 8 needs the every-replica-lost abort
    assert "without an every-replica-lost abort event" in v
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"type": "abort", "detail": "every replica is lost and ..."}) + "\n")
    assert checks.check_abort_reason(run, {0: 8}) == []


# ---------------------------------------------------------------------------- leftovers


def test_a_leftover_process_of_the_job_is_found_and_killed():
    tag = f"unit-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, checks.TAG_ENV: tag}
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    other = subprocess.Popen(  # another job's process is not ours
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, checks.TAG_ENV: tag + "x"},
    )
    try:
        deadline = time.monotonic() + 20
        found = []
        while not found and time.monotonic() < deadline:
            found = checks.tagged_processes(tag)
            time.sleep(0.05)
        assert [p.pid for p in found] == [mine.pid]
        assert found[0].ppid == os.getpid()
        (v,) = checks.check_leftovers(found)
        assert f"leftover process pid {mine.pid}" in v and "time.sleep(60)" in v
        checks.kill_processes(found)
        assert mine.wait(timeout=10) == -9
        assert checks.tagged_processes(tag) == []  # reaped: gone; a zombie has no environment
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


def test_leftover_shared_memory_is_reported(tmp_path):
    folder = tmp_path / "mecefo-0123456789ab"
    assert checks.check_shm(folder) == [] and checks.check_shm(None) == []
    (folder / "node0000").mkdir(parents=True)
    (folder / "node0000" / "rank00000.slot0").write_bytes(b"x")
    (v,) = checks.check_shm(folder)
    assert "leftover shared memory" in v and "rank00000.slot0" in v


def test_silent_kinds_are_trainer_side_injections():
    plans = schedules(3, 12, kinds=("nan", "bitflip"), **LAYOUT)
    faults = [f for p in plans for f in p.faults]
    assert {f.kind for f in faults} == {"nan", "bitflip"}
    for f in faults:
        assert f.by_trainer and f.at == "step" and f.rank is not None
        assert f.inject_arg() == f"{f.kind}:{f.rank}:{f.step}"
    assert not set(FAIL_STOP) & {"nan", "bitflip"}  # the default draws what it drew before


def test_spikes_come_after_the_warm_up_and_slow_ranks_say_how_slow():
    from megatron_mecefo.config.anomaly import AnomalyConfig
    from megatron_mecefo.testing.inject import parse_inject
    from tools.chaos.schedule import SPIKE_WARMUP

    assert SPIKE_WARMUP == AnomalyConfig().spike_warmup
    plans = schedules(5, 12, kinds=("spike", "slow"), **LAYOUT)
    faults = [f for p in plans for f in p.faults]
    assert {f.kind for f in faults} == {"spike", "slow"}
    for f in faults:
        spec = parse_inject(f.inject_arg())  # the trainer accepts it
        assert (spec.kind, spec.rank, spec.step) == (f.kind, f.rank, f.step)
        if f.kind == "spike":
            assert f.step >= SPIKE_WARMUP, f
        else:
            assert spec.factor == 2.0
    assert not set(FAIL_STOP) & {"spike", "slow"}


def test_data_and_persistent_nan_kinds_inject_their_mode_and_an_evicted_node_may_exit_11():
    from megatron_mecefo.testing.inject import parse_inject

    plans = schedules(4, 12, kinds=("nan_data", "nan_persistent"), **LAYOUT)
    faults = [f for p in plans for f in p.faults]
    assert {f.kind for f in faults} == {"nan_data", "nan_persistent"}
    for f in faults:
        spec = parse_inject(f.inject_arg())
        assert (spec.kind, spec.rank, spec.step, spec.mode) == (
            "nan",
            f.rank,
            f.step,
            f.kind.removeprefix("nan_"),
        )
        assert f.evicts == (f.kind == "nan_persistent")
    one = _schedule([Fault(kind="nan_persistent", step=3, rank=1)], nodes=2, nproc=2)
    assert int(ExitCode.EVICTED) not in one.acceptable_exits()  # node 0 keeps rank 0
    assert not one.may_lose_every_replica()
    both = _schedule(
        [
            Fault(kind="nan_persistent", step=3, rank=0),
            Fault(kind="nan_persistent", step=5, rank=1),
        ],
        nodes=2,
        nproc=2,
    )
    assert "exits 11" in both.acceptable_exits()[int(ExitCode.EVICTED)]
    killed = _schedule(
        [Fault(kind="nan_persistent", step=3, rank=0), Fault(kind="kill", step=5, rank=1)]
    )  # one node of 2 ranks: an eviction and a kill may leave no replica
    assert killed.may_lose_every_replica()
