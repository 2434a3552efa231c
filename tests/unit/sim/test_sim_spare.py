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


# Constants for hand computation: Gamma(3/2) = sqrt(pi)/2, Gamma(5/4), Gamma(4/3) (tables).
GAMMA_3_2 = 0.886226925452758
GAMMA_5_4 = 0.9064024770554771
GAMMA_4_3 = 0.8929795115692492


@pytest.mark.timeout(60)
def test_closed_forms_equal_hand_computed_values():
    """Each closed form at points worked out by hand (exact arithmetic in the comments)."""
    # mu(N, r) = Gamma(1 + 1/r) N^(1 - 1/r)
    assert spare.endurable_failures(100, 2) == pytest.approx(GAMMA_3_2 * 10.0, rel=1e-12)
    assert spare.endurable_failures(1000, 3) == pytest.approx(GAMMA_4_3 * 100.0, rel=1e-12)
    # replication: Gamma(1 + 1/r) N (r/N)^(1/r); (4/100)^(1/4) = sqrt(0.2)
    assert spare.endurable_failures_replication(100, 4) == pytest.approx(
        GAMMA_5_4 * 100 * 0.2**0.5, rel=1e-12
    )
    assert spare.endurable_failures_replication(200, 2) == pytest.approx(GAMMA_3_2 * 20.0)
    # S_bar(10, 2): mu = 2.80 -> k = 0, 1, 2 -> c = 1, ceil(10/9) = 2, ceil(10/8) = 2 -> 5/3
    assert spare.mean_overhead_closed(10, 2) == pytest.approx(5 / 3, rel=1e-12)
    # S_bar(200, 4): mu = Gamma(5/4) 200^(3/4) = 48.2 -> k = 0..48: c = 1, then 2 (200/152 < 2)
    assert spare.mean_overhead_closed(200, 4) == pytest.approx(97 / 49, rel=1e-12)
    # T_c* = T_s + sqrt(T_s^2 + 2 T_s (T_f + T_r)) = 60 + sqrt(3600 + 120 * 8600)
    assert spare.optimal_checkpoint_period(60.0, 5000.0, 3600.0) == pytest.approx(
        60.0 + 1035600.0**0.5, rel=1e-12
    )
    # A = (1 - 60/600) * 5000 / (5000 + 3600 + 300) = 4500 / 8900
    assert spare.availability(600.0, 60.0, 5000.0, 3600.0) == pytest.approx(4500 / 8900)
    # J(r) = overhead / A*(mu m): SPARe N = 200, r = 4, m = 300 s, T_r = 3600 s, T_s = 60 s
    tf = GAMMA_5_4 * 200**0.75 * 300.0
    tc = 60.0 + (3600.0 + 120.0 * (tf + 3600.0)) ** 0.5
    a_star = (1 - 60.0 / tc) * tf / (tf + 3600.0 + tc / 2)
    j = spare.time_to_train_ratio(200, 4, 300.0, 3600.0, 60.0)
    assert j == pytest.approx((97 / 49) / a_star, rel=1e-12)
    # replication r = 2 pays 2x per step: T_f = Gamma(3/2) 200 (2/200)^(1/2) m = 17.72 m
    tf = GAMMA_3_2 * 20.0 * 300.0
    tc = 60.0 + (3600.0 + 120.0 * (tf + 3600.0)) ** 0.5
    a_star = (1 - 60.0 / tc) * tf / (tf + 3600.0 + tc / 2)
    j = spare.time_to_train_ratio(200, 2, 300.0, 3600.0, 60.0, scheme="replication")
    assert j == pytest.approx(2.0 / a_star, rel=1e-12)
    # r* = floor(log2 N + 0.833): 7.64 + 0.83 -> 8; 9.23 + 0.83 -> 10; 9.97 + 0.83 -> 10
    assert [spare.optimal_redundancy_closed(n) for n in (1, 2, 200, 600, 1000)] == [1, 1, 8, 10, 10]


@pytest.mark.timeout(60)
def test_monte_carlo_mu_equals_exact_small_case():
    """N = 4, r = 2, counted by hand. Cyclic stacks: the 2nd failure is fatal when it neighbours
    the 1st (2 of 3 groups), else the 3rd always is: E = 2 (2/3) + 3 (1/3) = 7/3. Disjoint pairs
    {0,1},{2,3}: 2nd fatal with prob. 1/3, else the 3rd: E = 2/3 + 3 (2/3) = 8/3."""
    for layout, exact in (("spare", 7 / 3), ("replication", 8 / 3)):
        mc, se = spare.endurable_failures_monte_carlo(4, 2, trials=20000, seed=3, layout=layout)
        assert se == pytest.approx((2 / 9) ** 0.5 / 20000**0.5, rel=0.05)  # Var = 2/9 both
        assert abs(mc - exact) < 4 * se, (layout, mc, exact)


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
