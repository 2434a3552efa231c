"""Silent numerical faults with real processes (`training/anomaly.py`, `failover/trainer/rerun.py`):
one `mecefo-launch` job of 4 ranks meets, in turn, a transient NaN (one attempt of one rank), bad
data (a replica's micro-batches are NaN wherever they are computed) and a faulty device (one
rank's outputs NaN from a step on). Each is voted down before the update, rerun inside the job and
classified: transient -> the step is redone and the curve equals a failure-free run's (one
reference run for the module); data -> the
micro-batches are skipped and named; persistent -> the rank is evicted (exit 11, never restarted)
and the survivors finish the job. No NaN reaches a parameter: the losses stay finite and the
surviving replicas end bitwise equal."""

from __future__ import annotations

import json
import math

import pytest

from megatron_mecefo.errors import ExitCode
from tests.helpers.launch import launch
from tools.chaos import checks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 14
PIN = ("mecefo.takeover_policy=spread", "mecefo.takeover_granularity=sample")
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


def test_transient_data_and_persistent_nan_are_rerun_classified_and_healed(
    tmp_path, demo_data_dir, failure_free
):
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=STEPS,
        inject=("nan:1:3", "nan:2:6:data", "nan:3:9:persistent"),
        overrides=PIN,
    )
    assert res.returncode == ExitCode.OK, res.explain()
    rows = res.metrics()
    assert [r["step"] for r in rows] == list(range(STEPS)), res.explain()
    assert all(math.isfinite(float(r["loss"])) for r in rows), [r["loss"] for r in rows]
    # transient: step 3 redone on the same members, so steps 0-5 equal the failure-free run
    for got, want in zip(rows[:6], failure_free[:6], strict=True):
        assert got["loss"] == want["loss"], (got["step"], got["loss"], want["loss"])
    events = res.events()
    kinds = [(e["type"], e.get("kind"), e["step"], e.get("dp_rank")) for e in events]
    classified = [k for k in kinds if k[0] == "classified"]
    assert classified == [
        ("classified", "transient", 3, 1),
        ("classified", "data", 6, 2),
        ("classified", "persistent", 9, 3),
    ], kinds
    assert ("anomaly", None, 3, 1) in kinds and ("rerun", None, 3, 1) in kinds
    assert ("evicted", None, 9, 3) in kinds
    data = next(e for e in events if e.get("kind") == "data")
    assert data["microbatches"] == [0, 1] and len(data["samples"]) == 8  # M = 2, mbs = 4
    # the skipped samples are not trained on: 6 of 8 micro-batches at step 6, 8 elsewhere
    assert [r["global_microbatches"] for r in rows[5:8]] == [8, 6, 8]
    # the evicted rank is not restarted; the others take its micro-batches over
    assert "rank 3 was evicted for a persistent NaN/Inf; not restarting it" in res.output
    assert rows[-1]["replicas_alive"] == 3 and rows[-1]["global_microbatches"] == 8
    summary = res.summary()["failover"]
    assert (summary["anomalies"], summary["classified"], summary["evictions"]) == (
        sum(k[0] == "anomaly" for k in kinds),
        3,
        1,
    )
    violations = (
        checks.check_metrics(res.run_dir, STEPS)
        + checks.check_digests(res.run_dir, STEPS, required=range(3))
        + checks.check_summary(res.run_dir)
    )
    assert violations == [], violations
    assert json.loads((res.run_dir / "summary.json").read_text())["steps"] == STEPS


def test_a_flipped_bit_is_caught_by_the_fingerprint_and_healed_from_a_peer(
    tmp_path, demo_data_dir, failure_free
):
    """bitflip:2:4 flips one bit of one parameter of replica 2 before step 4. The state
    fingerprints in step 4's vote disagree (3 against 1): the step is not committed anywhere,
    replica 2 is named, leaves (exit 7) and rejoins with a healthy peer's state; once a step
    commits with it back, `healed`. At the end every replica holds the same state, bit for bit,
    and the curve equals a failure-free run's."""
    steps = REF_STEPS
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=steps,
        inject=("bitflip:2:4",),
        overrides=PIN,
        until_rejoined=True,
    )
    assert res.returncode == ExitCode.PREEMPTED, res.explain()  # stopped once rank 2 was back
    rows = res.metrics()
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) >= steps
    for got, want in zip(rows[:steps], failure_free, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-5, abs=1e-6), got["step"]
    kinds = [(e["type"], e.get("kind"), e["step"], e.get("dp_rank")) for e in res.events()]
    assert ("classified", "corruption", 4, 2) in kinds, kinds
    order = [k[0] for k in kinds if k[0] in ("classified", "failure", "rejoin", "healed")]
    assert order == ["classified", "failure", "rejoin", "healed"], kinds
    assert not any(k[0] == "evicted" for k in kinds)
    violations = (
        checks.check_metrics(res.run_dir, len(rows))
        + checks.check_digests(res.run_dir, len(rows), required=range(4))
        + checks.check_summary(res.run_dir)
    )
    assert violations == [], violations
