"""Scenario files (shared with the trainer's injector) and events.jsonl replay."""

import math
from pathlib import Path

import pytest

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.sim import events
from megatron_mecefo.sim.scenario import injections_to_trace, load_scenario
from megatron_mecefo.sim.simulator import JobConfig, simulate
from megatron_mecefo.sim.strategies import StrategyConfig

ROOT = Path(__file__).resolve().parents[3]
DATA = Path(__file__).parent / "data"


@pytest.mark.timeout(60)
def test_every_failure_config_loads():
    files = sorted((ROOT / "configs" / "failures").glob("*.yaml"))
    assert {f.stem for f in files} >= {"none", "single_kill", "llama3_405b", "spare_paper"}
    for f in files:
        sc = load_scenario(f)
        assert sc.name == f.stem
        assert sc.injections or sc.process is not None or sc.name == "none"


@pytest.mark.timeout(60)
def test_bad_scenarios(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("injections:\n  - {step: 3, dp_rank: 0, downtime_steps: 2, rejoin_step: 9}\n")
    with pytest.raises(ConfigError, match="not both"):
        load_scenario(bad)
    bad.write_text("process: {gpu_mtbf_h: -5}\n")
    with pytest.raises(ConfigError, match="gpu_mtbf_h must be > 0"):
        load_scenario(bad)
    bad.write_text("procss: {}\n")
    with pytest.raises(ConfigError, match="unknown config key"):
        load_scenario(bad)
    bad.write_text("injections:\n  - {step: 3, dp_rank: 0, kind: explode}\n")
    with pytest.raises(ConfigError, match="not allowed"):
        load_scenario(bad)


@pytest.mark.timeout(60)
def test_injections_become_a_trace():
    sc = load_scenario(ROOT / "configs" / "failures" / "single_kill.yaml")
    tr = injections_to_trace(sc, step_time_s=2.0, num_groups=4)
    assert tr.times_s.tolist() == [40.0] and tr.groups.tolist() == [1]
    assert tr.repair_s.tolist() == [20.0]
    with pytest.raises(ConfigError, match="does not exist"):
        injections_to_trace(sc, step_time_s=2.0, num_groups=1)


@pytest.mark.timeout(60)
def test_events_example_replay():
    evs = events.read_events(DATA / "events_example.jsonl")
    assert len(evs) == 10
    assert evs[1].detail == "SIGKILL" and evs[1].generation == 0 and evs[2].latency_ms == 900.0
    tr = events.events_to_trace(evs)
    assert tr.groups.tolist() == [2, 0]
    assert tr.repair_s[0] == pytest.approx(152.0 - 61.5) and math.isinf(tr.repair_s[1])
    lat = events.measured_latencies(evs)
    assert lat["detection_s"] == pytest.approx((0.9 + 3.0) / 2)
    assert lat["regroup_s"] == pytest.approx((1.4 + 3.6) / 2)
    job = JobConfig(num_gpus=8, gpus_per_group=1, num_steps=100, step_time_s=5.0, restart_s=30.0)
    neighbor = simulate(job, StrategyConfig(name="mecefo", takeover_policy="neighbor"), tr)
    ckpt = simulate(job, StrategyConfig(name="ckpt", checkpoint_interval_s=100.0), tr)
    assert neighbor.restarts == 0 and ckpt.restarts == 2
    assert job.t0_s < neighbor.ttt_s < ckpt.ttt_s


@pytest.mark.timeout(60)
def test_bad_events(tmp_path):
    f = tmp_path / "events.jsonl"
    f.write_text('{"type": "failure", "step": 1, "dp_rank": 0, "time_s": 1.0}\n{"type": "boom"}\n')
    with pytest.raises(ConfigError, match=r"events.jsonl:2: missing field"):
        events.read_events(f)
    f.write_text('{"type": "explode", "step": 1, "dp_rank": 0, "time_s": 1.0}\n')
    with pytest.raises(ConfigError, match="unknown type"):
        events.read_events(f)
    f.write_text(
        '{"type": "detection", "step": 1, "dp_rank": 0, "time_s": 1.0, "generation": -1}\n'
    )
    with pytest.raises(ConfigError, match=r"events.jsonl:1: generation must be an integer >= 0"):
        events.read_events(f)
    f.write_text(
        '\n{"type": "regroup", "step": 1, "dp_rank": null, "time_s": 1, "latency_ms": "x"}\n'
    )
    with pytest.raises(ConfigError, match=r"events.jsonl:2: latency_ms must be a number >= 0"):
        events.read_events(f)
