"""Chaos schedules: random fault plans drawn from a seed, and the outcomes each one may end with.

`tools/chaos/run.py` runs them against real `mecefo-launch` jobs and checks the invariants
(`tools/chaos/checks.py`). This module is pure: no processes, no torch. A schedule is a function
of (seed, index, layout, kinds) only, so `--seed S --only I` reproduces schedule I alone.

The layout: `nodes` x `nproc` ranks, replicas of TP x PP consecutive ranks (megatron's order),
optionally the distributed optimizer. The failover unit is the replica: a rank fault takes its
whole replica out.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from megatron_mecefo.errors import ExitCode
from megatron_mecefo.optim.placement import placement

KINDS = (
    "kill",
    "stop",
    "exception",
    "agent_kill",
    "smp_kill",
    "coordinator_kill",
    "node_loss",
    "cpu_hog",
    "etcd_kill",
    "head_node_loss",
    "nan",
    "bitflip",
    "spike",
    "slow",
    "nan_data",
    "nan_persistent",
)
"""Every fault kind, in the order schedules cycle through them (`Fault.kind`)."""
SLOW_FACTOR = 2.0
"""How many times slower a `slow` fault makes its rank."""
SPIKE_WARMUP = 20
"""A spike is drawn at this step or later: the default `anomaly.spike_warmup` (before it, the
window is too short to judge)."""
KIND_HELP = {
    "kill": "SIGKILL a rank (from outside; `at: rejoin` is the trainer's own SIGKILL while it "
    "sends or receives a rejoining replica's state, --inject kill:RANK:rejoin)",
    "stop": "SIGSTOP a rank, SIGCONT it hold_s later (shorter or longer than the heartbeat "
    "timeout)",
    "exception": "the trainer raises at the start of a step (--inject exception:RANK:STEP)",
    "agent_kill": "SIGKILL one node's mecefo-launch; its ranks are left running (on node 0 the "
    "coordinator it started may go with it: exit 6 is then acceptable)",
    "smp_kill": "SIGKILL one node's snapshot process, mecefo-smp (the run takes snapshots)",
    "coordinator_kill": "SIGKILL the membership coordinator process "
    "(python -m megatron_mecefo.failover.authority.coordinator_cli)",
    "node_loss": "SIGKILL one simulated node's agent and every process under it at once (ranks, "
    "spares, snapshot process; on node 0 also the coordinator it started: a head-node loss, "
    "which every rank answers with COORDINATOR_LOST, exit 6)",
    "cpu_hog": "one busy-loop process per core beside the job for hold_s seconds",
    "etcd_kill": "(--store etcd) SIGKILL the etcd member that leads now, restart it hold_s "
    "later; a member still down from an earlier etcd_kill is restarted first (a quorum stays)",
    "head_node_loss": "node_loss of the node that coordinates: tcp, node 0 (its store: exit 6); "
    "etcd, the node whose candidate was elected (a new one is elected: exit 0)",
    "nan": "a silent numerical fault: one attempt of a step turns NaN on a rank (--inject "
    "nan:RANK:STEP); voted down, rerun, classified transient",
    "bitflip": "silent data corruption: one bit of one parameter of a rank flips before a step "
    "(--inject bitflip:RANK:STEP); caught by the state fingerprint, the rank rejoins healed",
    "spike": "one attempt of a step's loss (and gradients) on a rank is multiplied by 50 (--inject "
    "spike:RANK:STEP), at a step past the spike warm-up; voted down, rerun, classified transient",
    "slow": f"a rank computes {SLOW_FACTOR:g}x slower from a step to the end (--inject "
    f"slow:RANK:{SLOW_FACTOR:g}:STEP); its share shrinks once its pace is compared",
    "nan_data": "bad data: a replica's micro-batches of a step are NaN on whichever rank computes "
    "them (--inject nan:RANK:STEP:data); classified data, skipped and named",
    "nan_persistent": "a faulty device: a rank's outputs are NaN from a step on (--inject "
    "nan:RANK:STEP:persistent); classified persistent, the rank is evicted (exit 11) and never "
    "rejoins; the survivors finish",
}
SILENT = ("nan", "bitflip", "spike", "slow", "nan_data", "nan_persistent")
"""Trainer-side faults that no process death announces (`docs/anomalies.md`); opt-in (`--kinds`)."""
FAIL_STOP = tuple(k for k in KINDS if k not in SILENT)
"""The default kinds: what the soak drew before the silent kinds existed (old seeds reproduce)."""
STORES = ("tcp", "etcd")
"""The control-plane stores a schedule runs on (`mecefo-launch --store`)."""
PASSING_TODAY = KINDS
"""Kinds the failover core survives at the time of writing (each is in tests/e2e/test_chaos.py;
etcd_kill needs --store etcd)."""
MOMENTS = ("start", "step", "rejoin")
"""When a fault fires: right after the first generation forms (before step 0), when the job
reaches `step`, or (trainer-side) while a rejoining replica's state is sent or received."""
HEARTBEAT_TIMEOUT_S = 3.0
"""mecefo-coordinator's default heartbeat timeout: short stops stay under it, long ones pass it."""
_DYING = ("kill", "stop", "exception")
"""Rank faults that take a replica out of the membership (a stop only past the timeout)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault of a schedule."""

    kind: str
    """One of KINDS."""
    at: str = "step"
    """One of MOMENTS."""
    step: int = -1
    """Job step at which it fires (`at == "step"`), else -1."""
    rank: int | None = None
    """Global rank hit (kill, stop, exception)."""
    node: int | None = None
    """Simulated node hit (agent_kill, smp_kill, node_loss)."""
    hold_s: float = 0.0
    """stop: seconds between SIGSTOP and SIGCONT; cpu_hog: seconds the hog runs."""
    why: str = ""
    """The awkward moment this fault was drawn for, if any (leader, twice, before step 0, ...)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.at not in MOMENTS:
            raise ValueError(f"bad fault {self}: kind in {KINDS}, at in {MOMENTS}")
        if (self.at == "step") != (self.step >= 0):
            raise ValueError(f"bad fault {self}: a step exactly when at == 'step'")

    @property
    def by_trainer(self) -> bool:
        """Fired by the trainer itself through `--inject` (fixed before launch)."""
        return self.kind in ("exception", *SILENT) or self.at == "rejoin"

    def inject_arg(self) -> str:
        """The trainer's `--inject` value of a `by_trainer` fault."""
        where = "rejoin" if self.at == "rejoin" else str(self.step)
        if self.kind == "slow":
            return f"slow:{self.rank}:{SLOW_FACTOR:g}:{where}"
        if self.kind.startswith("nan_"):  # nan_data -> nan:RANK:STEP:data
            return f"nan:{self.rank}:{where}:{self.kind.removeprefix('nan_')}"
        return f"{self.kind}:{self.rank}:{where}"

    @property
    def evicts(self) -> bool:
        """Takes its replica out for good (a persistent fault: never restarted)."""
        return self.kind == "nan_persistent"

    def describe(self) -> str:
        target = (
            f" r{self.rank}"
            if self.rank is not None
            else f" n{self.node}"
            if self.node is not None
            else ""
        )
        when = {"start": "@start", "rejoin": "@rejoin"}.get(self.at, f"@{self.step}")
        hold = f" {self.hold_s:.1f}s" if self.hold_s else ""
        return f"{self.kind}{target}{when}{hold}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(kw_only=True)
class Schedule:
    """A job layout and the faults thrown at it."""

    seed: int
    index: int
    nodes: int
    nproc: int
    """Ranks per node."""
    max_steps: int
    snapshot_interval: int
    faults: list[Fault]
    kinds: tuple[str, ...]
    """The kinds it was drawn from (part of what reproduces it)."""
    store: str = "tcp"
    """One of STORES."""
    tp: int = 1
    """parallel.tensor_model_parallel_size."""
    pp: int = 1
    """parallel.pipeline_model_parallel_size: a replica is TP x PP consecutive ranks."""
    dist_opt: bool = False
    """training.use_distributed_optimizer: each optimizer shard on `SHARD_COPIES` replicas;
    losing every holder of one at once rolls the job back to its newest saved state."""

    def __post_init__(self) -> None:
        check_layout(self.nodes, self.nproc, tp=self.tp, pp=self.pp)

    @property
    def world(self) -> int:
        return self.nodes * self.nproc

    @property
    def replica_size(self) -> int:
        """Ranks of one replica (TP x PP); ranks r and r' hold the same (stage, TP rank)
        position iff r % replica_size == r' % replica_size."""
        return self.tp * self.pp

    @property
    def num_replicas(self) -> int:
        return self.world // self.replica_size

    def replica_of(self, rank: int) -> int:
        return rank // self.replica_size

    def replica_ranks(self, replica: int) -> list[int]:
        """Every rank of `replica`: they leave and come back together."""
        size = self.replica_size
        return list(range(replica * size, (replica + 1) * size))

    def node_of(self, rank: int) -> int:
        return rank // self.nproc

    def ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.nproc, (node + 1) * self.nproc))

    @property
    def recoverable(self) -> bool:
        """Losing every replica at once is survivable (the job recovers from a snapshot)."""
        return self.snapshot_interval > 0

    def inject_args(self) -> list[str]:
        out: list[str] = []
        for f in self.faults:
            if f.by_trainer:
                out += ["--inject", f.inject_arg()]
        return out

    def agents_killed(self) -> set[int]:
        """Nodes whose agent the schedule SIGKILLs (their exit code says nothing); a
        head_node_loss on etcd hits the node elected at the time, known only then."""
        out = {f.node for f in self.faults if f.kind in ("agent_kill", "node_loss")}
        if self.store == "tcp" and any(f.kind == "head_node_loss" for f in self.faults):
            out.add(0)
        return out

    def acceptable_exits(self) -> dict[int, str]:
        """Exit codes of the surviving agents this schedule may end with, and why."""
        lost = int(ExitCode.COORDINATOR_LOST)
        head = any(
            (f.kind == "node_loss" and f.node == 0) or f.kind == "head_node_loss"
            for f in self.faults
        )
        if head and self.store == "tcp":
            return {lost: "the head node and its coordinator store are lost (docs/failover.md)"}
        ok = {int(ExitCode.OK): "finished every step"}
        evicted = {f.rank for f in self.faults if f.evicts}
        if any(set(self.ranks_of(n)) <= evicted for n in range(self.nodes)):
            ok[int(ExitCode.EVICTED)] = (
                "every rank of a node may be evicted for a persistent fault: its agent, left "
                "with no rank to run, exits 11"
            )
        if self.store == "tcp" and any(f.kind == "agent_kill" and f.node == 0 for f in self.faults):
            ok[lost] = "the coordinator may go with the head node's agent (its launcher)"
        if not self.recoverable and self.may_lose_every_replica():
            ok[int(ExitCode.JOB_ABORTED)] = (
                "every replica may be lost at once with no snapshot or checkpoint "
                "(docs/failover.md: the job aborts, exit 8)"
            )
        elif not self.recoverable and self.may_lose_every_shard_holder():
            ok[int(ExitCode.JOB_ABORTED)] = (
                "every holder of an optimizer shard may be lost at once with no snapshot or "
                "checkpoint to roll back to (the job aborts, exit 8)"
            )
        return ok

    def _replicas_hit(self) -> tuple[list[set[int]], list[set[int]]]:
        """The replicas each dying fault may take out (a rank fault: its whole replica; a
        node fault: every replica with a rank there), and those of each possible head node."""
        hits: list[set[int]] = []
        for f in self.faults:
            if (f.kind in _DYING and f.rank is not None and _dies(f)) or f.evicts:
                hits.append({self.replica_of(f.rank)})
            elif f.kind in ("node_loss", "agent_kill") and f.node is not None:
                # agent_kill: if its ranks die with it
                hits.append({self.replica_of(r) for r in self.ranks_of(f.node)})
        heads = [0] if self.store == "tcp" else list(range(self.nodes))  # whichever is elected
        if not any(f.kind == "head_node_loss" for f in self.faults):
            return hits, []
        return hits, [{self.replica_of(r) for r in self.ranks_of(h)} for h in heads]

    def may_lose_every_replica(self) -> bool:
        """Whether the faults can leave no replica holding the state (conservative: the union
        of replicas that may be down covers them all; whether they overlap depends on timing)."""
        hits, heads = self._replicas_hit()
        hit = set().union(*hits)
        every = set(range(self.num_replicas))
        if heads:
            return any(hit | head >= every for head in heads)
        return hit >= every

    def may_lose_every_shard_holder(self) -> bool:
        """Distributed optimizer: whether two faults may take both holders of a shard at once
        (conservative: two faults that hit two replicas, on two nodes unless there is one; a
        shard's copies are on different nodes while each node has a live replica, and after a
        failure they move, so any two replicas may come to share one. Whether the faults
        overlap depends on timing). One node's loss alone never does."""
        if not self.dist_opt:
            return False
        hits, heads = self._replicas_hit()
        for head in heads or [None]:
            faults = hits + ([head] if head is not None else [])
            for i, a in enumerate(faults):
                for b in faults[i + 1 :]:
                    both = a | b
                    nodes = {self.node_of(r) for rep in both for r in self.replica_ranks(rep)}
                    if len(both) > 1 and (self.nodes == 1 or len(nodes) > 1):
                        return True
        return False

    def describe(self) -> str:
        snap = f" snap={self.snapshot_interval}" if self.snapshot_interval else ""
        store = " etcd" if self.store == "etcd" else ""
        layout = "".join(
            f" {name}={v}" for name, v in (("tp", self.tp), ("pp", self.pp)) if v > 1
        ) + (" dist-opt" if self.dist_opt else "")
        return f"{', '.join(f.describe() for f in self.faults)}{snap}{store}{layout}"

    def repro(self, tool: str = "tools/chaos/run.py") -> str:
        return (
            f"python {tool} --seed {self.seed} --only {self.index} --nodes {self.nodes} "
            f"--nproc {self.nproc} --max-steps {self.max_steps} --kinds {','.join(self.kinds)}"
            + (f" --store {self.store}" if self.store != "tcp" else "")
            + (f" --tp {self.tp}" if self.tp > 1 else "")
            + (f" --pp {self.pp}" if self.pp > 1 else "")
            + (" --dist-opt" if self.dist_opt else "")
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["faults"] = [f.to_dict() for f in self.faults]
        d["kinds"] = list(self.kinds)
        d["describe"] = self.describe()
        d["acceptable_exits"] = self.acceptable_exits()
        d["repro"] = self.repro()
        return d


SHARD_COPIES = 2
"""failover.shard_copies' default: the replicas that hold each optimizer shard."""


def check_layout(nodes: int, nproc: int, *, tp: int = 1, pp: int = 1) -> None:
    """Raise ValueError unless `nodes` x `nproc` ranks split into replicas of TP x PP ranks,
    each on one node or on whole nodes (as the launcher places them)."""
    if nodes < 1 or nproc < 1 or tp < 1 or pp < 1:
        raise ValueError(f"nodes, nproc, tp and pp must be >= 1 (got {nodes}, {nproc}, {tp}, {pp})")
    size, world = tp * pp, nodes * nproc
    if world % size:
        raise ValueError(
            f"{nodes} node(s) x {nproc} rank(s) = {world} is not divisible by TP x PP = "
            f"{tp} x {pp}; choose --nodes/--nproc so that it is"
        )
    if nproc % size and size % nproc:
        raise ValueError(
            f"a replica of TP x PP = {size} rank(s) would straddle nodes of {nproc} rank(s); "
            f"make --nproc a multiple or a divisor of {size}"
        )


def shard_partners(replica: int, *, num_replicas: int, replicas_per_node: int) -> list[int]:
    """The other replicas that hold a shard with `replica` when every replica is alive (the
    distributed optimizer's placement, `optim/placement.py`)."""
    where = placement(
        range(num_replicas),
        num_replicas=num_replicas,
        copies=SHARD_COPIES,
        replicas_per_node=replicas_per_node,
    )
    return sorted({r for hs in where if replica in hs for r in hs} - {replica})


def _dies(f: Fault) -> bool:
    return f.kind != "stop" or f.hold_s > HEARTBEAT_TIMEOUT_S


def possible_kinds(kinds, nodes: int, store: str = "tcp") -> tuple[str, ...]:
    """The kinds a layout can take: losing or orphaning a whole node needs a second node, and
    killing an etcd member the etcd store."""
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown fault kind(s) {bad}; known: {', '.join(KINDS)}")
    if store not in STORES:
        raise ValueError(f"unknown store {store!r}; known: {', '.join(STORES)}")
    whole_node = ("agent_kill", "node_loss", "head_node_loss")
    return tuple(
        k
        for k in kinds
        if (nodes > 1 or k not in whole_node) and (store == "etcd" or k != "etcd_kill")
    )


def generate(
    seed: int,
    index: int,
    *,
    nodes: int,
    nproc: int,
    max_steps: int,
    kinds,
    store: str = "tcp",
    tp: int = 1,
    pp: int = 1,
    dist_opt: bool = False,
) -> Schedule:
    """Schedule `index` of `seed`: its first fault's kind cycles through `kinds` (so N schedules
    cover min(N, len(kinds)) kinds), then 0-2 more faults of random kinds. Awkward moments are
    drawn on purpose: before step 0, on the leader (rank 0), twice on one rank, during a rejoin;
    with replicas of several ranks (TP x PP), another rank of a replica already hit; with the
    distributed optimizer, both holders of a shard at one step. The TP 1, PP 1 layout without
    the distributed optimizer draws what it drew before these layouts existed."""
    kinds = tuple(kinds)
    usable = possible_kinds(kinds, nodes, store)
    if not usable:
        raise ValueError(f"none of the kinds {kinds} applies to {nodes} node(s) on {store}")
    if nodes < 1 or nproc < 1 or nodes * nproc < 2 or max_steps < 8:
        raise ValueError("need at least 2 ranks and max_steps >= 8")
    check_layout(nodes, nproc, tp=tp, pp=pp)
    if nodes * nproc < 2 * tp * pp:
        raise ValueError(
            f"{nodes * nproc} rank(s) hold a single replica of TP x PP = {tp * pp}: failover "
            "needs at least 2 replicas"
        )
    layout = _Layout(nodes=nodes, nproc=nproc, replica_size=tp * pp, dist_opt=dist_opt)
    rng = random.Random(f"mecefo-chaos:{seed}:{index}")
    count = rng.choice((1, 2, 2, 3))
    chosen = [usable[index % len(usable)]] + [rng.choice(usable) for _ in range(count - 1)]
    last = max(2, int(max_steps * 0.6))  # leave room to rejoin before the end
    faults: list[Fault] = []
    for kind in chosen:
        faults.append(_draw(kind, rng, faults, layout=layout, last_step=last))
    faults.sort(key=lambda f: (MOMENTS.index(f.at), f.step))
    # a rollback (every holder of a shard lost) needs saved state: snapshots more often
    odds = 0.5 if dist_opt else 0.3
    wants_snapshot = any(f.kind == "smp_kill" for f in faults) or rng.random() < odds
    return Schedule(
        seed=seed,
        index=index,
        nodes=nodes,
        nproc=nproc,
        max_steps=max_steps,
        snapshot_interval=1 if wants_snapshot else 0,
        faults=faults,
        kinds=kinds,
        store=store,
        tp=tp,
        pp=pp,
        dist_opt=dist_opt,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Layout:
    nodes: int
    nproc: int
    replica_size: int
    dist_opt: bool

    @property
    def world(self) -> int:
        return self.nodes * self.nproc

    def partners(self, replica: int) -> list[int]:
        return shard_partners(
            replica,
            num_replicas=self.world // self.replica_size,
            replicas_per_node=max(1, self.nproc // self.replica_size),
        )


def _draw(
    kind: str, rng: random.Random, prior: list[Fault], *, layout: _Layout, last_step
) -> Fault:
    nodes = layout.nodes
    step = rng.randint(1, last_step)
    if kind in ("agent_kill", "smp_kill", "node_loss"):
        # node 0 runs the coordinator: losing it ends the job (exit 6), so it is drawn less often
        head = nodes == 1 or rng.random() < 0.25
        return Fault(kind=kind, step=step, node=0 if head else rng.randrange(1, nodes))
    if kind == "coordinator_kill":
        if rng.random() < 0.2:
            return Fault(kind=kind, at="start", why="before step 0")
        return Fault(kind=kind, step=step)
    if kind == "cpu_hog":
        return Fault(kind=kind, step=rng.randint(0, last_step // 2), hold_s=rng.uniform(8, 20))
    if kind == "etcd_kill":  # down for longer or shorter than an election (~1 s) and a lease
        hold = rng.uniform(0.5, 8.0)
        if rng.random() < 0.2:
            return Fault(kind=kind, at="start", hold_s=hold, why="before step 0")
        return Fault(kind=kind, step=step, hold_s=hold)
    if kind == "head_node_loss":
        return Fault(kind=kind, step=step, why="the coordinating node")
    rank, why = _pick_rank(rng, prior, layout.world)
    together = _together(kind, rng, prior, layout)  # draws nothing in the plain layout
    if together is not None:
        rank, step, why = together
    taken = {(f.rank, f.step) for f in prior if f.by_trainer}
    if kind in ("exception", *SILENT):
        if together is None:
            first = min(SPIKE_WARMUP, last_step) if kind == "spike" else 0
            step = rng.randint(first, max(first, last_step))
        while (rank, step) in taken:  # one injection per (rank, step)
            step = step + 1 if step < last_step else 0
        return Fault(kind=kind, step=step, rank=rank, why=why)
    hold = 0.0
    if kind == "stop":
        short = rng.random() < 0.5
        hold = rng.uniform(0.5, 0.6 * HEARTBEAT_TIMEOUT_S) if short else rng.uniform(4.0, 7.0)
    if together is not None:
        return Fault(kind=kind, step=step, rank=rank, hold_s=hold, why=why)
    others_die = any(f.kind in _DYING and _dies(f) and f.rank != rank for f in prior)
    roll = rng.random()
    if kind == "kill" and others_die and roll < 0.25 and (rank, -1) not in taken:
        return Fault(kind=kind, at="rejoin", rank=rank, why=_join(why, "during a rejoin"))
    if roll > 0.85:
        return Fault(kind=kind, at="start", rank=rank, hold_s=hold, why=_join(why, "before step 0"))
    same = [f.step for f in prior if f.rank == rank and f.at == "step"]
    if same:  # the second hit on a rank comes after the first (ideally once it rejoined)
        step = min(last_step + 4, max(same) + rng.randint(3, 8))
    return Fault(kind=kind, step=step, rank=rank, hold_s=hold, why=why)


def _together(
    kind: str, rng: random.Random, prior: list[Fault], layout: _Layout
) -> tuple[int, int, str] | None:
    """(rank, step, why) of a rank fault drawn to land at the step of an earlier one: on
    another rank of the same replica (TP x PP > 1: one replica lost, never two), or on a
    replica that holds an optimizer shard with it (distributed optimizer: a rollback). None:
    drawn as usual. Draws nothing from `rng` in the plain layout (old seeds reproduce)."""
    if layout.replica_size == 1 and not layout.dist_opt:
        return None
    earlier = [
        f for f in prior if f.rank is not None and f.at == "step" and f.kind in _DYING and _dies(f)
    ]
    if kind not in ("kill", "exception") or not earlier:
        return None
    first = rng.choice(earlier)
    replica, size = first.rank // layout.replica_size, layout.replica_size
    roll = rng.random()
    if layout.dist_opt and roll < 0.35:
        partners = layout.partners(replica)
        if partners:
            other = rng.choice(partners)
            rank = other * size + rng.randrange(size)
            why = f"both holders of a shard (replicas {replica} and {other}) at one step"
            return rank, first.step, why
    if size > 1 and roll > 0.75:
        others = [r for r in range(replica * size, (replica + 1) * size) if r != first.rank]
        return rng.choice(others), first.step, f"another rank of replica {replica} at one step"
    return None


def _pick_rank(rng: random.Random, prior: list[Fault], world: int) -> tuple[int, str]:
    hit = [f.rank for f in prior if f.rank is not None]
    roll = rng.random()
    if hit and roll < 0.2:
        return rng.choice(hit), "twice on one rank"
    if roll < 0.4:
        return 0, "the leader (rank 0)"
    return rng.randrange(world), ""


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def schedules(seed: int, count: int, **layout) -> list[Schedule]:
    """Schedules 0..count-1 of `seed` (`layout`: generate's keyword arguments)."""
    return [generate(seed, i, **layout) for i in range(count)]
