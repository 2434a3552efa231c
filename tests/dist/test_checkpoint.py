"""Disk checkpoints with megatron dist_checkpointing, end to end through the real CLI: an
interrupted-and-resumed run equals the uninterrupted one bit for bit; a corrupt or uncommitted
newest checkpoint is skipped for the previous valid one; a different DP size resumes; under
failover, losing every replica at once is no longer the end of the run; and a rollback starts a
new lineage that pruning and `resume=auto` keep to (issue 15)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_mecefo.checkpoint import layout
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
    missing = tmp_path / "step_00000099"
    proc = _train(tmp_path / "run", demo_data_dir, 8, f"checkpoint.resume={missing}")
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert proc.returncode == 5 and errors == [f"error: {missing}: no such checkpoint folder"]


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


def _recommit_unloadable(folder: Path) -> None:
    """Cut the shards short and commit them again: every checksum holds, the load fails."""
    marker = layout.validate(folder)
    for shard in folder.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    extra = {k: v for k, v in marker.items() if k not in ("next_step", "files", "identity")}
    extra.pop("marker_sha256")
    layout.write_marker(folder, marker["next_step"], extra, identity=marker["identity"])


def test_a_rollback_is_a_new_lineage_that_prune_and_auto_resume_keep_to(tmp_path, demo_data_dir):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    ck = ("checkpoint.interval=5",)
    first = _train(run, demo_data_dir, 20, *ck, "checkpoint.keep_latest=3")
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in layout.candidates(ckpts)) == [
        f"step_{s:08d}" for s in (10, 15, 20)
    ]

    # roll back to step 10 with another learning rate, keep only the newest: train to 18
    lr = "training.lr=0.002"
    back = ckpts / "step_00000010"
    rolled = _train(
        run, demo_data_dir, 18, *ck, lr, f"checkpoint.resume={back}", "checkpoint.keep_latest=1"
    )
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    assert "a rollback/branch at step 10: new lineage" in rolled.stdout
    assert "training.lr: 0.003 -> 0.002" in rolled.stdout
    left = sorted(p.name for p in layout.candidates(ckpts))
    assert left == ["step_00000018", "step_00000020"]  # 18 kept; the abandoned 20 not deleted
    assert (ckpts / "abandoned").is_dir()  # line 1's step 15 moved aside for line 2's

    # the same command with resume=auto continues line 2 at 18, never line 1's step 20
    again = _train(run, demo_data_dir, 22, *ck, lr)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step_00000018 at step 18" in again.stdout
    assert "step_00000020 belong to an abandoned lineage" in again.stdout
    assert _losses(run)[0] == list(range(22))  # one line: no gap, no rows of line 1 after 10
    losses = _losses(run)[1]
    assert len(json.loads((run / "identity.json").read_text())["lineage"]) == 2

    # a checkpoint that passes its checksums but does not load: the next older one is used
    _recommit_unloadable(ckpts / "step_00000022")
    fallback = _train(run, demo_data_dir, 24, *ck, lr)
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert "skipping disk step 22: cannot load" in fallback.stdout
    assert "step_00000020 at step 20" in fallback.stdout
    assert _losses(run)[1][:20] == losses[:20] and _losses(run)[0] == list(range(24))

    # nothing loads: CHECKPOINT_ERROR naming what was tried, never a fresh start
    for common in ckpts.glob("step_*/common.pt"):
        common.write_bytes(common.read_bytes()[::-1])
    broken = _train(run, demo_data_dir, 26, *ck, lr)
    errors = [x for x in broken.stderr.splitlines() if x.startswith("error: ")]
    assert broken.returncode == 5 and len(errors) == 1, broken.stderr[-3000:]
    assert "tried disk step 24, disk step 22" in errors[0]


def test_a_pipeline_resumes_bit_for_bit_and_reshards_to_one_stage(tmp_path, demo_data_dir):
    """PP 2 (two processes, one replica): a run resumed from a step-8 checkpoint equals the
    uninterrupted run that wrote it, bit for bit (every stage's model, optimizer and RNG shard);
    the same layout's checkpoint also resumes unpipelined, resharded, on the same curve (no
    dropout there: a stage draws its own dropout masks, so only the weights and optimizer carry
    over). The resumed runs start from the folder (`checkpoint.resume`): `resume=auto` after an
    interruption is `test_resume_equals_the_uninterrupted_run`'s."""
    pp = ("parallel.pipeline_model_parallel_size=2", "training.num_microbatches=4")
    ck = ("checkpoint.interval=4", "checkpoint.keep_latest=3", *pp)
    straight = tmp_path / "straight"
    assert _train(straight, demo_data_dir, 12, *ck, DROPOUT, nproc=2).returncode == 0
    run = tmp_path / "run"
    at_8 = f"checkpoint.resume={layout.step_dir(straight / 'checkpoints', 8)}"
    second = _train(run, demo_data_dir, 12, *ck, DROPOUT, at_8, nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    steps, losses = _losses(straight)
    assert _losses(run) == (steps[8:], losses[8:]) and steps == list(range(12))
    reference = tmp_path / "reference"  # no dropout; its step-8 checkpoint resumes unpipelined
    assert _train(reference, demo_data_dir, 12, *ck, nproc=2).returncode == 0
    saved = layout.step_dir(reference / "checkpoints", 8)
    flat = tmp_path / "flat"
    one = _train(flat, demo_data_dir, 12, f"checkpoint.resume={saved}", "training.num_microbatches=4")
    assert one.returncode == 0, one.stderr[-3000:]
    assert "TP x PP = 1 x 2, this run has 1 x 1" in one.stdout
    steps, losses = _losses(flat)
    assert steps == [8, 9, 10, 11]
    assert losses == pytest.approx(_losses(reference)[1][8:], rel=1e-5)
