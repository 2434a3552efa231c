"""Disk checkpoints of the distributed optimizer, through the real CLI: each shard's primary
writes one file per (stage, TP rank, shard) beside megatron's model checkpoint; the commit
marker waits for all of them; a resume reads them by flat range, so DP 2 resumes at DP 1 on the
same curve; under failover, losing every replica recovers the shards from disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import run_train as _train
from tests.helpers.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
SHARDED = "training.use_distributed_optimizer=true"


def _losses(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows], [r["loss"] for r in rows]


def test_dp2_shards_resume_at_dp1_and_same_layout_bit_for_bit(tmp_path, demo_data_dir):
    straight = tmp_path / "straight"
    proc = _train(straight, demo_data_dir, 10, "training.num_microbatches=4", SHARDED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = _losses(straight)[1]

    run = tmp_path / "run"
    first = _train(run, demo_data_dir, 5, "checkpoint.interval=5", SHARDED, nproc=2)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    folder = run / "checkpoints" / "step_00000005"
    files = sorted(p.name for p in (folder / "optim").iterdir())
    assert files == ["pp0_tp0_shard0_of2.pt", "pp0_tp0_shard1_of2.pt"], files
    # DP 2 -> DP 1: two shards read into one (same global batch; only reduction order differs)
    second = _train(run, demo_data_dir, 10, "training.num_microbatches=4", SHARDED)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout
    steps, losses = _losses(run)
    assert steps == list(range(10))
    assert losses[5:] == pytest.approx(ref[5:], rel=1e-5)


def test_missing_shard_file_falls_back_to_the_previous_checkpoint(tmp_path, demo_data_dir):
    run = tmp_path / "run"
    ck = ("checkpoint.interval=2", "checkpoint.keep_latest=2", SHARDED)
    first = _train(run, demo_data_dir, 4, *ck, nproc=2)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (run / "checkpoints" / "step_00000004" / "optim" / "pp0_tp0_shard1_of2.pt").unlink()
    second = _train(run, demo_data_dir, 6, *ck, nproc=2)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "file optim/pp0_tp0_shard1_of2.pt is missing" in out, out[-3000:]
    assert "step_00000002 at step 2" in out, out[-3000:]


def test_every_replica_lost_recovers_shards_from_disk(tmp_path, demo_data_dir):
    ck = ("checkpoint.interval=5", "checkpoint.async_save=false", SHARDED)
    res = launch(
        tmp_path, demo_data_dir, nproc=2, steps=20, inject=("kill:0:8", "kill:1:8"), overrides=ck
    )
    assert res.returncode == 0, res.explain()
    assert "recovered the state of step 5 from disk checkpoint" in res.output
    assert [m["step"] for m in res.metrics()] == list(range(20))
    digests = res.state_digests()
    assert len({d["model"] for d in digests.values()}) == 1 and len(digests) == 2
    # both replicas hold both shards (two copies of two), identical
    shards = [d["shards"] for d in digests.values()]
    assert shards[0] == shards[1] and sorted(shards[0]) == ["0", "1"]
