"""Takeover planner: who runs a dead replica's micro-batches, and in which mode (pure; no torch).

`make_step_plans` turns (alive set, micro-batches per replica, policy, cost model) into one
`RankStepPlan` per alive replica. The global batch is unchanged: every (replica, micro-batch) pair
of the failure-free job is run exactly once by some survivor. Gradient scaling follows the contract
in `plan/step_plan.py`: ordinary grads 1/n, attention/input-norm grads M/E (E = exact micro-
batches in the group), which is 1/|N| for MeCeFO's Neighbor-Do-Both.

Granularity (`spread`, `hybrid`): `microbatch` hands out whole micro-batches, so the slowest
survivor runs M + ceil(M d / (n - d)) of them; `sample` cuts the orphaned micro-batches into
sample slices so that every survivor runs floor or ceil of d M b / (n - d) extra samples
(b = micro-batch size): whole micro-batches first, slices only for the remainder, a slice never
crossing a micro-batch. "Exactly once" then holds per sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_mecefo.plan.cost import CostModel
from megatron_mecefo.plan.step_plan import MicroBatchTask, RankStepPlan
from megatron_mecefo.plan.techniques import ALL_TECHNIQUES, DegradedTechniques

POLICIES = ("neighbor", "spread", "hybrid")
GRANULARITIES = ("microbatch", "sample")


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
    granularity: str = "microbatch",
    micro_batch_size: int = 1,
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
        granularity: `microbatch` (whole micro-batches) or `sample` (`spread` and `hybrid` cut
            the orphaned micro-batches into sample slices; `neighbor` ignores it).
        micro_batch_size: b, samples per micro-batch (`sample` granularity only).

    Returns:
        {logical replica index: RankStepPlan} for every alive replica. Tasks list the rank's own
        micro-batches first, then taken-over ones by (source replica, micro index).
        `masked_scale` is M/E (E = micro-batches in the group that compute attention gradients:
        exact ones and degraded ones without the skip, slices counting their share; 0.0 when
        E = 0, so attention and input-norm weights get a zero gradient) if any task skips
        attention, else None.

    Raises:
        ValueError: no survivor, replicas out of range, bad M, policy, target_ratio,
            granularity or micro_batch_size.
    """
    survivors = _check_alive(alive, num_replicas)
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if policy not in POLICIES:
        raise ValueError(f"unknown takeover policy {policy!r}; choose one of {POLICIES}")
    if target_ratio < 1.0:
        raise ValueError(f"target_ratio must be >= 1.0, got {target_ratio}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; choose one of {GRANULARITIES}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    n, m, b = num_replicas, num_microbatches, micro_batch_size
    dead = [r for r in range(n) if r not in set(survivors)]
    tasks = {r: [MicroBatchTask(r, i) for i in range(m)] for r in survivors}
    sliced = granularity == "sample" and policy != "neighbor" and b > 1
    if policy == "neighbor":
        _assign_neighbor(tasks, dead, survivors, n, m)
    else:
        if sliced:
            _assign_spread_samples(tasks, dead, survivors, n, m, b)
        else:
            _assign_spread(tasks, dead, survivors, n, m)
        if policy == "hybrid" and sliced:
            _degrade_slices_to_target(
                tasks, m, b, cost, target_ratio, allowed_techniques if choose_techniques else None
            )
        elif policy == "hybrid" and choose_techniques:
            _choose_techniques(tasks, m, cost, target_ratio, allowed_techniques)
        elif policy == "hybrid":
            _degrade_to_target(tasks, m, cost, target_ratio)
    # E in samples, so slices count their share (in whole micro-batches m * b / (E * b) = m / E)
    num_attention = sum(
        t.num_samples(b) for ts in tasks.values() for t in ts if not t.skips_attention
    )
    any_skipped = num_attention < n * m * b
    masked_scale = (m * b / num_attention if num_attention else 0.0) if any_skipped else None
    return {
        r: RankStepPlan(
            tasks=tuple(tasks[r]),
            num_replicas=n,
            microbatches_per_replica=m,
            masked_scale=masked_scale,
            micro_batch_size=b if sliced else None,
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


def _assign_spread_samples(
    tasks: dict[int, list[MicroBatchTask]],
    dead: list[int],
    survivors: list[int],
    n: int,
    m: int,
    b: int,
) -> None:
    """Sample granularity: survivor k takes quota_k = floor or ceil(d m b / s) orphaned samples
    (the ceil goes to the survivors nearest after the first dead replica in ring order): first
    floor(quota_k / b) whole micro-batches, then the rest of its quota as slices cut from the
    micro-batches left over, in (replica, micro-batch, sample) order (a slice never crosses a
    micro-batch, so a survivor gets at most two)."""
    orphans = [(f, i) for f in dead for i in range(m)]
    if not orphans:
        return
    order = sorted(survivors, key=lambda r: ((r - dead[0]) % n, r))
    base, extra = divmod(len(orphans) * b, len(order))
    quota = {r: base + (k < extra) for k, r in enumerate(order)}
    pos = 0
    for r in order:  # whole micro-batches first
        whole = quota[r] // b
        tasks[r].extend(MicroBatchTask(f, i) for f, i in orphans[pos : pos + whole])
        quota[r] -= whole * b
        pos += whole
    left = orphans[pos:]
    cursor = 0  # position in the stream of the left-over micro-batches' samples
    for r in order:
        need = quota[r]
        while need:
            j, start = divmod(cursor, b)
            stop = min(b, start + need)
            f, i = left[j]
            task = (
                MicroBatchTask(f, i)
                if stop - start == b
                else MicroBatchTask(f, i, False, None, (start, stop))
            )
            tasks[r].append(task)
            need -= stop - start
            cursor += stop - start
    assert cursor == len(left) * b, "every orphaned sample is assigned once"
    for r in survivors:
        own = [t for t in tasks[r] if t.source_dp_rank == r]
        tasks[r] = own + sorted((t for t in tasks[r] if t.source_dp_rank != r), key=_task_key)


def _degrade_slices_to_target(
    tasks: dict[int, list[MicroBatchTask]],
    m: int,
    b: int,
    cost: CostModel,
    target_ratio: float,
    allowed: DegradedTechniques | None,
) -> None:
    """`hybrid` at sample granularity: per rank over the target, degrade tasks from the end
    (taken-over slices and micro-batches first, then own ones) until the predicted step time
    meets it; all if it cannot. With `allowed` (techniques auto), each measured subset is tried
    and the least accuracy cost (fraction-weighted) among those that fit wins, as in
    `_choose_techniques`."""
    target_s = target_ratio * cost.step_time(m, 0)
    if allowed is None:
        candidates = [(None, 0.0)]
    else:
        candidates = [(t, t.accuracy_cost) for t in cost.measured_techniques if t.issubset(allowed)]
    for r, ts in tasks.items():
        fractions = [t.num_samples(b) / b for t in ts]
        if _rank_time(cost, fractions, 0, None) <= target_s * (1 + 1e-12) or not candidates:
            continue
        options = []
        for techniques, accuracy_per_mb in candidates:
            k = next(
                (
                    k
                    for k in range(1, len(ts) + 1)
                    if _rank_time(cost, fractions, k, techniques) <= target_s * (1 + 1e-12)
                ),
                None,
            )
            fits = k is not None
            k = len(ts) if k is None else k
            step_s = _rank_time(cost, fractions, k, techniques)
            if step_s is None:
                continue
            accuracy = accuracy_per_mb * sum(fractions[len(ts) - k :])
            key = (0, accuracy, step_s) if fits else (1, step_s, accuracy)
            name = () if techniques is None else (len(techniques.names), techniques.key)
            options.append((key + name, techniques, k))
        # nothing degraded competes as a non-fitting option (degrading may not be faster)
        options.append(((1, _rank_time(cost, fractions, 0, None), 0.0, -1, ""), None, 0))
        _, chosen, k = min(options, key=lambda o: o[0])
        num = len(ts)
        tasks[r] = [
            MicroBatchTask(
                t.source_dp_rank,
                t.micro_index,
                j >= num - k,
                chosen if j >= num - k else None,
                t.samples,
            )
            for j, t in enumerate(ts)
        ]


def _rank_time(
    cost: CostModel,
    fractions: list[float],
    num_degraded: int,
    techniques: DegradedTechniques | None,
) -> float | None:
    """Predicted step time of a rank whose last `num_degraded` tasks are degraded."""
    total = cost.step_overhead_s
    first_degraded = len(fractions) - num_degraded
    for j, fraction in enumerate(fractions):
        degraded = j >= first_degraded
        seconds = cost.task_time(fraction, degraded=degraded, techniques=techniques)
        if seconds is None:
            return None
        total += seconds
    return total


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


def _task_key(t: MicroBatchTask) -> tuple[int, int, tuple[int, int]]:
    return (t.source_dp_rank, t.micro_index, t.samples or (0, 0))


def plan_step_times(plans: dict[int, RankStepPlan], cost: CostModel) -> dict[int, float]:
    """Predicted step time of each rank under `cost` (each degraded task at its technique set's
    time, a slice at its share plus `slice_overhead_s`; a set without a measured time raises
    KeyError)."""

    def task_s(p: RankStepPlan, t: MicroBatchTask) -> float:
        seconds = cost.task_time(p.task_fraction(t), degraded=t.degraded, techniques=t.techniques)
        if seconds is None:
            raise KeyError(f"cost model has no time for technique set {t.techniques.key!r}")
        return seconds

    def rank_s(p: RankStepPlan) -> float:
        return cost.step_overhead_s + sum(task_s(p, t) for t in p.tasks)

    return {r: rank_s(p) for r, p in plans.items()}
