"""SPARe closed forms (arXiv 2603.00357): stack layout, endurable failures, overhead, availability.

N data-parallel groups, redundancy r: group g holds the shard stack [D_g, ..., D_{g+r-1}] (mod N). A
restart is needed only when all r holders of a shard are dead, i.e. r cyclically consecutive groups.
Times are in seconds. This module is closed forms plus small Monte Carlo estimators; the exact
minimum stack number by bipartite matching lives in `matching.py`.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_mecefo.sim.matching import min_stack_fast


def check_layout(num_groups: int, redundancy: int) -> None:
    """Raise ValueError unless 1 <= r <= N (N groups, redundancy r)."""
    if num_groups < 1:
        raise ValueError(f"number of groups N must be >= 1, got {num_groups}")
    if redundancy < 1:
        raise ValueError(f"redundancy r must be >= 1, got {redundancy}")
    if redundancy > num_groups:
        raise ValueError(
            f"redundancy r={redundancy} exceeds the number of groups N={num_groups}: "
            "each shard needs r distinct holders, so choose r <= N"
        )


def stack_layout(num_groups: int, redundancy: int) -> np.ndarray:
    """Shard ids held by each group: row g is [g, g+1, ..., g+r-1] mod N (top of stack first)."""
    check_layout(num_groups, redundancy)
    return (np.arange(num_groups)[:, None] + np.arange(redundancy)[None, :]) % num_groups


def min_stack_lower_bound(num_groups: int, num_dead: int) -> int:
    """c(k) = ceil(N / (N - k)): no assignment can do better than spreading N shards evenly."""
    if not 0 <= num_dead < num_groups:
        raise ValueError(f"need 0 <= k < N, got k={num_dead}, N={num_groups}")
    return -(-num_groups // (num_groups - num_dead))


def endurable_failures(num_groups: int, redundancy: int) -> float:
    """mu(N, r) ~= Gamma(1 + 1/r) * N^(1 - 1/r): mean failures (incl. the fatal one) SPARe endures.

    Derivation: after k uniform failures each of the N windows of r consecutive groups is fully dead
    with probability ~(k/N)^r, so P(no fatal window) ~= exp(-N (k/N)^r); integrate over k.
    """
    check_layout(num_groups, redundancy)
    return math.gamma(1.0 + 1.0 / redundancy) * num_groups ** (1.0 - 1.0 / redundancy)


def endurable_failures_replication(num_groups: int, redundancy: int) -> float:
    """Same for classic r-fold replication (N/r disjoint replica sets): Gamma(1+1/r) N
    (r/N)^(1/r)."""
    check_layout(num_groups, redundancy)
    r = redundancy
    return math.gamma(1.0 + 1.0 / r) * num_groups * (r / num_groups) ** (1.0 / r)


def _fatal_index(order: np.ndarray, redundancy: int, layout: str) -> int:
    """Index (0-based) in the failure order `order` of the first failure that loses a shard."""
    n = order.size
    dead = np.zeros(n, dtype=bool)
    for i, g in enumerate(order):
        dead[g] = True
        if layout == "replication":
            s = (g // redundancy) * redundancy
            if dead[s : s + redundancy].all():
                return i
        elif dead_run_length(dead, int(g)) >= redundancy:
            return i
    return n - 1


def dead_run_length(dead: np.ndarray, group: int) -> int:
    """Length of the cyclic run of dead groups that contains `group` (0 if it is alive)."""
    n = dead.size
    if not dead[group]:
        return 0
    length = 1
    i = (group - 1) % n
    while dead[i] and length < n:
        length += 1
        i = (i - 1) % n
    i = (group + 1) % n
    while dead[i] and length < n:
        length += 1
        i = (i + 1) % n
    return length


def endurable_failures_monte_carlo(
    num_groups: int, redundancy: int, *, trials: int = 2000, seed: int = 0, layout: str = "spare"
) -> tuple[float, float]:
    """Monte Carlo mu(N, r): (mean, standard error) of the failure count at the first lost shard.

    Args:
        layout: "spare" (cyclic stacks) or "replication" (N/r disjoint sets; needs r | N).
            Trials run a Python loop per failure: keep N in the low thousands.
    """
    check_layout(num_groups, redundancy)
    if layout not in ("spare", "replication"):
        raise ValueError(f"unknown layout {layout!r} (allowed: 'spare', 'replication')")
    if layout == "replication" and num_groups % redundancy:
        raise ValueError(f"replication needs r to divide N, got N={num_groups}, r={redundancy}")
    rng = np.random.default_rng(seed)
    counts = np.array(
        [_fatal_index(rng.permutation(num_groups), redundancy, layout) + 1 for _ in range(trials)],
        dtype=float,
    )
    return float(counts.mean()), float(counts.std(ddof=1) / math.sqrt(trials))


def mean_overhead_closed(num_groups: int, redundancy: int, rho: np.ndarray | None = None) -> float:
    """S_bar ~= (1/mu) sum_{k < mu} (c(k) + rho_k); rho (extra stacks above c(k)) defaults to 0."""
    mu = endurable_failures(num_groups, redundancy)
    ks = np.arange(int(math.ceil(mu)))
    ks = ks[ks < num_groups]
    c = -(-num_groups // (num_groups - ks))
    if rho is not None:
        c = c + np.asarray(rho, dtype=float)[: ks.size]
    return float(np.mean(c))


def mean_overhead_monte_carlo(
    num_groups: int, redundancy: int, *, trials: int = 50, seed: int = 0
) -> tuple[float, np.ndarray]:
    """Monte Carlo S_bar with the exact min stack number: (mean over k < fatal, rho_k by k).

    Each trial kills groups in random order until a shard is lost; S(k) is the exact minimum stack
    number (Hall's condition on intervals, equal to bipartite matching).
    """
    check_layout(num_groups, redundancy)
    rng = np.random.default_rng(seed)
    samples: list[float] = []
    rho_sum = np.zeros(num_groups)
    rho_cnt = np.zeros(num_groups)
    for _ in range(trials):
        order = rng.permutation(num_groups)
        fatal = _fatal_index(order, redundancy, "spare")
        dead = np.zeros(num_groups, dtype=bool)
        samples.append(1.0)
        for k in range(1, fatal + 1):
            dead[order[k - 1]] = True
            s = min_stack_fast(np.flatnonzero(dead), num_groups, redundancy)
            samples.append(float(s))
            rho_sum[k] += s - min_stack_lower_bound(num_groups, k)
            rho_cnt[k] += 1
    rho = np.divide(rho_sum, rho_cnt, out=np.zeros_like(rho_sum), where=rho_cnt > 0)
    return float(np.mean(samples)), rho


def optimal_checkpoint_period(save_s: float, mtbf_s: float, restart_s: float) -> float:
    """T_c* = T_s + sqrt(T_s^2 + 2 T_s (T_f + T_r)): the period maximising `availability`."""
    if save_s <= 0 or mtbf_s <= 0 or restart_s < 0:
        raise ValueError("need T_s > 0, T_f > 0 and T_r >= 0")
    return save_s + math.sqrt(save_s**2 + 2.0 * save_s * (mtbf_s + restart_s))


def availability(period_s: float, save_s: float, mtbf_s: float, restart_s: float) -> float:
    """A = (1 - T_s/T_c) * T_f / (T_f + T_r + T_c/2): useful fraction of wall time."""
    if period_s <= save_s:
        raise ValueError(f"checkpoint period {period_s} s must exceed the save time {save_s} s")
    return (1.0 - save_s / period_s) * mtbf_s / (mtbf_s + restart_s + period_s / 2.0)


def best_availability(save_s: float, mtbf_s: float, restart_s: float) -> float:
    """A*(T_f) = A at T_c*."""
    tc = optimal_checkpoint_period(save_s, mtbf_s, restart_s)
    return availability(tc, save_s, mtbf_s, restart_s)


def time_to_train_ratio(
    num_groups: int,
    redundancy: int,
    system_mtbf_s: float,
    restart_s: float,
    save_s: float,
    *,
    scheme: str = "spare",
    overhead: float | None = None,
) -> float:
    """J(r) = overhead / A*(mu m): predicted TTT / T_0 (T_0 = failure-free, no redundancy).

    Args:
        scheme: "spare" (overhead S_bar, cyclic mu) or "replication" (overhead r, disjoint-set mu).
        overhead: override the per-step compute multiplier (e.g. a Monte Carlo S_bar).
    """
    if system_mtbf_s <= 0:
        raise ValueError(f"system MTBF must be > 0 s, got {system_mtbf_s}")
    if scheme == "spare":
        mu = endurable_failures(num_groups, redundancy)
        cost = mean_overhead_closed(num_groups, redundancy) if overhead is None else overhead
    elif scheme == "replication":
        mu = endurable_failures_replication(num_groups, redundancy)
        cost = float(redundancy) if overhead is None else overhead
    else:
        raise ValueError(f"unknown scheme {scheme!r} (allowed: 'spare', 'replication')")
    if redundancy == 1:
        mu = 1.0
    return cost / best_availability(save_s, mu * system_mtbf_s, restart_s)


def optimal_redundancy_closed(num_groups: int) -> int:
    """r* ~= floor(log2 N + 0.833) (the paper's fit for SPARe)."""
    if num_groups < 1:
        raise ValueError(f"number of groups N must be >= 1, got {num_groups}")
    return max(1, min(num_groups, int(math.floor(math.log2(num_groups) + 0.833))))


def optimal_redundancy(
    num_groups: int,
    system_mtbf_s: float,
    restart_s: float,
    save_s: float,
    *,
    scheme: str = "spare",
    max_redundancy: int = 16,
) -> tuple[int, float]:
    """argmin_r J(r) over 1..max_redundancy: (r, J)."""
    best: tuple[int, float] | None = None
    for r in range(1, min(max_redundancy, num_groups) + 1):
        j = time_to_train_ratio(num_groups, r, system_mtbf_s, restart_s, save_s, scheme=scheme)
        if best is None or j < best[1]:
            best = (r, j)
    assert best is not None
    return best
