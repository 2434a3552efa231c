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

from collections.abc import Sequence

from megatron_mecefo.plan.accuracy import AccuracyCosts, load_accuracy_costs
from megatron_mecefo.plan.cost import CostModel
from megatron_mecefo.plan.hybrid import OBJECTIVES, Technique, choose, hybrid_options
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
    objective: str = "accuracy",
    accuracy_budget: float = 1.0,
    accuracy: AccuracyCosts | None = None,
) -> dict[int, RankStepPlan]:
    """Plans for every alive replica for one step.

    Policies:
      * `neighbor`: MeCeFO Neighbor-Do-Both. Each dead replica's micro-batches go to its ring
        neighbour (`neighbor_of`); a covering replica runs all its micro-batches (own and taken
        over) degraded. A replica may cover several dead ones (two dead in a row, all but one dead).
      * `spread`: orphaned micro-batches go one by one to the least-loaded survivor (ties: ring
        distance from the dead replica, then index); all exact.
      * `hybrid`: one plan among those that exist (`plan/hybrid.py`): exact `spread` (whole
        micro-batches, and sample slices with `granularity="sample"`), `neighbor`, and `spread`
        with some tasks degraded (taken-over ones first, any subset of slices, one technique set
        per rank), chosen by `objective` from the predicted time (`cost`) and the measured
        accuracy cost (`accuracy`): `accuracy` = least accuracy cost within `target_ratio` x a
        normal rank's step (else the fastest); `time` = fastest within `accuracy_budget`.
        Never dominated. With `choose_techniques`, the technique sets are every measured subset
        of `allowed_techniques`, carried by the tasks as `techniques`; else the configured set
        (`techniques=None`).

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
        objective: `hybrid`: "accuracy" or "time" (`mecefo.hybrid_objective`).
        accuracy_budget: `hybrid` with objective "time": the largest accuracy cost allowed
            (`AccuracyCosts` unit: % perplexity if every step ran the plan).
        accuracy: Measured accuracy costs; None = the table shipped with the package.

    Returns:
        {logical replica index: RankStepPlan} for every alive replica. Tasks list the rank's own
        micro-batches first, then taken-over ones by (source replica, micro index).
        `masked_scale` is M/E (E = micro-batches in the group that compute attention gradients:
        exact ones and degraded ones without the skip, slices counting their share; 0.0 when
        E = 0, so attention and input-norm weights get a zero gradient) if any task skips
        attention, else None.

    Raises:
        ValueError: no survivor, replicas out of range, bad M, policy, target_ratio,
            granularity, micro_batch_size, objective or budget; `hybrid` without an accuracy
            cost for the configured technique set.
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
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown hybrid objective {objective!r}; choose one of {OBJECTIVES}")
    if not accuracy_budget >= 0:
        raise ValueError(f"accuracy_budget must be >= 0, got {accuracy_budget}")
    n, m, b = num_replicas, num_microbatches, micro_batch_size
    dead = [r for r in range(n) if r not in set(survivors)]

    def fresh() -> dict[int, list[MicroBatchTask]]:
        return {r: [MicroBatchTask(r, i) for i in range(m)] for r in survivors}

    can_slice = granularity == "sample" and b > 1
    if policy != "hybrid" or not dead:
        tasks = fresh()
        if policy == "neighbor":
            _assign_neighbor(tasks, dead, survivors, n, m)
        elif can_slice:
            _assign_spread_samples(tasks, dead, survivors, n, m, b)
        else:
            _assign_spread(tasks, dead, survivors, n, m)
    else:
        tasks = _hybrid(
            dead=dead,
            survivors=survivors,
            n=n,
            m=m,
            b=b,
            fresh=fresh,
            can_slice=can_slice,
            cost=cost,
            target_ratio=target_ratio,
            choose_techniques=choose_techniques,
            allowed=allowed_techniques,
            objective=objective,
            budget=accuracy_budget,
            accuracy=accuracy,
        )
    sliced = any(t.is_slice for ts in tasks.values() for t in ts)
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


def _hybrid(
    *,
    dead: list[int],
    survivors: list[int],
    n: int,
    m: int,
    b: int,
    fresh,
    can_slice: bool,
    cost: CostModel,
    target_ratio: float,
    choose_techniques: bool,
    allowed: DegradedTechniques,
    objective: str,
    budget: float,
    accuracy: AccuracyCosts | None,
) -> dict[int, list[MicroBatchTask]]:
    """`hybrid`: the candidates of `plan.hybrid` and the objective's choice among them."""
    accuracy = load_accuracy_costs() if accuracy is None else accuracy
    techniques = _technique_candidates(cost, accuracy, choose_techniques, allowed)
    bases = []
    if can_slice:  # the configured granularity first: it wins exact ties
        samples = fresh()
        _assign_spread_samples(samples, dead, survivors, n, m, b)
        bases.append(("spread/sample", samples))
    whole = fresh()
    _assign_spread(whole, dead, survivors, n, m)
    bases.append(("spread", whole))
    neighbor = fresh()
    _assign_neighbor(neighbor, dead, survivors, n, m)
    target_s = target_ratio * cost.step_time(m, 0)
    options = hybrid_options(
        bases=bases,
        neighbor=neighbor,
        cost=cost,
        techniques=techniques,
        n=n,
        m=m,
        b=b,
        objective=objective,
        target_s=target_s,
        budget=budget,
    )
    return choose(options, objective=objective, target_s=target_s, budget=budget).tasks


def _technique_candidates(
    cost: CostModel, accuracy: AccuracyCosts, choose_techniques: bool, allowed: DegradedTechniques
) -> list[Technique]:
    """`fixed`: the configured set only; `auto`: every subset of it with a measured time and a
    measured accuracy cost."""
    if not choose_techniques:
        acc = accuracy.of(allowed)
        if acc is None:
            raise ValueError(
                f"{accuracy.source or 'the accuracy costs'} has no cost for the configured "
                f"technique set {allowed.key!r}; measure it (tools/bench/convergence.py "
                "--accuracy-costs) or point mecefo.accuracy_costs at a table that has it"
            )
        return [Technique(None, cost.degraded_microbatch_s, acc)]
    out = []
    for t in cost.measured_techniques:
        acc = accuracy.of(t)
        if t.issubset(allowed) and acc is not None:
            out.append(Technique(t, cost.degraded_time(t), acc))
    return out


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
