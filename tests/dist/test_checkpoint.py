"""Disk checkpoints with megatron dist_checkpointing, end to end through the real CLI: an
interrupted-and-resumed run equals the uninterrupted one bit for bit; a corrupt or uncommitted
newest checkpoint is skipped for the previous valid one; a different DP size resumes; and under
failover, losing every replica at once is no longer the end of the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import run_train as _train
from tests.helpers.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]
DROPOUT = "model.hidden_dropout=0.1"  # so the losses depend on the restored RNG states too


def _losses(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows], [r["loss"] for r in rows]


def _straight(tmp_path_factory, demo_data_dir, *extra):
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = _train(run, demo_data_dir, 12, "training.num_microbatches=4", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(run)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, demo_data_dir):
    return _straight(tmp_path_factory, demo_data_dir, DROPOUT)


def test_resume_equals_the_uninterrupted_run(tmp_path, demo_data_dir, straight):
    run = tmp_path / "run"
    ck = ("checkpoint.interval=4", "checkpoint.keep_latest=3", "training.num_microbatches=4")
    ck += (DROPOUT,)
    first = _train(run, demo_data_dir, 8, *ck)
    assert first.returncode == 0, first.stderr[-3000:]
    # a crash after step 8 logged two more steps that the resumed run will redo
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 8, "loss": 0.0}) + "\n" + json.dumps({"step": 9}) + "\n")
    second = _train(run, demo_data_dir, 12, *ck)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step_00000008 at step 8" in second.stdout
    steps, losses = _losses(run)
    assert steps == list(range(12))
    assert losses == straight[1]  # bit for bit: model, optimizer, RNG and data position
    summary = json.loads((run / "summary.json").read_text())
    assert summary["checkpoint"]["saved_steps"] == [12]
    assert summary["checkpoint"]["resumed"]["next_step"] == 8


def test_corrupt_newest_falls_back_to_the_previous_one(tmp_path, demo_data_dir, straight):
    run = tmp_path / "run"
    ck = ("checkpoint.interval=4", "checkpoint.keep_latest=3", "training.num_microbatches=4")
    ck += (DROPOUT,)
    first = _train(run, demo_data_dir, 8, *ck)
    assert first.returncode == 0, first.stderr[-3000:]
    shard = sorted((run / "checkpoints" / "step_00000008").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    second = _train(run, demo_data_dir, 12, *ck)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "fails its checksum" in second.stdout
    assert "step_00000004 at step 4" in second.stdout
    assert _losses(run)[1] == straight[1]


def test_named_checkpoint_that_is_invalid_is_a_clean_error(tmp_path, demo_data_dir):
    bad = tmp_path / "step_00000004"
    bad.mkdir()
    proc = _train(tmp_path / "run", demo_data_dir, 8, f"checkpoint.resume={bad}")
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert proc.returncode == 5 and len(errors) == 1, proc.stderr[-2000:]
    assert "never completed" in errors[0] and "Traceback" not in proc.stderr


def test_resume_under_another_dp_size(tmp_path, tmp_path_factory, demo_data_dir):
    # world 1 with 4 micro-batches, then DP=2 with 2 each: the same global batch (no dropout:
    # its masks depend on the layout)
    straight = _straight(tmp_path_factory, demo_data_dir)
    run = tmp_path / "run"
    first = _train(run, demo_data_dir, 6, "checkpoint.interval=6", "training.num_microbatches=4")
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(run, demo_data_dir, 12, "checkpoint.interval=6", nproc=2)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    steps, losses = _losses(run)
    assert steps == list(range(12))
    assert losses[6:] == pytest.approx(straight[1][6:], rel=1e-5)  # up to reduction order


def test_every_replica_lost_recovers_from_disk_in_the_same_launch(tmp_path, demo_data_dir):
    kill_all = ("kill:0:8", "kill:1:8")
    nothing = launch(tmp_path, demo_data_dir, nproc=2, steps=20, inject=kill_all, name="bare")
    assert nothing.returncode == 8, nothing.explain()  # JOB_ABORTED: no state survives
    assert "neither snapshots nor checkpoints are enabled" in nothing.output

    ck = ("checkpoint.interval=5", "checkpoint.async_save=false")
    res = launch(tmp_path, demo_data_dir, nproc=2, steps=20, inject=kill_all, overrides=ck)
    assert res.returncode == 0, res.explain()
    assert "recovered the state of step 5 from disk checkpoint" in res.output
    assert {e["step"] for e in res.events() if e["type"] == "recovery"} == {5}
    assert [m["step"] for m in res.metrics()] == list(range(20))  # rows 5-7 logged once
    digests = res.state_digests()
    assert len({d["model"] for d in digests.values()}) == 1 and len(digests) == 2
