"""tools/bench/sharded_optimizer.py and its sharded_failover_bench.py: how it counts optimizer
state (a real DP-2 job of the tiny model, both optimizers), and how it reads shard moves from
events.jsonl and the shard audit. The step-time and failover runs themselves are benchmarks, not
tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

import sharded_failover_bench as failover_bench  # noqa: E402
import sharded_optimizer as bench  # noqa: E402


@pytest.mark.timeout(120)
def test_memory_job_counts_8_bytes_replicated_12_over_dp_sharded(demo_data_dir):
    ranks = bench.spawn(bench.memory_worker, 2, ["tiny"], demo_data_dir, 2, limit_s=110)
    (row,) = bench.memory_rows(ranks, 2)
    assert row["params"] == row["numel"] > 0
    # fp32 on CPU: the param is its own master; exp_avg + exp_avg_sq, on every rank
    assert row["replicated_bytes_by_rank"] == [8 * row["params"]] * 2
    assert row["replicated_master_bytes"] == 0
    # one copy: the ranks' shards add up to master + 2 moments of every element, once
    assert sum(row["sharded_bytes_by_rank"]) == 12 * row["numel"]
    assert row["sharded_bytes_per_param"] == pytest.approx(6.0, rel=1e-3)
    assert row["sharded_master_bytes"] == row["sharded_bytes"] // 3
    # two copies at DP 2: each rank holds both shards
    assert row["copies_x2"] == 2
    assert row["sharded_x2_bytes_by_rank"] == [12 * row["numel"]] * 2


def test_replicated_bytes_walk_the_chain_and_skip_the_step_count():
    import torch

    p = torch.nn.Parameter(torch.ones(10))
    adam = torch.optim.Adam([p])
    p.grad = torch.ones(10)
    adam.step()

    class Part:  # megatron's FP32Optimizer / Float16OptimizerWithFloat16Params shape
        def __init__(self, optimizer, masters=()):
            self.optimizer = optimizer
            if masters:
                self.fp32_from_float16_groups = [list(masters)]

    class Chained:
        def __init__(self, *parts):
            self.chained_optimizers = list(parts)

    got = bench.replicated_state_bytes(Chained(Part(adam), Part(None)))
    assert got == {"moments": 80, "master": 0, "total": 80}
    mixed = Part(adam, masters=[torch.zeros(10)])
    assert bench.replicated_state_bytes(mixed) == {"moments": 80, "master": 40, "total": 120}


def _write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_moves_pair_with_their_regroup_and_rejoins():
    events = [
        {"type": "failure", "step": 5, "dp_rank": 2, "time_s": 0.7},
        {"type": "shard_adopt", "step": 5, "generation": 2, "bytes": 100, "transfer_ms": 16.0},
        {"type": "regroup", "step": 5, "generation": 2, "latency_ms": 768.0, "detail": "failure"},
        {"type": "rejoin", "step": 11, "generation": 3, "latency_ms": 700.0, "bytes": 7},
        {"type": "rejoin", "step": 11, "generation": 3, "latency_ms": 800.0, "bytes": 8},
        {"type": "shard_adopt", "step": 11, "generation": 3, "bytes": 100, "transfer_ms": 21.0},
        {"type": "regroup", "step": 11, "generation": 3, "detail": "join"},
    ]
    first, back = failover_bench.shard_moves(events)
    assert (first["bytes"], first["transfer_ms"], first["regroup_ms"]) == (100, 16.0, 768.0)
    assert first["rejoin_ms"] is None and first["rejoin_state_bytes"] is None
    assert back["regroup_ms"] is None  # a join measures no failure-to-regroup latency
    assert (back["rejoin_ms"], back["rejoin_state_bytes"]) == (750.0, 15)


def test_audit_check_finds_unheld_shards_and_disagreeing_holders(tmp_path):
    def row(step, replica, shards):
        return {"next_step": step, "replica": replica, "position": 0, "shards": shards}

    _write_jsonl(tmp_path / "audit" / "shards_rank0.jsonl", [row(1, 0, {"0": "a", "1": "b"})])
    _write_jsonl(tmp_path / "audit" / "shards_rank1.jsonl", [row(1, 1, {"1": "b"})])
    assert failover_bench.audit_check(tmp_path) == {
        "audited_steps": 1,
        "always_held": True,
        "max_holders": 2,
        "holders_agree": True,
        "own_held_at_end": True,  # replica s holds shard s after the last step
    }
    _write_jsonl(tmp_path / "audit" / "shards_rank1.jsonl", [row(1, 1, {"1": "x"}), row(2, 1, {})])
    got = failover_bench.audit_check(tmp_path)
    assert not got["holders_agree"] and not got["always_held"]  # shard 1 differs; step 2 empty
    assert not got["own_held_at_end"]
    assert failover_bench.audit_check(tmp_path / "none") == {"audited_steps": 0}
