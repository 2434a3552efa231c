"""Takeover planner: who runs a dead replica's micro-batches, and in which mode (pure; no torch).

`make_step_plans` turns (alive set, micro-batches per replica, policy, cost model) into one
`RankStepPlan` per alive replica. The global batch is unchanged: every (replica, micro-batch) pair
of the failure-free job is run exactly once by some survivor. Gradient scaling follows the contract
in `plan/step_plan.py`: ordinary grads 1/n, attention/input-norm grads M/E (E = exact micro-
batches in the group), which is 1/|N| for MeCeFO's Neighbor-Do-Both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_mecefo.plan.cost import CostModel
from megatron_mecefo.plan.step_plan import MicroBatchTask, RankStepPlan
from megatron_mecefo.plan.techniques import ALL_TECHNIQUES, DegradedTechniques

POLICIES = ("neighbor", "spread", "hybrid")


def _check_alive(alive: Sequence[int], num_replicas: int) -> list[int]:
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    survivors = sorted(alive)
    if not survivors:
        raise ValueError(
            f"no survivor: all {num_replicas} replicas are dead, so no takeover plan exists "
            "(restart from a snapshot or checkpoint)"
        )
    if len(set(survivors)) != len(survivors):
        raise ValueError(f"alive has duplicate replicas: {list(alive)}")
    bad = [r for r in survivors if not 0 <= r < num_replicas]
    if bad:
        raise ValueError(f"alive replicas {bad} are out of range [0, {num_replicas})")
    return survivors


def neighbor_of(dead: int, alive: Sequence[int], num_replicas: int) -> int:
    """The next healthy replica after `dead` in ring order (dead+1, dead+2, ... mod n).

    Args:
        dead: Logical index of the dead replica, in [0, num_replicas).
        alive: Logical indices of the healthy replicas.
        num_replicas: n, replicas in the failure-free job.

    Returns:
        The covering replica's logical index.

    Raises:
        ValueError: no survivor, `dead` out of range or listed as alive.
    """
    survivors = set(_check_alive(alive, num_replicas))
    if not 0 <= dead < num_replicas:
        raise ValueError(f"dead replica {dead} is out of range [0, {num_replicas})")
    if dead in survivors:
        raise ValueError(f"replica {dead} is listed as alive, so it has no covering neighbour")
    for step in range(1, num_replicas):
        candidate = (dead + step) % num_replicas
        if candidate in survivors:
            return candidate
    raise AssertionError("unreachable: a survivor exists")


def make_step_plans(
    *,
    alive: Sequence[int],
    num_replicas: int,
    num_microbatches: int,
    policy: str,
    cost: CostModel,
    target_ratio: float = 1.15,
    choose_techniques: bool = False,
    allowed_techniques: DegradedTechniques = ALL_TECHNIQUES,
) -> dict[int, RankStepPlan]:
    """Plans for every alive replica for one step.

    Policies:
      * `neighbor`: MeCeFO Neighbor-Do-Both. Each dead replica's micro-batches go to its ring
        neighbour (`neighbor_of`); a covering replica runs all its micro-batches (own and taken
        over) degraded. A replica may cover several dead ones (two dead in a row, all but one dead).
      * `spread`: orphaned micro-batches go one by one to the least-loaded survivor (ties: ring
        distance from the dead replica, then index); all exact.
      * `hybrid`: `spread`, then on each rank whose predicted step time exceeds
        `target_ratio` x a normal rank's, micro-batches are switched to degraded (taken-over ones
        first, then own) until it fits; if it cannot fit, all of that rank's are degraded.
        With `choose_techniques`, each such rank also picks the technique set of its degraded
        micro-batches (`_choose_techniques`): among the measured subsets of
        `allowed_techniques` that meet the target, the least total accuracy cost
        (k x `DegradedTechniques.accuracy_cost`); the tasks carry it as `techniques`.

    Args:
        alive: Logical indices of the healthy replicas (any order, no duplicates).
        num_replicas: n, replicas of the failure-free job (ordinary grads are averaged over n).
        num_microbatches: M, micro-batches per replica per step (loss scale 1/M).
        policy: One of `POLICIES`.
        cost: Micro-batch costs (only `hybrid` uses them).
        target_ratio: `hybrid`'s bound on the slowest rank, as a multiple of a normal rank's time.
        choose_techniques: `hybrid` only: also choose the techniques (`hybrid_techniques: auto`).
            Off: degraded tasks carry `techniques=None` (the configured set), as before.
        allowed_techniques: The techniques the config switches on (candidates are its non-empty
            subsets that `cost` has a time for).

    Returns:
        {logical replica index: RankStepPlan} for every alive replica. Tasks list the rank's own
        micro-batches first, then taken-over ones by (source replica, micro index).
        `masked_scale` is M/E (E = micro-batches in the group that compute attention gradients:
        exact ones and degraded ones without the skip; 0.0 when E = 0, so attention and
        input-norm weights get a zero gradient) if any task skips attention, else None.

    Raises:
        ValueError: no survivor, replicas out of range, bad M, policy or target_ratio.
    """
    survivors = _check_alive(alive, num_replicas)
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if policy not in POLICIES:
        raise ValueError(f"unknown takeover policy {policy!r}; choose one of {POLICIES}")
    if target_ratio < 1.0:
        raise ValueError(f"target_ratio must be >= 1.0, got {target_ratio}")
    n, m = num_replicas, num_microbatches
    dead = [r for r in range(n) if r not in set(survivors)]
    tasks = {r: [MicroBatchTask(r, i) for i in range(m)] for r in survivors}
    if policy == "neighbor":
        _assign_neighbor(tasks, dead, survivors, n, m)
    else:
        _assign_spread(tasks, dead, survivors, n, m)
        if policy == "hybrid" and choose_techniques:
            _choose_techniques(tasks, m, cost, target_ratio, allowed_techniques)
        elif policy == "hybrid":
            _degrade_to_target(tasks, m, cost, target_ratio)
    num_attention = sum(not t.skips_attention for ts in tasks.values() for t in ts)
    any_skipped = num_attention < n * m
    masked_scale = (m / num_attention if num_attention else 0.0) if any_skipped else None
    return {
        r: RankStepPlan(
            tasks=tuple(tasks[r]),
            num_replicas=n,
            microbatches_per_replica=m,
            masked_scale=masked_scale,
        )
        for r in survivors
    }


def _assign_neighbor(
    tasks: dict[int, list[MicroBatchTask]], dead: list[int], survivors: list[int], n: int, m: int
) -> None:
    covering: set[int] = set()
    for f in dead:
        c = neighbor_of(f, survivors, n)
        covering.add(c)
        tasks[c].extend(MicroBatchTask(f, i) for i in range(m))
    for c in covering:  # NDB: the neighbour runs everything degraded while it covers
        tasks[c] = [MicroBatchTask(t.source_dp_rank, t.micro_index, True) for t in tasks[c]]
    for c in covering:
        own = [t for t in tasks[c] if t.source_dp_rank == c]
        rest = sorted((t for t in tasks[c] if t.source_dp_rank != c), key=_task_key)
        tasks[c] = own + rest


def _assign_spread(
    tasks: dict[int, list[MicroBatchTask]], dead: list[int], survivors: list[int], n: int, m: int
) -> None:
    for f in dead:
        for i in range(m):
            # least loaded first; ties go to the replica closest after f in ring order
            target = min(survivors, key=lambda r, f=f: (len(tasks[r]), (r - f) % n, r))
            tasks[target].append(MicroBatchTask(f, i))
    for r in survivors:
        own = [t for t in tasks[r] if t.source_dp_rank == r]
        tasks[r] = own + sorted((t for t in tasks[r] if t.source_dp_rank != r), key=_task_key)


def _degrade_to_target(
    tasks: dict[int, list[MicroBatchTask]], m: int, cost: CostModel, target_ratio: float
) -> None:
    target_s = target_ratio * cost.step_time(m, 0)
    if cost.degraded_microbatch_s >= cost.exact_microbatch_s:
        return  # degrading would not make anything faster
    for r, ts in tasks.items():
        num = len(ts)
        if cost.step_time(num, 0) <= target_s * (1 + 1e-12):
            continue
        # smallest k with step_time(num - k, k) <= target_s (each switch saves the same time)
        saving = cost.exact_microbatch_s - cost.degraded_microbatch_s
        k = math.ceil((cost.step_time(num, 0) - target_s) / saving - 1e-9)
        k = min(num, max(0, k))
        # degrade from the end: taken-over micro-batches first, then the rank's own
        tasks[r] = [
            MicroBatchTask(t.source_dp_rank, t.micro_index, j >= num - k) for j, t in enumerate(ts)
        ]


def _num_to_degrade(num: int, exact_s: float, degraded_s: float, cost: CostModel, target_s: float):
    """Smallest k <= num with step time (num - k exact, k degraded) <= target_s, or None."""
    now = cost.step_overhead_s + num * exact_s
    if now <= target_s * (1 + 1e-12):
        return 0
    if degraded_s >= exact_s:
        return None
    k = math.ceil((now - target_s) / (exact_s - degraded_s) - 1e-9)
    return max(0, k) if k <= num else None


def _choose_techniques(
    tasks: dict[int, list[MicroBatchTask]],
    m: int,
    cost: CostModel,
    target_ratio: float,
    allowed: DegradedTechniques,
) -> None:
    """hybrid with `hybrid_techniques: auto`: per rank over the target, the technique set (and
    the fewest micro-batches k to degrade with it) of least accuracy cost k x cost(set) among the
    sets that meet the target; ties: lower predicted step time, then fewer techniques. If none
    meets it, every micro-batch of the rank is degraded with the fastest set (ties: least
    accuracy cost)."""
    target_s = target_ratio * cost.step_time(m, 0)
    exact_s = cost.exact_microbatch_s
    candidates = [
        (t, cost.degraded_time(t)) for t in cost.measured_techniques if t.issubset(allowed)
    ]
    for r, ts in tasks.items():
        num = len(ts)
        if cost.step_time(num, 0) <= target_s * (1 + 1e-12) or not candidates:
            continue
        options = []  # (meets target?, accuracy cost, step time, #techniques, key), techniques, k
        for t, t_s in candidates:
            k = _num_to_degrade(num, exact_s, t_s, cost, target_s)
            fits = k is not None
            k = num if k is None else k
            step_s = cost.step_overhead_s + (num - k) * exact_s + k * t_s
            accuracy = k * t.accuracy_cost
            rank_key = (0, accuracy, step_s) if fits else (1, step_s, accuracy)
            options.append((rank_key + (len(t.names), t.key), t, k))
        _, chosen, k = min(options, key=lambda o: o[0])
        # degrade from the end: taken-over micro-batches first, then the rank's own
        tasks[r] = [
            MicroBatchTask(t.source_dp_rank, t.micro_index, True, chosen)
            if j >= num - k
            else MicroBatchTask(t.source_dp_rank, t.micro_index)
            for j, t in enumerate(ts)
        ]


def _task_key(t: MicroBatchTask) -> tuple[int, int]:
    return (t.source_dp_rank, t.micro_index)


def plan_step_times(plans: dict[int, RankStepPlan], cost: CostModel) -> dict[int, float]:
    """Predicted step time of each rank under `cost` (each degraded task at its technique set's
    time; a set without a measured time raises KeyError)."""

    def task_s(t: MicroBatchTask) -> float:
        if not t.degraded:
            return cost.exact_microbatch_s
        seconds = cost.degraded_time(t.techniques)
        if seconds is None:
            raise KeyError(f"cost model has no time for technique set {t.techniques.key!r}")
        return seconds

    return {r: cost.step_overhead_s + sum(map(task_s, p.tasks)) for r, p in plans.items()}
