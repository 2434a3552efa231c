"""Pipelines in the simulator (issue 25): a group is a TP x PP replica read from a real run config,
its replacement time follows from its per-rank state and a stated bandwidth, extra work is charged
against a 1F1B step of M + P - 1 slots, and stage-granular takeover (a dead stage rerouted into
the other pipelines' bubbles) is modelled beside replica-granular takeover."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from megatron_mecefo.sim.cli import main
from megatron_mecefo.sim.failures import FailureTrace
from megatron_mecefo.sim.layout import ReplicaLayout, from_run_config
from megatron_mecefo.sim.simulator import JobConfig, simulate
from megatron_mecefo.sim.strategies import StrategyConfig

pytestmark = pytest.mark.timeout(60)
RUN_405B = Path(__file__).resolve().parents[3] / "configs" / "run" / "llama-405b-2048n.yaml"
JOB = dict(num_gpus=64, gpus_per_group=8, num_steps=100, step_time_s=10.0, checkpoint_save_s=5.0)
ONE_DEAD = FailureTrace(  # group 1 dies at 200 s and never comes back: 7 of 8 to the end
    times_s=np.array([200.0]),
    groups=np.array([1], dtype=np.int64),
    repair_s=np.array([math.inf]),
    horizon_s=math.inf,
)


def _mecefo(**kw) -> StrategyConfig:
    base = dict(name="mecefo", failover_s=0.0, checkpoint_interval_s=1e9, microbatches_per_rank=8)
    return StrategyConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "multiplier"),
    [
        (dict(takeover_policy="spread"), 1 + 2 / 8),  # ceil(8 / 7) = 2 extra of M = 8
        (dict(takeover_policy="spread", pipeline_stages=4), 1 + 2 / 11),  # of 8 + 4 - 1 slots
        (dict(takeover_policy="spread", unit="stage", pipeline_stages=4), 1.0),  # 2 <= 3 bubbles
        (dict(takeover_policy="spread", unit="stage", pipeline_stages=2), 1 + 1 / 9),  # 2 - 1
        (
            dict(takeover_policy="neighbor", neighbor_step_ratio=1.5, pipeline_stages=4),
            (2 * 8 * 0.75 + 3) / 11,
        ),  # fmt: skip
    ],
    ids=["spread", "spread-pp4", "stage-in-bubbles", "stage-past-bubbles", "neighbor-pp4"],
)
def test_step_time_under_one_dead_group(kw, multiplier):
    res = simulate(JobConfig(**JOB), _mecefo(**kw), ONE_DEAD)
    assert res.ttt_s == pytest.approx(200.0 + 800.0 * multiplier)


def test_the_405b_layout_and_its_replacement_time():
    layout = from_run_config(RUN_405B)
    assert (layout.gpus, layout.tp, layout.pp) == (128, 8, 16)
    assert layout.microbatches(16384) == 16  # 2048 sequences / (1 x 128 replicas)
    per_rank = layout.parameters * 14 / 128
    assert layout.state_bytes_per_rank() == pytest.approx(per_rank)
    assert layout.replacement_s(5.0, 200.0) == pytest.approx(5.0 + per_rank * 8 / 200e9)
    tiny = ReplicaLayout("tiny", parameters=160_000, tp=1, pp=1)
    assert tiny.replacement_s(5.4, 200.0) == pytest.approx(5.4, abs=1e-4)  # the measured part


def test_cli_reads_the_layout_from_a_run_config(capsys):
    args = ["simulate", "--scenario", "configs/failures/llama3_405b.yaml", "--gpus", "16384"]
    args += ["--run-config", str(RUN_405B), "--steps", "2000", "--state-gbps", "100"]
    args += ["--strategies", "mecefo:hybrid,mecefo:stage", "--spare-nodes", "4", "--json"]
    main(args)
    out = json.loads(capsys.readouterr().out)
    assert out["num_groups"] == 128 and out["layout"]["gpus_per_replica"] == 128
    state = out["layout"]["state_gb_per_rank"]
    assert out["replace_s"] == pytest.approx(5.4 + state * 8 / 100, rel=1e-3)
    main(args[:-1])  # the table, without --json
    text = capsys.readouterr().out
    assert "a replica is 128 GPUs (TP 8 x PP 16)" in text and "mecefo stage" in text
