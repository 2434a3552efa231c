"""The control-plane benchmark's model of a job: its layout, the request rates it offers, the
records its synthetic ranks write, and the store and coordinator wrappers that count and time.

Imported by `control.py`, which puts `tools/bench` and the repository on `sys.path`."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from bench_common import (
    percentile,
)

from megatron_mecefo.control import keys
from megatron_mecefo.control.records import (
    GenerationRecord,
    NodeReport,
    RankEntry,
    Registration,
)
from megatron_mecefo.failover.authority.coordinator import Coordinator

HB_INTERVAL_S = 0.2
"""FailoverConfig.heartbeat_interval_s (each rank's heartbeat thread)."""
AGENT_INTERVAL_S = 0.1
"""The node agent's tick (agent.py `_watch`)."""
FLAGS, REG_LOG, DEAD_LOG, STANDBY_LOG = keys.FLAGS, keys.REG_LOG, keys.DEAD_LOG, keys.STANDBY_LOG
"""Mode b: the job flags ABORT/STOP/DONE in one key, and the append-only logs of ranks that
registered / were reported dead and of standby ids (the product's keys)."""
GEN_LOG_RE = re.compile(r"\[coordinator\] generation (\d+): .*\((\w+)\)$", re.S)
WAIT_GEN_S = 20.0
"""Bound on waiting for a generation (beyond the detector's own timeouts)."""
WAIT_SEEN_S = 15.0
"""Bound on waiting until every live client has seen a generation."""


# ---------------------------------------------------------------------------------- pure parts
@dataclass(frozen=True)
class Layout:
    """N ranks on nodes of `ranks_per_node` (= TP: one node is one replica, as in the 16k case)."""

    ranks: int
    ranks_per_node: int = 8

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node

    def node_ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)


def offered_rps(mode: str, layout: Layout, *, step_s: float) -> dict[str, float]:
    """Store requests per second the clients of N ranks send in steady state under protocol
    `mode` (a or b), from its exact sequence (see the module docstring); progress changes twice
    per training step. The coordinator's own requests are not included (they are measured)."""
    if mode == "a":
        beat = 5  # add hb, check GEN + get GEN, check ABORT, check STOP
        rank_rps = layout.ranks * (beat / HB_INTERVAL_S + 2.0 / step_s)
    elif mode == "b":
        rank_rps = 0.0  # the beats travel in the node reports
    else:
        raise ValueError(f"mode must be a or b, got {mode!r}")
    # set node/<i>, multi_get [GEN, job/flags, evict/seq, node_owner] (the same agent in both)
    agent = 2
    agent_rps = layout.nodes * agent / AGENT_INTERVAL_S
    return {"ranks": rank_rps, "agents": agent_rps, "total": rank_rps + agent_rps}


def live_nodes(mode: str, layout: Layout, *, step_s: float, client_rps: float) -> int:
    """How many nodes the workers can drive on the protocol's schedule within `client_rps`
    (at least 4: the two victims and some witnesses)."""
    per_node = offered_rps(mode, layout, step_s=step_s)["total"] / layout.nodes
    return max(4, min(layout.nodes, int(client_rps // per_node)))


def assign_nodes(layout: Layout, live: int, workers: int) -> list[dict[str, list[int]]]:
    """Contiguous node slices per worker; the live nodes are spread evenly over the workers."""
    out = []
    for w in range(workers):
        nodes = list(range(w * layout.nodes // workers, (w + 1) * layout.nodes // workers))
        n_live = live * (w + 1) // workers - live * w // workers
        out.append({"live": nodes[:n_live], "bulk": nodes[n_live:]})
    return out


def tick_summary(ticks: list[tuple]) -> dict:
    """Coordinator ticks (start, duration_s, reads_heartbeats, requests, store_s, cpu_s) ->
    durations (wall and the coordinator's own CPU) of the heartbeat-reading ticks and of the
    others, and the period between heartbeat reads."""
    hb = [t for t in ticks if t[2]]
    light = [t for t in ticks if not t[2]]
    starts = [t[0] for t in hb]
    periods = [b - a for a, b in zip(starts, starts[1:])]

    def stats(rows, i):
        vals = [r[i] for r in rows]
        return {
            "p50": percentile(vals, 50),
            "p99": percentile(vals, 99),
            "max": max(vals, default=None),
        }

    return {
        "ticks": len(ticks),
        "hb_tick_s": stats(hb, 1),
        "hb_tick_cpu_s": stats(hb, 5),
        "light_tick_s": stats(light, 1),
        "light_tick_cpu_s": stats(light, 5),
        "hb_read_period_s": {"p50": percentile(periods, 50), "max": max(periods, default=None)},
        "requests_per_hb_tick": percentile([t[3] for t in hb], 50),
        "store_s_per_hb_tick": percentile([t[4] for t in hb], 50),
    }


def generation_record(layout: Layout) -> str:
    """The first generation record of N ranks (every replica a member), as the coordinator
    publishes it (`records.GenerationRecord`)."""
    return GenerationRecord(
        members=list(range(layout.nodes)),
        reason="start",
        replica_size=layout.ranks_per_node,
        epoch_s=time.time(),
        step=0,
        incarnations={str(r): 0 for r in range(layout.ranks)},
    ).to_json()


def removed_replicas(record: str) -> list[int]:
    """The replicas generation `record` removed, decoded by its own type (`GenerationRecord`),
    as a trainer decodes it: one schema, no second reader of its text."""
    return GenerationRecord.from_json(record).removed


SYNTHETIC_PID = 100000
"""Rank r's process id in the synthetic node reports and registrations: SYNTHETIC_PID + r."""


def rank_entry(rank: int, incarnation: int, alive: bool = True) -> RankEntry:
    """A synthetic rank as its node agent reports it: running (S) or a zombie (Z), 1 CPU tick."""
    return RankEntry(incarnation, SYNTHETIC_PID + rank, "S" if alive else "Z", 1)


_SEQ, _HB, _PROGRESS = "@seq@", 918273645, "@progress@"
"""Sentinels that `report_template` renders in a NodeReport, then turns into placeholders."""


def report_template(mode: str, ranks: list[int], incarnation: dict[int, int]) -> str:
    """A node report (`records.NodeReport`, every rank running) with %(seq)s, %(hb)d and
    %(progress)s left to fill: mode a without beats (the ranks beat to the store themselves),
    mode b with each rank's heartbeat counter and progress. A %-template, not a NodeReport per
    tick, because the bulk nodes of 16k ranks are rendered every 0.1 s; it is a NodeReport
    rendered once with sentinel values, so the format has one home."""
    entries = {}
    for r in ranks:
        entries[r] = entry = rank_entry(r, incarnation.get(r, 0))
        if mode == "b":
            entry.beats, entry.progress = _HB, f"{entry.incarnation}:{_PROGRESS}"
    text = NodeReport(_SEQ, entries).to_json().replace("%", "%%")
    text = text.replace(f'"{_SEQ}"', '"%(seq)s"').replace(f", {_HB}, ", ", %(hb)d, ")
    return text.replace(_PROGRESS, "%(progress)s")


def progress_now(t0: float, step_s: float, now: float) -> str:
    """`<step>:<phase>` of a job whose steps take `step_s` (compute 75%, then reduce)."""
    step, frac = divmod(max(0.0, now - t0) / step_s, 1.0)
    return f"{int(step)}:{'compute' if frac < 0.75 else 'reduce'}"


def server_cores(offered: float, us_per_request: float | None) -> float | None:
    """CPU cores the store's event loop needs for `offered` requests/s (it has one thread)."""
    return None if us_per_request is None else offered * us_per_request / 1e6


MODES = ("a", "b")
"""The clients' protocols: a (per-rank heartbeats) or b (aggregated per node); the coordinator is
the product's in both."""


class CountingStore:
    """A store client that counts the requests made through it and the time they took."""

    OPS = (
        "add",
        "append",
        "check",
        "compare_set",
        "delete_key",
        "get",
        "multi_get",
        "multi_set",
        "set",
    )

    def __init__(self, store):
        self.requests = 0
        self.seconds = 0.0
        self.by_op: dict[str, int] = {}
        for name in self.OPS:
            setattr(self, name, self._wrap(name, getattr(store, name)))

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.requests += 1
                self.by_op[name] = self.by_op.get(name, 0) + 1

        return call


class TimedCoordinator(Coordinator):
    """The product's `Coordinator`, unchanged but for a timer around each `tick()`: `timings`
    gets (start, wall s, whether it read heartbeats, store requests, store s, the process's CPU
    s) per tick, and `on_tick()` runs after each. Its store must be a `CountingStore`."""

    def __init__(self, store: CountingStore, world_size: int, cfg, *, log=print, on_tick=None):
        super().__init__(store, world_size, cfg, log=log)
        self.counted = store
        self.timings: list[tuple] = []
        self.on_tick = on_tick or (lambda: None)

    def tick(self) -> None:
        store, reads_hb = self.counted, self.reads_heartbeats_next
        r0, s0, t0, c0 = store.requests, store.seconds, time.monotonic(), time.process_time()
        super().tick()
        wall, cpu = time.monotonic() - t0, time.process_time() - c0
        self.timings.append((t0, wall, reads_hb, store.requests - r0, store.seconds - s0, cpu))
        self.on_tick()


def _registration(rank: int, incarnation: int, tp: int, layout: Layout, node: int) -> str:
    """A synthetic rank's registration (`records.Registration`)."""
    reg = Registration(incarnation, SYNTHETIC_PID + rank, "synthetic", tp, layout.ranks, node)
    return reg.to_json()
