"""Spare nodes and sample-granular takeover in the simulator: hand-computed timelines, the
pool's bookkeeping, the CLI, and the Llama-3 16k headline (drop <= 0.5% with spares)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_mecefo.errors import ConfigError, ExitCode
from megatron_mecefo.sim.cli import main
from megatron_mecefo.sim.failures import FailureTrace
from megatron_mecefo.sim.simulator import JobConfig, simulate
from megatron_mecefo.sim.strategies import MEASURED_REPLACE_S, StrategyConfig

pytestmark = pytest.mark.timeout(60)

# 8 groups, 100 steps of 10 s: T0 = 1000 s; no checkpoint in the way
JOB = dict(num_gpus=64, gpus_per_group=8, num_steps=100, step_time_s=10.0, checkpoint_save_s=5.0)


def _job(**kw) -> JobConfig:
    return JobConfig(**JOB, **kw)


def _spread(granularity="microbatch", **kw) -> StrategyConfig:
    return StrategyConfig(
        name="mecefo",
        takeover_policy="spread",
        failover_s=0.0,
        checkpoint_interval_s=1e9,
        granularity=granularity,
        microbatches_per_rank=8,
        micro_batch_size=4,
        **kw,
    )


def _trace(*events) -> FailureTrace:
    return FailureTrace(
        times_s=np.array([e[0] for e in events], dtype=float),
        groups=np.array([e[1] for e in events], dtype=np.int64),
        repair_s=np.array([e[2] for e in events], dtype=float),
        horizon_s=math.inf,
    )


def test_sample_granularity_charges_the_slowest_survivor_its_extra_samples():
    one = _trace((200.0, 1, math.inf))  # never repaired, no spares: 7 of 8 groups to the end
    whole = simulate(_job(), _spread(), one)
    sliced = simulate(_job(), _spread("sample"), one)
    # M = 8: 1 + ceil(8 / 7) / 8 = 1.25;  M b = 32: 1 + ceil(32 / 7) / 32 = 1.15625
    assert whole.ttt_s == pytest.approx(200.0 + 800.0 * 1.25)
    assert sliced.ttt_s == pytest.approx(200.0 + 800.0 * (1 + 5 / 32))
    assert sliced.summary()["strategy"] == "mecefo spread/sample"
    neighbor = StrategyConfig(name="mecefo", takeover_policy="neighbor", granularity="sample")
    assert neighbor.label == "mecefo neighbor"  # whole micro-batches to one neighbour


def test_a_spare_node_ends_the_degraded_window_after_the_replacement_time():
    one = _trace((200.0, 1, math.inf))
    res = simulate(_job(spare_nodes=1, replace_s=30.0), _spread(), one)
    # [200, 230) at 1.25x: 24 s of work; 776 s left after 230
    assert res.ttt_s == pytest.approx(230.0 + 776.0)
    assert res.replacements == 1 and res.degraded_s == pytest.approx(30.0)
    assert simulate(_job(), _spread(), one).replacements == 0


def test_with_the_pool_empty_a_group_waits_for_a_repaired_node():
    # g1 fails at 200 (its node repaired by 300), g2 at 250 (never): one spare goes to g1 at
    # 230; g2 waits for g1's repaired node (300), back at full strength at 330
    events = _trace((200.0, 1, 100.0), (250.0, 2, math.inf))
    res = simulate(_job(spare_nodes=1, replace_s=30.0), _spread(), events)
    work = 200 + 30 / 1.25 + 20 + 80 / 1.25
    assert res.ttt_s == pytest.approx(330.0 + (1000.0 - work))
    assert res.replacements == 2
    # without spares: g1 rejoins at its repair (300); from 250 to 300 two groups are dead
    two_dead = 1 + math.ceil(16 / 6) / 8
    res = simulate(_job(), _spread(), events)
    work = 200 + 50 / 1.25 + 50 / two_dead
    assert res.ttt_s == pytest.approx(300.0 + (1000.0 - work) * 1.25)


def test_restart_strategies_are_unchanged_and_checks_hold():
    events = _trace((200.0, 1, math.inf), (400.0, 5, math.inf))
    snap = StrategyConfig(name="snapshot", snapshot_overhead=0.0, snapshot_restart_s=7.0)
    assert simulate(_job(spare_nodes=3), snap, events).ttt_s == simulate(_job(), snap, events).ttt_s
    with pytest.raises(ConfigError, match="spare_nodes"):
        _job(spare_nodes=-1)
    with pytest.raises(ConfigError, match="replace_s"):
        _job(spare_nodes=1, replace_s=math.inf)
    with pytest.raises(ConfigError, match="granularity"):
        StrategyConfig(name="mecefo", granularity="token")


def test_cli_takes_spares_and_granularity(capsys):
    argv = ["simulate", "--gpus", "512", "--gpus-per-group", "8", "--steps", "200"]
    argv += ["--system-mtbf-s", "3000", "--spare-nodes", "2", "--replace-s", "60"]
    argv += ["--strategies", "mecefo:spread,mecefo:spread:sample,mecefo:hybrid", "--json"]
    assert main([*argv, "--granularity", "microbatch"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spare_nodes"] == 2 and out["replace_s"] == 60.0
    labels = [r["strategy"] for r in out["results"]]
    assert labels == ["mecefo spread", "mecefo spread/sample", "mecefo hybrid"]
    assert all(r["replacements"] > 0 for r in out["results"])
    assert main([*argv[:-2], "mecefo:spread:token"]) == ExitCode.CONFIG_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err


LLAMA3 = [
    "simulate",
    "--scenario",
    "configs/failures/llama3_405b.yaml",
    "--gpus",
    "16384",
    "--gpus-per-group",
    "8",
    "--steps",
    "2000",
    "--snapshot-restart-s",
    "300",
    "--strategies",
    "snapshot,mecefo:neighbor,mecefo:spread,mecefo:hybrid",
    "--json",
]


def _drops(capsys, *extra) -> dict[str, float]:
    assert main([*LLAMA3, *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    return {r["strategy"]: 1 - 1 / r["ttt_over_t0"] for r in out["results"]}


def test_llama3_16k_drop_is_under_half_a_percent_with_four_spares(capsys):
    """BENCHMARKS.md's spare-node table: seed 0, 4 spare nodes, the (provisional) measured
    replacement time, and the issue's 120 s."""
    without = _drops(capsys)
    assert without["mecefo hybrid"] > 0.05 and without["mecefo neighbor"] > 0.15
    assert MEASURED_REPLACE_S < 120
    for replace in (MEASURED_REPLACE_S, 120.0):
        spared = _drops(capsys, "--spare-nodes", "4", "--replace-s", str(replace))
        assert spared["snapshot"] == pytest.approx(without["snapshot"])  # restarts anyway
        for policy in ("neighbor", "spread", "hybrid"):
            assert spared[f"mecefo {policy}"] <= 0.006, (replace, spared)
        assert spared["mecefo hybrid"] <= 0.005 and spared["mecefo spread"] <= 0.005
