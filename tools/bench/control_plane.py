"""Control-plane benchmark: the job's store and membership coordinator under the load of a
16,384-GPU job, driven by synthetic clients on one machine.

    python tools/bench/control_plane.py [--ranks 1024 4096 16384] [--modes a b]
        [--client-rps 20000] [--out bench_out/control_plane.json]
    python tools/bench/control_plane.py --real-nproc 8 16 32    # real jobs, one kill each

The store is torch's libuv `TCPStore`, served in its own process exactly as `mecefo-coordinator`
(`store_host.py`) serves it, with the same 0.1 s polling loop beside it. The coordinator is the real
`Coordinator` class in its own process, running its own loop (`Coordinator.run`: tick, sleep 50 ms)
in a subclass that times every tick and counts its store requests (the real `mecefo-coordinator`
would start its own coordinator child, which exposes neither). Every record the bench writes (node
reports, generation records, registrations) is built with the product's record types
(`control/records.py`).

Clients are worker processes, each driving many logical ranks and node agents over one store
connection, request for request as the product's. Mode a is the per-rank protocol (a trainer
without an agent channel): each rank's heartbeat (every 0.2 s: add hb/<r>, set progress/<r> when
it changed, get GEN, check ABORT, check STOP; on a new GEN its main thread reads gen/<g>), beside
the same node agents as in b. Mode b is the product's protocol under `mecefo-launch`
(heartbeats aggregated per node, `control/local_beat.py`): one writer per node of 8 ranks. The
agent's node report carries each rank's heartbeat counter and progress; every 0.1 s the agent
reads [GEN, job/flags, evict/seq, node_owner/<i>] in one multi_get, hands GEN/ABORT/STOP to its
trainers through a node-local file (that local hop is not measured here; tests/dist cover it),
and reads its ranks' eviction keys only when evict/seq moved; on a new GEN it reads gen/<g> once
for the node and puts it in the folder, where its ranks read it. Registrations, death reports
and standbys are announced in append-only logs. The coordinator is
the product's `Coordinator` in both modes: it reads every node report with one multi_get, only new
log entries, and the per-rank keys only of ranks no node report carries (all of them in mode a).

A 2-core machine cannot generate the request rate of 16k ranks (a Python client does about 20k
synchronous requests/s), so only `live` nodes (as many as --client-rps allows, victims included)
run the protocol on its schedule; the other nodes' keys are kept fresh by one multi_set per worker
every 0.1 s, so the coordinator reads and judges all N ranks. The store's CPU per protocol request
is measured (workers flat out, before the coordinator starts) and the load of all N ranks is
projected from it: what is measured and what is projected is labelled in the table and the JSON.
Prints tables and writes JSON. A benchmark, not a test; every wait is bounded and every process
it starts is stopped before it returns.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "tools" / "bench", ROOT):  # bench_common; the package (tests load by path)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_common import (  # noqa: E402 - after the path fix (no torch import)
    bench_parser,
    cell,
    demo_job_args,
    machine,
    mem_available_gb,
    percentile,
    read_jsonl,
    write_json,
)

from megatron_mecefo.control import keys  # noqa: E402
from megatron_mecefo.control.keys import node_key  # noqa: E402
from megatron_mecefo.control.records import (  # noqa: E402
    GenerationRecord,
    NodeReport,
    RankEntry,
    Registration,
)
from megatron_mecefo.failover.authority.coordinator import Coordinator  # noqa: E402
from megatron_mecefo.failover.liveness.detector import DetectorConfig  # noqa: E402

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
    """`GenerationRecord.from_json(record).removed`, without decoding all of the record (a
    16k-rank record is ~200 KB; the trainers' own decode is local CPU, not control-plane load).
    Reads the text `GenerationRecord.to_json` writes; the tests hold the two to agreement."""
    start = record.index('"removed": [') + len('"removed": [')
    body = record[start : record.index("]", start)]
    return [int(x) for x in body.split(",") if x.strip()]


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


# ------------------------------------------------------------------------- synthetic clients
class _Worker:
    """One worker process: its live nodes' ranks and agents on the protocol's schedule (a heap of
    due times; a client's next turn is one interval after its last one ended, as a heartbeat
    thread's `wait(interval)`), and its bulk nodes' keys refreshed by one multi_set every 0.1 s.
    Client ids: rank r >= 0 (mode a heartbeats), -(node + 1) for a node's agent."""

    def __init__(self, spec: dict, index: int, store, counters, out):
        self.spec, self.index, self.store, self.counters, self.out = (
            spec,
            index,
            store,
            counters,
            out,
        )
        self.mode = spec["mode"]
        self.layout = Layout(spec["ranks"], spec["ranks_per_node"])
        self.t0, self.step_s = spec["t0"], spec["step_s"]
        self.live, self.bulk = spec["live"], spec["bulk"]
        ranks = [r for n in self.live for r in self.layout.node_ranks(n)]
        self.inc = dict.fromkeys(ranks, 0)
        self.alive = dict.fromkeys(ranks, True)
        self.published: dict[int, str | None] = dict.fromkeys(ranks)
        self.started_at = dict.fromkeys(
            ranks, self.t0
        )  # mode b: the local heartbeat counter's origin
        self.frozen: dict[int, tuple[int, str]] = {}  # a dead rank's last heartbeat and progress
        self.agent_on = dict.fromkeys(self.live, True)
        self.report_seq = dict.fromkeys(self.live, 0)
        self.dying: dict[int, list[int]] = {n: [] for n in self.live}  # killed, reported next tick
        self.evict_seen: dict[int, bytes] = {}  # mode b: node -> evict/seq at its last check
        self.token: dict[int, int] = {}
        self.seen: dict[int, int] = {}
        self.pending: dict[int, set[int]] = {}
        self.last_seen: dict[int, float] = {}
        self.last_record: dict[int, float] = {}
        self.done_gens: set[int] = set()
        self.max_gen = 0
        self.heap: list[tuple[float, int, int]] = []
        self.requests = self.bulk_requests = self.errors = 0
        self.samples = {"beat": (array("d"), array("d")), "agent": (array("d"), array("d"))}
        self.last_start: dict[int, float] = {}
        self.templates = {
            n: report_template(self.mode, list(self.layout.node_ranks(n)), {}) for n in self.bulk
        }
        self.bulk_seq, self.bulk_progress = 0, ""
        bulk_ranks = [r for n in self.bulk for r in self.layout.node_ranks(n)]
        self.bulk_names = {
            "node": [node_key(n) for n in self.bulk],
            "hb": [keys.heartbeat(r) for r in bulk_ranks],
            "progress": [keys.progress(r) for r in bulk_ranks],
        }
        self.started = self.stopped = False
        self.next_bulk = 0.0

    # ---------------------------------------------------------------- schedule
    def _schedule(self, client: int, due: float) -> None:
        heapq.heappush(self.heap, (due, client, self.token.get(client, 0)))

    def _begin(self) -> None:
        now = time.monotonic()
        ranks = [r for r in self.alive if self.mode == "a"]
        for i, r in enumerate(ranks):
            self._schedule(r, now + HB_INTERVAL_S * i / len(ranks))
        for i, n in enumerate(self.live):
            self._schedule(-(n + 1), now + AGENT_INTERVAL_S * i / len(self.live))
        self.started, self.next_bulk = True, now

    def run(self, commands) -> None:
        next_poll = 0.0
        while not self.stopped:
            now = time.monotonic()
            if now >= next_poll:
                self._commands(commands)
                self._publish_counters()
                next_poll = now + 0.01
                continue
            if self.started and now >= self.next_bulk:
                self._bulk_tick(now)
                self.next_bulk = max(self.next_bulk + AGENT_INTERVAL_S, now + AGENT_INTERVAL_S / 2)
                continue
            due = self.heap[0][0] if self.heap else math.inf
            if due > now:
                nxt = min(due, next_poll, self.next_bulk if self.started else math.inf)
                time.sleep(max(0.0, min(nxt - now, 0.005)))
                continue
            _, client, token = heapq.heappop(self.heap)
            if token != self.token.get(client, 0):
                continue  # restarted or stopped since it was scheduled
            try:
                if client >= 0:
                    self._beat(client, now)
                else:
                    self._agent_tick(-client - 1, now)
            except Exception:  # noqa: BLE001 - a store error is counted, the client goes on
                self.errors += 1
            interval = HB_INTERVAL_S if client >= 0 else AGENT_INTERVAL_S
            self._schedule(client, time.monotonic() + interval)

    def _sample(self, kind: str, client: int, now: float) -> None:
        last = self.last_start.get(client)
        self.last_start[client] = now
        if last is not None:
            times, periods = self.samples[kind]
            times.append(now)
            periods.append(now - last)

    # ---------------------------------------------------------------- clients
    def _beat(self, rank: int, now: float) -> None:
        """heartbeat.py's loop body, request for request."""
        s = self.store
        self._sample("beat", rank, now)
        s.add(keys.heartbeat(rank), 1)
        prog = f"{self.inc[rank]}:{progress_now(self.t0, self.step_s, now)}"
        sent = 4
        if prog != self.published[rank]:
            s.set(keys.progress(rank), prog)
            self.published[rank] = prog
            sent += 1
        has_gen = s.check([keys.GEN])
        gen = int(s.get(keys.GEN)) if has_gen else 0
        s.check([keys.ABORT])
        s.check([keys.STOP])
        self.requests += sent + int(has_gen)
        if gen > self.seen.get(rank, 0):
            self._saw(rank, gen)

    def _agent_tick(self, node: int, now: float) -> None:
        """agent.py `_tick` (the same in both modes; in a the ranks read GEN themselves)."""
        s, client = self.store, -(node + 1)
        self._sample("agent", client, now)
        dying, self.dying[node] = self.dying[node], []
        self.report_seq[node] += 1
        # the same agent in both modes; in b its report carries its ranks' beats
        s.set(node_key(node), self._report(node, now, dying))
        gen_raw, _, evict_seq, _ = s.multi_get(
            [keys.GEN, FLAGS, keys.EVICT_SEQ, keys.node_owner(node)]
        )
        self.requests += 2
        if evict_seq != self.evict_seen.get(node):  # agent.py: only after an eviction was set
            self.evict_seen[node] = evict_seq
            self._check_evictions(node, now)
        if self.mode == "b" and int(gen_raw) > self.seen.get(client, 0):
            self._saw(client, int(gen_raw))
        for r in dying:  # dead key, log entry, then the counter (keys.report_dead)
            keys.report_dead(s, r, self.inc[r])
            self.requests += 3

    def _check_evictions(self, node: int, now: float) -> None:
        """agent.py `_maybe_evict` for each live rank of `node`."""
        for r in self.layout.node_ranks(node):
            if self.alive[r]:
                self.requests += 1
                if self.store.check([keys.evict(r)]):
                    self.requests += 1
                    if int(self.store.get(keys.evict(r))) == self.inc[r]:
                        self._kill(r, node, now)  # SIGKILL; its death is reported next tick

    def _report(self, node: int, now: float, dying: list[int]) -> str:
        ranks = {}
        for r in self.layout.node_ranks(node):
            if not self.alive[r] and r not in dying:
                continue  # reported dead earlier: the agent no longer has the process
            ranks[r] = entry = rank_entry(r, self.inc[r], self.alive[r])
            if self.mode == "b":
                entry.beats, entry.progress = self._hb_progress(r, now)
        return NodeReport(f"{node + 1}:{self.report_seq[node]}", ranks).to_json()

    def _hb_progress(self, rank: int, now: float) -> tuple[int, str]:
        """Mode b: the heartbeat counter and progress the trainer handed to its agent."""
        if not self.alive[rank]:
            return self.frozen[rank]
        beats = int((now - self.started_at[rank]) / HB_INTERVAL_S) + 1
        return beats, f"{self.inc[rank]}:{progress_now(self.t0, self.step_s, now)}"

    def _bulk_tick(self, now: float) -> None:
        if not self.bulk:
            return
        self.bulk_seq += 1
        k, prog = self.bulk_seq, progress_now(self.t0, self.step_s, now)
        fill = {"hb": k, "progress": prog}
        names = list(self.bulk_names["node"])
        values = [self.templates[n] % {**fill, "seq": f"{n + 1}:{k}"} for n in self.bulk]
        if self.mode == "a":
            if k % 2 == 0:  # heartbeats every 0.2 s
                names += self.bulk_names["hb"]
                values += [str(k)] * len(self.bulk_names["hb"])
            if prog != self.bulk_progress:
                names += self.bulk_names["progress"]
                values += [f"0:{prog}"] * len(self.bulk_names["progress"])
        self.bulk_progress = prog
        self.store.multi_set(names, values)
        self.bulk_requests += 1

    # ---------------------------------------------------------------- generations
    def _live_clients(self) -> set[int]:
        if self.mode == "a":
            return {r for r, up in self.alive.items() if up}
        return {-(n + 1) for n, up in self.agent_on.items() if up}

    def _saw(self, client: int, gen: int) -> None:
        """`client` read GEN = `gen` > the newest it knew: it reads the record (mode a: the rank's
        main thread; mode b: the agent, once for its node: its ranks read the agent's copy; ranks
        of a removed replica stop)."""
        t_seen = time.monotonic()
        prev, self.seen[client] = self.seen.get(client, 0), gen
        new = [g for g in range(prev + 1, gen + 1) if g not in self.done_gens]
        for g in new:
            self.pending.setdefault(g, self._live_clients())
        self.max_gen = max(self.max_gen, gen)
        raw = self.store.get(keys.gen_record(gen)).decode()
        self.requests += 1
        t_record = time.monotonic()
        if self.mode == "b":
            node = -client - 1  # one node is one replica (TP = ranks per node)
            if node in removed_replicas(raw):
                for r in self.layout.node_ranks(node):
                    self._kill(r, node, t_record)
        for g in new:
            self.last_seen[g] = max(self.last_seen.get(g, 0.0), t_seen)
            self.last_record[g] = max(self.last_record.get(g, 0.0), t_record)
            self.pending[g].discard(client)
        self._check_seen()

    def _forget(self, client: int) -> None:
        for waiting in self.pending.values():
            waiting.discard(client)
        self._check_seen()

    def _check_seen(self) -> None:
        for g in sorted(self.pending):
            if not self.pending[g]:
                del self.pending[g]
                self.done_gens.add(g)
                seen, record = self.last_seen.get(g), self.last_record.get(g)
                self.out.put(("all_seen", self.index, g, seen, record))

    # ---------------------------------------------------------------- failures
    def _kill(self, rank: int, node: int, now: float) -> None:
        if not self.alive[rank]:
            return
        self.frozen[rank] = self._hb_progress(rank, now)
        self.alive[rank] = False
        self.token[rank] = self.token.get(rank, 0) + 1
        self.dying[node].append(rank)
        if self.mode == "a":
            self._forget(rank)

    def _silence(self, node: int, rank: int) -> float:
        """The rank's heartbeat stops and its node's agent falls silent (SIGSTOP of both)."""
        now = time.monotonic()
        self._kill(rank, node, now)
        self.dying[node].remove(rank)  # nobody reports it: the agent is silent too
        self.agent_on[node] = False
        client = -(node + 1)
        self.token[client] = self.token.get(client, 0) + 1
        if self.mode == "b":
            self._forget(client)
        return now

    def _rejoin(self, node: int) -> float:
        """The node's agent is back and every rank of it restarts with a new incarnation and
        registers (manager.register's requests)."""
        now, s = time.monotonic(), self.store
        for r in self.layout.node_ranks(node):
            self.token[r] = self.token.get(r, 0) + 1
            self.inc[r] += 1
            self.alive[r], self.published[r], self.started_at[r] = True, None, now
            if r in self.dying[node]:
                self.dying[node].remove(r)
            s.set(keys.progress(r), f"{self.inc[r]}:-1:idle")
            reg = _registration(r, self.inc[r], self.spec["tp"], self.layout, node)
            s.add(keys.heartbeat(r), 1)  # Heartbeat.__init__, in both modes
            keys.register(s, r, reg)  # registration, its log entry, the counter
            if self.mode == "a":
                self.seen[r] = self.max_gen
                self._schedule(r, now + 0.01)
            self.requests += 5
        client = -(node + 1)
        self.agent_on[node], self.seen[client] = True, self.max_gen
        self.token[client] = self.token.get(client, 0) + 1
        self._schedule(client, now + 0.01)
        return now

    # ---------------------------------------------------------------- commands
    def _commands(self, commands) -> None:
        while True:
            try:
                cmd = commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "start":
                self._begin()
            elif kind == "calibrate":
                self.out.put(("calibrated", self.index, cmd[1], *self._calibrate(cmd[1], cmd[2])))
            elif kind in ("silence", "exit"):
                node, rank = cmd[1], cmd[2]
                if kind == "silence":
                    t = self._silence(node, rank)
                else:
                    t = time.monotonic()
                    self._kill(rank, node, t)
                self.out.put(("failed", kind, node, rank, t))
            elif kind == "rejoin":
                self.out.put(("rejoined", cmd[1], self._rejoin(cmd[1])))
            elif kind == "stop":
                self.stopped = True
                self.out.put(("stats", self.index, self._stats(cmd[1], cmd[2])))
                return

    def _calibrate(self, what: str, seconds: float) -> tuple[int, float]:
        """Flat out for `seconds`: the protocol's requests of this worker's live nodes (in their
        proportions: a node's ranks beat once per two agent ticks), or gen/0 record reads."""
        n0, t0 = self.requests, time.monotonic()
        while time.monotonic() - t0 < seconds:
            if what == "record":
                self.store.get(keys.gen_record(0))
                self.requests += 1
                continue
            for node in self.live:
                now = time.monotonic()
                self._agent_tick(node, now)
                self._agent_tick(node, now)
                if self.mode == "a":
                    for r in self.layout.node_ranks(node):
                        self._beat(r, now)
        self.last_start.clear()
        self.samples = {"beat": (array("d"), array("d")), "agent": (array("d"), array("d"))}
        return self.requests - n0, time.monotonic() - t0

    def _publish_counters(self) -> None:
        base = 3 * self.index
        self.counters[base], self.counters[base + 1] = self.requests, self.bulk_requests
        self.counters[base + 2] = self.errors

    def _stats(self, t0: float, t1: float) -> dict:
        self._publish_counters()
        out = {"errors": self.errors, "live_clients": len(self._live_clients())}
        for kind, (times, periods) in self.samples.items():
            out[f"{kind}_periods"] = [p for t, p in zip(times, periods) if t0 <= t <= t1]
        return out


# --------------------------------------------------------------------------------- processes
def _child_setup() -> None:
    from megatron_mecefo.control.proc import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops its children itself


def _server_main(out, stop) -> None:
    """The job's store, served as `store_host.py` serves it, with its 0.1 s loop beside it."""
    _child_setup()
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
        use_libuv=True,
    )
    out.put(("server", store.port, os.getpid()))
    while not stop.is_set():
        store.check([keys.DONE])
        store.check([keys.ABORT])
        keys.get_int(store, keys.AGENTS_ACTIVE, 0)
        stop.wait(0.1)


def _worker_main(spec: dict, index: int, counters, commands, out) -> None:
    _child_setup()
    worker = _Worker(spec, index, keys.connect(spec["address"], 30.0), counters, out)
    out.put(("ready", index))
    worker.run(commands)


def _coordinator_main(spec: dict, counters, stop, out) -> None:
    """The real Coordinator in its own loop (`Coordinator.run`: tick, epoch check every 20
    ticks, agents count, sleep 50 ms), each tick timed (`TimedCoordinator`); its tick count and
    store requests are published in the last two `counters` after each tick and between ticks."""
    _child_setup()
    store = CountingStore(keys.connect(spec["address"], 30.0))
    cfg = DetectorConfig(heartbeat_timeout_s=spec["heartbeat_timeout_s"])
    notes: list[str] = []
    coord = None

    def log(msg: str) -> None:  # a generation is logged right after GEN is set: its publication
        m = GEN_LOG_RE.match(msg)
        if m:
            out.put(("gen", int(m.group(1)), time.monotonic(), list(coord.members), m.group(2)))
        elif len(notes) < 100:
            notes.append(msg[:300])

    def publish() -> None:
        counters[len(counters) - 2] = coord.ticks
        counters[len(counters) - 1] = store.requests

    def should_stop() -> bool:  # between ticks: after the loop's own requests and its sleep
        publish()
        return stop.is_set()

    coord = TimedCoordinator(store, spec["ranks"], cfg, log=log, on_tick=publish)
    t = time.perf_counter()
    coord.restore()
    out.put(("restored", time.perf_counter() - t, store.requests))
    why = coord.run(should_stop)
    if why != "stopped":  # a newer coordinator, or every agent gone: neither happens here
        notes.insert(0, f"Coordinator.run stopped early: {why}")
    coord.close()
    out.put(("coordinator", {"ticks": coord.timings, "by_op": store.by_op, "notes": notes}))


def _cpu_s(pid: int, tid: int | None = None) -> float:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as fh:
        raw = fh.read()
    fields = raw[raw.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(pid: int) -> dict[int, float]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = _cpu_s(pid, int(tid))
        except OSError:
            pass
    return out


class _Inbox:
    """Messages from the children: generations and all-seen reports are kept by number, the
    rest queued for `take`."""

    def __init__(self, q):
        self.q = q
        self.msgs: list[tuple] = []
        self.gens: dict[int, dict] = {}
        self.seen: dict[int, dict[int, tuple]] = {}

    def _pump(self, timeout_s: float) -> None:
        try:
            m = self.q.get(timeout=max(0.001, timeout_s))
        except queue.Empty:
            return
        if m[0] == "gen":
            self.gens[m[1]] = {"t": m[2], "members": set(m[3]), "reason": m[4]}
        elif m[0] == "all_seen":
            self.seen.setdefault(m[2], {})[m[1]] = (m[3], m[4])
        else:
            self.msgs.append(m)

    def until(self, cond, timeout_s: float):
        """Pump until `cond()` returns something other than None; None after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = cond()
            if value is not None or time.monotonic() > deadline:
                return value
            self._pump(min(0.05, deadline - time.monotonic()))

    def take(self, kind: str, timeout_s: float, pred=lambda m: True) -> tuple | None:
        def find():
            for m in self.msgs:
                if m[0] == kind and pred(m):
                    self.msgs.remove(m)
                    return m
            return None

        return self.until(find, timeout_s)

    def take_all(self, kind: str, count: int, timeout_s: float) -> list[tuple]:
        deadline, got = time.monotonic() + timeout_s, []
        while len(got) < count:
            m = self.take(kind, max(0.0, deadline - time.monotonic()))
            if m is None:
                raise TimeoutError(f"{len(got)} of {count} '{kind}' replies in {timeout_s:.0f} s")
            got.append(m)
        return got


# ------------------------------------------------------------------------------ one configuration
def _registration(rank: int, incarnation: int, tp: int, layout: Layout, node: int) -> str:
    """A synthetic rank's registration (`records.Registration`)."""
    reg = Registration(incarnation, SYNTHETIC_PID + rank, "synthetic", tp, layout.ranks, node)
    return reg.to_json()


def _populate(store, mode: str, layout: Layout, run_dir: str, tp: int) -> None:
    """What the job's start-up leaves in the store: every rank registered and beating once, every
    node's agent reporting, GEN = 0 (the bench sets it so that mode b's multi_get finds it; the
    coordinator treats 0 as no generation)."""
    items: dict[str, str] = {
        keys.AGENT_IDS: str(layout.nodes),
        keys.AGENTS_ACTIVE: str(layout.nodes),
        keys.REG_SEQ: str(layout.ranks),
        keys.GEN: "0",
        keys.RECOVERY: json.dumps({"mode": "failover", "recoverable": True, "wait_all_s": 60.0}),
        keys.RUN_DIR: f"{run_dir}|{time.time()}",
    }
    for r in range(layout.ranks):
        items[keys.registration(r)] = _registration(r, 0, tp, layout, r // layout.ranks_per_node)
        items[keys.heartbeat(r)] = "1"
        items[keys.progress(r)] = "0:-1:idle"
    for n in range(layout.nodes):
        items[keys.node_owner(n)] = str(n + 1)
        template = report_template(mode, list(layout.node_ranks(n)), {})
        items[node_key(n)] = template % {"seq": f"{n + 1}:0", "hb": 0, "progress": "-1:idle"}
    # the job flags, eviction counter and append-only logs, as a running job has them
    items.update({FLAGS: "", keys.EVICT_SEQ: "0", DEAD_LOG: "", STANDBY_LOG: ""})
    items[REG_LOG] = "".join(f"{r}," for r in range(layout.ranks))
    names = list(items)
    for i in range(0, len(names), 8192):
        chunk = names[i : i + 8192]
        store.multi_set(chunk, [items[k] for k in chunk])


class _Run:
    """One (mode, N) configuration: start, calibrate, steady load, a silent failure, an exit, a
    rejoin of both; every wait bounded, every process stopped in `close`."""

    def __init__(self, mode: str, n_ranks: int, args, ctx):
        self.mode, self.protocol, self.args, self.ctx = mode, mode[0], args, ctx
        self.layout = Layout(n_ranks, args.ranks_per_node)
        self.live = live_nodes(
            self.protocol, self.layout, step_s=args.step_s, client_rps=args.client_rps
        )
        self.plan = assign_nodes(self.layout, self.live, args.workers)
        self.out = ctx.Queue()
        self.inbox = _Inbox(self.out)
        self.stop_server, self.stop_coord = ctx.Event(), ctx.Event()
        self.counters = ctx.Array("d", 3 * args.workers + 2, lock=False)
        self.cmds = [ctx.Queue() for _ in range(args.workers)]
        self.procs: list = []
        self.run_dir = tempfile.mkdtemp(prefix="mecefo-control-plane-")
        self.res: dict = {"mode": mode, "ranks": n_ranks, "nodes": self.layout.nodes}

    def _spawn(self, target, *args) -> None:
        proc = self.ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)

    def start(self) -> None:
        self._spawn(_server_main, self.out, self.stop_server)
        msg = self.inbox.take("server", 120)
        if msg is None:
            raise TimeoutError("the store did not start within 120 s")
        self.address, self.server_pid = f"127.0.0.1:{msg[1]}", msg[2]
        store = keys.connect(self.address, 60.0)
        t = time.perf_counter()
        _populate(store, self.protocol, self.layout, self.run_dir, self.args.ranks_per_node)
        record = generation_record(self.layout)
        store.set(keys.gen_record(0), record)
        self.res.update(populate_s=time.perf_counter() - t, record_bytes=len(record))
        t0 = time.monotonic()
        for w, part in enumerate(self.plan):
            spec = {"mode": self.protocol, "ranks": self.layout.ranks, "address": self.address}
            spec.update(ranks_per_node=self.layout.ranks_per_node, tp=self.layout.ranks_per_node)
            spec.update(t0=t0, step_s=self.args.step_s, **part)
            self._spawn(_worker_main, spec, w, self.counters, self.cmds[w], self.out)
        self.inbox.take_all("ready", self.args.workers, 180)
        self.res["live_nodes"] = self.live
        self.res["live_ranks"] = self.live * self.layout.ranks_per_node

    def calibrate(self) -> None:
        """Server CPU per request: the workers flat out on their live nodes' protocol requests,
        then on gen/<g> reads of an N-rank record (before the coordinator starts)."""
        calib = {}
        for what, seconds in (("protocol", self.args.calibrate_s), ("record", 0.5)):
            c0 = _cpu_s(self.server_pid)
            for q in self.cmds:
                q.put(("calibrate", what, seconds))
            replies = self.inbox.take_all("calibrated", self.args.workers, seconds + 60)
            cpu = _cpu_s(self.server_pid) - c0
            requests = sum(m[3] for m in replies)
            elapsed = max(m[4] for m in replies)
            calib[what] = {
                "requests": requests,
                "requests_per_s": requests / elapsed,
                "server_cpu_fraction": cpu / elapsed,
                "server_us_per_request": 1e6 * cpu / requests if requests else None,
            }
        self.res["calibration"] = calib

    def begin(self) -> None:
        for q in self.cmds:
            q.put(("start",))
        spec = {"mode": self.mode, "ranks": self.layout.ranks, "address": self.address}
        spec["heartbeat_timeout_s"] = self.args.heartbeat_timeout_s
        self._spawn(_coordinator_main, spec, self.counters, self.stop_coord, self.out)
        msg = self.inbox.take("restored", 300)
        if msg is None:
            raise TimeoutError("the coordinator did not restore within 300 s")
        self.res.update(coordinator_restore_s=msg[1], coordinator_restore_requests=msg[2])
        if self.inbox.until(lambda: self.inbox.gens.get(1), 120) is None:
            raise TimeoutError("no first generation within 120 s")
        self.res["start_propagation"] = self._propagation(1)

    def _propagation(self, gen: int) -> dict:
        """Time from the publication of `gen` until every live client (mode a: rank; mode b:
        agent) of every worker has read GEN and then the generation record."""
        workers = self.args.workers
        got = self.inbox.until(
            lambda: (
                self.inbox.seen.get(gen) if len(self.inbox.seen.get(gen, {})) == workers else None
            ),
            WAIT_SEEN_S,
        )
        if got is None:
            return {
                "gen_s": None,
                "record_s": None,
                "note": f"not everywhere in {WAIT_SEEN_S:.0f} s",
            }
        t_pub = self.inbox.gens[gen]["t"]
        return {
            "gen_s": max(v[0] for v in got.values()) - t_pub,
            "record_s": max(v[1] for v in got.values()) - t_pub,
        }

    def steady(self) -> None:
        time.sleep(self.args.warmup_s)
        a = (time.monotonic(), _cpu_s(self.server_pid), _thread_cpu_s(self.server_pid))
        ca = list(self.counters)
        time.sleep(self.args.steady_s)
        b = (time.monotonic(), _cpu_s(self.server_pid), _thread_cpu_s(self.server_pid))
        cb = list(self.counters)
        dt = b[0] - a[0]
        d = [y - x for x, y in zip(ca, cb)]
        live = sum(d[3 * w] for w in range(self.args.workers))
        bulk = sum(d[3 * w + 1] for w in range(self.args.workers))
        threads = [b[2][t] - a[2].get(t, 0.0) for t in b[2]]
        self.window = (a[0], b[0])
        self.res["steady"] = {
            "window_s": dt,
            "live_requests_per_s": live / dt,
            "bulk_multi_sets_per_s": bulk / dt,
            "coordinator_requests_per_s": d[-1] / dt,
            "coordinator_ticks": d[-2],
            "served_requests_per_s": (live + bulk + d[-1]) / dt,
            "server_cpu_fraction": (b[1] - a[1]) / dt,
            "server_busiest_thread_fraction": max(threads, default=0.0) / dt,
            "client_errors": sum(d[3 * w + 2] for w in range(self.args.workers)),
        }

    def _worker_of(self, node: int) -> int:
        return next(w for w, p in enumerate(self.plan) if node in p["live"])

    def fail(self, kind: str, node: int) -> dict:
        """Stop a rank of `node` (silence: its heartbeat and its agent's report; exit: the rank
        dies and its agent reports it) and time the generation that removes its replica."""
        rank = self.layout.node_ranks(node)[1]
        self.cmds[self._worker_of(node)].put((kind, node, rank))
        msg = self.inbox.take("failed", 30, lambda m: m[2] == node)
        if msg is None:
            return {"node": node, "detection_s": None, "note": "worker did not confirm"}
        t_fail = msg[4]
        bound = self.args.heartbeat_timeout_s + DetectorConfig().agent_timeout_s + WAIT_GEN_S

        def removed():
            for g, rec in sorted(self.inbox.gens.items()):
                if rec["t"] > t_fail and node not in rec["members"]:
                    return g
            return None

        gen = self.inbox.until(removed, bound)
        if gen is None:
            return {
                "node": node,
                "rank": rank,
                "detection_s": None,
                "note": f"none in {bound:.0f} s",
            }
        t_pub = self.inbox.gens[gen]["t"]
        return {
            "node": node,
            "rank": rank,
            "generation": gen,
            "detection_s": t_pub - t_fail,
            "propagation": self._propagation(gen),
        }

    def rejoin(self, nodes: list[int]) -> dict:
        for node in nodes:
            self.cmds[self._worker_of(node)].put(("rejoin", node))
        msgs = [self.inbox.take("rejoined", 30, lambda m, n=n: m[1] == n) for n in nodes]
        if any(m is None for m in msgs):
            return {"rejoin_s": None, "note": "worker did not confirm"}
        t_back = max(m[2] for m in msgs)

        def joined():
            for g, rec in sorted(self.inbox.gens.items()):
                if rec["t"] > t_back and all(n in rec["members"] for n in nodes):
                    return g
            return None

        gen = self.inbox.until(joined, WAIT_GEN_S)
        if gen is None:
            return {"rejoin_s": None, "note": f"no generation with them in {WAIT_GEN_S:.0f} s"}
        return {
            "generation": gen,
            "rejoin_s": self.inbox.gens[gen]["t"] - t_back,
            "propagation": self._propagation(gen),
        }

    def finish(self, victims: set[int]) -> None:
        t0, t1 = self.window
        for q in self.cmds:
            q.put(("stop", t0, t1))
        stats = [m[2] for m in self.inbox.take_all("stats", self.args.workers, 60)]
        beats = [p for s in stats for p in s["beat_periods"]]
        agents = [p for s in stats for p in s["agent_periods"]]
        self.res["client_periods_s"] = {
            "beat": {"p50": percentile(beats, 50), "p99": percentile(beats, 99), "n": len(beats)},
            "agent": {
                "p50": percentile(agents, 50),
                "p99": percentile(agents, 99),
                "n": len(agents),
            },
        }
        self.stop_coord.set()
        msg = self.inbox.take("coordinator", 60)
        if msg is not None:
            ticks = msg[1]["ticks"]
            steady = [t for t in ticks if t0 <= t[0] <= t1]
            self.res["coordinator"] = {
                "steady": tick_summary(steady),
                "all": tick_summary(ticks),
                "requests_by_op": msg[1]["by_op"],
                "notes": msg[1]["notes"][:20],
            }
        everyone = set(range(self.layout.nodes))
        wrongly = set()
        for rec in self.inbox.gens.values():
            wrongly |= everyone - rec["members"] - victims
        self.res["false_removals"] = sorted(wrongly)
        self.res["detection_events_ms"] = _detection_events(Path(self.run_dir))

    def close(self) -> None:
        self.stop_coord.set()
        self.stop_server.set()
        for q in self.cmds:
            q.put(("stop", 0.0, 0.0))
        for proc in self.procs:
            proc.join(timeout=5)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.res["leftover_processes"] = sum(p.is_alive() for p in self.procs)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        for q in [self.out, *self.cmds]:
            q.cancel_join_thread()
            q.close()


def _detection_events(run_dir: Path) -> list[float]:
    events = read_jsonl(run_dir / "events.jsonl")
    return [  # the failed ranks' own (their TP peers are removed with them, latency 0)
        e["latency_ms"]
        for e in events
        if e.get("type") == "detection" and "TP peer" not in e.get("detail", "")
    ]


def run_config(mode: str, n_ranks: int, args, ctx) -> dict:
    """One configuration, start to finish; its processes are stopped whatever happens."""
    run = _Run(mode, n_ranks, args, ctx)
    load0 = os.getloadavg()[0]
    t = time.monotonic()
    try:
        _phases(run, args)
    except TimeoutError as exc:
        run.res["error"] = str(exc)
    finally:
        run.close()
    run.res.update(wall_s=time.monotonic() - t, loadavg_1m=[load0, os.getloadavg()[0]])
    _project(run.res, args)
    return run.res


def _phases(run: _Run, args) -> None:
    run.start()
    run.calibrate()
    run.begin()
    run.steady()
    ticks = run.res["steady"]["coordinator_ticks"]
    if ticks < 2:  # a tick takes longer than half the window: no failure can be timed
        run.res["skipped_failures"] = (
            f"the coordinator completed {ticks:.0f} ticks in {args.steady_s:.0f} s"
        )
        run.finish(set())
        return
    silent = run.plan[0]["live"][0]
    exited = run.plan[-1]["live"][-1]
    run.res["silent"] = run.fail("silence", silent)
    run.res["exit"] = run.fail("exit", exited)
    run.res["rejoin"] = run.rejoin([silent, exited])
    run.finish({silent, exited})


def _project(res: dict, args) -> None:
    """The full-N load from the protocol and the measured server cost per request."""
    layout = Layout(res["ranks"], args.ranks_per_node)
    protocol = res["mode"][0]
    offered = offered_rps(protocol, layout, step_s=args.step_s)
    calib = res.get("calibration", {})
    us = calib.get("protocol", {}).get("server_us_per_request")
    us_record = calib.get("record", {}).get("server_us_per_request")
    readers = layout.ranks if protocol == "a" else layout.nodes  # b: the agent, for its node
    res["projected"] = {
        "offered_requests_per_s": offered,
        "server_cores_needed": server_cores(offered["total"], us),
        "record_storm_s": None if us_record is None else readers * us_record / 1e6,
        "record_readers": readers,
    }


# ------------------------------------------------------------------------------------ real jobs
def run_real(nproc: int, args) -> dict:
    """`launch/local/run.sh` with NPROC ranks of the tiny demo model and one SIGKILL (the last
    rank at step --real-kill-step, back after 3 steps): detection and regroup from events.jsonl."""
    avail_gb = mem_available_gb()
    need_gb = 0.4 * (nproc + 2) + 1.0  # ~360 MB a rank, a warm spare, the agent and coordinator
    res = {"nproc": nproc, "mem_available_gb": avail_gb, "loadavg_1m": os.getloadavg()[0]}
    if avail_gb < need_gb:
        return {**res, "skipped": f"needs ~{need_gb:.0f} GB, {avail_gb:.1f} GB available"}
    victim, kill_at = nproc - 1, args.real_kill_step
    run_dir = Path(tempfile.mkdtemp(prefix=f"mecefo-real-{nproc}-")) / "run"
    cmd = ["bash", str(ROOT / "launch/local/run.sh")]
    cmd += demo_job_args(kill_at + 8, run_dir, args.demo_dir, f"--inject=kill:{victim}:{kill_at}:3")
    env = {**os.environ, "NPROC": str(nproc), "PYTHON": sys.executable, "PYTHONWARNINGS": "ignore"}
    log = run_dir.parent / "job.log"
    t0, first_step = time.monotonic(), None
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while proc.poll() is None and time.monotonic() - t0 < args.real_timeout_s:
                if first_step is None and (run_dir / "metrics.jsonl").exists():
                    first_step = time.monotonic() - t0
                time.sleep(0.5)
            rc = proc.poll()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the job's whole session, on time-out
                proc.wait(30)
    res.update(exit_code=rc, wall_s=time.monotonic() - t0, first_step_s=first_step)
    if rc is None:
        res["note"] = f"did not finish within {args.real_timeout_s:.0f} s (killed)"
    res.update(_real_latencies(run_dir, victim))
    res["log_tail"] = log.read_text(errors="replace").splitlines()[-5:]
    shutil.rmtree(run_dir.parent, ignore_errors=True)
    return res


def _real_latencies(run_dir: Path, victim: int) -> dict:
    events = read_jsonl(run_dir / "events.jsonl")
    det = [
        e["latency_ms"] for e in events if e["type"] == "detection" and victim in e.get("ranks", [])
    ]
    reg = [e["latency_ms"] for e in events if e["type"] == "regroup" and "latency_ms" in e]
    rejoin = [e for e in events if e["type"] == "rejoin"]
    return {
        "detection_ms": det[0] if det else None,
        "regroup_ms": reg[0] if reg else None,
        "rejoined": bool(rejoin),
        "events": len(events),
    }


# ------------------------------------------------------------------------------------ reporting
def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return cell(value, f",.{digits}f", scale=scale)


def _row_values(r: dict) -> dict[str, object]:
    """One synthetic configuration's table cells (None: not measured)."""
    steady, proj = r.get("steady", {}), r.get("projected", {})
    coord = r.get("coordinator", {}).get("steady", {})
    beat = "beat" if r["mode"][0] == "a" else "agent"  # the client that carries heartbeats
    props = [r.get(k, {}).get("propagation", {}) for k in ("silent", "exit", "rejoin")]
    gens = [p["gen_s"] for p in props if p.get("gen_s") is not None]
    records = [p["record_s"] for p in props if p.get("record_s") is not None]
    return {
        "offered": proj.get("offered_requests_per_s", {}).get("total"),
        "served": steady.get("served_requests_per_s"),
        "srv_cpu": steady.get("server_cpu_fraction"),
        "us_req": r.get("calibration", {}).get("protocol", {}).get("server_us_per_request"),
        "cores": proj.get("server_cores_needed"),
        "tick": coord.get("hb_tick_s", {}).get("p50"),
        "tick_cpu": coord.get("hb_tick_cpu_s", {}).get("p50"),
        "req_tick": coord.get("requests_per_hb_tick"),
        "read_period": coord.get("hb_read_period_s", {}).get("p50"),
        "silent": r.get("silent", {}).get("detection_s"),
        "exit": r.get("exit", {}).get("detection_s"),
        "rejoin": r.get("rejoin", {}).get("rejoin_s"),
        "gen_all": max(gens, default=None),
        "record": max(records, default=None),
        "storm": proj.get("record_storm_s"),
        "period_p99": r.get("client_periods_s", {}).get(beat, {}).get("p99"),
    }


LOAD_COLUMNS = (  # (header, key, scale, digits, width)
    ("offered/s", "offered", 1, 0, 10),
    ("served/s", "served", 1, 0, 9),
    ("srv%", "srv_cpu", 100, 0, 5),
    ("us/req", "us_req", 1, 1, 7),
    ("cores@N", "cores", 1, 2, 8),
    ("tick ms", "tick", 1000, 0, 8),
    ("cpu ms", "tick_cpu", 1000, 0, 7),
    ("req/tick", "req_tick", 1, 0, 9),
    ("read s", "read_period", 1, 2, 7),
)
LATENCY_COLUMNS = (
    ("silent s", "silent", 1, 2, 9),
    ("exit s", "exit", 1, 2, 7),
    ("rejoin s", "rejoin", 1, 2, 9),
    ("gen all", "gen_all", 1, 2, 8),
    ("record", "record", 1, 2, 7),
    ("storm@N", "storm", 1, 2, 8),
    ("period", "period_p99", 1, 2, 7),
)


def format_tables(rows: list[dict]) -> str:
    """The load table and the latency table of the synthetic runs."""
    out = []
    for columns in (LOAD_COLUMNS, LATENCY_COLUMNS):
        lines = [
            f"{'mode':<5}{'ranks':>6}{'live':>6}" + "".join(f"{h:>{w}}" for h, *_, w in columns)
        ]
        for r in rows:
            cells = _row_values(r)
            line = f"{r['mode']:<5}{r['ranks']:>6}{r.get('live_ranks', 0):>6}"
            line += "".join(f"{_fmt(cells[k], sc, d):>{w}}" for _, k, sc, d, w in columns)
            note = r.get("error") or r.get("skipped_failures")
            if columns is LATENCY_COLUMNS and (note or r.get("false_removals")):
                line += f"  {note or ''} {len(r.get('false_removals', []))} false removals"
            lines.append(line)
        out.append("\n".join(lines))
    return "\n\n".join(out)


LEGEND = """\
modes:   a = per-rank heartbeats to the store (a trainer without an agent channel);
         b = the product's protocol under mecefo-launch: heartbeats aggregated per node (one
         writer per node); the product's coordinator in both
load:    offered/s = store requests/s of all N ranks by the protocol (computed); served/s =
         measured (live clients + bulk multi_sets + coordinator); srv% = store process CPU in the
         steady window; us/req = store CPU per protocol request (calibration, measured);
         cores@N = offered x us/req (projected; the libuv store serves on ONE thread, so above
         ~0.7 it cannot hold); tick ms / cpu ms = coordinator ticks that read heartbeats, wall /
         the coordinator's own CPU (p50, at full N); req/tick = its store requests per such tick
         (serial round trips); read s = period between heartbeat reads (target 0.1 s)
latency: silent = a rank's heartbeat and its agent stop -> generation without it (includes the
         3 s soft timeout); exit = the rank exits, its agent reports it -> generation; rejoin =
         re-registration -> generation with it; gen all / record = publication -> the last live
         client read GEN / the generation record (max over the three generations); storm@N =
         store CPU to send the record to every reader at N (projected: N ranks in a, N/8 agents
         in b); period = p99 of the live clients' heartbeat period (0.2 s in a, 0.1 s in b)
"""


def format_real(rows: list[dict]) -> str:
    head = ("ranks", "exit", "start s", "wall s", "detect ms", "regroup ms")
    lines = ["".join(f"{h:>11}" for h in head) + "  note"]
    for r in rows:
        cells = (r["nproc"], r.get("exit_code", "-"), _fmt(r.get("first_step_s"), 1, 0))
        cells += (_fmt(r.get("wall_s"), 1, 0), _fmt(r.get("detection_ms"), 1, 0))
        cells += (_fmt(r.get("regroup_ms"), 1, 0),)
        note = r.get("skipped") or r.get("note", "")
        lines.append("".join(f"{str(c):>11}" for c in cells) + f"  {note}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "--ranks-per-node", type=int, default=8, help="also the TP size (node = replica)"
    )
    p.add_argument("--workers", type=int, default=3, help="client processes")
    p.add_argument(
        "--client-rps",
        type=float,
        default=20000.0,
        help="protocol requests/s the workers offer (sets the live nodes)",
    )
    p.add_argument("--step-s", type=float, default=2.0, help="synthetic training step time")
    p.add_argument(
        "--heartbeat-timeout-s", type=float, default=3.0, help="coordinator soft timeout"
    )
    p.add_argument("--calibrate-s", type=float, default=1.5)
    p.add_argument("--warmup-s", type=float, default=1.5)
    p.add_argument("--steady-s", type=float, default=5.0)
    p.add_argument(
        "--real-nproc",
        type=int,
        nargs="*",
        default=None,
        help="run real jobs of these sizes instead of the synthetic load",
    )
    p.add_argument("--real-kill-step", type=int, default=4)
    p.add_argument("--real-timeout-s", type=float, default=420.0)
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--out", default=None, help="default bench_out/control_plane[_real].json")
    args = p.parse_args(argv)
    if any(n % args.ranks_per_node or n < 4 * args.ranks_per_node for n in args.ranks):
        p.error("--ranks must be multiples of --ranks-per-node, at least 4 nodes")
    return args


def main(argv=None) -> int:
    import multiprocessing as mp

    args = parse_args(argv)
    real = args.real_nproc is not None
    out = Path(args.out or f"bench_out/control_plane{'_real' if real else ''}.json")
    doc = {"machine": machine(), "args": vars(args)}
    if real:
        rows = []
        for n in args.real_nproc or [8, 16, 32]:
            rows.append(run_real(n, args))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "log_tail"}), flush=True)
        doc["real"] = rows
        print("\n" + format_real(rows))
    else:
        ctx = mp.get_context("spawn")
        rows = []
        for n in args.ranks:
            for mode in args.modes:
                rows.append(run_config(mode, n, args, ctx))
                print(
                    f"mode {mode}, {n} ranks: {rows[-1].get('error', 'done')} "
                    f"in {rows[-1]['wall_s']:.0f} s",
                    flush=True,
                )
        doc["synthetic"] = rows
        print("\n" + format_tables(rows) + "\n\n" + LEGEND)
    return write_json(doc, out, indent=1, blank_line=False)


if __name__ == "__main__":
    sys.exit(main())
