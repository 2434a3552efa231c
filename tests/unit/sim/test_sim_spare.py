"""SPARe closed forms against Monte Carlo and against their own definitions."""

import math

import numpy as np
import pytest

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.sim import spare
from megatron_mecefo.sim.failures import FailureProcess


@pytest.mark.timeout(60)
def test_stack_layout_cyclic():
    layout = spare.stack_layout(5, 3)
    assert layout.tolist()[0] == [0, 1, 2]
    assert layout.tolist()[4] == [4, 0, 1]
    # every shard is held by exactly r groups
    assert np.all(np.bincount(layout.ravel(), minlength=5) == 3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n,r", [(400, 2), (400, 3), (1000, 4)])
def test_mu_closed_form_vs_monte_carlo(n, r):
    mc, se = spare.endurable_failures_monte_carlo(n, r, trials=300, seed=1)
    closed = spare.endurable_failures(n, r)
    # stated tolerance: the closed form is an asymptotic estimate, within 12% here
    assert abs(mc / closed - 1.0) < 0.12, (mc, se, closed)


@pytest.mark.timeout(60)
def test_mu_replication_closed_form_vs_monte_carlo():
    mc, _ = spare.endurable_failures_monte_carlo(400, 4, trials=300, seed=2, layout="replication")
    closed = spare.endurable_failures_replication(400, 4)
    assert abs(mc / closed - 1.0) < 0.12
    # disjoint replica sets endure more failures than cyclic stacks at the same r
    assert closed > spare.endurable_failures(400, 4)


@pytest.mark.timeout(60)
def test_mean_overhead_about_two_and_closed_form_is_lower_bound():
    mc, rho = spare.mean_overhead_monte_carlo(200, 4, trials=20, seed=0)
    closed = spare.mean_overhead_closed(200, 4)
    assert spare.endurable_failures(200, 4) < 100  # mu <= N/2 regime
    assert closed <= mc + 1e-9
    assert 1.8 <= mc <= 2.3
    assert np.all(rho >= 0)


@pytest.mark.timeout(60)
def test_c_of_k():
    assert spare.min_stack_lower_bound(10, 0) == 1
    assert spare.min_stack_lower_bound(10, 1) == 2
    assert spare.min_stack_lower_bound(10, 5) == 2
    assert spare.min_stack_lower_bound(10, 6) == 3


@pytest.mark.timeout(60)
def test_optimal_checkpoint_period_maximises_availability():
    ts, tf, tr = 60.0, 5000.0, 3600.0
    tc = spare.optimal_checkpoint_period(ts, tf, tr)
    grid = np.linspace(ts * 1.01, 20 * tc, 20000)
    best = grid[np.argmax([spare.availability(t, ts, tf, tr) for t in grid])]
    assert abs(best / tc - 1.0) < 0.01
    assert spare.best_availability(ts, tf, tr) == pytest.approx(spare.availability(tc, ts, tf, tr))


@pytest.mark.timeout(60)
def test_r_star_and_j():
    n, m = 600, 300.0
    r_opt, j_opt = spare.optimal_redundancy(n, m, 3600.0, 60.0)
    assert abs(r_opt - spare.optimal_redundancy_closed(n)) <= 2
    j_rep = min(
        spare.time_to_train_ratio(n, r, m, 3600.0, 60.0, scheme="replication") for r in (2, 3, 4)
    )
    assert j_opt < j_rep  # SPARe beats replication at this scale
    assert j_opt == pytest.approx(spare.time_to_train_ratio(n, r_opt, m, 3600.0, 60.0))


@pytest.mark.timeout(60)
def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="exceeds the number of groups"):
        spare.stack_layout(4, 5)
    with pytest.raises(ValueError, match="r <= N"):
        spare.endurable_failures(3, 8)
    with pytest.raises(ConfigError, match="must be > 0"):
        FailureProcess(gpu_mtbf_h=-1.0)
    with pytest.raises(ValueError, match="unknown scheme"):
        spare.time_to_train_ratio(10, 2, 300, 3600, 60, scheme="raid")
    with pytest.raises(ValueError):
        spare.time_to_train_ratio(10, 2, -300, 3600, 60)
    assert math.isfinite(spare.time_to_train_ratio(10, 1, 300, 3600, 60))
