"""Silent numerical faults with real processes (`training/anomaly.py`, `failover/trainer/rerun.py`):
one `mecefo-launch` job of 4 ranks meets, in turn, a transient NaN (one attempt of one rank), a
transient loss spike, bad data (a replica's micro-batches are NaN wherever they are computed), bad
data that spikes the loss, and a faulty device (one rank's outputs NaN from a step on). Each is
voted down before the update, rerun inside the job and classified: transient -> the step is redone
and the curve equals a failure-free run's (one reference run for the module); data -> the
micro-batches are skipped and named; persistent -> the rank is evicted (exit 11, never restarted)
and the survivors finish the job. No NaN reaches a parameter: the losses stay finite and the
surviving replicas end bitwise equal. The spike window is warm after 3 steps here (20 by
default) so that a short job can meet spikes; the thresholds are the defaults."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from megatron_mecefo.errors import ExitCode
from tests.helpers.launch import launch
from tools.chaos import checks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 15
PIN = ("mecefo.takeover_policy=spread", "mecefo.takeover_granularity=sample")
SPIKES = ("anomaly.spike_warmup=3",)
"""Every run ends inside the demo's 30 warm-up steps, so their learning rates agree step by step
whatever their length."""
REF_STEPS = 12


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory, demo_data_dir):
    """One failure-free reference for both tests."""
    ref = launch(
        tmp_path_factory.mktemp("ref"), demo_data_dir, steps=REF_STEPS, overrides=PIN, name="ref"
    )
    assert ref.returncode == 0, ref.explain()
    return ref.metrics()


def test_transient_data_and_persistent_faults_are_rerun_classified_and_healed(
    tmp_path, demo_data_dir, failure_free
):
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=STEPS,
        inject=("nan:1:3", "spike:0:4", "nan:2:6:data", "spike:1:8:data", "nan:3:10:persistent"),
        overrides=PIN + SPIKES,
    )
    assert res.returncode == ExitCode.OK, res.explain()
    rows = res.metrics()
    assert [r["step"] for r in rows] == list(range(STEPS)), res.explain()
    assert all(math.isfinite(float(r["loss"])) for r in rows), [r["loss"] for r in rows]
    # transient: steps 3 and 4 redone on the same members, so 0-5 equal the failure-free run
    for got, want in zip(rows[:6], failure_free[:6], strict=True):
        assert got["loss"] == want["loss"], (got["step"], got["loss"], want["loss"])
    events = res.events()
    kinds = [(e["type"], e.get("kind"), e["step"], e.get("dp_rank")) for e in events]
    classified = [k for k in kinds if k[0] == "classified"]
    assert classified == [
        ("classified", "transient", 3, 1),
        ("classified", "transient", 4, 0),
        ("classified", "data", 6, 2),
        ("classified", "data", 8, 1),
        ("classified", "persistent", 10, 3),
    ], kinds
    assert ("anomaly", None, 3, 1) in kinds and ("rerun", None, 3, 1) in kinds
    assert ("evicted", None, 10, 3) in kinds
    details = {e["step"]: e["detail"] for e in events if e["type"] == "anomaly"}
    assert details[4].startswith("loss spike ") and "x median" in details[4], details
    assert details[3] == "gradient NaN/Inf", details  # found in the reducer, before the loss
    nan_data, spike_data = (e for e in events if e.get("kind") == "data")
    assert nan_data["microbatches"] == [[2, 0], [2, 1]] and len(nan_data["samples"]) == 8  # M 2
    assert spike_data["microbatches"] == [[1, 0], [1, 1]]
    assert spike_data["detail"].startswith("loss spike")
    assert set(spike_data["samples"]).isdisjoint(nan_data["samples"])
    # the skipped samples are not trained on: 6 of 8 micro-batches at steps 6 and 8
    assert [r["global_microbatches"] for r in rows[5:10]] == [8, 6, 8, 6, 8]
    assert max(float(r["loss"]) for r in rows) < rows[0]["loss"] + 0.5  # no spike committed
    # the evicted rank is not restarted; the others take its micro-batches over
    assert "rank 3 was evicted for a persistent NaN/Inf; not restarting it" in res.output
    assert rows[-1]["replicas_alive"] == 3 and rows[-1]["global_microbatches"] == 8
    summary = res.summary()["failover"]
    assert (summary["anomalies"], summary["classified"], summary["evictions"]) == (
        sum(k[0] == "anomaly" for k in kinds),
        5,
        1,
    )
    violations = (
        checks.check_metrics(res.run_dir, STEPS)
        + checks.check_digests(res.run_dir, STEPS, required=range(3))
        + checks.check_summary(res.run_dir)
    )
    assert violations == [], violations
    assert json.loads((res.run_dir / "summary.json").read_text())["steps"] == STEPS


@pytest.mark.parametrize("nproc", [4, 2], ids=["majority", "two-replicas"])
def test_a_flipped_bit_is_caught_by_the_fingerprint_and_healed_from_a_peer(
    tmp_path, demo_data_dir, failure_free, nproc
):
    """bitflip:1:4 flips one bit of one parameter of replica 1 before step 4. The state
    fingerprints in step 4's vote disagree: the step is not committed anywhere, replica 1 is
    named, leaves (exit 7) and rejoins with a healthy peer's state; once a step commits with it
    back, `healed`. With 4 replicas the majority names it (3 against 1); with 2 there is no
    majority, and it is named because its state no longer equals its own fingerprint after its
    last update, while its peer's does. At the end every replica holds the same state, bit for
    bit, and (4 replicas) the curve equals a failure-free run's."""
    steps = REF_STEPS
    res = launch(
        tmp_path,
        demo_data_dir,
        nproc=nproc,
        steps=steps,
        inject=("bitflip:1:4",),
        overrides=PIN,
        until_rejoined=True,
    )
    assert res.returncode == ExitCode.PREEMPTED, res.explain()  # stopped once rank 1 was back
    rows = res.metrics()
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) >= steps
    if nproc == 4:
        for got, want in zip(rows[:steps], failure_free, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=2e-5, abs=1e-6), got["step"]
    kinds = [(e["type"], e.get("kind"), e["step"], e.get("dp_rank")) for e in res.events()]
    assert ("classified", "corruption", 4, 1) in kinds, kinds
    order = [k[0] for k in kinds if k[0] in ("classified", "failure", "rejoin", "healed")]
    assert order == ["classified", "failure", "rejoin", "healed"], kinds
    assert not any(k[0] == "evicted" for k in kinds)
    violations = (
        checks.check_metrics(res.run_dir, len(rows))
        + checks.check_digests(res.run_dir, len(rows), required=range(nproc))
        + checks.check_summary(res.run_dir)
    )
    assert violations == [], violations


def test_a_straggler_gets_a_smaller_share_until_its_compute_time_is_the_others(
    tmp_path, demo_data_dir, failure_free
):
    """slow:2:3:2 makes rank 2 compute three times as slowly from step 2 on (a busy loop: on
    CPU the compute clock is the thread's CPU time, so the other processes sharing the 2 cores
    do not blur it). Its pace (median compute time of 3 steps) is shared at step 5's vote: every
    member sees replica 2 at about 3x the others' and gives it a smaller share from step 6 on
    (`rebalanced`); later comparisons adjust its weight while its compute time is off the
    others'. The global batch is unchanged (every sample once, exact tasks), so the curve is the
    failure-free one up to the order of summation. The job's wall step time is not asserted: 4
    ranks on 2 cores share them, so it measures the machine (`tools/bench/straggler.py` does).

    Margins, from CI runs on a loaded machine: a healthy replica's compute time on this tiny
    model swings 0.04-0.09 s from step to step, so a 2x slowdown with the default factor 1.3 let
    a healthy replica's median of 3 cross the mark once, and a 6-step median after the
    rebalance read 1.31. With 3x, factor 1.5 (the band 1.25) and 12 steps, a broken rebalance
    (none: ~3x; a weight that never follows: ~1.5x at best) still fails by a wide margin."""
    steps = 24
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=steps,
        inject=("slow:2:3:2",),
        overrides=(*PIN, "straggler.interval=5", "straggler.window=3", "straggler.factor=1.5"),
    )
    assert res.returncode == ExitCode.OK, res.explain()
    rows = res.metrics()
    assert [r["step"] for r in rows] == list(range(steps)), res.explain()
    for got, want in zip(rows, failure_free, strict=False):
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-5, abs=1e-6), got["step"]
    rebalanced = [e for e in res.events() if e["type"] == "rebalanced"]
    assert [(e["step"], e["dp_rank"]) for e in rebalanced][:1] == [(6, 2)], rebalanced
    assert all(e["dp_rank"] == 2 for e in rebalanced), rebalanced  # nobody else, never undone
    shares, compute = {}, {}
    for row in res.task_rows():
        n = sum((t[4] - t[3]) if len(t) >= 5 else row["micro_batch_size"] for t in row["tasks"])
        shares.setdefault(row["step"], {})[row["replica"]] = n
        compute.setdefault(row["replica"], {})[row["step"]] = row["compute_s"]
    assert all(shares[s] == {0: 8, 1: 8, 2: 8, 3: 8} for s in range(6)), shares
    later = [shares[s] for s in range(6, steps)]
    assert all(s[2] <= 5 and sum(s.values()) == 32 for s in later), later  # 32 / 3.33 ~ 3.2

    def ratio(steps_):  # the straggler's compute time over the others' median
        mine = statistics.median(compute[2][s] for s in steps_)
        others = statistics.median(compute[r][s] for r in (0, 1, 3) for s in steps_)
        return mine / others

    before, after = ratio(range(2, 6)), ratio(range(steps - 12, steps))
    assert before > 2.2 and after < 1.35, (before, after, compute)
    violations = (
        checks.check_metrics(res.run_dir, steps)
        + checks.check_digests(res.run_dir, steps, required=range(4))
        + checks.check_summary(res.run_dir)
    )
    assert violations == [], violations
    assert res.summary()["failover"]["rebalanced"] == len(rebalanced)


def test_with_pipeline_stages_spikes_are_classified_and_a_straggler_gets_whole_micro_batches(
    tmp_path, demo_data_dir
):
    """PP 2 x DP 2 (a replica is two stages; only the last stage has losses, each stage its own
    gradient norm): slow:3:2:2 slows replica 1's last stage from step 2; spike:1:8 spikes replica
    0's outputs once; spike:2:11:data marks replica 1's step-11 data bad; nan:3:14:persistent
    makes replica 1's last stage NaN for good. The straggler's share drops in whole micro-batches
    (a slice cannot cross stages: sample slices once crashed both replicas here); the spikes are
    classified transient and data; the faulty replica leaves whole (both stages) and the other
    finishes the job with every stage's replicas equal up to then."""
    steps = 18
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=steps,
        inject=("slow:3:2:2", "spike:1:8", "spike:2:11:data", "nan:3:14:persistent"),
        overrides=(
            *SPIKES,
            "parallel.pipeline_model_parallel_size=2",
            "training.num_microbatches=4",
            "straggler.interval=5",
            "straggler.window=3",
        ),
    )
    assert res.returncode == ExitCode.OK, res.explain()
    rows = res.metrics()
    kinds = [(e["type"], e.get("kind"), e["step"], e.get("dp_rank")) for e in res.events()]
    classified = [k[1:] for k in kinds if k[0] == "classified"]
    # replica 1's bad data runs on both members (replica 0 computes a share of it), so both
    # flag it: data, classified by each
    assert classified[0] == ("transient", 8, 0) and classified[-1] == ("persistent", 14, 1), kinds
    assert sorted(classified[1:-1]) == [("data", 11, 0), ("data", 11, 1)], kinds
    skipped = sorted(
        tuple(p) for e in res.events() if e.get("kind") == "data" for p in e["microbatches"]
    )  # replica 1's micro-batches, wherever they ran, and none of replica 0's
    assert skipped == [(1, i) for i in range(4)], skipped
    assert ("evicted", None, 14, 1) in kinds
    assert "rank 3 was evicted for a persistent NaN/Inf; not restarting it" in res.output
    assert rows[-1]["replicas_alive"] == 1 and rows[-1]["global_microbatches"] == 8
    assert max(float(r["loss"]) for r in rows) < rows[0]["loss"] + 0.5  # no spike committed
    assert [r["global_microbatches"] for r in rows[10:13]] == [8, 4, 8]  # step 11's data skipped
    rebalanced = [k for k in kinds if k[0] == "rebalanced"]
    assert rebalanced and rebalanced[0][2:] == (6, 1), kinds
    shares: dict[int, dict[int, int]] = {}
    for row in res.task_rows():
        assert all(len(t) == 3 for t in row["tasks"]), row  # whole micro-batches, no slice
        shares.setdefault(row["step"], {})[row["replica"]] = len(row["tasks"])
    assert all(shares[s] == {0: 4, 1: 4} for s in range(6)), shares
    assert all(shares[s][1] < 4 and sum(shares[s].values()) == 8 for s in range(6, 14)), shares
    violations = (
        checks.check_metrics(res.run_dir, steps)
        + checks.check_digests(res.run_dir, steps, replica_size=2, required=range(2))
        + checks.check_summary(res.run_dir)
    )
    assert violations == [], violations
