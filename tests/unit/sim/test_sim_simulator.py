"""Discrete-event simulator: exact no-failure time, hand-computed traces, seeds, speed."""

import math
import time

import numpy as np
import pytest

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.sim.failures import FailureProcess, FailureTrace, generate_trace, no_failures
from megatron_mecefo.sim.simulator import JobConfig, simulate, simulate_all
from megatron_mecefo.sim.strategies import StrategyConfig

SMALL = JobConfig(
    num_gpus=64,
    gpus_per_group=8,
    num_steps=100,
    step_time_s=10.0,
    checkpoint_save_s=5.0,
    restart_s=100.0,
)
ALL = [
    StrategyConfig(name="ckpt"),
    StrategyConfig(name="snapshot", snapshot_overhead=0.0),
    StrategyConfig(name="replication", redundancy=2),
    StrategyConfig(name="spare", redundancy=3),
    *[StrategyConfig(name="mecefo", takeover_policy=p) for p in ("neighbor", "spread", "hybrid")],
]


def trace(*events, horizon=math.inf):
    t = np.array([e[0] for e in events], dtype=float)
    return FailureTrace(
        times_s=t,
        groups=np.array([e[1] for e in events], dtype=np.int64),
        repair_s=np.array([e[2] for e in events], dtype=float),
        horizon_s=horizon,
    )


@pytest.mark.timeout(60)
def test_no_failures_returns_t0_exactly():
    for res in simulate_all(SMALL, ALL, no_failures()):
        if res.label.startswith("replication"):
            assert res.ttt_s == 2 * SMALL.t0_s  # replication pays r even without failures
        else:
            assert res.ttt_s == SMALL.t0_s, res.label
        assert res.restarts == 0


@pytest.mark.timeout(60)
def test_checkpoint_cost_exact_without_failures():
    cfg = StrategyConfig(name="ckpt", checkpoint_interval_s=105.0)
    res = simulate(SMALL, cfg, no_failures())
    # 1000 s of compute, a 5 s save after every 100 s of compute: 9 saves before the end
    assert res.ttt_s == pytest.approx(SMALL.t0_s + 9 * 5.0)


@pytest.mark.timeout(60)
def test_one_failure_checkpoint_restart_by_hand():
    cfg = StrategyConfig(name="ckpt", checkpoint_interval_s=105.0)
    res = simulate(SMALL, cfg, trace((250.0, 3, math.inf)))
    # saves end at 105 and 210 (progress 20 steps); failure at 250 loses 40 s, restart 100 s
    assert res.restarts == 1
    assert res.ttt_s == pytest.approx(250.0 + 100.0 + (1000.0 - 200.0) + 7 * 5.0)


@pytest.mark.timeout(60)
def test_spare_masks_failure_and_doubles_step_time():
    cfg = StrategyConfig(name="spare", redundancy=3, checkpoint_interval_s=1e9)
    res = simulate(SMALL, cfg, trace((500.0, 2, math.inf)))
    assert res.restarts == 0 and res.masked_failures == 1
    assert res.ttt_s == pytest.approx(500.0 + 2 * 500.0)  # S = 2 after one dead group
    # three consecutive dead groups lose a shard: restart
    res = simulate(SMALL, cfg, trace((100, 2, math.inf), (200, 3, math.inf), (300, 4, math.inf)))
    assert res.restarts == 1


@pytest.mark.timeout(60)
def test_rejoin_restores_speed_and_policies_order():
    events = trace((200.0, 1, 300.0), (400.0, 2, 300.0))
    res = {r.label: r for r in simulate_all(SMALL, ALL[4:], events)}
    assert all(r.restarts == 0 for r in res.values())
    assert res["mecefo hybrid"].ttt_s <= res["mecefo spread"].ttt_s <= res["mecefo neighbor"].ttt_s
    assert res["mecefo neighbor"].ttt_s > SMALL.t0_s


@pytest.mark.timeout(60)
def test_seeds_reproducible():
    proc = FailureProcess(distribution="weibull", system_mtbf_s=200.0)

    def run(seed):
        tr = generate_trace(
            proc, num_gpus=64, gpus_per_group=8, horizon_s=40 * SMALL.t0_s, seed=seed
        )
        return [r.ttt_s for r in simulate_all(SMALL, ALL, tr, system_mtbf_s=200.0)]

    assert run(3) == run(3)
    assert run(3) != run(4)


@pytest.mark.timeout(60)
def test_failure_rate_matches_mtbf():
    proc = FailureProcess(distribution="exponential", gpu_mtbf_h=1000.0, level="gpu")
    tr = generate_trace(proc, num_gpus=10_000, gpus_per_group=100, horizon_s=3600 * 1000, seed=0)
    expected = 10_000 * 1000 / 1000.0  # GPU-hours / MTBF, sd 1%
    assert abs(tr.times_s.size / expected - 1) < 0.04
    assert np.all(np.diff(tr.times_s) >= 0)


@pytest.mark.timeout(120)
def test_600k_gpu_simulation_is_fast():
    job = JobConfig(gpus_per_group=1000)
    proc = FailureProcess(distribution="weibull", system_mtbf_s=300.0)
    start = time.perf_counter()
    tr = generate_trace(
        proc,
        num_gpus=job.num_gpus,
        gpus_per_group=1000,
        horizon_s=job.t0_s * job.horizon_factor,
        seed=0,
    )
    res = simulate(job, StrategyConfig(name="spare", redundancy=8), tr, system_mtbf_s=300.0)
    elapsed = time.perf_counter() - start
    assert res.finished and 2.0 < res.ratio < 4.0
    assert elapsed < 10.0  # the budget, measured on a shared 2-core machine


@pytest.mark.timeout(60)
def test_bad_inputs():
    with pytest.raises(ConfigError, match="unknown strategy"):
        StrategyConfig(name="raid5")
    with pytest.raises(ValueError, match="r <= N"):
        simulate(SMALL, StrategyConfig(name="spare", redundancy=9), no_failures())
    with pytest.raises(ConfigError, match="must divide"):
        JobConfig(num_gpus=100, gpus_per_group=7)
    with pytest.raises(ConfigError, match="outside"):
        simulate(SMALL, StrategyConfig(name="ckpt"), trace((1.0, 99, math.inf)))


@pytest.mark.timeout(60)
def test_rejoin_restores_the_failure_free_step_time_by_hand():
    """One failure at t = 200 s (progress 20 steps), back 300 s later, no pauses or saves: the
    step-time multiplier applies only while the group is away. Without the rejoin (or with a
    rejoin that does nothing) each TTT below is larger."""
    events = trace((200.0, 1, 300.0))
    mecefo = dict(name="mecefo", failover_s=0.0, checkpoint_interval_s=1e9)
    # spread, N = 8, M = 8: 1 + ceil(8 / 7) / 8 = 1.25 -> 300 s = 24 steps; 56 left at 10 s
    res = simulate(SMALL, StrategyConfig(**mecefo, takeover_policy="spread"), events)
    assert res.ttt_s == pytest.approx(500.0 + 56 * 10.0)
    # neighbor, measured ratio 1.37: 300 / 13.7 steps while away
    res = simulate(SMALL, StrategyConfig(**mecefo, takeover_policy="neighbor"), events)
    assert res.ttt_s == pytest.approx(500.0 + (80 - 300.0 / 13.7) * 10.0)
    # SPARe r = 3: S = 2 while away (300 s = 15 steps), back to S = 1 after
    cfg = StrategyConfig(name="spare", redundancy=3, checkpoint_interval_s=1e9)
    res = simulate(SMALL, cfg, events)
    assert res.ttt_s == pytest.approx(500.0 + 65 * 10.0) and res.masked_failures == 1
    # replication r = 2: a rejoined group makes its set whole again, so the partner's death
    # (600 s) is not fatal; without the rejoin it would be (same set {0, 1})
    cfg = StrategyConfig(name="replication", redundancy=2, checkpoint_interval_s=1e9)
    res = simulate(SMALL, cfg, trace((200.0, 1, 300.0), (600.0, 0, math.inf)))
    assert res.restarts == 0 and res.ttt_s == pytest.approx(2 * SMALL.t0_s)


def test_snapshot_restart_keeps_the_progress_of_the_last_whole_step():
    """Every-step in-memory snapshot: a failure costs the restart and the step in flight, never
    a rollback to a disk checkpoint. By hand: failure at t = 255 s (25.5 steps of 10 s), restart
    100 s, resume from step 25: finish at 255 + 100 + 75 x 10 = 1105 s."""
    cfg = StrategyConfig(name="snapshot", snapshot_overhead=0.0, snapshot_restart_s=100.0)
    res = simulate(SMALL, cfg, trace((255.0, 3, math.inf)))
    assert res.restarts == 1
    assert res.ttt_s == pytest.approx(1105.0)
