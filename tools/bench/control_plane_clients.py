"""The control-plane benchmark's synthetic clients (worker processes driving many ranks and node
agents over one store connection each), the store and coordinator processes, and their inbox.

Imported by `control.py`, which puts `tools/bench` and the repository on `sys.path`."""

from __future__ import annotations

import heapq
import math
import os
import queue
import signal
import time
from array import array

from control_plane_model import (
    AGENT_INTERVAL_S,
    FLAGS,
    GEN_LOG_RE,
    HB_INTERVAL_S,
    CountingStore,
    Layout,
    TimedCoordinator,
    _registration,
    progress_now,
    rank_entry,
    removed_replicas,
    report_template,
)

from megatron_mecefo.control import keys
from megatron_mecefo.control.keys import node_key
from megatron_mecefo.control.records import (
    NodeReport,
)
from megatron_mecefo.failover.liveness.detector import DetectorConfig


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
    # the plain client, as `mecefo-coordinator` has (it never imports torch; this process has)
    store = CountingStore(keys.connect(spec["address"], 30.0, torch_client=False))
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
