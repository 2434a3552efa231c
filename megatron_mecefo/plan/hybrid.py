"""`hybrid`: choose, per membership, one plan among those that exist (pure; no torch).

Candidates, each with a predicted time (the slowest rank's step, `CostModel`) and an accuracy
cost (`AccuracyCosts`: % perplexity if every step ran the plan):
  * exact `spread`, at micro-batch granularity and, where allowed, at sample granularity;
  * `neighbor` (MeCeFO), with each candidate technique set;
  * `spread` with some tasks degraded: per rank any number of its whole micro-batches (taken-over
    ones first) and any subset of its slices, one technique set per rank.
The degraded family is searched exactly: for a time bound X the least-accuracy member degrades, on
every rank independently, the option of least accuracy whose time is <= X (ranks are
independent: the step time is their maximum, the accuracy cost their sum).

Objectives (`mecefo.hybrid_objective`):
  * `accuracy`: the least accuracy cost whose time is <= the target; ties: the faster. If no plan
    meets the target: the fastest; ties: the more accurate.
  * `time`: the fastest plan whose accuracy cost is <= the budget; ties: the more accurate.
Both are lexicographic over the candidates, so the choice is never dominated (no plan is at least as
good on both axes and better on one), in particular never worse in accuracy than `neighbor` at the
same or a higher time. tests/unit/plan/test_plan_hybrid.py checks both against brute force.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable

from megatron_mecefo.plan.cost import CostModel
from megatron_mecefo.plan.step_plan import MicroBatchTask
from megatron_mecefo.plan.techniques import DegradedTechniques

OBJECTIVES = ("accuracy", "time")
_EPS = 1e-9

Tasks = dict[int, list[MicroBatchTask]]


@dataclasses.dataclass(frozen=True)
class Technique:
    """A technique set the planner may degrade with: None = the configured set."""

    techniques: DegradedTechniques | None
    microbatch_s: float
    """Time of one degraded whole micro-batch."""
    cost: float
    """Accuracy cost (`AccuracyCosts` unit) of degrading the whole global batch with it."""


@dataclasses.dataclass(frozen=True)
class PlanOption:
    """One candidate plan for the job."""

    label: str
    tasks: Tasks
    time_s: float
    accuracy: float


@dataclasses.dataclass(frozen=True)
class _RankOption:
    time_s: float
    accuracy: float
    technique: Technique | None
    degraded: frozenset[int]  # task positions


def task_fraction(task: MicroBatchTask, b: int) -> float:
    return 1.0 if task.samples is None else task.num_samples(b) / b


def rank_time(cost: CostModel, ts: list[MicroBatchTask], b: int) -> float:
    """Predicted step time of a rank running `ts` (degraded tasks at their technique's time)."""
    total = cost.step_overhead_s
    for t in ts:
        seconds = cost.task_time(task_fraction(t, b), degraded=t.degraded, techniques=t.techniques)
        if seconds is None:
            raise KeyError(f"cost model has no time for technique set {t.techniques.key!r}")
        total += seconds
    return total


def plan_accuracy(tasks: Tasks, techniques: list[Technique], n: int, m: int, b: int) -> float:
    """Accuracy cost of a plan: sum over degraded tasks of cost(set) x share of the batch."""
    by_set = {t.techniques: t.cost for t in techniques}
    total = 0.0
    for ts in tasks.values():
        for t in ts:
            if t.degraded:
                total += by_set[t.techniques] * task_fraction(t, b) / (n * m)
    return total


def _rank_options(
    ts: list[MicroBatchTask], cost: CostModel, techniques: list[Technique], n: int, m: int, b: int
) -> list[_RankOption]:
    """Every way to degrade this rank: w whole micro-batches from the end (taken-over first),
    any subset of its slices, one technique set; plus nothing degraded. Pareto frontier only,
    sorted by time (accuracy strictly decreasing)."""
    fractions = [task_fraction(t, b) for t in ts]
    whole = [j for j, f in enumerate(fractions) if f >= 1.0]
    slices = [j for j, f in enumerate(fractions) if f < 1.0]
    base = cost.step_overhead_s + sum(cost.task_time(f) for f in fractions)
    options = [_RankOption(base, 0.0, None, frozenset())]
    for tech in techniques:
        for w in range(len(whole) + 1):
            for k in range(len(slices) + 1):
                for chosen in itertools.combinations(slices, k):
                    degraded = frozenset(whole[len(whole) - w :]) | frozenset(chosen)
                    if not degraded:
                        continue
                    seconds = base
                    for j in degraded:
                        f = fractions[j]
                        seconds += _degraded_task_s(cost, tech, f) - cost.task_time(f)
                    share = sum(fractions[j] for j in degraded)
                    options.append(
                        _RankOption(seconds, tech.cost * share / (n * m), tech, degraded)
                    )
    options.sort(key=lambda o: (o.time_s, o.accuracy, len(o.degraded)))
    frontier: list[_RankOption] = []
    for o in options:
        if not frontier or o.accuracy < frontier[-1].accuracy - _EPS:
            frontier.append(o)
    return frontier


def _degraded_task_s(cost: CostModel, tech: Technique, fraction: float) -> float:
    if fraction >= 1.0:
        return tech.microbatch_s
    return fraction * tech.microbatch_s + cost.slice_overhead_s


class DegradeFamily:
    """`spread` base tasks with some degraded: the least-accuracy member under any time bound."""

    def __init__(
        self,
        base: Tasks,
        cost: CostModel,
        techniques: list[Technique],
        n: int,
        m: int,
        b: int,
        label: str,
    ):
        self.base, self.label = base, label
        self._frontiers: dict[int, list[_RankOption]] = {}
        memo: dict[tuple, list[_RankOption]] = {}  # ranks with the same load share a frontier
        for r, ts in base.items():
            signature = tuple(t.samples or (0, 0) for t in ts)
            if signature not in memo:
                memo[signature] = _rank_options(ts, cost, techniques, n, m, b)
            self._frontiers[r] = memo[signature]
        self.fastest_s = max(f[0].time_s for f in self._frontiers.values())

    def thresholds(self) -> list[float]:
        """Every time bound at which some rank's best option changes, >= the fastest plan's."""
        times = {o.time_s for f in self._frontiers.values() for o in f}
        return sorted(t for t in times if t >= self.fastest_s - _EPS)

    def under(self, bound_s: float) -> PlanOption | None:
        """The least-accuracy member whose slowest rank takes <= bound_s (None if none)."""
        chosen = {}
        for r, frontier in self._frontiers.items():
            times = [o.time_s for o in frontier]
            i = bisect.bisect_right(times, bound_s * (1 + _EPS) + _EPS) - 1
            if i < 0:
                return None
            chosen[r] = frontier[i]
        tasks = {
            r: [
                MicroBatchTask(
                    t.source_dp_rank,
                    t.micro_index,
                    True,
                    o.technique.techniques,
                    t.samples,
                )
                if j in o.degraded
                else t
                for j, t in enumerate(self.base[r])
            ]
            for r, o in chosen.items()
        }
        return PlanOption(
            label=self.label + "+degraded"
            if any(o.degraded for o in chosen.values())
            else self.label,
            tasks=tasks,
            time_s=max(o.time_s for o in chosen.values()),
            accuracy=sum(o.accuracy for o in chosen.values()),
        )


def choose(
    options: list[PlanOption], *, objective: str, target_s: float, budget: float
) -> PlanOption:
    """The objective's pick among `options` (earlier options win exact ties)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown hybrid objective {objective!r}; choose one of {OBJECTIVES}")
    indexed = list(enumerate(options))
    if objective == "accuracy":
        feasible = [(i, o) for i, o in indexed if o.time_s <= target_s * (1 + _EPS)]
        key: Callable = (
            (lambda io: (_q(io[1].accuracy), _q(io[1].time_s), io[0]))
            if feasible
            else (lambda io: (_q(io[1].time_s), _q(io[1].accuracy), io[0]))
        )
    else:
        feasible = [(i, o) for i, o in indexed if o.accuracy <= budget * (1 + _EPS) + _EPS]
        key = lambda io: (_q(io[1].time_s), _q(io[1].accuracy), io[0])  # noqa: E731
    return min(feasible or indexed, key=key)[1]


def _q(x: float) -> float:
    """Rounds away float noise, so that equal sums in another order compare equal."""
    return round(x, 9)


def hybrid_options(
    *,
    bases: list[tuple[str, Tasks]],
    neighbor: Tasks,
    cost: CostModel,
    techniques: list[Technique],
    n: int,
    m: int,
    b: int,
    objective: str,
    target_s: float,
    budget: float,
) -> list[PlanOption]:
    """The candidates `choose` picks from: each exact base, `neighbor` with each technique set,
    and each base's degraded family at the bounds the objective needs (the target and the
    fastest plan for `accuracy`; the least bound within the budget for `time`)."""
    options = []
    families = []
    for label, base in bases:
        options.append(PlanOption(label, base, _max_time(cost, base, b), 0.0))
        families.append(DegradeFamily(base, cost, techniques, n, m, b, label))
    for tech in techniques:
        tasks = {
            r: [
                MicroBatchTask(t.source_dp_rank, t.micro_index, True, tech.techniques, t.samples)
                if t.degraded
                else t
                for t in ts
            ]
            for r, ts in neighbor.items()
        }
        name = "neighbor" if tech.techniques is None else f"neighbor[{tech.techniques.key}]"
        options.append(
            PlanOption(
                name,
                tasks,
                _max_time(cost, tasks, b),
                plan_accuracy(tasks, techniques, n, m, b),
            )
        )
    for family in families:
        if objective == "accuracy":
            bounds = [target_s, family.fastest_s]
        else:
            bounds = [_least_bound_within(family, budget)]
        for bound in bounds:
            option = family.under(bound)
            if option is not None:
                options.append(option)
    return options


def _least_bound_within(family: DegradeFamily, budget: float) -> float:
    thresholds = family.thresholds()
    lo, hi = 0, len(thresholds) - 1  # the largest bound degrades nothing: accuracy 0
    while lo < hi:  # accuracy under a bound is non-increasing in the bound
        mid = (lo + hi) // 2
        if family.under(thresholds[mid]).accuracy <= budget * (1 + _EPS) + _EPS:
            hi = mid
        else:
            lo = mid + 1
    return thresholds[lo]


def _max_time(cost: CostModel, tasks: Tasks, b: int) -> float:
    return max(rank_time(cost, ts, b) for ts in tasks.values())
